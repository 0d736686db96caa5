#!/usr/bin/env bash
# Seventh call: the 8-thread pairs under the recommended set, 7657857 (before the thread
# cache's reclaim marks) against 99c4739, criterion's pair_1MiB_8threads_recommended and
# pair_1MiB_8threads alternated over six rounds (order flipped every other round), on
# cores 2-10 as run.sh pins them. Bench binaries in target/probe21 (carried).
set -u
P=target/probe21
for r in 1 2 3 4 5 6; do
  if [ $((r % 2)) = 1 ]; then order="prev head"; else order="head prev"; fi
  for b in $order; do
    CRITERION_HOME="$OUT/c_$b" taskset -c 2-10 "$P/bench_alloc_$b" --bench \
      '^alloc/pair_1MiB_8threads(_recommended)?$' --warm-up-time 0.5 --measurement-time 1.5 \
      2>&1 | grep -E "^alloc/|time:" | paste - - | awk -v r=$r -v b=$b '{print "round", r, b, $1, $5, $6}'
  done
done | tee "$OUT/ab8.txt"
