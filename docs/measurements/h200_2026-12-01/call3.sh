#!/usr/bin/env bash
# Third call: where the churn's cycles go on the H200 host, by its counters (perf stat on
# the churn example, default and recommended, one core), and whether transparent huge
# pages for the allocator's heap change them (GLIBC_TUNABLES=glibc.malloc.hugetlb=1 asks
# glibc's malloc to madvise its memory for them). Binaries in target/probe20 (carried).
set -u
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag 2>&1
ldd --version | head -1
command -v perf || { echo "no perf"; exit 0; }
EV=cycles,instructions,branch-misses,L1-dcache-load-misses,dTLB-load-misses,dTLB-store-misses,LLC-load-misses
for r in 1 2 3; do
  for conf in "" "ferrocuda_recommended:True"; do
    for tun in "" "glibc.malloc.hugetlb=1"; do
      echo "== round $r [$conf] tunables [$tun]"
      GLIBC_TUNABLES=$tun perf stat -x, -e "$EV" taskset -c 3 target/probe20/churn_new "$conf" 2000000 3 2> "$OUT/perf.tmp" | head -1
      awk -F, '{printf "%s=%s ", $3, $1} END {print ""}' "$OUT/perf.tmp"
    done
  done
done 2>&1 | tee "$OUT/perf.txt"
