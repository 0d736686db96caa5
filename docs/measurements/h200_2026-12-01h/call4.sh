#!/usr/bin/env bash
# Fourth call (the bundle built at 344dc02: block in-pool marks in a dense array, the recent
# frees table at 16 bits, free lists' bins in place): the churn bench of eeb9cc6 (issue 30's
# reference), of adc33ba (this session's allocator before the change) and of 344dc02,
# interleaved round by round on core 2; then issue 30's table twice. From the repository
# root with gpu-bundle.tar.xz and target/ab/ (alloc_eeb, alloc_adc) carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb target/ab/alloc_adc gpu-bundle/
cd gpu-bundle || exit 1
(
  export FERROCUDA_REQUIRE_GPU=1
  FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
  export FERROCUDA_CUDA_LIBRARY_PATH
  cp bench_alloc alloc_new
  for r in $(seq 1 "${ROUNDS:-5}"); do
    for b in alloc_eeb alloc_adc alloc_new; do
      CRITERION_HOME=/tmp/crit_$b taskset -c 2 ./$b --bench '^alloc/churn_1024_live$' --warm-up-time 1 --measurement-time 2 --noplot 2>&1 \
        | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3), $(NF-2)}'
    done
  done
) | tee "$OUT/ab.txt"
echo "=== A/B done ($((SECONDS - start)) s)"
for t in 1 2; do
  mkdir -p /tmp/t$t
  OUT=/tmp/t$t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t$t/run.log 2>&1
  echo "=== table $t ($((SECONDS - start)) s)"
  sed -n '/allocator hot path/,$p' /tmp/t$t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
  cp /tmp/t$t/run.log "$OUT/t$t.run.log"; cp /tmp/t$t/bench_alloc.log "$OUT/t$t.bench_alloc.log"
done
echo "total: $((SECONDS - start)) s"
