#!/usr/bin/env bash
# Second call: free's prefetch under contention. Four builds of benches/alloc.rs (cargo
# bench, stripped): alloc_warm (a9c5213: the prefetch before every locked free),
# alloc_nowarm (no prefetch), alloc_v1 (the prefetch only while the lock looks free) and
# alloc_v2 (v1, and lock_or_combine reads the lock word before its compare-and-swap).
#  1. The 1 MiB pairs on 8 threads (cores 2-10), default and recommended set, eight
#     rounds, the order of the four rotated every round.
#  2. The churn on core 2: warm, v1, v2, six rounds, rotated likewise.
# From the repository root with gpu-bundle.tar.xz and the four target/ab/ binaries carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_warm target/ab/alloc_nowarm target/ab/alloc_v1 target/ab/alloc_v2 gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
export FERROCUDA_REQUIRE_GPU=1
FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
export FERROCUDA_CUDA_LIBRARY_PATH
# rotated R WAYS...: WAYS rotated left by R.
rotated() { local r=$1; shift; local w=("$@") i; for i in "${!w[@]}"; do echo -n "${w[(i + r) % ${#w[@]}]} "; done; }
for r in $(seq 1 8); do
  for b in $(rotated "$r" alloc_warm alloc_nowarm alloc_v1 alloc_v2); do
    CRITERION_HOME=/tmp/crit_8_$b taskset -c 2-10 ./$b --bench '^alloc/pair_1MiB_8threads(_recommended)?$' \
      --warm-up-time 0.5 --measurement-time 1.5 --noplot 2>&1 \
      | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3)}'
  done
done | tee "$OUT/threads_ab.txt"
echo "=== 8 threads done ($((SECONDS - start)) s)"
for r in $(seq 1 6); do
  for b in $(rotated "$r" alloc_warm alloc_v1 alloc_v2); do
    CRITERION_HOME=/tmp/crit_1_$b taskset -c 2 ./$b --bench '^alloc/churn_1024_live$' \
      --warm-up-time 0.5 --measurement-time 1.5 --noplot 2>&1 \
      | awk -v r="$r" -v b=$b '/time:/{print r, b, "churn", $(NF-3)}'
  done
done | tee "$OUT/churn_ab.txt"
echo "total: $((SECONDS - start)) s"
