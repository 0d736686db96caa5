"""ferrocuda's caching allocator inside real PyTorch, loaded as a CUDAPluggableAllocator
(libferrocuda_torch.so, from crates/torch-plugin), beside PyTorch's own allocator.

    python3 plugin_bench.py check
        ferrocuda only, fails loudly (exit 1): every hook is installed, tensors come from
        ferrocuda (its statistics move, no exported call failed), record_stream,
        empty_cache and the memory fraction reach it, CUDA graphs captured by PyTorch
        (torch.cuda.graph, a shared pool, make_graphed_callables) replay correctly with their
        memory in the graph's private pool, and the snapshot file loads in PyTorch's viewer.

    python3 plugin_bench.py bench [--steps N] [--requests N] [--repeats R] [--only WORKLOAD]
                                  [--ways WAY,WAY,...]
        a GPT-2-small-style bf16 training loop and a BERT-style serving loop with random
        shapes (models randomly initialised), each run five ways, one process each:
        PyTorch native (default), PyTorch native with expandable_segments:True,
        ferrocuda with FERROCUDA_ALLOC_CONF=ferrocuda_recommended:True, ferrocuda with
        the empty configuration (to tell the library's cost from the configuration's), and
        the recommended set without page reclaim (to tell what reclaim's event marks and
        waits cost from the rest); the five ways of a round run back to back. Prints each
        way's step time (median over rounds of each run's mean step, what a loop pays, and of its median
        step, which its few slowest steps do not move), the median over rounds of its mean
        step over native default's in the same round (paired: what drifts between rounds
        cancels), peak reserved side by side, and whether the recommended set and its
        no-reclaim variant met the targets (paired mean within 2% of native, peak reserved
        at or below native expandable's); writes plugin_bench.json. --ways runs a subset
        (both native ways always among them: the targets are judged against them), so a
        round costs less and a fixed device time buys more rounds.

    python3 plugin_bench.py paired [--only WORKLOAD] [--rounds R] [--ways WAY,WAY,...]
        the decisive comparison: one long-lived process per way, each pinned to a CPU core of
        its own, all warmed up; then request by request (or step by step) every way runs the
        same request in turn, in a shuffled order, one process at a time, timed on the host and
        on the GPU (CUDA events around it). Each way's time over native default's for the
        same request is one paired ratio; prints their geometric mean with a 95% confidence
        interval (over requests and rounds, on the log scale), host and GPU, and writes
        plugin_bench_paired.json.

    python3 plugin_bench.py worker WORKLOAD WAY [--steps N] [--requests N]
        one run (what bench starts), printing one JSON line.

    python3 plugin_bench.py serve WORKLOAD WAY
        one way's process of `paired`: reads an index per line, runs that request, answers
        with its host and GPU milliseconds as one JSON line; "end" answers with its statistics.

The library is FERROCUDA_TORCH_LIB, else libferrocuda_torch.so beside this script. Results
go to $OUT (else the current folder).
"""
import argparse
import ctypes
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.environ.get("FERROCUDA_TORCH_LIB", os.path.join(HERE, "libferrocuda_torch.so"))
OUT = os.environ.get("OUT", ".")
MIB = 1 << 20

# PyTorch's setter on allocator() -> the function of libferrocuda_torch.so it is given.
HOOKS = [
    ("set_init_fn", "ferrocuda_init"),
    ("set_reset_fn", "ferrocuda_reset"),
    ("set_memory_fraction_fn", "ferrocuda_memory_fraction"),
    ("set_base_alloc_fn", "ferrocuda_base_alloc"),
    ("set_record_stream_fn", "ferrocuda_record_stream"),
    ("set_begin_allocate_to_pool", "ferrocuda_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "ferrocuda_end_allocate_to_pool"),
    ("set_release_pool", "ferrocuda_release_pool"),
]

WAYS = {
    "native_default": {"PYTORCH_CUDA_ALLOC_CONF": None, "FERROCUDA_ALLOC_CONF": None},
    "native_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "FERROCUDA_ALLOC_CONF": None},
    "ferrocuda": {"PYTORCH_CUDA_ALLOC_CONF": None, "FERROCUDA_ALLOC_CONF": "ferrocuda_recommended:True"},
    # ferrocuda with the empty configuration (PyTorch's behaviour): what the library itself
    # costs, apart from what expandable segments and reclaim cost or save.
    "ferrocuda_default": {"PYTORCH_CUDA_ALLOC_CONF": None, "FERROCUDA_ALLOC_CONF": None},
    # the recommended set without page reclaim (no event marks, no waits): what reclaim
    # costs in step time (docs/tuning.md has how much it saves as the device lags).
    "ferrocuda_noreclaim": {"PYTORCH_CUDA_ALLOC_CONF": None,
                            "FERROCUDA_ALLOC_CONF": "ferrocuda_recommended:True,expandable_segments_reclaim:False"},
}


class Ferrocuda:
    """libferrocuda_torch.so installed as PyTorch's CUDA allocator, and its own functions."""

    def __init__(self, path=LIB, strict=True):
        import torch
        if not os.path.exists(path):
            raise SystemExit(f"{path} not found: build it (cargo xtask gpu-bundle) or set FERROCUDA_TORCH_LIB")
        if torch.cuda.is_initialized():
            raise SystemExit("CUDA is already initialised: the allocator must be installed first")
        self.allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "ferrocuda_malloc", "ferrocuda_free")
        self.lib = ctypes.CDLL(path)  # the same handle PyTorch's ctypes load got
        hooks = self.allocator.allocator()
        self.installed, self.missing = [], []
        for setter, name in HOOKS:
            if hasattr(hooks, setter):
                getattr(hooks, setter)(ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value)
                self.installed.append(setter)
            else:
                self.missing.append(setter)
        if strict and self.missing:
            raise SystemExit(f"this PyTorch ({torch.__version__}) lacks the hook setters {self.missing}")
        torch.cuda.memory.change_current_allocator(self.allocator)
        L = self.lib
        L.ferrocuda_memory_stats_json.restype = ctypes.c_ssize_t
        L.ferrocuda_memory_stats_json.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        L.ferrocuda_allocator_settings.restype = ctypes.c_ssize_t
        L.ferrocuda_allocator_settings.argtypes = (ctypes.c_char_p, ctypes.c_size_t)
        L.ferrocuda_last_error.restype = ctypes.c_ssize_t
        L.ferrocuda_last_error.argtypes = (ctypes.c_char_p, ctypes.c_size_t)
        L.ferrocuda_error_count.restype = ctypes.c_uint64
        L.ferrocuda_reset_peak_memory_stats.argtypes = (ctypes.c_int,)
        L.ferrocuda_record_memory_history.argtypes = (ctypes.c_int, ctypes.c_size_t)
        L.ferrocuda_dump_snapshot.argtypes = (ctypes.c_char_p,)

    def _text(self, fn, *args):
        n = fn(*args, None, 0)
        if n < 0:
            raise RuntimeError(self.last_error())
        buf = ctypes.create_string_buffer(n + 1)
        fn(*args, buf, n + 1)
        return buf.value.decode()

    def stats(self, device=0):
        return json.loads(self._text(self.lib.ferrocuda_memory_stats_json, device))

    def settings(self):
        return self._text(self.lib.ferrocuda_allocator_settings)

    def last_error(self):
        n = self.lib.ferrocuda_last_error(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.lib.ferrocuda_last_error(buf, n + 1)
        return buf.value.decode()

    def errors(self):
        return self.lib.ferrocuda_error_count()

    def require_no_error(self, where):
        if self.errors():
            raise AssertionError(f"{where}: {self.errors()} ferrocuda call(s) failed; last: {self.last_error()}")


# ---- models (randomly initialised) ---------------------------------------------------------

def gpt2_small(torch):
    """GPT-2 small: 12 layers, 768 wide, 12 heads, 1024 positions, 50257 tokens, tied head."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self, d=768, heads=12):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, vocab=50257, positions=1024, d=768, layers=12):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, ids, targets):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            for b in self.blocks:
                x = b(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


def bert_base(torch):
    """BERT base encoder: 12 post-norm layers, 768 wide, 12 heads, 512 positions."""
    nn, F = torch.nn, torch.nn.functional

    class Layer(nn.Module):
        def __init__(self, d=768, heads=12):
            super().__init__()
            self.heads = heads
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x, mask):
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(C, dim=2)
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = self.ln1(x + self.proj(y.transpose(1, 2).reshape(B, T, C)))
            return self.ln2(x + self.out(F.gelu(self.fc(x))))

    class Bert(nn.Module):
        def __init__(self, vocab=30522, positions=512, d=768, layers=12):
            super().__init__()
            self.tok, self.pos, self.typ = nn.Embedding(vocab, d), nn.Embedding(positions, d), nn.Embedding(2, d)
            self.ln = nn.LayerNorm(d)
            self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
            self.pool = nn.Linear(d, d)

        def forward(self, ids, lengths):
            T = ids.shape[1]
            pos = torch.arange(T, device=ids.device)
            x = self.ln(self.tok(ids) + self.pos(pos) + self.typ(torch.zeros_like(ids)))
            keep = pos[None, :] < lengths[:, None]  # padding mask, as a served batch has
            mask = keep[:, None, None, :]
            for layer in self.layers:
                x = layer(x, mask)
            return torch.tanh(self.pool(x[:, 0]))

    return Bert()


# ---- workloads: (warm-up, measured) step lists; each step returns when its work is done ----

def gpt2_train(torch, steps, seed):
    dev = "cuda"
    torch.manual_seed(0)
    model = gpt2_small(torch).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = [128, 256, 384, 512, 640, 768, 896, 1024]
    rng = random.Random(seed)

    def step(L):
        ids = torch.randint(0, 50257, (8, L + 1), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    warm = [lambda L=L: step(L) for L in lengths]  # every shape once
    measured = [lambda L=rng.choice(lengths): step(L) for _ in range(steps)]
    return warm, measured


def bert_serve(torch, requests, seed):
    dev = "cuda"
    torch.manual_seed(0)
    model = bert_base(torch).to(dev).eval().half()
    rng = random.Random(seed)

    def request(B, L):
        with torch.inference_mode():
            ids = torch.randint(0, 30522, (B, L), device=dev)
            lengths = torch.randint(L // 2, L + 1, (B,), device=dev)
            model(ids, lengths).float().sum().item()  # the answer goes back to the host

    shapes = [(rng.randint(1, 64), rng.choice([64, 128, 192, 256, 384, 512])) for _ in range(requests)]
    # Every shape once before the clock starts (the same list, so the measured pass replays
    # it): a shape's first request pays cuBLAS heuristics and kernel selection, which would
    # otherwise land in the measured steps of whichever run meets it first.
    warm = [lambda s=s: request(*s) for s in shapes]
    measured = [lambda s=s: request(*s) for s in shapes]
    return warm, measured


WORKLOADS = {"gpt2_train": gpt2_train, "bert_serve": bert_serve}


def warmed_up(workload, way, steps, requests, seed):
    """This process set up for `way` (ferrocuda installed or not), with `workload` made and
    every shape of it run once: (ferrocuda or None, torch, the measured calls)."""
    ferro = Ferrocuda() if way.startswith("ferrocuda") else None
    import torch
    n = steps if workload == "gpt2_train" else requests
    warm, measured = WORKLOADS[workload](torch, n, seed)
    for f in warm:
        f()
    return ferro, torch, measured


def allocator_stats(ferro, torch, where):
    """The statistics of the allocator in use; ferrocuda's after checking that no exported
    call failed."""
    if not ferro:
        return torch.cuda.memory_stats()
    st = ferro.stats()
    ferro.require_no_error(where)
    return st


def way_env(way):
    """This process's environment with `way`'s allocator variables set or removed."""
    env = dict(os.environ)
    for key, value in WAYS[way].items():
        env.pop(key, None)
        if value is not None:
            env[key] = value
    return env


def worker(workload, way, steps, requests, seed=1234):
    """One run in this process; prints one JSON line."""
    ferro, torch, measured = warmed_up(workload, way, steps, requests, seed)
    times = []
    for f in measured:
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    st = allocator_stats(ferro, torch, f"{workload} on ferrocuda")
    if ferro:
        if st["allocation.all.allocated"] == 0:
            raise AssertionError("ferrocuda allocated nothing: PyTorch did not use it")
        conf = ferro.settings()
    else:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    free, total = torch.cuda.mem_get_info()
    res = {
        "workload": workload, "way": way, "conf": conf, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(), "steps": len(times),
        "step_ms_mean": 1e3 * statistics.fmean(times), "step_ms_median": 1e3 * statistics.median(times),
        "total_s": sum(times),
        "peak_reserved": st["reserved_bytes.all.peak"], "peak_allocated": st["allocated_bytes.all.peak"],
        "num_device_alloc": st.get("num_device_alloc"), "num_alloc_retries": st["num_alloc_retries"],
        "allocations": st["allocation.all.allocated"], "device_used_at_end": total - free,
    }
    print(json.dumps(res), flush=True)


def bench(args):
    """Every workload five ways, `repeats` rounds, each run a fresh process."""
    rows = []
    workloads = [args.only] if args.only else list(WORKLOADS)
    for r in range(args.repeats):
        for workload in workloads:
            for way in args.ways:
                cmd = [sys.executable, os.path.abspath(__file__), "worker", workload, way,
                       "--steps", str(args.steps), "--requests", str(args.requests)]
                print(f"--- round {r + 1}: {workload} / {way}", flush=True)
                p = subprocess.run(cmd, env=way_env(way), capture_output=True, text=True)
                sys.stderr.write(p.stderr[-4000:])
                line = [l for l in p.stdout.splitlines() if l.startswith("{")]
                if p.returncode != 0 or not line:
                    print(p.stdout[-2000:])
                    raise SystemExit(f"{workload} / {way} failed (exit {p.returncode})")
                res = json.loads(line[-1])
                res["round"] = r + 1
                print(line[-1], flush=True)
                rows.append(res)
    with open(os.path.join(OUT, "plugin_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    report(rows, workloads, args.ways)


def report(rows, workloads, ways):
    """The side-by-side table: per way, the median over rounds of each run's mean step time
    (what the loop pays) and of its median step time (which a run's few slowest steps do not
    move), and the median over rounds of its mean over native default's mean in the same
    round (the targets judge this paired figure); peak reserved is the largest of the
    rounds."""
    print()
    print(f"{'workload':12} {'way':20} {'mean ms':>8} {'median ms':>9} {'paired':>7} "
          f"{'peak reserved MiB':>18} {'vs expandable':>13}")
    verdicts = []
    for workload in workloads:
        agg = {}
        base = {r["round"]: r["step_ms_mean"] for r in rows
                if r["workload"] == workload and r["way"] == "native_default"}
        for way in ways:
            mine = [r for r in rows if r["workload"] == workload and r["way"] == way]
            agg[way] = (statistics.median(r["step_ms_mean"] for r in mine),
                        statistics.median(r["step_ms_median"] for r in mine),
                        statistics.median(r["step_ms_mean"] / base[r["round"]] for r in mine),
                        max(r["peak_reserved"] for r in mine))
        exp_r = agg["native_expandable"][3]
        for way, (mean, median, paired, peak) in agg.items():
            print(f"{workload:12} {way:20} {mean:8.2f} {median:9.2f} {paired:7.3f} "
                  f"{peak / MIB:18.0f} {peak / exp_r:13.3f}")
        best_native = min(agg["native_default"][2], agg["native_expandable"][2])
        for way in (w for w in ("ferrocuda", "ferrocuda_noreclaim") if w in agg):
            _, _, paired, peak = agg[way]
            verdicts.append(
                f"{workload} {way}: mean step {100 * (paired - 1):+.2f}% vs native default, "
                f"{100 * (paired / best_native - 1):+.2f}% vs the faster native (paired; "
                f"target within 2%: {'MET' if paired <= 1.02 else 'MISSED'}); "
                f"peak reserved {peak / MIB:.0f} MiB vs {exp_r / MIB:.0f} MiB native expandable "
                f"(target at or below: {'MET' if peak <= exp_r else 'MISSED'})")
    print()
    for v in verdicts:
        print("target", v)


# ---- check ---------------------------------------------------------------------------------

def check():
    ferro = Ferrocuda()
    import torch
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}; hooks installed: {ferro.installed}")
    print(f"ferrocuda configuration: {ferro.settings() or '(empty: exact PyTorch behaviour)'}")
    lib = ferro.lib
    assert lib.ferrocuda_record_memory_history(1, 100000) == 0, ferro.last_error()

    # Tensors come from ferrocuda.
    x = torch.randn(1024, 1024, device="cuda")
    st = ferro.stats()
    assert st["allocation.all.current"] >= 1 and st["allocated_bytes.all.current"] >= 4 * MIB, st
    ferro.require_no_error("a first tensor")
    print(f"tensors: {st['allocation.all.current']} live from ferrocuda, {st['reserved_bytes.all.current'] / MIB:.0f} MiB reserved")

    # record_stream reaches it: the block is held for the side stream's work.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x * 2
    x.record_stream(side)
    del x
    torch.cuda.synchronize()
    assert float(y.sum()) != 0.0
    del y
    ferro.require_no_error("record_stream")

    # empty_cache and the memory fraction reach it.
    big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    del big
    before = ferro.stats()["reserved_bytes.all.current"]
    torch.cuda.empty_cache()
    after = ferro.stats()["reserved_bytes.all.current"]
    assert after < before, (before, after)
    torch.cuda.set_per_process_memory_fraction(0.95)
    ferro.require_no_error("empty_cache / memory fraction")
    print(f"empty_cache: reserved {before / MIB:.0f} -> {after / MIB:.0f} MiB")

    check_graphs(torch, ferro)

    # The snapshot file, in PyTorch's own viewer.
    path = os.path.join(OUT, "ferrocuda_plugin_snapshot.pickle")
    assert lib.ferrocuda_dump_snapshot(path.encode()) == 0, ferro.last_error()
    import pickle
    from torch.cuda import _memory_viz as viz
    snap = pickle.load(open(path, "rb"))
    viz.segsum(snap)
    viz.trace(snap)
    print(f"snapshot: {len(snap['segments'])} segments, {len(snap['device_traces'][0])} trace entries, read by _memory_viz")
    st = ferro.stats()
    assert st["allocation.all.allocated"] > 0 and st["segment.all.allocated"] > 0, st
    ferro.require_no_error("the check")
    print(f"ferrocuda served {st['allocation.all.allocated']} allocations, {st['segment.all.allocated']} segments, 0 errors")
    print("plugin check: PASSED")


def check_graphs(torch, ferro):
    """CUDA graphs captured by PyTorch with ferrocuda as its allocator replay correctly,
    and their memory comes from their private pools."""
    import pickle
    dev = "cuda"
    w = torch.randn(1024, 1024, device=dev) / 32
    static_in = torch.randn(2048, 1024, device=dev)

    def f(x):
        h = torch.relu(x @ w)  # temporaries the capture allocates and frees
        h = h * 2 + 1
        return h.softmax(-1) @ w.t()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            f(static_in)
    torch.cuda.current_stream().wait_stream(side)

    g = torch.cuda.CUDAGraph()
    allocated_before = ferro.stats()["allocation.all.allocated"]
    with torch.cuda.graph(g):
        static_out = f(static_in)
    captured = ferro.stats()["allocation.all.allocated"] - allocated_before
    assert captured >= 3, f"the capture allocated {captured} times from ferrocuda"
    # A second graph sharing the first one's pool, fed by its output.
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=g.pool()):
        static_out2 = (static_out * 3).sum(0)

    path = os.path.join(OUT, "ferrocuda_plugin_graph_snapshot.pickle")
    assert ferro.lib.ferrocuda_dump_snapshot(path.encode()) == 0, ferro.last_error()
    pools = {tuple(s["segment_pool_id"]) for s in pickle.load(open(path, "rb"))["segments"]}
    assert tuple(g.pool()) in pools, f"no segment in the graph's pool {g.pool()}: {pools}"

    for i in range(5):
        static_in.copy_(torch.randn_like(static_in))
        g.replay()
        g2.replay()
        ref = f(static_in)
        torch.testing.assert_close(static_out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(static_out2, (ref * 3).sum(0), rtol=1e-3, atol=1e-3)
    expected = static_out.clone()
    pool = tuple(g.pool())
    del g, g2  # releasePool: the outputs stay valid until freed
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, expected)
    del static_out, static_out2, expected
    torch.cuda.empty_cache()

    # make_graphed_callables: forward and backward graphs of a small model, trained.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)).to(dev)
    ref_model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 10)).to(dev)
    ref_model.load_state_dict(model.state_dict())
    sample = torch.randn(64, 256, device=dev)
    graphed = torch.cuda.make_graphed_callables(model, (sample,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for step in range(5):
        data, target = torch.randn(64, 256, device=dev), torch.randint(0, 10, (64,), device=dev)
        for m, o in ((graphed, opt), (ref_model, ref_opt)):
            loss = torch.nn.functional.cross_entropy(m(data), target)
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
    ferro.require_no_error("CUDA graphs")
    print(f"CUDA graphs: {captured} allocations captured into private pool {pool}, a second graph "
          "sharing it, make_graphed_callables: every replay equals eager")


def serve(workload, way, steps, requests, seed=1234):
    """One way's long-lived process of `paired` (see the module's text)."""
    ferro, torch, measured = warmed_up(workload, way, steps, requests, seed)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    print(json.dumps({"ready": len(measured)}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if line == "end":
            break
        f = measured[int(line)]
        t = time.perf_counter()
        start.record()
        f()
        end.record()
        end.synchronize()
        host = 1e3 * (time.perf_counter() - t)
        print(json.dumps({"host_ms": host, "gpu_ms": start.elapsed_time(end)}), flush=True)
    st = allocator_stats(ferro, torch, f"{workload} on ferrocuda (paired)")
    print(json.dumps({"peak_reserved": st["reserved_bytes.all.peak"]}), flush=True)


def geomean_ci(ratios):
    """Geometric mean of `ratios` with a 95% confidence interval (normal on the log scale)."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("inf")
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def paired(args):
    """Every way in its own pinned process, the same request through each in turn."""
    workloads = [args.only] if args.only else list(WORKLOADS)
    cores = sorted(os.sched_getaffinity(0))
    results = {}
    for workload in workloads:
        procs = {}
        for k, way in enumerate(args.ways):
            cmd = [sys.executable, os.path.abspath(__file__), "serve", workload, way,
                   "--steps", str(args.steps), "--requests", str(args.requests)]
            # Core 0 stays with this process; each way gets one of its own when there are enough.
            core = cores[(1 + k) % len(cores)] if len(cores) > 1 else cores[0]
            p = subprocess.Popen(cmd, env=way_env(way), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, bufsize=1,
                                 preexec_fn=lambda c=core: os.sched_setaffinity(0, {c}))
            procs[way] = p
        def ask(way, text):
            p = procs[way]
            p.stdin.write(text + "\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"{workload} / {way}: the process ended (exit {p.wait()})")
            return json.loads(line)
        counts = set()
        for way, p in procs.items():
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"{workload} / {way}: failed to start (exit {p.wait()})")
            counts.add(json.loads(line)["ready"])
        n = counts.pop()
        rng = random.Random(99)
        times = {way: [] for way in args.ways}
        for _ in range(args.rounds):
            for i in range(n):
                order = list(args.ways)
                rng.shuffle(order)
                for way in order:
                    times[way].append(ask(way, str(i)))
        peaks = {way: ask(way, "end")["peak_reserved"] for way in args.ways}
        for p in procs.values():
            p.wait()
        results[workload] = {"times": times, "peak_reserved": peaks}
        print(f"\n{workload}: {n} requests x {args.rounds} rounds, ways interleaved request by request")
        print(f"{'way':20} {'host ms':>8} {'gpu ms':>8} {'host ratio [95% CI]':>26} {'gpu ratio [95% CI]':>26} {'peak MiB':>9}")
        base = times["native_default"]
        ratios = {(way, key): geomean_ci([t[key] / b[key] for t, b in zip(times[way], base)])
                  for way in args.ways for key in ("host_ms", "gpu_ms")}
        for way in args.ways:
            row = f"{way:20} {statistics.median(t['host_ms'] for t in times[way]):8.2f} " \
                  f"{statistics.median(t['gpu_ms'] for t in times[way]):8.2f}"
            for key in ("host_ms", "gpu_ms"):
                g, lo, hi = ratios[way, key]
                row += f" {g:9.4f} [{lo:.4f}, {hi:.4f}]"
            print(row + f" {peaks[way] / MIB:9.0f}")
        for way in (w for w in ("ferrocuda", "ferrocuda_noreclaim") if w in times):
            g, lo, hi = ratios[way, "host_ms"]
            verdict = "MET" if hi <= 1.02 else ("MISSED" if lo > 1.02 else "UNDECIDED")
            print(f"target {workload} {way}: host time x{g:.4f} [{lo:.4f}, {hi:.4f}] vs native "
                  f"default (within 2%: {verdict})")
    with open(os.path.join(OUT, "plugin_bench_paired.json"), "w") as f:
        json.dump(results, f)


def ways_list(text):
    """--ways: known names, in WAYS' order, the two native ways the targets compare with always in."""
    asked = set(text.split(","))
    unknown = asked - set(WAYS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown ways {sorted(unknown)}; known: {','.join(WAYS)}")
    asked |= {"native_default", "native_expandable"}
    return [w for w in WAYS if w in asked]


def main():
    os.makedirs(OUT, exist_ok=True)  # run by hand with OUT=some/new/folder
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check")
    b = sub.add_parser("bench")
    b.add_argument("--steps", type=int, default=60)
    b.add_argument("--requests", type=int, default=150)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--only", choices=list(WORKLOADS))
    b.add_argument("--ways", type=ways_list, default=list(WAYS),
                   help="comma-separated subset of " + ",".join(WAYS))
    q = sub.add_parser("paired")
    q.add_argument("--steps", type=int, default=60)
    q.add_argument("--requests", type=int, default=150)
    q.add_argument("--rounds", type=int, default=3)
    q.add_argument("--only", choices=list(WORKLOADS))
    q.add_argument("--ways", type=ways_list, default=["native_default", "native_expandable", "ferrocuda"],
                   help="comma-separated subset of " + ",".join(WAYS))
    for name in ("worker", "serve"):
        w = sub.add_parser(name)
        w.add_argument("workload", choices=list(WORKLOADS))
        w.add_argument("way", choices=list(WAYS))
        w.add_argument("--steps", type=int, default=60)
        w.add_argument("--requests", type=int, default=150)
    a = p.parse_args()
    if a.cmd == "check":
        check()
    elif a.cmd == "bench":
        bench(a)
    elif a.cmd == "paired":
        paired(a)
    elif a.cmd == "serve":
        serve(a.workload, a.way, a.steps, a.requests)
    else:
        worker(a.workload, a.way, a.steps, a.requests)


if __name__ == "__main__":
    main()
