#!/usr/bin/env bash
# 589e137 (churn_final) against the same with `PoolCounters::change` (the inactive splits'
# net change at a free) computed without a branch on the sign (churn_change), default and
# recommended, alternated run by run on one pinned core (3), with probe_harness.patch.
set -u
for r in $(seq 1 "${ROUNDS:-12}"); do
  for conf in "" "ferrocuda_recommended:True"; do
    for b in churn_final churn_change; do
      echo "$r $b conf='$conf' $(taskset -c 3 target/ab/$b "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    done
  done
done
