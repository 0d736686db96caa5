#!/bin/bash
# A/B of allocator bench binaries, interleaved: ab.sh ROUNDS FILTER bin...
rounds=$1; filter=$2; shift 2
export FERROCUDA_REQUIRE_GPU=1
for r in $(seq 1 $rounds); do
  for b in "$@"; do
    ./$b --bench "$filter" --warm-up-time 0.5 --measurement-time 2 2>&1 | grep -E "^alloc/|time:" | paste -sd' ' | sed 's/alloc\//\nalloc\//g' | awk -v r=$r -v b=$b 'NF{for(i=1;i<=NF;i++) if($i=="time:"){print r, b, $1, $(i+3), $(i+4); break}}'
  done
done
