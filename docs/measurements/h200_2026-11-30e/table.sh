#!/usr/bin/env bash
# Issue 30's table on the GPU machine (as ../h200_2026-11-30d/table.sh): PyTorch's anchors,
# then the bundle's allocator and pinned benches, sharing cores 2-10 (run.sh pins the
# benches there). From the repository root with gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
nproc; lscpu | grep -E "Model name" | head -1
export PYTHONUNBUFFERED=1 FERROCUDA_REQUIRE_GPU=1
OUT=$OUT taskset -c 2-10 python3 torch_anchor.py > "$OUT/torch_anchor.log" 2>&1; tail -2 "$OUT/torch_anchor.log"
OUT=$OUT taskset -c 2-10 python3 torch_pinned.py > "$OUT/torch_pinned.log" 2>&1; tail -2 "$OUT/torch_pinned.log"
OUT=$OUT ONLY='^(bench_alloc|bench_pinned)$' bash run.sh > "$OUT/run.log" 2>&1
sed -n '/allocator hot path/,$p' "$OUT/run.log" | head -30
grep -E "^[0-9]+ passed" "$OUT/run.log"
rm -rf "$OUT"/criterion/*/*/report "$OUT"/criterion/*/report
