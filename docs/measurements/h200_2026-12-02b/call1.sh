#!/usr/bin/env bash
# First call (bundle at a12ef03, the allocator as at a9c5213): is the host's slow phase a
# core's or the whole host's, and does free's prefetch before the lock cost the 8-thread
# pairs anything?
#  1. Sweep: the criterion churn on each of the 16 cores in turn, twice over.
#  2. Together: the churn on cores 2, 6, 10 and 14 at once, three times (same moment,
#     different cores).
#  3. A/B: the 1 MiB pairs on 8 threads (cores 2-10), alloc_warm (cargo bench at a9c5213, with the
#     prefetch) against alloc_nowarm (the same allocator without FreeHints::warm), six
#     rounds, the order flipped every other round.
# From the repository root with gpu-bundle.tar.xz and target/ab/alloc_warm, alloc_nowarm carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_nowarm target/ab/alloc_warm gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
export FERROCUDA_REQUIRE_GPU=1
FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
export FERROCUDA_CUDA_LIBRARY_PATH
# churn CORE BINARY TAG: one short criterion run of the churn on CORE, its median in ns.
churn() {
  CRITERION_HOME=/tmp/crit_$1_$3 taskset -c "$1" ./"$2" --bench '^alloc/churn_1024_live$' \
    --warm-up-time 0.3 --measurement-time 1 --sample-size 10 --noplot 2>&1 \
    | awk '/time:/{print $(NF-3)}'
}
for r in 1 2; do
  for c in $(seq 0 15); do echo "sweep $r core $c $(churn "$c" bench_alloc s) $((SECONDS - start))"; done
done | tee "$OUT/sweep.txt"
echo "=== sweep done ($((SECONDS - start)) s)"
for r in 1 2 3; do
  for c in 2 6 10 14; do churn "$c" bench_alloc t > /tmp/together_$c.txt & done
  wait
  echo "together $r $(for c in 2 6 10 14; do printf 'core%s %s ' "$c" "$(cat /tmp/together_$c.txt)"; done)"
done | tee "$OUT/together.txt"
echo "=== together done ($((SECONDS - start)) s)"
for r in 1 2 3 4 5 6; do
  if (( r % 2 )); then order="alloc_warm alloc_nowarm"; else order="alloc_nowarm alloc_warm"; fi
  for b in $order; do
    CRITERION_HOME=/tmp/crit_ab_$b taskset -c 2-10 ./$b --bench '^alloc/pair_1MiB_8threads$' \
      --warm-up-time 0.5 --measurement-time 1.5 --noplot 2>&1 \
      | awk -v r="$r" -v b=$b '/time:/{print r, b, $(NF-3), $(NF-2)}'
  done
done | tee "$OUT/warm_ab.txt"
echo "total: $((SECONDS - start)) s"
