#!/usr/bin/env bash
# Fifth call: issue 30's table again on the bundle at 0a9212d (../h200_2026-11-30e/table.sh:
# PyTorch's anchors, then the allocator and pinned benches on cores 2-10), an hour after
# the third call's slow phase. From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
bash docs/measurements/h200_2026-11-30e/table.sh 2>&1 | tee "$OUT/table.txt"
echo "total: $((SECONDS - start)) s"
