#!/usr/bin/env bash
# Third call (the bundle built at a12ef03, as in call 2): the bundle's tests and
# compute-sanitizer, then six more rounds of call 2's churn A/B (eeb9cc6, 344dc02,
# a12ef03 on core 2, with the compute-bound phase probe), then issue 30's table once.
# From the repository root with gpu-bundle.tar.xz and target/ab/ (alloc_eeb, alloc_344)
# carried.
set -u
start=$SECONDS
tar xJf gpu-bundle.tar.xz || exit 1
cp target/ab/alloc_eeb target/ab/alloc_344 gpu-bundle/
cd gpu-bundle || exit 1
mkdir -p /tmp/tests /tmp/t
OUT=/tmp/tests ONLY='^(test_.*|sanitize)$' bash run.sh > /tmp/tests/run.log 2>&1
grep -E "^(test result|[0-9]+ passed)|FAILED|panicked|skipped|failed" /tmp/tests/run.log | grep -v "^test result: ok" | tail -20
grep -E "^test result" /tmp/tests/run.log | awk '{p+=$4; f+=$6; i+=$8} END {print "tests:", p, "passed,", f, "failed,", i, "ignored"}'
cp /tmp/tests/run.log "$OUT/tests_run.log"; cp /tmp/tests/sanitize.log "$OUT/" 2>/dev/null
echo "=== tests and sanitize: $((SECONDS - start)) s"
(
  export FERROCUDA_REQUIRE_GPU=1
  FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
  export FERROCUDA_CUDA_LIBRARY_PATH
  cp bench_alloc alloc_new
  for r in $(seq 6 "${LAST_ROUND:-11}"); do
    t0=$(date +%s.%N); head -c 256M /dev/zero | taskset -c 2 sha256sum >/dev/null; t1=$(date +%s.%N)
    echo "$r sha256 $(awk "BEGIN{print $t1 - $t0}") s"
    for b in alloc_eeb alloc_344 alloc_new; do
      CRITERION_HOME=/tmp/crit_$b taskset -c 2 ./$b --bench '^alloc/churn_1024_live$' --warm-up-time 1 --measurement-time 2 --noplot 2>&1 \
        | awk -v r="$r" -v b=$b '/^alloc\//{name=$1} /time:/{print r, b, name, $(NF-3), $(NF-2)}'
    done
  done
) | tee "$OUT/ab.txt"
echo "=== A/B done ($((SECONDS - start)) s)"
OUT=/tmp/t ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t/run.log 2>&1
sed -n '/allocator hot path/,$p' /tmp/t/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
cp /tmp/t/run.log "$OUT/table_run.log"; cp /tmp/t/bench_alloc.log "$OUT/"
echo "total: $((SECONDS - start)) s"
