#!/usr/bin/env bash
# Fifth call (the bundle built at a12ef03): the recommended set against the default
# (paired_alloc) and PyTorch's expandable rules against the default (paired_rules), six
# paired rounds each, the ways alternating in order: the churn on core 2, the 1 MiB pairs
# on 8 threads over cores 2-10. From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
OUT=/tmp/p PAIRED_ROUNDS=6 ONLY='^(paired_alloc|paired_rules)$' bash run.sh > /tmp/p.log 2>&1
grep -v "^FERROCUDA_CUDA" /tmp/p.log | tail -30
cp /tmp/p.log "$OUT/paired_run.log"; cp /tmp/p/paired_alloc.txt /tmp/p/paired_rules.txt "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
