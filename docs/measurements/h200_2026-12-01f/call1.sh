#!/usr/bin/env bash
# First call: where the recommended set's extra time goes, by attribution builds of the
# allocator bench (HEAD 3ac564a built as the bundle builds it, stripped, in target/probe26):
#   base     HEAD as it is;
#   nostamp  page reclaim's per-free bookkeeping left out (no page stamps, no frees counted
#            toward marks, so no marks and no stream queries; credits as without reclaim):
#            NOT safe, an upper bound on what cheaper bookkeeping could win;
#   rareq    marks on an idle stream down to one per 65 536 frees (16 << 12) instead of
#            1 024, so about 1/64 of the stream queries.
# Churn and 8-thread pairs, default / expandable / recommended, alternated rounds, cores 2-10.
set -u
P=target/probe26
start=$SECONDS
for r in $(seq 1 "${ROUNDS:-10}"); do
  [ $((SECONDS - start)) -gt "${BUDGET:-520}" ] && break
  case $((r % 3)) in 1) order="base nostamp rareq";; 2) order="nostamp rareq base";; 0) order="rareq base nostamp";; esac
  for b in $order; do
    CRITERION_HOME="$OUT/c_$b" taskset -c 2-10 "$P/bench_alloc_$b" --bench \
      '^alloc/(pair_1MiB_8threads|churn_1024_live)(_expandable|_recommended)?$' --warm-up-time 0.5 \
      --measurement-time 1.5 2>&1 | awk -v r=$r -v b=$b '
        $1 ~ /^alloc\// { name = $1 }
        { for (i = 1; i <= NF; i++) if ($i == "time:") print "round", r, b, name, $(i + 3), $(i + 4) }'
  done
done | tee "$OUT/attr.txt" > /dev/null
python3 - "$OUT/attr.txt" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    rows.setdefault((int(f[1]), f[2], f[3]), float(f[4]) * {"ns": 1, "µs": 1e3, "us": 1e3}[f[5]])
rounds = sorted({k[0] for k in rows})
print("rounds:", len(rounds))
for bench in ["pair_1MiB_8threads", "churn_1024_live"]:
    for v in ["base", "nostamp", "rareq"]:
        t = {s: [rows.get((r, v, f"alloc/{bench}{s}")) for r in rounds] for s in ["", "_expandable", "_recommended"]}
        med = {s: st.median([x for x in t[s] if x]) for s in t}
        rr = [c / b for b, c in zip(t[""], t["_recommended"]) if b and c]
        re = [c / b for b, c in zip(t["_expandable"], t["_recommended"]) if b and c]
        ed = [c / b for b, c in zip(t[""], t["_expandable"]) if b and c]
        print(f"{bench} {v}: default {med['']:.1f} expandable {med['_expandable']:.1f} recommended {med['_recommended']:.1f} ns; "
              f"rec/default {st.median(rr):.3f}, exp/default {st.median(ed):.3f}, rec/exp {st.median(re):.3f} (medians of per-round ratios)")
    for v in ["nostamp", "rareq"]:
        for s in ["", "_expandable", "_recommended"]:
            r_ = [rows[(r, v, f"alloc/{bench}{s}")] / rows[(r, "base", f"alloc/{bench}{s}")] for r in rounds
                  if (r, v, f"alloc/{bench}{s}") in rows and (r, "base", f"alloc/{bench}{s}") in rows]
            print(f"  {bench}{s} {v}/base median {st.median(r_):.3f}, faster in {sum(x < 1 for x in r_)} of {len(r_)}")
PY
echo "total: $((SECONDS - start)) s"
