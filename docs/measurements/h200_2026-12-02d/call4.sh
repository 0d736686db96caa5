#!/usr/bin/env bash
# Fourth call: the third again, to see whether it holds in another phase of the host, with
# run.sh's paired_alloc step (the recommended set against the default, the table's two
# "≤ default" rows paired) beside paired_rules (expandable segments against the default);
# then PyTorch's expandable segments against its default (torch_rules.py), 8 rounds each.
# From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
here=$PWD/docs/measurements/h200_2026-12-02d
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/r
OUT=/tmp/r ONLY='^(paired_alloc|paired_rules)$' PAIRED_ROUNDS=8 bash run.sh > /tmp/r/run.log 2>&1
grep -E "^(===|paired)" /tmp/r/run.log
cp /tmp/r/paired_rules.txt /tmp/r/paired_rules.log /tmp/r/paired_alloc.txt /tmp/r/paired_alloc.log "$OUT/" 2>/dev/null
echo "=== ours: $((SECONDS - start)) s"
python3 "$here/torch_rules.py" . 8 | tee "$OUT/torch_rules.txt"
python3 paired_summary.py "$OUT/torch_rules.txt" expandable default ns "churn, 1024 live" "1 MiB pairs, 8 threads" | tee "$OUT/torch_rules.log"
echo "total: $((SECONDS - start)) s"
