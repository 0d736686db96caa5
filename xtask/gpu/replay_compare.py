"""Compares the replays replay.sh wrote into DIR and prints one table.

    python3 replay_compare.py DIR

DIR holds, per trace NAME, configuration TAG (default, expandable) and run R = 1, 2, ...:
  NAME.TAG.cuda.R.json   `ferrocuda replay NAME --device cuda --json`
  NAME.TAG.fake.R.json   `ferrocuda replay NAME --device fake --json
                          --addresses-from NAME.TAG.cuda.R.json` (the fake device places its
                          segments where the driver placed run R's)
  NAME.TAG.torch.R.json  `torch_replay.py NAME --repeat 1 --json ...`

Fails (exit code 1, with a line starting "MISMATCH" or "MISSING") where
  - a memory figure of one of our GPU runs differs from PyTorch's on the same GPU
    (peak_reserved, peak_allocated, num_device_alloc, num_device_free): both allocators got
    their segments from the same driver, so an exact allocator gives PyTorch's figures;
  - a memory figure of GPU run R differs from fake run R's (the same keys and num_ooms), or
    fake run R did not put every segment where the driver put run R's: with the driver's
    placement (best fit breaks ties between equal free blocks by address) the fake device
    must give the GPU's figures under every configuration;
  - ours and PyTorch timed different numbers of events, or ran another configuration (the
    ratio would compare unlike work);
  - a file is missing or unreadable.
Prints, per trace and configuration, the fastest run of each side: ns per event of ferrocuda
on the GPU and of PyTorch, their ratio (the target, <= 0.5, is for the default
configuration), ferrocuda on the fake device, and PyTorch's memory figures beside ours on
the GPU. Writes the table's figures to DIR/summary.json."""
import glob
import json
import os
import re
import sys

MEMORY = ["peak_reserved", "peak_allocated", "num_device_alloc", "num_device_free", "num_ooms"]
# The configuration each tag must have run under: ferrocuda's label, PyTorch's
# PYTORCH_CUDA_ALLOC_CONF.
CONF = {"default": ("default", ""), "expandable": ("expandable_segments:True",) * 2}
TARGET = {"default": 0.5}


def load(path, problems):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        problems.append(f"MISSING {os.path.basename(path)}: {e}")
        return None


def ours(path, problems):
    """The one row of a `ferrocuda replay --json` (a trace of one device)."""
    rows = load(path, problems)
    if rows is None:
        return None
    if not isinstance(rows, list) or len(rows) != 1:
        problems.append(f"MISSING {os.path.basename(path)}: expected one device's figures")
        return None
    return rows[0]


def runs(directory, stem, side, problems):
    """Run number -> the figures of `stem`'s runs on `side` (cuda, fake or torch)."""
    paths = glob.glob(os.path.join(directory, f"{stem}.{side}.*.json"))
    if not paths:
        problems.append(f"MISSING {stem}.{side}.*.json")
    read = load if side == "torch" else ours
    found = {}
    for p in paths:
        run = int(re.search(r"\.(\d+)\.json$", p).group(1))
        figures = read(p, problems)
        if figures is not None:
            found[run] = figures
    return found


def same_placement(name, tag, i, fake, cuda, problems):
    """Fake run i put every segment where GPU run i's driver did."""
    given = len(cuda.get("segment_addresses", []))
    used = fake.get("addresses") or {}
    if (used.get("recorded"), used.get("used"), used.get("fresh")) != (given, given, 0):
        problems.append(f"MISMATCH {name} {tag}: fake run {i} placed segments {used} where the "
                        f"GPU run gave {given} addresses")


def compare(directory):
    """(rows of the table, problems)."""
    problems, table = [], []
    stems = sorted({re.sub(r"\.cuda\.\d+\.json$", "", os.path.basename(p))
                    for p in glob.glob(os.path.join(directory, "*.cuda.*.json"))})
    if not stems:
        problems.append(f"MISSING {directory}/*.cuda.*.json: no replay ran")
    for stem in stems:
        name, tag = stem.rsplit(".", 1)
        cuda = runs(directory, stem, "cuda", problems)
        fake = runs(directory, stem, "fake", problems)
        torch = runs(directory, stem, "torch", problems)
        if not cuda or not fake or not torch:
            continue
        want_ours, want_theirs = CONF.get(tag, (None, None))
        for run in list(fake.values()) + list(cuda.values()):
            if run.get("conf") != want_ours:
                problems.append(f"MISMATCH {name} {tag}: ferrocuda ran {run.get('conf')!r}")
        for run in torch.values():
            if run.get("conf") != want_theirs:
                problems.append(f"MISMATCH {name} {tag}: PyTorch ran {run.get('conf')!r}")
        for i, run in sorted(cuda.items()):
            if run.get("backend") != "cuda":
                problems.append(f"MISMATCH {name} {tag}: GPU run {i} ran on {run.get('backend')!r}")
            twin = fake.get(i)
            if twin is None:
                problems.append(f"MISSING {stem}.fake.{i}.json")
            else:
                same_placement(name, tag, i, twin, run, problems)
                for key in MEMORY:
                    if run.get(key) != twin.get(key):
                        problems.append(f"MISMATCH {name} {tag}: {key} fake {twin.get(key)} != "
                                        f"cuda {run.get(key)} (run {i})")
            for j, theirs in sorted(torch.items()):
                for key in MEMORY:
                    if key in theirs and run.get(key) != theirs[key]:
                        problems.append(f"MISMATCH {name} {tag}: {key} PyTorch {theirs[key]} "
                                        f"!= ours on the GPU {run.get(key)} (runs {j}, {i})")
        first = fake[min(fake)]
        for run in list(cuda.values()) + list(torch.values()):
            events = run.get("timed_events", run.get("events"))
            if events != first.get("timed_events"):
                problems.append(f"MISMATCH {name} {tag}: {events} events timed in one run, "
                                f"{first.get('timed_events')} on the fake device")
        best = min(cuda.values(), key=lambda r: r["ns_per_event"])
        theirs = min(torch.values(), key=lambda r: r["ns_per_event"])
        ratio = best["ns_per_event"] / theirs["ns_per_event"] if theirs["ns_per_event"] else None
        table.append({
            "trace": name, "conf": tag, "events": first.get("timed_events"),
            "ferrocuda_cuda_ns_per_event": best["ns_per_event"],
            "pytorch_ns_per_event": theirs["ns_per_event"],
            "ratio": ratio, "target": TARGET.get(tag),
            "ferrocuda_fake_ns_per_event": min(r["ns_per_event"] for r in fake.values()),
            "runs": [len(cuda), len(torch)],
            "ours": {k: best.get(k) for k in MEMORY},
            "fake": {k: first.get(k) for k in MEMORY},
            "pytorch": {k: theirs.get(k) for k in MEMORY if k in theirs},
        })
    return table, problems


def versus(key, theirs, mine):
    return f"{key} =" if theirs == mine else f"{key} {theirs} (ours {mine})"


def render(table):
    head = (f"{'trace':20} {'conf':10} {'events':>8} {'ours cuda ns/ev':>15} "
            f"{'PyTorch ns/ev':>13} {'ratio':>6} {'target':>7} {'fake ns/ev':>10}  "
            "PyTorch's memory figures against ours on the GPU")
    lines = [head]
    for r in table:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        target = "-"
        if r["target"] is not None:
            met = r["ratio"] is not None and r["ratio"] <= r["target"]
            target = f"{'met' if met else 'NOT'} {r['target']}"
        theirs = ", ".join(versus(k, v, r["ours"][k]) for k, v in r["pytorch"].items())
        lines.append(
            f"{r['trace']:20} {r['conf']:10} {r['events']:>8} "
            f"{r['ferrocuda_cuda_ns_per_event']:15.1f} {r['pytorch_ns_per_event']:13.1f} "
            f"{ratio:>6} {target:>7} {r['ferrocuda_fake_ns_per_event']:10.1f}  {theirs}")
    return "\n".join(lines)


def main(argv):
    if len(argv) != 2:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    directory = argv[1]
    table, problems = compare(directory)
    print(render(table))
    with open(os.path.join(directory, "summary.json"), "w") as f:
        json.dump({"rows": table, "problems": problems}, f, indent=1)
    for p in problems:
        print(p)
    if problems:
        print(f"replay comparison FAILED: {len(problems)} problem(s)")
        return 1
    print(f"replay comparison passed: {len(table)} traces x configurations, memory figures "
          "on the GPU equal to PyTorch's, and to the fake device's with the driver's placement")
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv))
