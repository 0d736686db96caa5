#!/usr/bin/env bash
# Third call (the bundle at aea403f): the bundle's three paired allocator steps, the
# recommended set against the default (paired_alloc), PyTorch's expandable rules against
# the default (paired_rules) and the recommended set against those rules (paired_reclaim),
# as ../h200_2026-12-01e/call5.sh ran them. From the repository root with
# gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
(cd gpu-bundle && OUT=$OUT ONLY='^paired_(alloc|rules|reclaim)$' bash run.sh 2>&1 | grep -E "^(paired|===|[0-9]+ passed)")
echo "total: $((SECONDS - start)) s"
