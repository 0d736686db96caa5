#!/usr/bin/env bash
# Fourth call: the lock holder's pass reading every published free's block record and its
# neighbours' before serving any (warm.patch: two loops of independent loads, so that
# the misses overlap), against without (FC_NO_WARM=1), one bench binary built at the
# session's working tree with the switch (a measurement build: target/ho/alloc_warm,
# carried). Ten rounds, the two ways alternated (which goes first alternates too), cores
# 2-10 as run.sh pins the 8-thread benches.
set -u
B=target/ho/alloc_warm
F='^alloc/pair_1MiB_8threads(_recommended)?$'
one() {  # one run: way, round
  local way=$1 r=$2
  if [ "$way" = off ]; then export FC_NO_WARM=1; else unset FC_NO_WARM; fi
  taskset -c 2-10 "$B" --bench "$F" --warm-up-time 0.5 --measurement-time 1.5 > /tmp/o.txt 2> /tmp/e.txt
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
  :
}
for r in $(seq 1 10); do
  if [ $((r % 2)) = 1 ]; then one on "$r"; one off "$r"; else one off "$r"; one on "$r"; fi
done | tee "$OUT/rounds.tsv"
python3 - "$OUT/rounds.tsv" <<'PY'
import sys, statistics, random
rows = [l.split("\t") for l in open(sys.argv[1]) if not l.startswith("#")]
v = {}
for r, way, name, ns in rows:
    v[(int(r), way, name)] = float(ns)
rounds = sorted({k[0] for k in v})
def ci(xs):
    random.seed(1)
    meds = sorted(statistics.median(random.choices(xs, k=len(xs))) for _ in range(2000))
    return statistics.median(xs), meds[50], meds[1949]
d, rec = "alloc/pair_1MiB_8threads", "alloc/pair_1MiB_8threads_recommended"
for way in ("on", "off"):
    for name in (d, rec):
        print(way, name, "median ns", statistics.median(v[(r, way, name)] for r in rounds))
for label, num, den in [("default on/off", (d, "on"), (d, "off")),
                        ("recommended on/off", (rec, "on"), (rec, "off")),
                        ("rec/default on", (rec, "on"), (d, "on")),
                        ("rec/default off", (rec, "off"), (d, "off"))]:
    xs = [v[(r, num[1], num[0])] / v[(r, den[1], den[0])] for r in rounds]
    m, lo, hi = ci(xs)
    print(f"{label}: {m:.3f} [{lo:.3f}, {hi:.3f}] rounds: " + " ".join(f"{x:.3f}" for x in xs))
PY
