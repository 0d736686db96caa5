"""Summarizes rounds that alternated two ways of measuring the same thing (run.sh's paired
steps): FILE holds one line per way per round, "ROUND WAY VALUE...", one value per LABEL.
Prints, for each label, both ways' medians and the median over rounds of NUMERATOR's value
over DENOMINATOR's in the same round, with a 95% bootstrap interval (10 000 resamples of
the rounds, seeded: the same file prints the same figures).

usage: paired_summary.py FILE NUMERATOR DENOMINATOR UNIT LABEL..."""
import random
import statistics
import sys


def median_interval(ratios, rng):
    """The median of `ratios` and its 95% bootstrap interval (10 000 resamples by `rng`)."""
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(10000))
    return statistics.median(ratios), boot[250], boot[9750]


def main(path, numerator, denominator, unit, labels):
    values = {}
    for line in open(path):
        fields = line.split()
        values[(fields[0], fields[1])] = [float(v) for v in fields[2:]]
    rounds = sorted({r for r, _ in values}, key=int)
    rng = random.Random(0)
    for i, label in enumerate(labels):
        num = [values[(r, numerator)][i] for r in rounds]
        den = [values[(r, denominator)][i] for r in rounds]
        ratio, low, high = median_interval([a / b for a, b in zip(num, den)], rng)
        print(f"paired {label}: {numerator} {statistics.median(num):.2f} {unit}, "
              f"{denominator} {statistics.median(den):.2f} {unit} (medians of {len(rounds)} rounds), "
              f"{numerator}/{denominator} {ratio:.3f} [95% bootstrap {low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
