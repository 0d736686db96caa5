"""Sleep and wake through the PyTorch plug-in, shaped like an inference server.

ferrocuda (libferrocuda_torch.so) is PyTorch's allocator. Three sleepable pools
(`ferrocuda_create_sleepable_pool` on ids from `torch.cuda.graph_pool_handle()`): the
model's weights (filled through `torch._C._cuda_beginAllocateCurrentThreadToPool`, what
`torch.cuda.use_mem_pool` calls), a KV cache, and the pool the CUDA graphs of five batch
sizes are captured into (`torch.cuda.graph(g, pool=...)`). The graphs' outputs are the
reference. Then, as a server between rounds of an RL loop:

- sleep: the weights offloaded to pinned host memory with a checksum (mode 2), the KV
  cache and the graphs' memory discarded (mode 0); the device's free memory
  (`torch.cuda.mem_get_info`) must grow by at least 99% of the pools' bytes;
- something large allocated, written and freed in the memory given back (another model's
  weights being synchronized, say), and the cache emptied;
- wake: every pool mapped again at the same addresses, the weights restored (checksum
  checked by the library), the KV cache written again (the prefill a server reruns);
- every graph replays to its reference output, bit for bit, and no exported call failed.

Exit 1 on any failure; figures to $OUT/plugin_sleep.json.

    python3 plugin_sleep.py        (the library: FERROCUDA_TORCH_LIB, else beside this file)
"""
import ctypes
import json
import os
import pickle
import sys
import time

from plugin_bench import OUT, Ferrocuda

BATCHES = [16, 8, 4, 2, 1]
HIDDEN, HEADS, CONTEXT, LAYERS = 1024, 16, 1024, 4
DISCARD, OFFLOAD_CHECKED = 0, 2


class MempoolId(ctypes.Structure):
    _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]


def model_of(torch):
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
            self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
            self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
            self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x, keys, values):
            b = x.shape[0]
            q, _, _ = self.qkv(x).split(HIDDEN, dim=-1)
            q = q.view(b, HEADS, 1, HIDDEN // HEADS)
            att = torch.softmax(q @ keys[:b].transpose(-1, -2) / 8.0, dim=-1)
            x = x + self.proj((att @ values[:b]).reshape(b, HIDDEN))
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    return torch.nn.ModuleList([Layer() for _ in range(LAYERS)])


def main():
    ferro = Ferrocuda()
    import torch
    L = ferro.lib
    for name, args in [("ferrocuda_create_sleepable_pool", (ctypes.c_int, MempoolId)),
                       ("ferrocuda_sleep", (ctypes.c_int, MempoolId, ctypes.c_int)),
                       ("ferrocuda_wake", (ctypes.c_int, MempoolId))]:
        getattr(L, name).argtypes = args
        getattr(L, name).restype = ctypes.c_int

    def call(name, *args):
        if getattr(L, name)(*args) != 0:
            raise SystemExit(f"{name}: {ferro.last_error()}")

    pools = {name: torch.cuda.graph_pool_handle() for name in ("weights", "kv", "graphs")}
    for pool in pools.values():
        call("ferrocuda_create_sleepable_pool", 0, MempoolId(*pool))

    def filled(pool, make):
        torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
        try:
            return make()
        finally:
            torch._C._cuda_endAllocateToPool(0, pool)

    torch.manual_seed(0)
    layers = filled(pools["weights"], lambda: model_of(torch).half().cuda().eval())
    kv_host = torch.randn(LAYERS, 2, BATCHES[0], HEADS, CONTEXT, HIDDEN // HEADS, dtype=torch.half)
    kv = filled(pools["kv"], lambda: kv_host.cuda())
    inputs = {b: torch.randn(b, HIDDEN, device="cuda", dtype=torch.half) for b in BATCHES}

    def step(b):
        x = inputs[b]
        for i, layer in enumerate(layers):
            x = layer(x, kv[i, 0], kv[i, 1])
        return x

    stream = torch.cuda.Stream()
    graphs, outputs = {}, {}
    with torch.no_grad():
        with torch.cuda.stream(stream):
            for b in BATCHES:
                step(b)
        torch.cuda.synchronize()
        for b in BATCHES:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pools["graphs"], stream=stream):
                outputs[b] = step(b)
            graphs[b] = g
    reference = {}
    for b in BATCHES:
        graphs[b].replay()
        reference[b] = outputs[b].cpu()
    torch.cuda.synchronize()
    weight_ptrs = [p.data_ptr() for p in layers.parameters()]
    snapshot = os.path.join(OUT, "plugin_sleep_snapshot.pickle")
    assert L.ferrocuda_dump_snapshot(snapshot.encode()) == 0, ferro.last_error()
    pool_bytes = sum(s["total_size"] for s in pickle.load(open(snapshot, "rb"))["segments"]
                     if tuple(s["segment_pool_id"]) in {tuple(p) for p in pools.values()})
    ferro.require_no_error("serving")

    free_awake, _ = torch.cuda.mem_get_info()
    t = time.perf_counter()
    call("ferrocuda_sleep", 0, MempoolId(*pools["weights"]), OFFLOAD_CHECKED)
    call("ferrocuda_sleep", 0, MempoolId(*pools["kv"]), DISCARD)
    call("ferrocuda_sleep", 0, MempoolId(*pools["graphs"]), DISCARD)
    sleep_s = time.perf_counter() - t
    free_asleep, _ = torch.cuda.mem_get_info()
    returned = (free_asleep - free_awake) / pool_bytes
    print(f"sleep: {pool_bytes} bytes in the three pools; free memory +{free_asleep - free_awake} "
          f"({returned:.4f} of them, target >= 0.99) in {sleep_s * 1e3:.1f} ms")

    # Something else uses the memory meanwhile: most of what came back, written and freed.
    big = torch.empty(int(0.9 * (free_asleep - free_awake)) // 2, dtype=torch.half, device="cuda")
    big.fill_(7.0)
    torch.cuda.synchronize()
    del big
    torch.cuda.empty_cache()

    t = time.perf_counter()
    for name in ("weights", "kv", "graphs"):
        call("ferrocuda_wake", 0, MempoolId(*pools[name]))
    wake_s = time.perf_counter() - t
    kv.copy_(kv_host)  # the KV cache was discarded: the server's prefill writes it again
    assert [p.data_ptr() for p in layers.parameters()] == weight_ptrs
    same = True
    for b in BATCHES:
        graphs[b].replay()
        equal = torch.equal(outputs[b].cpu(), reference[b])
        same &= equal
        print(f"batch {b:2}: replay after wake {'equals' if equal else 'DIFFERS FROM'} the reference")
    ferro.require_no_error("sleep and wake")
    print(f"wake: {wake_s * 1e3:.1f} ms (weights restored and checked)")
    with open(os.path.join(OUT, "plugin_sleep.json"), "w") as f:
        json.dump({"pool_bytes": pool_bytes, "free_before": free_awake, "free_asleep": free_asleep,
                   "returned": returned, "sleep_ms": sleep_s * 1e3, "wake_ms": wake_s * 1e3,
                   "outputs_equal": same}, f, indent=1)
    ok = same and returned >= 0.99
    print("plugin_sleep:", "passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
