"""PyTorch's mixed churn (torch_anchor.py's `mixed_ns`: 1 024 slots, 512 B to 8 MiB, the same
xorshift generator), run ROUNDS times in one process, for a churn figure taken the way
ferrocuda's pinned one is (the caller pins this process with taskset). The extension is
torch_anchor.py's own source, so its build is the one torch_anchor.py cached."""
import os, re, sys, json
import torch
from torch.utils.cpp_extension import load_inline

anchor = open(sys.argv[1]).read()
cpp = re.search(r"cpp = r'''(.*?)'''", anchor, re.S).group(1)
ext = load_inline("anchor_alloc", cpp_sources=cpp, functions=["pair_ns", "mixed_ns"],
                  with_cuda=True, extra_cflags=["-O2"], verbose=False)
torch.cuda.init()
rounds = int(os.environ.get("ROUNDS", "5"))
runs = [ext.mixed_ns(1024, 1000000) for _ in range(rounds)]
print("torch churn ns/op:", " ".join(f"{r:.1f}" for r in runs))
json.dump({"torch_churn_pinned_ns": runs}, open(os.path.join(os.environ.get("OUT", "."), "torch_churn.json"), "w"))
