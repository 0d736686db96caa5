#!/usr/bin/env bash
# Second call: criterion's 8-thread pairs, d8e41fb (before the credit check's walk) against
# 74b7ff2, pair_1MiB_8threads and pair_1MiB_8threads_recommended, alternated over ROUNDS
# rounds (order flipped every other round), on cores 2-10 as run.sh pins them. Bench
# binaries in target/probe22 (carried): bench_alloc_$A and bench_alloc_$B (A=prev and
# B=head unless set).
set -u
P=target/probe22
A=${A:-prev}
B=${B:-head}
for r in $(seq 1 "${ROUNDS:-6}"); do
  if [ $((r % 2)) = 1 ]; then order="$A $B"; else order="$B $A"; fi
  for b in $order; do
    CRITERION_HOME="$OUT/c_$b" taskset -c 2-10 "$P/bench_alloc_$b" --bench \
      '^alloc/pair_1MiB_8threads(_recommended)?$' --warm-up-time 0.5 --measurement-time 1.5 \
      2>&1 | grep -E "^alloc/|time:" | paste - - | awk -v r=$r -v b=$b '{print "round", r, b, $1, $5, $6}'
  done
done | tee "$OUT/ab8_$B.txt"
A=$A B=$B python3 - "$OUT/ab8_$B.txt" <<'PY'
import os, sys, statistics
a, b = os.environ["A"], os.environ["B"]
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
    r = [h / p for h, p in zip(rows[(b, name)], rows[(a, name)])]
    print(f"{b}/{a} {name}: median {statistics.median(r):.3f} ({' '.join(f'{x:.3f}' for x in r)})")
for side in [a, b]:
    r = [x / y for x, y in zip(rows[(side, "alloc/pair_1MiB_8threads_recommended")], rows[(side, "alloc/pair_1MiB_8threads")])]
    print(f"{side}: recommended/default {statistics.median(r):.3f} ({' '.join(f'{x:.3f}' for x in r)})")
PY
