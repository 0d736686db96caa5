#!/usr/bin/env bash
# Seventh call: 64 MiB copies between pageable memory and the device, ours (align_probe,
# one round: copy_from_host and copy_to_host with no staging threads, from and into a
# Vec's start, 30 reps after a warm-up) and PyTorch's (`copy_` from and into a pageable
# tensor, 30 reps after 3 warm-up), alternated over twelve rounds (the order flipped every
# other round), on cores 2-10. Each line: round, way, H2D GB/s, D2H GB/s.
set -u
torch_copy() {
  taskset -c 2-10 python3 - <<'PY'
import time, torch
n = 64 << 20
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
host = torch.full((n,), 7, dtype=torch.uint8)
s = torch.cuda.current_stream()
res = []
for f in (lambda: (dev.copy_(host), s.synchronize()), lambda: host.copy_(dev)):
    for _ in range(3):
        f()
    t = time.perf_counter()
    for _ in range(30):
        f()
    res.append(n * 30 / (time.perf_counter() - t) / 1e9)
print("%.2f %.2f" % tuple(res))
PY
}
ours_copy() {
  taskset -c 2-10 target/probe/align_probe 1 | awk '/h2d/ {for (i = 3; i <= NF; i++) if ($i ~ /^malloc16:/) {split($i, a, ":"); h = a[2]}}
    /d2h/ {for (i = 3; i <= NF; i++) if ($i ~ /^malloc16:/) {split($i, a, ":"); d = a[2]}} END {print h, d}'
}
for r in $(seq 1 12); do
  if (( r % 2 )); then order="torch ours"; else order="ours torch"; fi
  for w in $order; do echo "$r $w $(${w}_copy)"; done
done | tee "$OUT/paired.txt"
