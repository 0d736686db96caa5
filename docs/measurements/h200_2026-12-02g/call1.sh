#!/usr/bin/env bash
# First call: the recommended set with and without `expandable_segments_small_page_bound`
# (small expandable blocks merge only inside their 2 MiB page), against the default, in one
# bench binary built at the session's working tree (a measurement build: target/ho/alloc_pb,
# carried; FC_REC_EXTRA appends keys to the `_recommended` rows' configuration). Sixteen
# rounds, the two ways alternated (which goes first alternates too), cores 2-10 as run.sh
# pins the 8-thread benches.
set -u
B=target/ho/alloc_pb
F='^alloc/(pair_1MiB_8threads|churn_1024_live)(_recommended)?$'
one() {  # one run: way, round
  local way=$1 r=$2
  if [ "$way" = on ]; then export FC_REC_EXTRA=",expandable_segments_small_page_bound:True"; else unset FC_REC_EXTRA; fi
  taskset -c "${CORES:-2-10}" "$B" --bench "$F" --warm-up-time 0.5 --measurement-time 1.5 > /tmp/o.txt 2> /tmp/e.txt
  python3 - "$way" "$r" /tmp/o.txt <<'PY'
import re, sys
way, r, path = sys.argv[1:]
name = None
for line in open(path):
    if line.startswith("alloc/"):
        name = line.split()[0]
    m = re.search(r"time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]", line)
    if m and name:
        v, u = float(m.group(1)), m.group(2)
        v *= {"ns": 1, "µs": 1e3, "us": 1e3, "ps": 1e-3}[u]
        print(f"{r}\t{way}\t{name}\t{v:.2f}")
        name = None
PY
}
for r in $(seq 1 "${ROUNDS:-16}"); do
  if [ $((r % 2)) = 1 ]; then one on "$r"; one off "$r"; else one off "$r"; one on "$r"; fi
done | tee "$OUT/rounds.tsv"
python3 - "$OUT/rounds.tsv" <<'PY' | tee "$OUT/summary.txt"
import sys, statistics, random
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
v = {}
for r, way, name, ns in rows:
    v[(int(r), way, name)] = float(ns)
rounds = sorted({k[0] for k in v})
def ci(xs):
    random.seed(1)
    meds = sorted(statistics.median(random.choices(xs, k=len(xs))) for _ in range(2000))
    return statistics.median(xs), meds[50], meds[1949]
for base in ("alloc/pair_1MiB_8threads", "alloc/churn_1024_live"):
    d, rec = base, base + "_recommended"
    for way in ("on", "off"):
        for name in (d, rec):
            xs = [v[(r, way, name)] for r in rounds if (r, way, name) in v]
            print(way, name, "median ns", round(statistics.median(xs), 2))
    for label, num, den in [("recommended on/off", (rec, "on"), (rec, "off")),
                            ("default on/off (same code)", (d, "on"), (d, "off")),
                            ("rec/default on", (rec, "on"), (d, "on")),
                            ("rec/default off", (rec, "off"), (d, "off"))]:
        xs = [v[(r, num[1], num[0])] / v[(r, den[1], den[0])] for r in rounds
              if (r, num[1], num[0]) in v and (r, den[1], den[0]) in v]
        m, lo, hi = ci(xs)
        print(f"{base} {label}: {m:.3f} [{lo:.3f}, {hi:.3f}] rounds: " + " ".join(f"{x:.3f}" for x in xs))
PY
