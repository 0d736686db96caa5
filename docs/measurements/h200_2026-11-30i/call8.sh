#!/usr/bin/env bash
# Eighth call: the 64 MiB copy from pageable memory again, ours (align_probe, one round,
# from a Vec filled by one thread) and PyTorch's from a tensor filled as torch.full fills
# it (its intra-op threads) and from one filled by one thread (torch.set_num_threads(1)
# before the fill), rotated over ten rounds on cores 2-10. Each line: round, way, H2D GB/s.
set -u
torch_copy() {
  THREADS=$1 taskset -c 2-10 python3 - <<'PY'
import os, time, torch
n = 64 << 20
if os.environ["THREADS"] == "1":
    torch.set_num_threads(1)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
host = torch.full((n,), 7, dtype=torch.uint8)
s = torch.cuda.current_stream()
for _ in range(3):
    dev.copy_(host); s.synchronize()
t = time.perf_counter()
for _ in range(30):
    dev.copy_(host); s.synchronize()
print("%.2f" % (n * 30 / (time.perf_counter() - t) / 1e9))
PY
}
torchmt_copy() { torch_copy 0; }
torch1_copy() { torch_copy 1; }
ours_copy() {
  taskset -c 2-10 target/probe/align_probe 1 | awk '/h2d/ {for (i = 3; i <= NF; i++) if ($i ~ /^malloc16:/) {split($i, a, ":"); print a[2]}}'
}
ways=(torchmt torch1 ours)
for r in $(seq 1 10); do
  for k in 0 1 2; do
    w=${ways[$(( (k + r) % 3 ))]}
    echo "$r $w $(${w}_copy)"
  done
done | tee "$OUT/fill.txt"
