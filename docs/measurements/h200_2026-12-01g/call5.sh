#!/usr/bin/env bash
# Fifth call (the last device seconds): issue 30's table twice more as call4.sh runs it
# (run.sh as of this commit over the bundle built at aea403f), then the bundle's paired
# recommended-against-default step (paired_alloc, six rounds: the churn on one core, the
# 8-thread pairs on cores 2-10). From the repository root with gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cp xtask/gpu/run.sh gpu-bundle/run.sh
cd gpu-bundle || exit 1
for t in 1 2; do
  mkdir -p /tmp/t$t
  OUT=/tmp/t$t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t$t/run.log 2>&1
  echo "=== table $t"
  sed -n '/allocator hot path/,$p' /tmp/t$t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
  cp /tmp/t$t/run.log "$OUT/t$t.run.log"; cp /tmp/t$t/bench_alloc.log "$OUT/t$t.bench_alloc.log"
done
mkdir -p /tmp/p
OUT=/tmp/p PAIRED_ROUNDS=6 ONLY='^paired_alloc$' bash run.sh > /tmp/p/run.log 2>&1
echo "=== paired_alloc"; cat /tmp/p/paired_alloc.log; tail -1 /tmp/p/run.log
cp /tmp/p/paired_alloc.txt /tmp/p/paired_alloc.log "$OUT/" 2>/dev/null
