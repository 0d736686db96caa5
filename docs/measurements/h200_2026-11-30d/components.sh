#!/usr/bin/env bash
# What the statistics and the entry plumbing cost the default churn on this host: 589e137
# (churn_final) beside two experimental builds of it that are not correct allocators, only
# probes: churn_nostats (nostats.patch: every statistics update returns at once) and
# churn_nochecks (nochecks.patch: allocate and free take the state lock directly, skipping
# the thread cache, combining, settling, history, routing, IPC and event checks; the
# single-thread churn needs none of them). All with probe_harness.patch, alternated run by
# run on one pinned core (3). Per run its three rounds.
set -u
for r in $(seq 1 "${ROUNDS:-10}"); do
  for b in churn_final churn_nostats churn_nochecks; do
    echo "$r $b conf='' $(taskset -c 3 target/ab/$b "" 2000000 3 | head -1 | sed 's/.*operation //')"
  done
done
