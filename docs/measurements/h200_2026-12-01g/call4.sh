#!/usr/bin/env bash
# Fourth call: issue 30's table twice with run.sh as of this call (single-threaded benches
# and PyTorch's single-threaded figures on one core, the many-threaded ones on cores 2-10),
# over the bundle built at aea403f (its allocator code is this commit's: only tests, docs and
# run.sh changed since; no test runs here, so run.sh's test list is not needed). After each
# table, the carried churn once more on cores 2-10, as the tables before this call ran it.
# From the repository root with gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cp xtask/gpu/run.sh gpu-bundle/run.sh
cd gpu-bundle || exit 1
lscpu | grep -E "Model name" | head -1
for t in 1 2; do
  mkdir -p /tmp/t$t
  OUT=/tmp/t$t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t$t/run.log 2>&1
  echo "=== table $t"
  sed -n '/allocator hot path/,$p' /tmp/t$t/run.log | head -34
  grep -E "^[0-9]+ passed" /tmp/t$t/run.log
  CRITERION_HOME=/tmp/t$t/spread FERROCUDA_REQUIRE_GPU=1 taskset -c 2-10 ./bench_alloc --bench '^alloc/churn_1024_live$' 2>&1 | grep -A1 "^alloc/churn" | tr -s ' ' | tail -1
  python3 -c "import json,sys; print('churn on 2-10, median ns', round(json.load(open(sys.argv[1]))['median']['point_estimate'],1))" /tmp/t$t/spread/alloc/churn_1024_live/new/estimates.json
  mkdir -p "$OUT/t$t"; cp /tmp/t$t/run.log /tmp/t$t/bench_*.log /tmp/t$t/torch_*.json /tmp/t$t/torch_*.log "$OUT/t$t/"
  cp /tmp/t$t/one_core/torch_anchor.json "$OUT/t$t/torch_anchor_one_core.json"
done
