#!/usr/bin/env bash
# First call (2862966): the bundle's GPU tests and compute-sanitizer, then issue 30's table
# (../h200_2026-11-30e/table.sh: PyTorch's anchors, then the allocator and pinned benches
# on cores 2-10). From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && FERROCUDA_REQUIRE_GPU=1 OUT=$OUT ONLY='^(test_.*|sanitize)$' bash run.sh > "$OUT/tests.log" 2>&1)
grep -E "^[0-9]+ passed" "$OUT/tests.log" | tail -1
grep -E "^sanitize" "$OUT/sanitize.log" | grep -vcE ": ok$"
echo "tests and sanitize: $((SECONDS - start)) s"
rm -rf gpu-bundle
bash docs/measurements/h200_2026-11-30e/table.sh 2>&1 | tee "$OUT/table.txt"
echo "total: $((SECONDS - start)) s"
