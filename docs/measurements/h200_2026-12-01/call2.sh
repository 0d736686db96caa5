#!/usr/bin/env bash
# Second call (2862966): the churn example's A/B against db223b9 (ab.sh, both
# configurations, six alternated rounds), then the bundle's paired_alloc step (the
# recommended set's churn and 8-thread pairs against the default's, eight rounds). From the
# repository root with gpu-bundle.tar.xz and target/probe20 carried.
set -u
start=$SECONDS
bash docs/measurements/h200_2026-12-01/ab.sh 2>&1 | tail -8
echo "a/b: $((SECONDS - start)) s"
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && OUT=$OUT ONLY='^paired_alloc$' bash run.sh 2>&1 | grep -E "^(paired|===)")
echo "total: $((SECONDS - start)) s"
