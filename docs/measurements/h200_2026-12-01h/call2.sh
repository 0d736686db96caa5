#!/usr/bin/env bash
# Second call (the bundle built at adc33ba: the fake's device-synchronize refusal and the
# conformance test device_synchronize_breaks_every_capture): the bundle's tests and
# compute-sanitizer, then issue 30's table once (single-threaded figures on one core).
# From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/tests /tmp/t
OUT=/tmp/tests ONLY='^(test_.*|sanitize)$' bash run.sh > /tmp/tests/run.log 2>&1
grep -E "^(test result|[0-9]+ passed)|FAILED|panicked|skipped|failed|device_synchronize_breaks" /tmp/tests/run.log | grep -v "^test result: ok" | tail -20
grep -E "^test result" /tmp/tests/run.log | awk '{p+=$4; f+=$6; i+=$8} END {print "tests:", p, "passed,", f, "failed,", i, "ignored"}'
cp /tmp/tests/run.log "$OUT/tests_run.log"; cp /tmp/tests/sanitize.log "$OUT/" 2>/dev/null
echo "tests and sanitize: $((SECONDS - start)) s"
OUT=/tmp/t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t/run.log 2>&1
sed -n '/allocator hot path/,$p' /tmp/t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
cp /tmp/t/run.log "$OUT/table_run.log"; cp /tmp/t/bench_alloc.log "$OUT/"
echo "total: $((SECONDS - start)) s"
