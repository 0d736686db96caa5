#!/usr/bin/env bash
# The churn example before (5527ffa, spin lock) and after (biased lock), on the GPU, rounds
# alternated, default configuration and the recommended set, on core 3.
set -u
for r in 1 2 3 4 5 6; do
  for b in churn churn_biased; do
    for c in "" "ferrocuda_recommended:True"; do
      echo "round $r $b: $(taskset -c 3 target/probe/$b "$c" 2000000 3 2>&1)"
    done
  done
done | tee $OUT/ab.txt
