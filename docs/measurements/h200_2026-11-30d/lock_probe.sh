#!/usr/bin/env bash
# What the lock's one locked instruction per operation costs on the H200 host's churn: one
# experimental build (churn_nolock: 303b19f with the state lock's try_lock a plain load and
# store, correct only for one thread) run with X unset (no locked instruction) and X=1 (the
# same build taking the lock with a compare-and-swap, as the real lock does), alternated on
# one pinned core; beside them the session-start build (churn_head) and 303b19f (churn_new),
# both with probe_harness.patch, default and recommended. Per run its three rounds.
set -u
for r in $(seq 1 "${ROUNDS:-10}"); do
  for conf in "" "ferrocuda_recommended:True"; do
    echo "$r nolock conf='$conf' $(env -u X taskset -c 3 target/ab/churn_nolock "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    echo "$r cas conf='$conf' $(X=1 taskset -c 3 target/ab/churn_nolock "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    for b in churn_head churn_new; do
      echo "$r $b conf='$conf' $(taskset -c 3 target/ab/$b "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    done
  done
done
