#!/usr/bin/env bash
# Fourth call (the bundle built at 60900d8: no prefetch before the lock, the lock word read
# before the compare-and-swap): the bundle's tests and compute-sanitizer; the A/B against
# eeb9cc6 (issue 30's reference, target/ab/alloc_eeb) in six rounds alternating, the churn
# on core 2 and the 8-thread pairs on cores 2-10; then issue 30's table once.
# From the repository root with gpu-bundle.tar.xz and target/ab/alloc_eeb carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/tests /tmp/t
OUT=/tmp/tests ONLY='^(test_.*|sanitize)$' bash run.sh > /tmp/tests/run.log 2>&1
grep -E "^(test result|[0-9]+ passed)|FAILED|panicked|skipped|failed" /tmp/tests/run.log | grep -v "^test result: ok" | tail -20
grep -E "^test result" /tmp/tests/run.log | awk '{p+=$4; f+=$6; i+=$8} END {print "tests:", p, "passed,", f, "failed,", i, "ignored"}'
cp /tmp/tests/run.log "$OUT/tests_run.log"; cp /tmp/tests/sanitize.log "$OUT/" 2>/dev/null
echo "=== tests and sanitize: $((SECONDS - start)) s"
(
  export FERROCUDA_REQUIRE_GPU=1
  FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
  export FERROCUDA_CUDA_LIBRARY_PATH
  cp bench_alloc alloc_new
  for r in $(seq 1 6); do
    if (( r % 2 )); then order="alloc_eeb alloc_new"; else order="alloc_new alloc_eeb"; fi
    for b in $order; do
      CRITERION_HOME=/tmp/crit_1_$b taskset -c 2 ./$b --bench '^alloc/churn_1024_live$' \
        --warm-up-time 0.5 --measurement-time 1.5 --noplot 2>&1 \
        | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3)}'
      CRITERION_HOME=/tmp/crit_8_$b taskset -c 2-10 ./$b --bench '^alloc/pair_1MiB_8threads$' \
        --warm-up-time 0.5 --measurement-time 1.5 --noplot 2>&1 \
        | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3)}'
    done
  done
) | tee "$OUT/eeb_ab.txt"
echo "=== A/B done ($((SECONDS - start)) s)"
OUT=/tmp/t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t/run.log 2>&1
sed -n '/allocator hot path/,$p' /tmp/t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
cp /tmp/t/run.log "$OUT/table_run.log"
echo "total: $((SECONDS - start)) s"
