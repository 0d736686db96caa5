#!/usr/bin/env bash
# Second call, right after the first on the same machine: issue 30's table again in eight
# rounds with the A/B against eeb9cc6, then the bundle's tests and compute-sanitizer in the
# time left (the bundle built at 5b40937, as in call1.sh).
# From the repository root with gpu-bundle.tar.xz and target/ab carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/t2 /tmp/tests
OUT=/tmp/t2 ONLY='^issue_table$' TABLE_ROUNDS=8 AB_ALLOC=alloc_eeb bash run.sh > /tmp/t2/run.log 2>&1
tail -22 /tmp/t2/run.log
cp /tmp/t2/issue_table.txt /tmp/t2/issue_table.log /tmp/t2/run.log /tmp/t2/torch_table.log "$OUT/" 2>/dev/null
echo "=== table: $((SECONDS - start)) s"
OUT=/tmp/tests ONLY='^(test_.*|sanitize)$' timeout $((585 - SECONDS)) bash run.sh > /tmp/tests/run.log 2>&1
echo "tests exit: $?"
grep -E "FAILED|panicked|skipped|failed" /tmp/tests/run.log | grep -v "^test result: ok" | tail -10
grep -E "^test result" /tmp/tests/run.log | awk '{p+=$4; f+=$6; i+=$8} END {print "tests:", p, "passed,", f, "failed,", i, "ignored"}'
tail -3 /tmp/tests/sanitize.log 2>/dev/null
cp /tmp/tests/run.log "$OUT/tests_run.log"; cp /tmp/tests/sanitize.log "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
