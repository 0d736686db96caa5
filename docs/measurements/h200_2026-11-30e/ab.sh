#!/usr/bin/env bash
# The continuous churn (crates/alloc/examples/churn.rs with
# ../h200_2026-11-30d/probe_harness.patch) of the builds named in BUILDS (executables in
# target/ab), default and recommended, alternated run by run on one pinned core (3),
# ROUNDS times. Each line: round, build, configuration, the run's three rounds (ns/op).
set -u
for r in $(seq 1 "${ROUNDS:-10}"); do
  for conf in "" "ferrocuda_recommended:True"; do
    for b in $BUILDS; do
      echo "$r $b conf='$conf' $(taskset -c 3 target/ab/$b "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    done
  done
done
