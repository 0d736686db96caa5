#!/usr/bin/env bash
# Eight 1 MiB slots through the lock (../h200_2026-11-30e/pair8probe.rs built at 3765682,
# in target/perf2), default and recommended alternated on core 3, ROUNDS rounds: what one
# locked operation costs each configuration, the unit of the 8-thread bench's figure.
set -u
for r in $(seq 1 "${ROUNDS:-6}"); do
  for conf in "thread_cache:False" "thread_cache:False,ferrocuda_recommended:True"; do
    echo "$r $(taskset -c 3 target/perf2/pair8probe "$conf" 3000000)"
  done
done
