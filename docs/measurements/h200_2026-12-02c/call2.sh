#!/usr/bin/env bash
# Second call: why the recommended set's churn ran at 76-95 ns in four of call 1's eight
# rounds, where the default's stayed at 57-68. The churn example (target/ab/churn, built at
# 2d56e5e: crates/alloc/examples/churn.rs) over the real driver, on core 2, six rounds of
# four configurations in turn (each: a warm-up of 5M steps, then three timed rounds of 5M);
# then perf stat (and a perf record of the recommended set) where perf runs; then the
# bundle's tests and compute-sanitizer.
# From the repository root with gpu-bundle.tar.xz and target/ab/churn carried.
set -u
start=$SECONDS
confs=("" "expandable_segments:True" "ferrocuda_recommended:True" "ferrocuda_recommended:True,expandable_segments_reclaim:False")
for r in 1 2 3 4 5 6; do
  for c in "${confs[@]}"; do
    echo "$r [$c] $(taskset -c 2 ./target/ab/churn "$c" 5000000 3 mixed 2>&1 | tail -1)"
  done
done | tee "$OUT/churn_rounds.txt"
echo "=== churn rounds: $((SECONDS - start)) s"
if command -v perf >/dev/null; then
  for c in "" "ferrocuda_recommended:True" "" "ferrocuda_recommended:True"; do
    echo "[$c]"
    taskset -c 2 perf stat -e cycles,instructions,branch-misses,dTLB-load-misses,L1-dcache-load-misses,cache-misses \
      ./target/ab/churn "$c" 5000000 3 mixed 2>&1 | grep -E "ns per|cycles|instructions|misses|elapsed"
  done 2>&1 | tee "$OUT/perf_stat.txt"
  taskset -c 2 perf record -o /tmp/perf.data -F 4999 -g ./target/ab/churn "ferrocuda_recommended:True" 5000000 3 mixed > /dev/null 2>&1 \
    && perf report -i /tmp/perf.data --no-children --sort dso,symbol --stdio 2>/dev/null | grep -v "^#" | grep "%" | head -40 > "$OUT/perf_rec.txt"
  taskset -c 2 perf record -o /tmp/perf0.data -F 4999 -g ./target/ab/churn "" 5000000 3 mixed > /dev/null 2>&1 \
    && perf report -i /tmp/perf0.data --no-children --sort dso,symbol --stdio 2>/dev/null | grep -v "^#" | grep "%" | head -40 > "$OUT/perf_default.txt"
  head -15 "$OUT/perf_rec.txt"; head -15 "$OUT/perf_default.txt"
else
  echo "perf: not found"
fi
echo "=== perf: $((SECONDS - start)) s"
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/tests
OUT=/tmp/tests ONLY='^(test_.*|sanitize)$' bash run.sh > /tmp/tests/run.log 2>&1
grep -E "^(test result|[0-9]+ passed)|FAILED|panicked|skipped|failed" /tmp/tests/run.log | grep -v "^test result: ok" | tail -20
grep -E "^test result" /tmp/tests/run.log | awk '{p+=$4; f+=$6; i+=$8} END {print "tests:", p, "passed,", f, "failed,", i, "ignored"}'
cp /tmp/tests/run.log "$OUT/tests_run.log"; cp /tmp/tests/sanitize.log "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
