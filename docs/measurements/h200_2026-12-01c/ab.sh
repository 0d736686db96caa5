#!/usr/bin/env bash
# A/B of two builds on the H200 host: criterion's churn and 8-thread pairs (default and
# recommended set), alternated over ROUNDS rounds (order flipped every other round) on
# cores 2-10 as run.sh pins them; then the churn example (`crates/alloc/examples/churn.rs`,
# real driver) alternated the same way on core 3 (CORES and CORE1 override the cores).
# Stripped binaries in $P (carried): bench_alloc_$A, bench_alloc_$B, churn_$A, churn_$B
# (the churn example's part is skipped when either is missing).
set -u
P=${P:-target/probe23}
A=${A:-base}
B=${B:-new}
for r in $(seq 1 "${ROUNDS:-6}"); do
  if [ $((r % 2)) = 1 ]; then order="$A $B"; else order="$B $A"; fi
  for b in $order; do
    CRITERION_HOME="$OUT/c_$b" taskset -c "${CORES:-2-10}" "$P/bench_alloc_$b" --bench \
      '^alloc/(churn_1024_live|pair_1MiB_8threads)(_recommended)?$' --warm-up-time 0.5 \
      --measurement-time 1.5 2>&1 | awk -v r=$r -v b=$b '
        $1 ~ /^alloc\// { name = $1 }
        { for (i = 1; i <= NF; i++) if ($i == "time:") print "round", r, b, name, $(i + 3), $(i + 4) }'
  done
done | tee "$OUT/ab_${A}_$B.txt"
for r in $(seq 1 "${ROUNDS:-6}"); do
  [ -x "$P/churn_$A" ] && [ -x "$P/churn_$B" ] || break
  if [ $((r % 2)) = 1 ]; then order="$A $B"; else order="$B $A"; fi
  for b in $order; do
    for conf in "" "ferrocuda_recommended:True"; do
      taskset -c "${CORE1:-3}" "$P/churn_$b" "$conf" 2000000 3 | head -1 \
        | awk -v r=$r -v b=$b -v c="${conf:-default}" '{print "round", r, b, "example/" c, $(NF-2), $(NF-1), $NF}'
    done
  done
done | tee "$OUT/ex_${A}_$B.txt"
A=$A B=$B python3 - "$OUT/ab_${A}_$B.txt" "$OUT/ex_${A}_$B.txt" <<'PY'
import os, sys, statistics
a, b = os.environ["A"], os.environ["B"]
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 6 and f[0] == "round":
        ns = float(f[4]) * {"ns": 1, "µs": 1e3, "us": 1e3}[f[5]]
        rows.setdefault((f[2], f[3]), []).append(ns)
for line in open(sys.argv[2]):
    f = line.split()
    if len(f) >= 7 and f[0] == "round":
        rows.setdefault((f[2], f[3]), []).append(statistics.median(map(float, f[4:7])))
for k, v in sorted(rows.items()):
    print(k, f"median {statistics.median(v):.1f} ns", " ".join(f"{x:.1f}" for x in v))
names = sorted({n for _, n in rows})
for name in names:
    if (a, name) in rows and (b, name) in rows:
        r = [y / x for x, y in zip(rows[(a, name)], rows[(b, name)])]
        print(f"{b}/{a} {name}: median {statistics.median(r):.3f} ({' '.join(f'{x:.3f}' for x in r)})")
for side in [a, b]:
    for base in ["alloc/pair_1MiB_8threads", "alloc/churn_1024_live"]:
        rec = rows.get((side, base + "_recommended"))
        if rec:
            r = [x / y for x, y in zip(rec, rows[(side, base)])]
            print(f"{side}: {base} recommended/default {statistics.median(r):.3f} ({' '.join(f'{x:.3f}' for x in r)})")
PY
