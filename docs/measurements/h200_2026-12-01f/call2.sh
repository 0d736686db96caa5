#!/usr/bin/env bash
# Second call (the bundle at aea403f: page reclaim falls dormant): the bundle's GPU tests,
# compute-sanitizer and issue 30's table, the bundle's paired_alloc step
# (../h200_2026-12-01/call6.sh), then eeb9cc6 against this build, four alternated rounds
# (../h200_2026-12-01c/ab.sh). From the repository root with gpu-bundle.tar.xz and
# target/probe26 (stripped bench_alloc_eeb, bench_alloc_new) carried.
set -u
start=$SECONDS
bash docs/measurements/h200_2026-12-01/call6.sh
P=target/probe26 A=eeb B=new ROUNDS=4 bash docs/measurements/h200_2026-12-01c/ab.sh | tail -6
echo "total with the A/B: $((SECONDS - start)) s"
