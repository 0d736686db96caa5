#!/usr/bin/env bash
# A/B of the allocator bench, three builds interleaved round by round, each pinned to one
# core: eeb9cc6 (issue 30's reference), 665aeae (this session's start), HEAD (the bundle's).
set -u
[ -d gpu-bundle ] || tar xJf gpu-bundle.tar.xz
cp target/ab/alloc_eeb target/ab/alloc_base gpu-bundle/
cd gpu-bundle
cp bench_alloc alloc_new
export FERROCUDA_REQUIRE_GPU=1
ROUNDS=${ROUNDS:-3}
for r in $(seq 1 $ROUNDS); do
  for b in alloc_eeb alloc_base alloc_new; do
    CRITERION_HOME=$OUT/crit_$b taskset -c 3 ./$b --bench "${FILTER:-churn}" --warm-up-time 1 --measurement-time 3 --noplot 2>&1 \
      | awk -v r=$r -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3), $(NF-2)}'
  done
done | tee $OUT/ab.txt
