#!/usr/bin/env bash
# Seventeenth session, one call: the bundle's GPU tests and compute-sanitizer (the
# conformance suite now stages pageable copies on the real driver), then issue 30's table
# (../h200_2026-11-30e/table.sh: PyTorch's anchors, then the allocator and pinned benches,
# the pinned bench with its new row `h2d/pageable_64MiB_staged_4threads`). From the
# repository root with gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && FERROCUDA_REQUIRE_GPU=1 OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1)
grep -E "^[0-9]+ passed|FAILED|failed:" "$OUT/tests.log" | tail -5
rm -rf gpu-bundle
bash docs/measurements/h200_2026-11-30e/table.sh 2>&1 | tee "$OUT/table.txt"
