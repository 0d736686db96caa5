#!/usr/bin/env bash
# A/B of the allocator's churn example (crates/alloc/examples/churn.rs) on the real driver:
# churn_base (db223b9) against churn_new (this session's reclaim best-fit rule), default
# configuration and the recommended set, alternated run by run (order flipped every other
# round), each run one process pinned to one core: 2 000 000 warm-up operations, then
# three timed rounds of 2 000 000. Binaries in target/probe20 (carried). NEW names the
# binary compared with churn_base (churn_$NEW), CONFS the configurations (|-separated,
# empty for the default).
set -u
ROUNDS=${ROUNDS:-6}
NEW=${NEW:-new}
IFS='|' read -r -a CONFS <<< "${CONFS:-|ferrocuda_recommended:True}"
P=target/probe20
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="base $NEW"; else order="$NEW base"; fi
  for conf in "${CONFS[@]}"; do
    for b in $order; do
      line=$(taskset -c "${CORE:-3}" "$P/churn_$b" "$conf" 2000000 3 | head -1)
      echo "round $r $b [$conf] ${line##*operation }"
    done
  done
done | tee "$OUT/ab.txt"
NEW=$NEW python3 - "$OUT/ab.txt" <<'PY'
import os, sys, statistics, re
new = os.environ["NEW"]
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"round (\d+) (\w+) \[(.*)\] (.*)", line.strip())
    if not m:
        continue
    _, b, conf, times = m.groups()
    rows.setdefault((b, conf), []).append(statistics.median(float(t) for t in times.split()))
for (b, conf), v in sorted(rows.items()):
    print(f"{b:5} {conf or 'default':28} median of {len(v)} runs {statistics.median(v):.1f} ns (runs {' '.join(f'{x:.1f}' for x in v)})")
def ratios(num, den):
    r = [n / d for n, d in zip(rows[num], rows[den])]
    return f"median {statistics.median(r):.3f} (rounds {' '.join(f'{x:.3f}' for x in r)})"
confs = sorted({c for _, c in rows})
for conf in confs:
    print(f"{new}/base {conf or 'default'}: {ratios((new, conf), ('base', conf))}")
for b in ["base", new]:
    for conf in confs:
        if conf and (b, "") in rows:
            print(f"{b}: {conf} / default: {ratios((b, conf), (b, ''))}")
PY
