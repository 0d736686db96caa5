#!/usr/bin/env bash
# Fifth call (the bundle built at 60900d8, as call 4): issue 30's table once more.
# From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/t
OUT=/tmp/t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t/run.log 2>&1
sed -n '/allocator hot path/,$p' /tmp/t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
cp /tmp/t/run.log "$OUT/table_run.log"
echo "total: $((SECONDS - start)) s"
