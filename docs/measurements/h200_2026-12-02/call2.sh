#!/usr/bin/env bash
# Second call (the bundle built at a12ef03: free starts its lookup's loads before the lock):
# per round on core 2, a compute-bound probe of the host's phase, then the churn bench of
# eeb9cc6 (issue 30's reference), of 344dc02 (the allocator before the change, as at
# eebc642) and of a12ef03, interleaved; then issue 30's table once. From the repository
# root with gpu-bundle.tar.xz and target/ab/ (alloc_eeb, alloc_344) carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb target/ab/alloc_344 gpu-bundle/
cd gpu-bundle || exit 1
(
  export FERROCUDA_REQUIRE_GPU=1
  FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
  export FERROCUDA_CUDA_LIBRARY_PATH
  cp bench_alloc alloc_new
  for r in $(seq 1 "${ROUNDS:-5}"); do
    # The host's phase (call 1): a compute-bound probe, 0.27 s fast, 0.32-0.36 s slow.
    t0=$(date +%s.%N); head -c 256M /dev/zero | taskset -c 2 sha256sum >/dev/null; t1=$(date +%s.%N)
    echo "$r sha256 $(awk "BEGIN{print $t1 - $t0}") s"
    for b in alloc_eeb alloc_344 alloc_new; do
      CRITERION_HOME=/tmp/crit_$b taskset -c 2 ./$b --bench '^alloc/churn_1024_live$' --warm-up-time 1 --measurement-time 2 --noplot 2>&1 \
        | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3), $(NF-2)}'
    done
  done
) | tee "$OUT/ab.txt"
echo "=== A/B done ($((SECONDS - start)) s)"
for t in 1; do
  mkdir -p /tmp/t$t
  OUT=/tmp/t$t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t$t/run.log 2>&1
  echo "=== table $t ($((SECONDS - start)) s)"
  sed -n '/allocator hot path/,$p' /tmp/t$t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
  cp /tmp/t$t/run.log "$OUT/t$t.run.log"; cp /tmp/t$t/bench_alloc.log "$OUT/t$t.bench_alloc.log"
done
echo "total: $((SECONDS - start)) s"
