#!/usr/bin/env bash
# Third call: is the carried churn slower spread over cores 2-10 (as run.sh pins the benches)
# than on one core, and does the core matter? The host's layout and load, then the churn
# (criterion's alloc/churn_1024_live over the real driver, 1 s of samples) on each core from
# 2 to 10 and on 2-10, twice over. From the repository root with gpu-bundle.tar.xz carried.
set -u
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
lscpu -e 2>/dev/null | head -20
grep MHz /proc/cpuinfo | head -16 | tr '\n' ' '; echo
top -bn1 | head -15
export CRITERION_HOME=/tmp/crit FERROCUDA_REQUIRE_GPU=1
churn() {  # CPUS: criterion's median ns per operation, and the samples' range
  rm -rf /tmp/crit
  taskset -c "$1" ./bench_alloc --bench '^alloc/churn_1024_live$' --warm-up-time 0.3 --measurement-time 1 > /tmp/b.log 2>&1 || { tail -3 /tmp/b.log; return; }
  python3 - "$1" /tmp/crit/alloc/churn_1024_live/new/sample.json <<'PY'
import json, sys, statistics as st
d = json.load(open(sys.argv[2]))
per = [t / i for i, t in zip(d["iters"], d["times"])]
print(f"cpus {sys.argv[1]:5} median {st.median(per):6.1f} min {min(per):6.1f} max {max(per):6.1f}")
PY
}
for r in 1 2; do
  for c in 2 3 4 5 6 7 8 9 10 2-10; do churn $c; done
done
