#!/usr/bin/env bash
# Second call: where the default churn's bimodal samples come from. The carried churn
# (criterion's alloc/churn_1024_live) over the real driver and over the fake device,
# alternated, pinned to cores 2-10 as run.sh pins it and to one core; each sample's time
# per operation printed in order. From the repository root with gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
command -v perf && perf --version
samples() {  # LABEL: criterion's samples of the last run, per operation, in order
  python3 - "$1" "$CRITERION_HOME/alloc/churn_1024_live/new/sample.json" <<'PY'
import json, sys, statistics as st
d = json.load(open(sys.argv[2]))
per = [t / i for i, t in zip(d["iters"], d["times"])]
print(f"{sys.argv[1]:24} median {st.median(per):6.1f} min {min(per):6.1f} max {max(per):6.1f} |",
      " ".join(f"{p:.0f}" for p in per))
PY
}
export CRITERION_HOME=/tmp/crit
run() {  # LABEL CPUS BACKEND
  rm -rf /tmp/crit
  if [ "$3" = fake ]; then
    CUDA_VISIBLE_DEVICES= taskset -c "$2" ./bench_alloc --bench '^alloc/churn_1024_live$' > /tmp/b.log 2>&1
  else
    FERROCUDA_REQUIRE_GPU=1 taskset -c "$2" ./bench_alloc --bench '^alloc/churn_1024_live$' > /tmp/b.log 2>&1
  fi || { tail -5 /tmp/b.log; return; }
  samples "$1"
}
for r in 1 2 3; do
  run "real 2-10 r$r" 2-10 real
  run "fake 2-10 r$r" 2-10 fake
  run "real core5 r$r" 5 real
  run "fake core5 r$r" 5 fake
done
if command -v perf >/dev/null; then
  for b in real fake; do
    if [ $b = fake ]; then export CUDA_VISIBLE_DEVICES=; unset FERROCUDA_REQUIRE_GPU; else unset CUDA_VISIBLE_DEVICES; export FERROCUDA_REQUIRE_GPU=1; fi
    perf stat -e cycles,instructions,cache-misses,L1-dcache-load-misses,dTLB-load-misses \
      taskset -c 5 ./bench_alloc --bench '^alloc/churn_1024_live$' 2>&1 | tail -14
  done
fi
