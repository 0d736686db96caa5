#!/usr/bin/env bash
# First call: the churn's hardware counters on the GPU machine. perf is not installed, so
# counters.py (in this folder) opens the kernel's counters itself. Ours (the churn example
# built at 7303548, target/ab/churn_base; and a variant whose short-bin insert finds its
# place by binary search, target/ab/churn_bsearch) against PyTorch's (torch_anchor.py's
# `mixed_ns`), each on one core, twice on two cores.
# From the repository root with target/ab carried (target/ab/anchor: this folder's
# counters.py beside torch_table.py, torch_pinned.py, torch_copies.py and torch_anchor.py).
set -u
start=$SECONDS
cat /proc/sys/kernel/perf_event_paranoid
lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz|L1d|L2|L3"
cd target/ab/anchor || exit 1
for core in 3 7; do
  echo "== core $core"
  python3 counters.py churn ../churn_base $core 5000000 "" "ferrocuda_recommended:True"
  python3 counters.py churn ../churn_bsearch $core 5000000 ""
  python3 counters.py anchor $core 2000000
done 2>&1 | tee "$OUT/counters.jsonl"
echo "total: $((SECONDS - start)) s"
