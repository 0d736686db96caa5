"""PyTorch's side of run.sh's `issue_table` step: one round of the rows of issue 30's table
that PyTorch has, on one line: "PAIR_NS CHURN_NS PAIRS_8THREADS_NS PINNED_8THREADS_NS
H2D_GBps" (the caching allocator's cached 1 MiB pair and its 1 024-live churn, both on one
core; its 1 MiB pairs on 8 threads; the pinned host allocator's 1 MiB pair on 8 threads; a
64 MiB copy to the device from pageable memory). Each is measured as the full anchors
measure it: the device allocator with torch_anchor.py's own C++ (its `cpp` source is read
from that file, so the two cannot drift), the pinned pair with torch_pinned.py's, the copy
with torch_copies.py's.

usage: torch_table.py CORE: the core the whole process runs on for the single-threaded
figures ("-": leave the affinity alone); the others run on the cores it started with."""
import ast
import os
import sys

import torch
from torch.utils.cpp_extension import load_inline

import torch_pinned
from torch_copies import pageable_source, rate


def allocator_extension():
    """torch_anchor.py's C++ allocator loops, built under the anchor's own name (so torch's
    extension cache serves both)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_anchor.py")
    tree = ast.parse(open(path).read())
    cpp = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and any(getattr(t, "id", None) == "cpp" for t in node.targets))
    return load_inline("anchor_alloc", cpp_sources=cpp, functions=["pair_ns", "mixed_ns"],
                       with_cuda=True, extra_cflags=["-O2"], verbose=False)


def pin_process(cpus):
    """Every thread of this process (the driver's and torch's included) onto `cpus`, as
    `taskset` pins our bench; threads started later (the anchors' C++ ones) inherit it."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def main(core):
    torch.zeros(1, device="cuda")
    alloc, pinned = allocator_extension(), torch_pinned.extension()
    started_on = os.sched_getaffinity(0)
    if core != "-":
        pin_process({int(core)})
    pair = alloc.pair_ns(1 << 20, 200000, 1)
    churn = alloc.mixed_ns(1024, 1000000)
    pin_process(started_on)
    pairs_8 = alloc.pair_ns(1 << 20, 100000, 8)
    pinned_8 = pinned.pair_ns(1 << 20, 100000, 8)
    n = 64 << 20
    src, dst = pageable_source(n), torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    h2d = rate(lambda: (dst.copy_(src), stream.synchronize()), n)
    print("%.3f %.3f %.3f %.3f %.3f" % (pair, churn, pairs_8, pinned_8, h2d))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
