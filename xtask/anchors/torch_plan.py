"""PyTorch's CUDA graph pools against `ferrocuda plan` (issue: a graph-memory planner).

A decode loop of nine batch sizes (a transformer block: layer norm, attention over a KV
cache, MLP; fp16, no autograd) is warmed up eagerly on the capture stream, each size's
second warm-up recorded as a snapshot (history switched on just before it, as the
planner's users record them), then captured into one shared pool, largest first (as vLLM
captures) and smallest first (the pool grows at each), with each graph keeping its output
and with the outputs freed after each capture (vLLM's weak references): four runs. After every capture the pool's bytes are read from
`torch.cuda.memory_snapshot()` (its segments with that pool id).

Each capture's own allocations are recorded too. `ferrocuda plan` (the bundle's binary,
argument 1) plans from both: from the captures' traces it must give the pool's bytes exactly
(the same rules), and from the warm-ups it predicts them before capturing (equal unless the
capture allocates something its warm-up did not). Exit 1 if the plan from the captures'
traces differs, or if the prediction differs; writes $OUT/torch_plan.json.
"""
import json
import os
import pickle
import subprocess
import sys

import torch

OUT = os.environ.get("OUT", ".")
EXE = sys.argv[1] if len(sys.argv) > 1 else "./ferrocuda"
DIR = os.path.join(OUT, "plan")
os.makedirs(DIR, exist_ok=True)
BATCHES = [64, 48, 32, 24, 16, 8, 4, 2, 1]
HIDDEN, HEADS, CONTEXT = 1024, 16, 512


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x, kv):
        b = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).split(HIDDEN, dim=-1)
        q = q.view(b, HEADS, 1, HIDDEN // HEADS)
        keys = torch.cat([kv[0][:b], k.view(b, HEADS, 1, -1)], dim=2)
        values = torch.cat([kv[1][:b], v.view(b, HEADS, 1, -1)], dim=2)
        att = torch.softmax(q @ keys.transpose(-1, -2) / (HIDDEN // HEADS) ** 0.5, dim=-1)
        x = x + self.proj((att @ values).reshape(b, HIDDEN))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def pool_bytes(pool):
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool))


def recorded(path, run):
    """Runs `run` with the history on, saves the snapshot of just its events."""
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
    start = len(torch.cuda.memory._snapshot()["device_traces"][0])
    out = run()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    snap["device_traces"] = [t[start:] if d == 0 else t for d, t in enumerate(snap["device_traces"])]
    with open(path, "wb") as f:
        pickle.dump(snap, f)
    torch.cuda.memory._record_memory_history(enabled=None)
    return out


def plan(files, free_outputs):
    args = [EXE, "plan", *files, "--json", "--conf", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")]
    if free_outputs:
        args.append("--free-outputs")
    return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)[0]["reserved_after"]


def main():
    torch.manual_seed(0)
    model = Block().cuda().half().eval()
    kv = torch.randn(2, BATCHES[0], HEADS, CONTEXT, HIDDEN // HEADS, device="cuda", dtype=torch.half)
    inputs = {b: torch.randn(b, HIDDEN, device="cuda", dtype=torch.half) for b in BATCHES}
    stream = torch.cuda.Stream()
    result = {"batches": BATCHES, "torch": torch.__version__}
    failed = False
    with torch.no_grad():
        with torch.cuda.stream(stream):
            for b in BATCHES:  # the first warm-up: libraries' one-time allocations
                model(inputs[b], kv)
        torch.cuda.synchronize()
        warmups = []
        for b in BATCHES:
            path = os.path.join(DIR, f"warmup_{b}.pickle")
            with torch.cuda.stream(stream):
                recorded(path, lambda: model(inputs[b], kv))
            warmups.append(path)
        runs = [(order, free) for order in ("largest_first", "smallest_first") for free in (False, True)]
        for order, free_outputs in runs:
            sizes = BATCHES if order == "largest_first" else BATCHES[::-1]
            name = order + ("_free_outputs" if free_outputs else "_keep_outputs")
            graphs, outputs, pool, reserved, captures = [], [], None, [], []
            for b in sizes:
                g = torch.cuda.CUDAGraph()
                path = os.path.join(DIR, f"capture_{name}_{b}.pickle")

                def capture():
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        return model(inputs[b], kv)

                out = recorded(path, capture)
                captures.append(path)
                pool = g.pool()
                if not free_outputs:
                    outputs.append(out)
                del out
                graphs.append(g)
                reserved.append(pool_bytes(pool))
            planned_warmups = [warmups[BATCHES.index(b)] for b in sizes]
            from_captures, predicted = plan(captures, free_outputs), plan(planned_warmups, free_outputs)
            result[name] = {"torch_pool_bytes": reserved, "planned_from_captures": from_captures,
                            "planned_from_warmups": predicted}
            print(f"{name}: PyTorch's pool after each capture {reserved}")
            print(f"{name}: ferrocuda plan from the captures' traces {from_captures}")
            print(f"{name}: ferrocuda plan from the warm-ups (before capturing) {predicted}")
            for label, figures in [("captures' traces", from_captures), ("warm-ups", predicted)]:
                same = figures == reserved
                print(f"{name}: plan from the {label} {'equals' if same else 'DIFFERS FROM'} PyTorch's pool")
                failed |= not same
            del graphs, outputs
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    with open(os.path.join(OUT, "torch_plan.json"), "w") as f:
        json.dump(result, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
