#!/usr/bin/env bash
# Fifth call: the 64 MiB host-to-device copy from pageable memory, ours (the driver's copy
# through DeviceBuffer::copy_from_host, pageable_probe of h200_2026-11-30g, 0 threads) and
# PyTorch's (`copy_` from a pageable tensor, then a sync, 30 reps), alternated over eight
# rounds (the order flipped every other round), on cores 2-10. Each line: round, way, GB/s.
set -u
torch_copy() {
  taskset -c 2-10 python3 - <<'PY'
import time, torch
n = 64 << 20
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
src = torch.full((n,), 7, dtype=torch.uint8)
s = torch.cuda.current_stream()
for _ in range(3):
    dst.copy_(src); s.synchronize()
t = time.perf_counter()
for _ in range(30):
    dst.copy_(src); s.synchronize()
print("%.2f" % (n * 30 / (time.perf_counter() - t) / 1e9))
PY
}
ours_copy() {
  taskset -c 2-10 target/probe/pageable_probe 1 | awk '$3 == "64" {print $6}'
}
for r in 1 2 3 4 5 6 7 8; do
  if (( r % 2 )); then order="torch ours"; else order="ours torch"; fi
  for w in $order; do echo "$r $w $(${w}_copy)"; done
done | tee "$OUT/paired.txt"
