"""Records PyTorch memory snapshots the way users record them, for the `ferrocuda` command's
tests and for checking it on real inputs: `torch.cuda.memory._record_memory_history(...)`,
a workload, then `torch.cuda.memory._dump_snapshot(path)` (a plain pickle; compressed
copies are made beside it). Needs a GPU and PyTorch (torchvision and transformers for two
of the workloads; no weights are downloaded, the models are built from their configs).

    python3 record_snapshots.py OUT_DIR [--only NAME,...]

Workloads (each in a fresh allocator state):
- resnet18_train: torchvision ResNet-18, SGD, fp16 autocast with GradScaler, 3 steps;
  history defaults (Python and C++ stacks, alloc and free context).
- gpt2_train_max_entries: a 4-layer GPT-2 from transformers' config, AdamW, bf16 autocast,
  4 steps; max_entries=2000, so the history is a ring buffer that starts mid-run.
- mlp_graph_mempool: a CUDA graph capture (private pool) and a torch.cuda.MemPool in use;
  context="all", stacks="python".
- churn_2m: two million events of plain tensor churn with context=None (no stacks): the
  size the reader's memory benchmark models.
"""
import gc
import json
import lzma
import os
import sys
import time

import torch


def fresh():
    torch.cuda.memory._record_memory_history(enabled=None)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def dump(out, name, facts):
    path = os.path.join(out, name + ".pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    snap = torch.cuda.memory._snapshot()
    with open(path, "rb") as f:
        raw = f.read()
    with lzma.open(path + ".xz", "wb", preset=6) as f:
        f.write(raw)
    facts[name] = {
        "pickle_bytes": len(raw),
        "xz_bytes": os.path.getsize(path + ".xz"),
        "segments": len(snap["segments"]),
        "pools": sorted({tuple(s["segment_pool_id"]) for s in snap["segments"]}),
        "memory_stats_peak_reserved": torch.cuda.memory_stats()["reserved_bytes.all.peak"],
    }
    print(name, facts[name], flush=True)


def resnet18_train(out, facts):
    import torchvision

    fresh()
    torch.cuda.memory._record_memory_history()
    model = torchvision.models.resnet18().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler()
    for _ in range(3):
        x = torch.randn(32, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (32,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dump(out, "resnet18_train", facts)


def gpt2_train_max_entries(out, facts):
    from transformers import GPT2Config, GPT2LMHeadModel

    fresh()
    torch.cuda.memory._record_memory_history(max_entries=2000)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(4):
        ids = torch.randint(0, 50257, (4, 128 + 64 * step), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dump(out, "gpt2_train_max_entries", facts)


def mlp_graph_mempool(out, facts):
    fresh()
    torch.cuda.memory._record_memory_history(context="all", stacks="python")
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
    ).cuda()
    static_in = torch.randn(64, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_in)
    for _ in range(3):
        static_in.copy_(torch.randn(64, 512, device="cuda"))
        graph.replay()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        kept = [torch.empty(1 << 20, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    dump(out, "mlp_graph_mempool", facts)
    del kept, static_out, graph


def churn_2m(out, facts):
    fresh()
    torch.cuda.memory._record_memory_history(context=None)
    sizes = [512, 4096, 1 << 20, 3 << 20]
    live = []
    # Each tensor gives alloc, free_requested and free_completed: 667 000 tensors.
    for i in range(667_000):
        live.append(torch.empty(sizes[i % 4], dtype=torch.uint8, device="cuda"))
        if len(live) > 64:
            del live[(i * 7919) % len(live)]
    del live
    torch.cuda.synchronize()
    dump(out, "churn_2m", facts)


def main():
    out = sys.argv[1]
    only = None
    if "--only" in sys.argv:
        only = sys.argv[sys.argv.index("--only") + 1].split(",")
    os.makedirs(out, exist_ok=True)
    facts = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for work in (resnet18_train, gpt2_train_max_entries, mlp_graph_mempool, churn_2m):
        if only is None or work.__name__ in only:
            start = time.time()
            work(out, facts)
            print(work.__name__, "recorded in %.1f s" % (time.time() - start), flush=True)
    with open(os.path.join(out, "facts.json"), "w") as f:
        json.dump(facts, f, indent=1)


if __name__ == "__main__":
    main()
