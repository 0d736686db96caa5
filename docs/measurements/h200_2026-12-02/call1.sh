#!/usr/bin/env bash
# First call (bundle at 344dc02, allocator as at eebc642): what the host's slow phase is.
# Each round on core 2: a compute-bound probe (sha256 of 256 MiB of zeros, little memory
# traffic), then the criterion churn with glibc's heap as usual and with
# GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (the heap advised to transparent huge pages), with
# the core's steal time (hypervisor) over each run. Then issue 30's table once.
# From the repository root with gpu-bundle.tar.xz carried.
set -u
start=$SECONDS
{
  grep -m1 "model name" /proc/cpuinfo; ldd --version | head -1
  for f in enabled defrag; do echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f)"; done
  lscpu | grep -i "cache\|NUMA\|Thread\|MHz"
} | tee "$OUT/facts.txt"
tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
steal() { awk '$1=="cpu2"{print $9}' /proc/stat; }
(
  export FERROCUDA_REQUIRE_GPU=1
  FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
  export FERROCUDA_CUDA_LIBRARY_PATH
  for r in $(seq 1 "${ROUNDS:-6}"); do
    t0=$(date +%s.%N); head -c 256M /dev/zero | taskset -c 2 sha256sum >/dev/null; t1=$(date +%s.%N)
    echo "$r sha256 $(awk "BEGIN{print $t1 - $t0}") s"
    for v in heap thp; do
      tun=""; [ $v = thp ] && tun=glibc.malloc.hugetlb=1
      s0=$(steal)
      GLIBC_TUNABLES=$tun CRITERION_HOME=/tmp/crit_$v taskset -c 2 ./bench_alloc --bench '^alloc/churn_1024_live$' --warm-up-time 1 --measurement-time 2 --noplot 2>&1 \
        | awk -v r="$r" -v v=$v '/time:/{printf "%s %s churn %s %s ", r, v, $(NF-3), $(NF-2)}'
      echo "steal $(( $(steal) - s0 )) jiffies"
    done
  done
) | tee "$OUT/phase.txt"
echo "=== probes done ($((SECONDS - start)) s)"
mkdir -p /tmp/t1
OUT=/tmp/t1 ONLY='^(bench_alloc|bench_pinned|torch_anchor|torch_pinned)$' bash run.sh > /tmp/t1/run.log 2>&1
sed -n '/allocator hot path/,$p' /tmp/t1/run.log | grep -v "^torch_\|^torch \|^extension\|^===" | head -40
cp /tmp/t1/run.log "$OUT/t1.run.log"; cp /tmp/t1/bench_alloc.log "$OUT/t1.bench_alloc.log"
echo "total: $((SECONDS - start)) s"
