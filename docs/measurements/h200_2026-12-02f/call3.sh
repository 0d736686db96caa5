#!/usr/bin/env bash
# Third call: what the thread cache does in the 8-thread 1 MiB pairs, default against the
# recommended set: a bench binary with temporary counters (probe.patch; a measurement
# build, target/ho/alloc_probe, carried). Each configuration in its own process, three
# times each, alternated, cores 2-10. The counters' last line per run (cumulative over the
# process: warm-up and criterion's samples): locked own allocations (grant calls), credits
# not considered (wants_credit), refused (credit test), granted, ended used or unused,
# lock-free reuses folded, requests served by the lock holder.
set -u
for r in 1 2 3; do
  for f in '' _recommended; do
    taskset -c 2-10 target/ho/alloc_probe --bench "^alloc/pair_1MiB_8threads$f\$" \
      --warm-up-time 0.5 --measurement-time 1.5 > /tmp/o.txt 2> /tmp/e.txt
    echo "round $r pair_1MiB_8threads$f: $(grep 'time:' /tmp/o.txt | tr -s ' ')"
    grep probe /tmp/e.txt | tail -1
  done
done | tee "$OUT/probe.txt"
