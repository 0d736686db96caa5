#!/usr/bin/env bash
# Third call (ce9b9b1): issue 30's table (../h200_2026-11-30e/table.sh: PyTorch's anchors, now with
# its copies to the host, then the allocator and pinned benches, the pinned bench with its
# new d2h group). From the repository root with gpu-bundle.tar.xz carried.
set -u
bash docs/measurements/h200_2026-11-30e/table.sh 2>&1 | tee "$OUT/table.txt"
