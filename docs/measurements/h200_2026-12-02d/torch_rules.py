"""PyTorch's own cost of expandable segments on issue 30's allocator rows: its 1 024-live
churn (on one core) and its 1 MiB pairs on 8 threads (on cores 2-10), with
PYTORCH_CUDA_ALLOC_CONF empty and "expandable_segments:True", each way a process of its
own, alternated round by round, the order flipped every other round (as run.sh's paired
steps alternate ours). The loops are torch_anchor.py's own C++ (`mixed_ns`, `pair_ns`),
built by the bundle's torch_table.py.

usage: torch_rules.py BUNDLE_DIR ROUNDS: prints "ROUND WAY CHURN_NS PAIRS8_NS" lines."""
import os
import subprocess
import sys

ONE_WAY = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch, torch_table
torch.zeros(1, device="cuda")
ext = torch_table.allocator_extension()
core = int(sys.argv[2])
started = os.sched_getaffinity(0)
torch_table.pin_process({core})
churn = ext.mixed_ns(1024, 1000000)
torch_table.pin_process(started)
print("%.3f %.3f" % (churn, ext.pair_ns(1 << 20, 100000, 8)))
"""
WAYS = {"default": "", "expandable": "expandable_segments:True"}


def main(bundle, rounds):
    for r in range(1, rounds + 1):
        order = list(WAYS) if r % 2 else list(WAYS)[::-1]
        core = 2 + (r - 1) % 9
        for way in order:
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=WAYS[way])
            out = subprocess.run(["taskset", "-c", "2-10", sys.executable, "-c", ONE_WAY,
                                  bundle, str(core)], env=env, capture_output=True,
                                 text=True, check=True).stdout.split()
            print(r, way, *out[-2:], flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(os.path.abspath(sys.argv[1]), int(sys.argv[2]))
