"""Steal time during call 2's table, from call2.sh's one-second samples of /proc/stat
(lines "t SECONDS", then "cpuN user nice system idle iowait irq softirq steal ...").

Prints, per core, the share of the sampled time the hypervisor took (steal) and the share
the core ran this machine's work (user + system), over the whole table and in 30-second
windows for the cores the table measures on (2 to 10).

usage: steal.py PROCSTAT (call2/procstat.txt.xz: read packed or not)"""
import lzma
import sys

TICK = 100  # USER_HZ: /proc/stat counts hundredths of a second


def samples(path):
    out, t, cpus = [], None, {}
    opener = lzma.open if path.endswith(".xz") else open
    for line in opener(path, "rt"):
        f = line.split()
        if f[0] == "t":
            if t is not None:
                out.append((t, cpus))
            t, cpus = int(f[1]), {}
        else:
            v = list(map(int, f[1:]))
            cpus[int(f[0][3:])] = {"busy": v[0] + v[1] + v[2], "steal": v[7],
                                   "total": sum(v[:8])}
    if t is not None and cpus:
        out.append((t, cpus))
    return out


def share(a, b, cpu, key):
    total = b[cpu]["total"] - a[cpu]["total"]
    return (b[cpu][key] - a[cpu][key]) / total if total else 0.0


def main(path):
    s = samples(path)
    (t0, first), (t1, last) = s[0], s[-1]
    print(f"{len(s)} samples over {t1 - t0} s")
    print("core  busy  steal")
    for cpu in sorted(first):
        print(f"{cpu:4} {share(first, last, cpu, 'busy'):5.1%} {share(first, last, cpu, 'steal'):6.2%}")
    print("30-second windows, cores 2-10: steal per core (max), busy (mean)")
    for i in range(0, len(s) - 30, 30):
        (ta, a), (tb, b) = s[i], s[i + 30]
        steals = [share(a, b, c, "steal") for c in range(2, 11) if c in a]
        busy = [share(a, b, c, "busy") for c in range(2, 11) if c in a]
        if not steals:
            break
        print(f"{ta - t0:5}-{tb - t0:<5} steal max {max(steals):6.2%}  busy mean {sum(busy) / len(busy):5.1%}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
