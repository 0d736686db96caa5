#!/usr/bin/env bash
# First call (74b7ff2: the thread cache's credit check runs best fit's walk): the bundle's
# GPU tests, compute-sanitizer and issue 30's table (../h200_2026-12-01/call1.sh), then
# the bundle's paired_alloc step. From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
bash docs/measurements/h200_2026-12-01/call1.sh
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && OUT=$OUT ONLY='^paired_alloc$' bash run.sh 2>&1 | grep -E "^(paired|===)")
echo "total: $((SECONDS - start)) s"
