#!/usr/bin/env bash
# churn example on the real GPU: configurations rotated, then perf counters.
set -u
P=target/probe/churn
confs=("" "ferrocuda_recommended:True" "ferrocuda_recommended:True,expandable_segments_reclaim:False" "expandable_segments:True" "expandable_segments:True,expandable_segments_page_mb:2")
for r in 1 2 3 4; do
  for k in 0 1 2 3 4; do
    c=${confs[$(( (k + r) % 5 ))]}
    echo "round $r: $(taskset -c 3 $P "$c" 2000000 3 2>&1)"
  done
done | tee $OUT/rotated.txt
which perf && for c in "" "ferrocuda_recommended:True" "ferrocuda_recommended:True,expandable_segments_reclaim:False"; do
  taskset -c 3 perf stat -e cycles,instructions,branch-misses,cache-misses,L1-dcache-load-misses,page-faults -- $P "$c" 2000000 3 2>&1 | tail -20
done | tee $OUT/perf.txt
