#!/usr/bin/env bash
# A/B of the allocator's churn example (crates/alloc/examples/churn.rs) on the real driver:
# churn_base (db223b9) against churn_new (this session's reclaim best-fit rule), default
# configuration and the recommended set, alternated run by run (order flipped every other
# round), each run one process pinned to one core: 2 000 000 warm-up operations, then
# three timed rounds of 2 000 000. Binaries in target/probe20 (carried).
set -u
ROUNDS=${ROUNDS:-6}
P=target/probe20
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for conf in "" "ferrocuda_recommended:True"; do
    for b in $order; do
      line=$(taskset -c "${CORE:-3}" "$P/churn_$b" "$conf" 2000000 3 | head -1)
      echo "round $r $b [$conf] ${line##*operation }"
    done
  done
done | tee "$OUT/ab.txt"
python3 - "$OUT/ab.txt" <<'PY'
import sys, statistics, re
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"round (\d+) (\w+) \[(.*)\] (.*)", line.strip())
    if not m:
        continue
    _, b, conf, times = m.groups()
    rows.setdefault((b, conf), []).append(statistics.median(float(t) for t in times.split()))
for (b, conf), v in sorted(rows.items()):
    print(f"{b:4} {conf or 'default':28} median of {len(v)} runs {statistics.median(v):.1f} ns (runs {' '.join(f'{x:.1f}' for x in v)})")
for conf in ["", "ferrocuda_recommended:True"]:
    pairs = [n / b for b, n in zip(rows[("base", conf)], rows[("new", conf)])]
    print(f"new/base {conf or 'default'}: median {statistics.median(pairs):.3f} (rounds {' '.join(f'{x:.3f}' for x in pairs)})")
for b in ["base", "new"]:
    pairs = [r / d for d, r in zip(rows[(b, "")], rows[(b, "ferrocuda_recommended:True")])]
    print(f"{b}: recommended/default median {statistics.median(pairs):.3f} (rounds {' '.join(f'{x:.3f}' for x in pairs)})")
PY
