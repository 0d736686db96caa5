#!/usr/bin/env bash
# Second call: the session's start (fc79e43) against its end (991be14), criterion's churn
# and 8-thread pairs and the churn example on the real driver, eight alternated rounds
# (../h200_2026-12-01c/ab.sh), then the bundle's paired_copies step.
# From the repository root with gpu-bundle.tar.xz and target/probe25 (stripped
# bench_alloc_final and churn_final built at fc79e43 as the bundle builds them,
# bench_alloc_new and churn_new at 991be14) carried.
set -u
start=$SECONDS
P=target/probe25 A=final B=new ROUNDS=8 bash docs/measurements/h200_2026-12-01c/ab.sh | tail -12
echo "A/B: $((SECONDS - start)) s"
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && OUT=$OUT ONLY='^paired_copies$' bash run.sh 2>&1 | grep -E "^(paired|===)")
echo "total: $((SECONDS - start)) s"
