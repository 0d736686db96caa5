#!/usr/bin/env bash
# Third call (the bundle built at adc33ba): issue 30's table twice, as call2.sh runs it.
# From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
for t in 1 2; do
  mkdir -p /tmp/t$t
  OUT=/tmp/t$t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t$t/run.log 2>&1
  echo "=== table $t ($((SECONDS - start)) s)"
  sed -n '/allocator hot path/,$p' /tmp/t$t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
  cp /tmp/t$t/run.log "$OUT/t$t.run.log"; cp /tmp/t$t/bench_alloc.log "$OUT/t$t.bench_alloc.log"
done
echo "total: $((SECONDS - start)) s"
