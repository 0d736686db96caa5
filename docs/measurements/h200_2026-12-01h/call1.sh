#!/usr/bin/env bash
# First call (bundle at ef734bc, allocator code as at HEAD; sanitize.sh from the checkout):
# the machine's CPU topology, the other-thread cuCtxSynchronize probe, the churn bench on
# each core in turn (two sweeps: is any core steadily fast?), then the bundle's tests and
# compute-sanitizer. From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
here=docs/measurements/h200_2026-12-01h
{ lscpu; grep -m1 "model name" /proc/cpuinfo
  for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$(basename $c) siblings $(cat $c/topology/thread_siblings_list 2>/dev/null) core $(cat $c/topology/core_id 2>/dev/null)"; done
} > "$OUT/topology.txt" 2>&1
grep -E "^Model name|^Thread|^Core|^Socket|^NUMA node0|MHz" "$OUT/topology.txt"
python3 $here/ctx_sync_probe.py > "$OUT/ctx_sync_probe.txt" 2>&1; cat "$OUT/ctx_sync_probe.txt"
tar xJf gpu-bundle.tar.xz || exit 1
cp xtask/gpu/sanitize.sh gpu-bundle/sanitize.sh
cd gpu-bundle || exit 1
export FERROCUDA_REQUIRE_GPU=1 CRITERION_HOME=/tmp/crit
for sweep in 1 2; do
  line="sweep $sweep:"
  for c in $(seq 0 15); do
    ns=$(taskset -c $c ./bench_alloc --bench '^alloc/churn_1024_live$' --warm-up-time 0.5 --measurement-time 1.5 --noplot 2>/dev/null \
      | sed -n 's/.*time: *\[[^ ]* [^ ]* \([0-9.]*\) ns.*/\1/p' | head -1)
    line="$line c$c=${ns:-?}"
  done
  echo "$line" | tee -a "$OUT/core_sweep.txt"
done
echo "sweeps: $((SECONDS - start)) s"
mkdir -p /tmp/tests
OUT=/tmp/tests ONLY='^(test_.*|sanitize)$' bash run.sh > /tmp/tests/run.log 2>&1
grep -E "^(test result|[0-9]+ passed)|FAILED|panicked|skipped|failed" /tmp/tests/run.log | grep -v "^test result: ok" | tail -20
grep -E "^test result" /tmp/tests/run.log | awk '{p+=$4; f+=$6; i+=$8} END {print "tests:", p, "passed,", f, "failed,", i, "ignored"}'
cp /tmp/tests/run.log "$OUT/tests_run.log"; cp /tmp/tests/sanitize.log "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
