#!/usr/bin/env bash
# Fourth call: only criterion's 8-thread 1 MiB pairs (default and recommended), fc79e43
# against 991be14, twenty alternated rounds, to confirm or not what calls 2 and 3 hinted
# (the new build slower in 14 of 20 rounds). From the repository root with
# target/probe25 carried (as ../h200_2026-12-01c/ab.sh runs them: cores 2-10).
set -u
P=target/probe25 A=final B=new
for r in $(seq 1 "${ROUNDS:-20}"); do
  if [ $((r % 2)) = 1 ]; then order="$A $B"; else order="$B $A"; fi
  for b in $order; do
    CRITERION_HOME="$OUT/c_$b" taskset -c 2-10 "$P/bench_alloc_$b" --bench \
      '^alloc/pair_1MiB_8threads(_recommended)?$' --warm-up-time 0.5 \
      --measurement-time 1.5 2>&1 | awk -v r=$r -v b=$b '
        $1 ~ /^alloc\// { name = $1 }
        { for (i = 1; i <= NF; i++) if ($i == "time:") print "round", r, b, name, $(i + 3), $(i + 4) }'
  done
done | tee "$OUT/ab8_${A}_$B.txt" > /dev/null
python3 - "$OUT/ab8_${A}_$B.txt" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    rows.setdefault((f[2], f[3]), []).append(float(f[4]) * {"ns": 1, "µs": 1e3, "us": 1e3}[f[5]])
for name in sorted({n for _, n in rows}):
    old, new = rows[("final", name)], rows[("new", name)]
    r = [y / x for x, y in zip(old, new)]
    print(f"{name}: fc79e43 median {statistics.median(old):.1f} min {min(old):.1f}, "
          f"991be14 median {statistics.median(new):.1f} min {min(new):.1f}; new/old median "
          f"{statistics.median(r):.3f}, new faster in {sum(x < 1 for x in r)} of {len(r)}")
PY
