#!/usr/bin/env bash
# Where the H200 host's churn time goes (fourteenth session, first call). The continuous
# churn (crates/alloc/examples/churn.rs with probe_harness.patch) of HEAD (churn_head) and
# of the dense-flags experiment (churn_dense), default and recommended configurations,
# alternated run by run on one pinned core (3); beside them HEAD with one extra locked
# compare-and-swap per operation in the harness (EXTRA_CAS=1: what one locked instruction
# costs on this host's churn), and the harness alone (floor). Per run its three rounds.
set -u
for r in $(seq 1 "${ROUNDS:-8}"); do
  for conf in "" "ferrocuda_recommended:True"; do
    for b in churn_head churn_dense; do
      echo "$r $b conf='$conf' $(taskset -c 3 target/ab/$b "$conf" 2000000 3 | head -1 | sed 's/.*operation //')"
    done
  done
  echo "$r churn_head+cas conf='' $(EXTRA_CAS=1 taskset -c 3 target/ab/churn_head "" 2000000 3 | head -1 | sed 's/.*operation //')"
  echo "$r floor $(taskset -c 3 target/ab/floor 2>&1 | tail -1)"
done
