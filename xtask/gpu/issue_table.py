"""Issue 30's table from run.sh's `issue_table` rounds: FILE holds one line per way per
round, "ROUND WAY VALUE...", for the ways
- ours: criterion's medians (ns) of alloc/pair_1MiB, alloc/churn_1024_live,
  alloc/churn_1024_live_recommended, alloc/pair_1MiB_8threads,
  alloc/pair_1MiB_8threads_recommended, pinned/pair_1MiB_8threads, h2d/pageable_64MiB;
- torch: torch_table.py's line (ns, and GB/s for the copy);
- reference (optional): another revision's alloc/churn_1024_live and
  alloc/pair_1MiB_8threads (ns).
Prints each row's medians over the rounds, the median over rounds of the row's ratio in the
same round with a 95% bootstrap interval (paired_summary.py's), the target, and whether the
median meets it; then every round's figures. Exits 0 whenever the file is complete: a
missed target is a figure, not a failed step.

usage: issue_table.py FILE"""
import random
import statistics
import sys

from paired_summary import median_interval

COPY_BYTES = 64 << 20
OURS = ["pair", "churn", "churn_rec", "pairs8", "pairs8_rec", "pinned8", "h2d_ns"]
TORCH = ["pair", "churn", "pairs8", "pinned8", "h2d"]
REFERENCE = ["churn", "pairs8"]


def rounds_of(path):
    """{way: [{name: value} per round]}, rounds in order; every round must have every way."""
    names = {"ours": OURS, "torch": TORCH, "reference": REFERENCE}
    lines = {}
    for line in open(path):
        r, way, *values = line.split()
        if len(values) != len(names[way]):
            sys.exit(f"{path}: round {r} {way}: {len(values)} values, {len(names[way])} expected")
        lines.setdefault(way, {})[int(r)] = dict(zip(names[way], map(float, values)))
    if "ours" not in lines or "torch" not in lines:
        sys.exit(f"{path}: no complete round (ways found: {sorted(lines) or 'none'})")
    rounds = sorted(lines["ours"])
    for way, by_round in lines.items():
        if sorted(by_round) != rounds:
            sys.exit(f"{path}: {way} has rounds {sorted(by_round)}, ours {rounds}")
    by_way = {way: [by_round[r] for r in rounds] for way, by_round in lines.items()}
    for values in by_way["ours"]:
        values["h2d"] = COPY_BYTES / values["h2d_ns"]
    return by_way


def main(path):
    ways = rounds_of(path)
    ours, torch, reference = ways["ours"], ways["torch"], ways.get("reference")
    rng = random.Random(0)
    print(f"issue 30's table: medians of {len(ours)} rounds, ours and PyTorch's alternated; "
          "ratios: the median over rounds of each round's ratio [95% bootstrap]")
    print(f"{'row':40} {'ferrocuda':>10} {'other':>10} {'ratio [95% bootstrap]':>25} {'target':>8}  met")

    def row(label, num, den, measure=None, target=None, unit="ns"):
        """`measure` is "abs" (ours' median against `target`), "le" or "ge" (the ratio's),
        or None: figures only, no target."""
        a, b = statistics.median(num), statistics.median(den)
        ratio, low, high = median_interval([x / y for x, y in zip(num, den)], rng)
        figures = f"{label:40} {a:10.2f} {b:10.2f} {ratio:9.3f} [{low:.3f}, {high:.3f}]"
        if measure is None:
            print(figures)
            return
        judged = a if measure == "abs" else ratio
        met = judged <= target if measure in ("abs", "le") else judged >= target
        sign = "≥" if measure == "ge" else "≤"
        print(f"{figures} {sign + ' ' + str(target) + (' ' + unit if measure == 'abs' else ''):>10}  "
              f"{'yes' if met else 'NO'}")

    def col(rows, name):
        return [r[name] for r in rows]

    row("cached pair 1 MiB, ns (PyTorch)", col(ours, "pair"), col(torch, "pair"), "abs", 35)
    row("churn, 1024 live, ns (PyTorch)", col(ours, "churn"), col(torch, "churn"), "abs", 60)
    row("1 MiB pairs, 8 threads, ns (PyTorch)", col(ours, "pairs8"), col(torch, "pairs8"), "abs", 150)
    row("recommended churn (default)", col(ours, "churn_rec"), col(ours, "churn"), "le", 1.0)
    row("recommended 8 threads (default)", col(ours, "pairs8_rec"), col(ours, "pairs8"), "le", 1.0)
    row("pinned pair 1 MiB, 8 threads (PyTorch)", col(ours, "pinned8"), col(torch, "pinned8"), "le", 0.8)
    row("H2D 64 MiB pageable, GB/s (PyTorch)", col(ours, "h2d"), col(torch, "h2d"), "ge", 1.0)
    if reference:
        row("A/B: churn (reference)", col(ours, "churn"), col(reference, "churn"))
        row("A/B: 8-thread pairs (reference)", col(ours, "pairs8"), col(reference, "pairs8"))
    print("rounds: ours " + " ".join(OURS[:-1]) + " h2d_GBps | torch " + " ".join(TORCH)
          + (" | reference " + " ".join(REFERENCE) if reference else ""))
    for i, values in enumerate(ours):
        line = " ".join(f"{values[n]:.2f}" for n in OURS[:-1] + ["h2d"])
        line += " | " + " ".join(f"{torch[i][n]:.2f}" for n in TORCH)
        if reference:
            line += " | " + " ".join(f"{reference[i][n]:.2f}" for n in REFERENCE)
        print(f"  {i + 1}: {line}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
