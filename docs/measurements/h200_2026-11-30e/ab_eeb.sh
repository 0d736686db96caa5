#!/usr/bin/env bash
# Issue 30's A/B against its reference: the criterion churn of eeb9cc6 (alloc_eeb) and of
# the bundle's commit (its bench_alloc), interleaved round by round on one pinned core (3),
# default and recommended; then PyTorch's churn pinned the same way
# (../h200_2026-11-30b/torch_churn.py). From the repository root with gpu-bundle.tar.xz and
# target/ab/ carried.
set -u
here=$(cd "$(dirname "$0")" && pwd)
[ -d gpu-bundle ] || tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/
cd gpu-bundle || exit 1
export PYTHONUNBUFFERED=1 FERROCUDA_REQUIRE_GPU=1
FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
export FERROCUDA_CUDA_LIBRARY_PATH
cp bench_alloc alloc_new
for r in $(seq 1 "${ROUNDS:-6}"); do
  for b in alloc_eeb alloc_new; do
    CRITERION_HOME=$OUT/crit_$b taskset -c 3 ./$b --bench churn_1024_live --warm-up-time 1 --measurement-time 2 --noplot 2>&1 \
      | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3), $(NF-2)}'
  done
done | tee "$OUT/ab_eeb.txt"
OUT=$OUT ROUNDS=5 taskset -c 3 python3 "$here/../h200_2026-11-30b/torch_churn.py" torch_anchor.py 2>&1 | tail -1
rm -rf "$OUT"/crit_*
