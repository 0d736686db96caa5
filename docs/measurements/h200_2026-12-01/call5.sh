#!/usr/bin/env bash
# Fifth call (bd13ada): the churn example's A/B against db223b9 with PyTorch's
# expandable_segments:True beside the default and the recommended set (ab.sh, six
# alternated rounds; churn_final is bd13ada's build), then the bundle's paired_alloc step.
# From the repository root with gpu-bundle.tar.xz and target/probe20 carried.
set -u
start=$SECONDS
NEW=final CONFS="|expandable_segments:True|ferrocuda_recommended:True" \
  bash docs/measurements/h200_2026-12-01/ab.sh 2>&1 | tail -12
echo "a/b: $((SECONDS - start)) s"
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && OUT=$OUT ONLY='^paired_alloc$' bash run.sh 2>&1 | grep -E "^(paired|===)")
echo "total: $((SECONDS - start)) s"
