#!/usr/bin/env bash
# Issue 30's table in one call: ferrocuda's alloc and pinned benches, then PyTorch's anchors,
# then run.sh's ratio tables (it prints them when the anchors' JSON sits in $OUT).
set -u
tar xJf gpu-bundle.tar.xz && cd gpu-bundle || exit 1
nproc; lscpu | grep -E "Model name|^CPU\(s\)|MHz" | head -4
export PYTHONUNBUFFERED=1
OUT=$OUT python3 torch_anchor.py > $OUT/torch_anchor.log 2>&1; tail -3 $OUT/torch_anchor.log
OUT=$OUT python3 torch_pinned.py > $OUT/torch_pinned.log 2>&1; tail -3 $OUT/torch_pinned.log
OUT=$OUT ONLY='^(bench_alloc|bench_pinned)$' bash run.sh > $OUT/run.log 2>&1
sed -n '/allocator hot path/,$p' $OUT/run.log
grep -E "^[0-9]+ passed" $OUT/run.log
rm -rf $OUT/criterion/*/*/report $OUT/criterion/*/report
