import sys,collections,statistics as st
d=collections.defaultdict(list)
for line in open(sys.argv[1]):
    p=line.split()
    if len(p)<4: continue
    shape,conf,b=p[:3]; vals=[float(x) for x in p[3:]]
    d[(shape,conf,b)].append(min(vals))
keys=sorted(set((s,c) for s,c,_ in d))
bins=sorted(set(b for _,_,b in d))
for s,c in keys:
    base=bins[0]
    row=[f"{s:6s} {c:28s}"]
    for b in bins:
        v=d[(s,c,b)]; row.append(f"{b}: med {st.median(v):6.2f} min {min(v):6.2f}")
    # paired ratios vs first bin
    for b in bins[1:]:
        r=[y/x for x,y in zip(d[(s,c,base)],d[(s,c,b)])]
        row.append(f"{b}/{base} med {st.median(r):.3f} [{min(r):.3f},{max(r):.3f}]")
    print(" | ".join(row))
