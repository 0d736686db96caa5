#!/usr/bin/env bash
# Third call: issue 30's table in eight rounds from a bundle built at 92e6ec1 with
# page_bound.patch applied (a measurement build, not a commit) and HACK_BOUND=1 set, so
# that the recommended rows run with small blocks merging only within their 2 MiB page;
# the default's rows and PyTorch's do not read the variable. No A/B.
# From the repository root with target/ab carried (target/ab/gpu-bundle-pb.tar.xz).
set -u
start=$SECONDS
tar xJf target/ab/gpu-bundle-pb.tar.xz || exit 1
cd gpu-bundle || exit 1
mkdir -p /tmp/t3
HACK_BOUND=1 OUT=/tmp/t3 ONLY='^issue_table$' TABLE_ROUNDS=8 bash run.sh > /tmp/t3/run.log 2>&1
tail -20 /tmp/t3/run.log
cp /tmp/t3/issue_table.txt /tmp/t3/issue_table.log /tmp/t3/run.log /tmp/t3/torch_table.log "$OUT/" 2>/dev/null
echo "total: $((SECONDS - start)) s"
