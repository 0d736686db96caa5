#!/usr/bin/env bash
# The continuous churn (crates/alloc/examples/churn.rs with probe_harness.patch) of the
# session-start build (churn_head, 4405c6a), of 303b19f (churn_new: before_unmapped, the
# branch-free GC tick and page stamps) and of 303b19f with a dense copy of the blocks'
# in-pool flags (churn_pooled), default and recommended, alternated run by run on one pinned
# core (3). Per run its three rounds.
set -u
for r in $(seq 1 "${ROUNDS:-12}"); do
  for conf in "" "ferrocuda_recommended:True"; do
    for b in churn_head churn_new churn_pooled; do
      echo "$r $b conf='$conf' $(taskset -c 3 target/ab/$b "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    done
  done
done
