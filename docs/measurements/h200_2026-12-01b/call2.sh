#!/usr/bin/env bash
# Second call: criterion's 8-thread pairs, d8e41fb (before the credit check's walk) against
# 74b7ff2, pair_1MiB_8threads and pair_1MiB_8threads_recommended, alternated over ROUNDS
# rounds (order flipped every other round), on cores 2-10 as run.sh pins them. Bench
# binaries in target/probe22 (carried): bench_alloc_prev and bench_alloc_head.
set -u
P=target/probe22
for r in $(seq 1 "${ROUNDS:-6}"); do
  if [ $((r % 2)) = 1 ]; then order="prev head"; else order="head prev"; fi
  for b in $order; do
    CRITERION_HOME="$OUT/c_$b" taskset -c 2-10 "$P/bench_alloc_$b" --bench \
      '^alloc/pair_1MiB_8threads(_recommended)?$' --warm-up-time 0.5 --measurement-time 1.5 \
      2>&1 | grep -E "^alloc/|time:" | paste - - | awk -v r=$r -v b=$b '{print "round", r, b, $1, $5, $6}'
  done
done | tee "$OUT/ab8.txt"
python3 - "$OUT/ab8.txt" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 6 or f[0] != "round":
        continue
    ns = float(f[4]) * {"ns": 1, "µs": 1e3, "us": 1e3}[f[5]]
    rows.setdefault((f[2], f[3]), []).append(ns)
for k, v in sorted(rows.items()):
    print(k, f"median {statistics.median(v):.1f} ns", " ".join(f"{x:.1f}" for x in v))
for name in ["alloc/pair_1MiB_8threads", "alloc/pair_1MiB_8threads_recommended"]:
    r = [h / p for h, p in zip(rows[("head", name)], rows[("prev", name)])]
    print(f"head/prev {name}: median {statistics.median(r):.3f} ({' '.join(f'{x:.3f}' for x in r)})")
for b in ["prev", "head"]:
    r = [x / y for x, y in zip(rows[(b, "alloc/pair_1MiB_8threads_recommended")], rows[(b, "alloc/pair_1MiB_8threads")])]
    print(f"{b}: recommended/default {statistics.median(r):.3f} ({' '.join(f'{x:.3f}' for x in r)})")
PY
