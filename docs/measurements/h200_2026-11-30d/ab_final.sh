#!/usr/bin/env bash
# The continuous churn (crates/alloc/examples/churn.rs with probe_harness.patch) of the
# session-start build (churn_head, 4405c6a), 303b19f (churn_new) and 589e137 (churn_final:
# best fit's walk by next_after), default and recommended, alternated run by run on one
# pinned core (3). Per run its three rounds.
set -u
for r in $(seq 1 "${ROUNDS:-8}"); do
  for conf in "" "ferrocuda_recommended:True"; do
    for b in churn_head churn_new churn_final; do
      echo "$r $b conf='$conf' $(taskset -c 3 target/ab/$b "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    done
  done
done
