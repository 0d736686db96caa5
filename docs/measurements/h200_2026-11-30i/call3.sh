#!/usr/bin/env bash
# The churn example at 5527ffa (base) and with the pooled bitmap (bits), on the GPU, the
# two alternated each round (order flipped every other round), default configuration and
# the recommended set, on core 3. Each line: round, build, configuration, three rounds' ns/op.
set -u
for r in 1 2 3 4 5 6 7 8; do
  if (( r % 2 )); then order="base bits"; else order="bits base"; fi
  for b in $order; do
    for c in "" "ferrocuda_recommended:True"; do
      echo "round $r $b: $(taskset -c 3 target/probe/churn_$b "$c" 2000000 3 2>&1)"
    done
  done
done | tee $OUT/ab.txt
