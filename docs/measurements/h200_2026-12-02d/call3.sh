#!/usr/bin/env bash
# Third call: what expandable segments cost on the allocator rows, ours and PyTorch's, in
# the same call. Ours: run.sh's paired_rules step (criterion's churn and 8-thread pairs,
# `_expandable` against the default, 8 rounds). PyTorch's: torch_rules.py (its own loops
# under PYTORCH_CUDA_ALLOC_CONF="" and "expandable_segments:True", 8 rounds).
# From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
here=$PWD/docs/measurements/h200_2026-12-02d
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/r
OUT=/tmp/r ONLY='^paired_rules$' PAIRED_ROUNDS=8 bash run.sh > /tmp/r/run.log 2>&1
tail -8 /tmp/r/run.log
cp /tmp/r/paired_rules.txt /tmp/r/paired_rules.log "$OUT/" 2>/dev/null
echo "=== ours: $((SECONDS - start)) s"
python3 "$here/torch_rules.py" . 8 | tee "$OUT/torch_rules.txt"
python3 paired_summary.py "$OUT/torch_rules.txt" expandable default ns "churn, 1024 live" "1 MiB pairs, 8 threads" | tee "$OUT/torch_rules.log"
echo "total: $((SECONDS - start)) s"
