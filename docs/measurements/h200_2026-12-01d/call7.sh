#!/usr/bin/env bash
# Seventh call (the bundle at fc79e43, the session's final allocator code, benches built
# plainly again): the bundle's GPU tests, compute-sanitizer and issue 30's table
# (../h200_2026-12-01/call1.sh), the bundle's paired_alloc step, then eeb9cc6 against the
# session's final bench build, four alternated rounds (../h200_2026-12-01c/ab.sh).
# From the repository root with gpu-bundle.tar.xz and target/probe24 (stripped
# bench_alloc_eeb, bench_alloc_final) carried.
set -u
start=$SECONDS
bash docs/measurements/h200_2026-12-01/call6.sh
P=target/probe24 A=eeb B=final ROUNDS=4 bash docs/measurements/h200_2026-12-01c/ab.sh | tail -6
echo "total with the A/B: $((SECONDS - start)) s"
