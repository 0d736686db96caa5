#!/usr/bin/env bash
# The churn A/B on one pinned core (3), from the repository root with gpu-bundle.tar.xz and
# target/ab/ carried: alloc_eeb and alloc_f3c (the alloc bench of eeb9cc6, issue 30's
# reference, and of f3c36ca, this session's start) beside the bundle's, interleaved round
# by round; then PyTorch's churn pinned the same way (../h200_2026-11-30b/torch_churn.py), and the continuous
# churn (crates/alloc/examples/churn.rs of the bundle's commit, target/ab/churn) for the
# default and the recommended set, interleaved.
set -u
here=$(cd "$(dirname "$0")" && pwd)
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb target/ab/alloc_f3c target/ab/churn gpu-bundle/
cd gpu-bundle || exit 1
export PYTHONUNBUFFERED=1 FERROCUDA_REQUIRE_GPU=1
cp bench_alloc alloc_new
for r in $(seq 1 "${ROUNDS:-4}"); do
  for b in alloc_eeb alloc_f3c alloc_new; do
    CRITERION_HOME=$OUT/crit_$b taskset -c 3 ./$b --bench churn --warm-up-time 1 --measurement-time 2 --noplot 2>&1 \
      | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3), $(NF-2)}'
  done
done | tee "$OUT/ab.txt"
OUT=$OUT ROUNDS=5 taskset -c 3 python3 "$here/../h200_2026-11-30b/torch_churn.py" torch_anchor.py 2>&1 | tail -1
for r in $(seq 1 4); do
  for conf in "" "ferrocuda_recommended:True"; do
    taskset -c 3 ./churn "$conf" 2000000 3
  done
done | tee "$OUT/churn_example.txt"
rm -rf "$OUT"/crit_*
