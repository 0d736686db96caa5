#!/usr/bin/env bash
# One call on the GPU machine: what a reclaim mark costs the host (event_cost.py, in this
# folder), then issue 30's table in eight rounds with the A/B against eeb9cc6 (the bundle
# built at 5b40937: the allocator's release code is HEAD's, 64df54f).
# From the repository root with gpu-bundle.tar.xz and target/ab carried.
set -u
start=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 docs/measurements/h200_2026-12-02e/event_cost.py 2>&1 | tee "$OUT/event_cost.txt"
echo "=== event cost: $((SECONDS - start)) s"
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb gpu-bundle/ || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/t
OUT=/tmp/t ONLY='^issue_table$' TABLE_ROUNDS=8 AB_ALLOC=alloc_eeb bash run.sh > /tmp/t/run.log 2>&1
tail -22 /tmp/t/run.log
cp /tmp/t/issue_table.txt /tmp/t/issue_table.log /tmp/t/run.log /tmp/t/torch_table.log "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
