#!/usr/bin/env python3
"""Per build and configuration: the median and best of the per-run best rounds, and the
paired ratio of two builds (per round, median and a 95% bootstrap interval).
usage: paired.py FILE BASE [OTHER ...]"""
import collections, random, re, statistics, sys

runs = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    m = re.match(r"(\d+) (\S+) conf='([^']*)' (.*)", line)
    if m:
        r, build, conf, values = m.groups()
        runs[(conf, build)][int(r)] = min(float(v) for v in values.split())
base, others = sys.argv[2], sys.argv[3:]
rng = random.Random(1)
for conf in sorted({c for c, _ in runs}):
    for build in [base] + others:
        v = list(runs[(conf, build)].values())
        print(f"{conf or 'default'}: {build} median {statistics.median(v):.1f} best {min(v):.1f} ({len(v)} runs)")
    for build in others:
        rounds = sorted(set(runs[(conf, build)]) & set(runs[(conf, base)]))
        ratios = [runs[(conf, build)][r] / runs[(conf, base)][r] for r in rounds]
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        faster = sum(x < 1 for x in ratios)
        print(f"  {build}/{base}: paired median {statistics.median(ratios):.3f} "
              f"[{boot[50]:.3f}, {boot[1949]:.3f}], faster in {faster} of {len(ratios)}")
