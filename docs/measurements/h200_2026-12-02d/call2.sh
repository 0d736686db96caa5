#!/usr/bin/env bash
# Second call: issue 30's table in eight rounds (run.sh's issue_table step) with the A/B
# against eeb9cc6 (target/ab/alloc_eeb, copied into the bundle), while /proc/stat is
# sampled every second (steal.py reads it: each core's steal time tells whether the host's
# slow phases are time the hypervisor takes from the measured cores); then the bundle's
# tests and compute-sanitizer in the time left.
# From the repository root with gpu-bundle.tar.xz and target/ab carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
(while :; do echo "t $SECONDS"; grep -E "^cpu[0-9]+ " /proc/stat; sleep 1; done) > "$OUT/procstat.txt" &
sampler=$!
cd gpu-bundle || exit 1
mkdir -p /tmp/t /tmp/tests
OUT=/tmp/t ONLY='^issue_table$' TABLE_ROUNDS=8 AB_ALLOC=alloc_eeb bash run.sh > /tmp/t/run.log 2>&1
kill $sampler
tail -22 /tmp/t/run.log
cp /tmp/t/issue_table.txt /tmp/t/issue_table.log /tmp/t/run.log /tmp/t/torch_table.log "$OUT/" 2>/dev/null
echo "=== table: $((SECONDS - start)) s"
OUT=/tmp/tests ONLY='^(test_.*|sanitize)$' timeout $((585 - SECONDS)) bash run.sh > /tmp/tests/run.log 2>&1
echo "tests exit: $?"
grep -E "FAILED|panicked|skipped|failed" /tmp/tests/run.log | grep -v "^test result: ok" | tail -10
grep -E "^test result" /tmp/tests/run.log | awk '{p+=$4; f+=$6; i+=$8} END {print "tests:", p, "passed,", f, "failed,", i, "ignored"}'
tail -3 /tmp/tests/sanitize.log 2>/dev/null
cp /tmp/tests/run.log "$OUT/tests_run.log"; cp /tmp/tests/sanitize.log "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
