#!/usr/bin/env bash
# Fourth call (the bundle built at a12ef03, as in calls 2 and 3): issue 30's table twice,
# each after the compute-bound probe of the host's phase (sha256 of 256 MiB of zeros on
# core 2: 0.25-0.29 s fast, 0.32-0.36 s slow in call 1). From the repository root with
# gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
for t in 1 2; do
  t0=$(date +%s.%N); head -c 256M /dev/zero | taskset -c 2 sha256sum >/dev/null; t1=$(date +%s.%N)
  echo "=== table $t, sha256 $(awk "BEGIN{print $t1 - $t0}") s"
  mkdir -p /tmp/t$t
  OUT=/tmp/t$t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t$t/run.log 2>&1
  echo "=== table $t done ($((SECONDS - start)) s)"
  sed -n '/allocator hot path/,$p' /tmp/t$t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
  cp /tmp/t$t/run.log "$OUT/t$t.run.log"
done
echo "total: $((SECONDS - start)) s"
