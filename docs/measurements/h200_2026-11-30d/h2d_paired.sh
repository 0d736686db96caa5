#!/usr/bin/env bash
# Pageable host-to-device copies, ferrocuda against PyTorch alternated in one call: each
# round runs the bundle's `h2d/pageable_64MiB` bench (criterion: a 64 MiB copy from a Vec
# and a stream synchronization) and then PyTorch's same copy (torch_pinned.py's loop: 3
# warm-up copies, 30 timed), both on cores 2-10 as the table runs them. From the repository
# root with gpu-bundle.tar.xz carried.
set -u
[ -d gpu-bundle ] || tar xJf gpu-bundle.tar.xz || exit 1
cd gpu-bundle || exit 1
export FERROCUDA_REQUIRE_GPU=1 CRITERION_HOME="$OUT/criterion_h2d"
FERROCUDA_CUDA_LIBRARY_PATH=$(python3 -c 'import glob, os, site; print(":".join(d for p in site.getsitepackages() for d in sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))))')
export FERROCUDA_CUDA_LIBRARY_PATH
for r in $(seq 1 "${ROUNDS:-6}"); do
  ours=$(taskset -c 2-10 ./bench_pinned --bench pageable_64MiB 2>&1 | grep -A2 "h2d/pageable_64MiB" | grep thrpt | sed 's/.*thrpt: *\[//; s/\].*//')
  torch=$(taskset -c 2-10 python3 - <<'PY'
import time, torch
n = 64 << 20
dev = torch.device("cuda")
dst = torch.empty(n, dtype=torch.uint8, device=dev)
src = torch.full((n,), 7, dtype=torch.uint8)
stream = torch.cuda.current_stream()
for _ in range(3):
    dst.copy_(src, non_blocking=False); stream.synchronize()
reps = 30
t = time.perf_counter()
for _ in range(reps):
    dst.copy_(src, non_blocking=False)
    stream.synchronize()
print(f"{n / ((time.perf_counter() - t) / reps) / 2**30:.3f} GiB/s")
PY
)
  echo "$r ferrocuda [$ours] torch $torch"
done
