#!/usr/bin/env bash
# The continuous churn (crates/alloc/examples/churn.rs) of 49762dd (target/ab/churn_old,
# this harness's first build; f3c36ca differs from it by 2 instructions per operation) and
# of the bundle's commit (target/ab/churn), default and recommended configurations,
# alternated run by run on one pinned core (3), ROUNDS rounds: the per-build median is
# what the host's slow and fast phases affect least.
set -u
for r in $(seq 1 "${ROUNDS:-15}"); do
  for conf in "" "ferrocuda_recommended:True"; do
    for b in churn_old churn; do
      echo "$r $b conf='$conf' $(taskset -c 3 target/ab/$b "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    done
  done
done
