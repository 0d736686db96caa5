#!/usr/bin/env bash
# Third call (the bundle built at b17e9f0: free's prefetch taken out): issue 30's table
# once; then the 1 MiB pairs on 8 threads (cores 2-10), default and recommended set,
# alloc_head (b17e9f0) against alloc_ttas (b17e9f0, lock_or_combine reading the lock word
# before its compare-and-swap), eight rounds, the order flipped every other round.
# From the repository root with gpu-bundle.tar.xz and the two target/ab/ binaries carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_head target/ab/alloc_ttas gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/t1
OUT=/tmp/t1 ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t1/run.log 2>&1
echo "=== table ($((SECONDS - start)) s)"
sed -n '/allocator hot path/,$p' /tmp/t1/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
cp /tmp/t1/run.log "$OUT/table_run.log"
export FERROCUDA_REQUIRE_GPU=1
FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
export FERROCUDA_CUDA_LIBRARY_PATH
for r in $(seq 1 8); do
  if (( r % 2 )); then order="alloc_head alloc_ttas"; else order="alloc_ttas alloc_head"; fi
  for b in $order; do
    CRITERION_HOME=/tmp/crit_8_$b taskset -c 2-10 ./$b --bench '^alloc/pair_1MiB_8threads(_recommended)?$' \
      --warm-up-time 0.5 --measurement-time 1.5 --noplot 2>&1 \
      | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3)}'
  done
done | tee "$OUT/ttas_ab.txt"
echo "total: $((SECONDS - start)) s"
