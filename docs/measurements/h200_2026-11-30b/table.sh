#!/usr/bin/env bash
# Issue 30's table and A/B in one call on the GPU machine, from the repository root with
# gpu-bundle.tar.xz and target/ab/ carried: alloc_eeb and alloc_base (the alloc bench of
# eeb9cc6 and of 0c586e6) and churn (crates/alloc/examples/churn.rs of the bundle's commit).
# 1. The table: ferrocuda's alloc and pinned benches and PyTorch's anchors, all on the same
#    nine cores (2-10); run.sh prints the ratio table from the anchors' JSON.
# 2. The churn pinned to one core (3): the three builds' churn benches interleaved round by
#    round, then PyTorch's churn (torch_churn.py) in the same way.
set -u
here=$(cd "$(dirname "$0")" && pwd)
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb target/ab/alloc_base gpu-bundle/
cd gpu-bundle || exit 1
nproc; lscpu | grep -E "Model name" | head -1
export PYTHONUNBUFFERED=1 FERROCUDA_REQUIRE_GPU=1
OUT=$OUT taskset -c 2-10 python3 torch_anchor.py > "$OUT/torch_anchor.log" 2>&1; tail -2 "$OUT/torch_anchor.log"
OUT=$OUT taskset -c 2-10 python3 torch_pinned.py > "$OUT/torch_pinned.log" 2>&1; tail -2 "$OUT/torch_pinned.log"
OUT=$OUT ONLY='^(bench_alloc|bench_pinned)$' taskset -c 2-10 bash run.sh > "$OUT/run.log" 2>&1
sed -n '/allocator hot path/,$p' "$OUT/run.log" | head -30
grep -E "^[0-9]+ passed" "$OUT/run.log"
cp bench_alloc alloc_new
for r in $(seq 1 "${ROUNDS:-3}"); do
  for b in alloc_eeb alloc_base alloc_new; do
    CRITERION_HOME=$OUT/crit_$b taskset -c 3 ./$b --bench churn --warm-up-time 1 --measurement-time 2 --noplot 2>&1 \
      | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3), $(NF-2)}'
  done
done | tee "$OUT/ab.txt"
OUT=$OUT ROUNDS=5 taskset -c 3 python3 "$here/torch_churn.py" torch_anchor.py 2>&1 | tail -1
# 3. The continuous churn (crates/alloc/examples/churn.rs) pinned to core 3, the default,
#    the recommended set and expandable segments with reclaim at 20 MiB pages, interleaved.
cp ../target/ab/churn .
for r in $(seq 1 5); do
  for conf in "" "ferrocuda_recommended:True" "expandable_segments:True,expandable_segments_reclaim:True"; do
    taskset -c 3 ./churn "$conf" 2000000 3
  done
done | tee "$OUT/churn_example.txt"
rm -rf "$OUT"/criterion/*/*/report "$OUT"/criterion/*/report "$OUT"/crit_*
