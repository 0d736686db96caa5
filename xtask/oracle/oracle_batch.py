"""Runs many programs of `torch_alloc_oracle.py` (the shared oracle, next to this file) through
PyTorch's caching allocator in one go, and records when PyTorch's `record_stream` events
completed, so that `cargo xtask alloc-oracle` can compare without guessing GPU timing.

    python3 oracle_batch.py --out DIR --seeds 1-60 [--ops 3000] [--expandable-seeds 101-106]
                            [--small-seeds 1000-1599 --small-ops 30] [--program P.program.json ...]
                            [--jobs 3] [--deadline 450]

Programs are the oracle's own `random_program(seed, ops)`: `seed-N`; `exp-N` gets
`expandable_segments:True` in front of its configuration; `small-N` are short ones (odd N
expandable) to find small programs that show a difference; `--program` runs given files
under their own names. DIR gets NAME.program.json and NAME.result.json in the oracle's
formats, with these differences from `torch_alloc_oracle.py`:

- record_stream reaches PyTorch's allocator ("record_stream": "applied" in the result). The
  oracle's `record()` wraps the pointer in a DataPtr without a deleter, and `recordStream`
  ignores a DataPtr whose deleter is not the allocator's: there, record_stream does nothing.
  A self-check at the start says whether a block freed after record_stream on a busy stream
  stays active.
- one process per (configuration, fraction or not) runs its programs one after the other
  (PyTorch is imported and the extension loaded once); each program starts as the oracle's
  does (empty_cache, both resets) with nothing allocated, so no state a result shows carries
  over. `exp-N` programs get a process each.
- "observed": true, and alloc steps may carry "obs": {"done": [...], "maybe": [...]}. When a
  block with uses on other streams is freed at step i, PyTorch records one event per such
  stream s; this script records marker events just before (m0) and just after (m1) that
  free on s, and names the pair by the token [i, s]. At each allocation it queries every
  outstanding m1 right before the allocator call and every m0 right after it (both in C++):
  "done" lists the tokens whose m1 had completed before the call (so PyTorch's event had
  completed when the allocation processed its events), "maybe" those whose m0 completed only
  during the call (PyTorch's event may or may not have been seen complete); tokens listed in
  neither were still pending. A done token is not listed again.
- with expandable segments PyTorch has no per-segment base (getBaseAllocation refuses), so
  a successful alloc step is {"oom": false} and "segments" is empty: compare OOMs and stats.
"""
import argparse, json, os, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_alloc_oracle as oracle  # noqa: E402  (the shared oracle, copied beside this file)

EXTRA_CPP = r'''
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>
static bool event_done(int64_t e) {
  cudaError_t r = cudaEventQuery((cudaEvent_t)e);
  if (r == cudaSuccess) return true;
  if (r == cudaErrorNotReady) { (void)cudaGetLastError(); return false; }
  C10_CUDA_CHECK(r);
  return false;
}
static int64_t marker(int64_t stream) {
  cudaEvent_t e;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(e, (cudaStream_t)stream));
  return (int64_t)e;
}
// torch_alloc_oracle.py's record() wraps the pointer in a DataPtr without a deleter, and
// recordStream ignores a DataPtr whose deleter is not the allocator's own: its record_stream
// never reaches the allocator. This one gives the DataPtr the allocator's deleter and
// releases it again, so the block is not freed.
void record_stream(int64_t ptr, int64_t stream) {
  auto device = c10::cuda::current_device();
  auto s = c10::cuda::getStreamFromExternal((cudaStream_t)stream, device);
  auto deleter = A::get()->raw_deleter();
  TORCH_CHECK(deleter != nullptr, "the caching allocator has no raw deleter");
  c10::DataPtr dp((void*)ptr, (void*)ptr, deleter, c10::Device(c10::DeviceType::CUDA, device));
  A::get()->recordStream(dp, s);
  (void)dp.release_context();
}
void drop_marker(int64_t e) { C10_CUDA_CHECK(cudaEventDestroy((cudaEvent_t)e)); }
// Frees ptr between marker events on each of `streams`: returns [m0..., m1...].
std::vector<int64_t> free_marked(int64_t ptr, std::vector<int64_t> streams) {
  std::vector<int64_t> out;
  for (auto s : streams) out.push_back(marker(s));
  A::raw_delete((void*)ptr);
  for (auto s : streams) out.push_back(marker(s));
  return out;
}
// [pointer or -1 for out of memory, m1[i] done before the call..., m0[i] done after it...]
std::vector<int64_t> alloc_observed(int64_t bytes, int64_t stream, std::vector<int64_t> m0,
                                    std::vector<int64_t> m1) {
  size_t n = m1.size();
  std::vector<int64_t> out(1 + 2 * n, 0);
  for (size_t i = 0; i < n; i++) out[1 + i] = event_done(m1[i]);
  try {
    out[0] = (int64_t)A::raw_alloc_with_stream((size_t)bytes, (cudaStream_t)stream);
  } catch (const c10::OutOfMemoryError&) {
    out[0] = -1;
  }
  for (size_t i = 0; i < n; i++) out[1 + n + i] = event_done(m0[i]);
  return out;
}
'''
FUNCTIONS = ["alloc", "free_", "base", "record", "device_mallocs", "drop_marker", "free_marked",
             "alloc_observed", "record_stream"]


def load_ext():
    from torch.utils.cpp_extension import load_inline
    return load_inline("oracle_batch_ext", cpp_sources=oracle.CPP + EXTRA_CPP, functions=FUNCTIONS,
                       with_cuda=True, extra_cflags=["-O2"], verbose=False)


def observe(out, pending, ext):
    """Splits the pending markers by what alloc_observed saw; drops the done ones."""
    n = len(pending)
    done = [p[0] for j, p in enumerate(pending) if out[1 + j]]
    maybe = [p[0] for j, p in enumerate(pending) if not out[1 + j] and out[1 + n + j]]
    keep = []
    for j, p in enumerate(pending):
        if out[1 + j]:
            ext.drop_marker(p[1]); ext.drop_marker(p[2])
        else:
            keep.append(p)
    pending[:] = keep
    return {"done": done, "maybe": maybe} if done or maybe else None


def run(torch, ext, prog, expandable):
    if prog.get("fraction") is not None:
        torch.cuda.set_per_process_memory_fraction(prog["fraction"])
    streams = [torch.cuda.default_stream()] + [torch.cuda.Stream() for _ in range(prog.get("streams", 1) - 1)]
    handles = [s.cuda_stream for s in streams]
    live, segs, seg_of, steps, pending = {}, [], {}, [], []  # live: id -> [ptr, stream, uses]
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(); torch.cuda.reset_accumulated_memory_stats()
    for i, op in enumerate(prog["ops"]):
        k, step = op[0], None
        if k == "alloc":
            before = ext.device_mallocs()
            out = ext.alloc_observed(op[2], handles[op[3]], [p[1] for p in pending], [p[2] for p in pending])
            obs = observe(out, pending, ext)
            if out[0] == -1:
                step = {"oom": True}
            elif expandable:
                step = {"oom": False}
                live[op[1]] = [out[0], op[3], set()]
            else:
                live[op[1]] = [out[0], op[3], set()]
                b, n = ext.base(out[0])
                if ext.device_mallocs() != before:
                    segs.append(b); seg_of[b] = len(segs) - 1
                step = {"seg": seg_of[b], "offset": out[0] - b, "seg_bytes": n}
            if obs:
                step["obs"] = obs
        elif k == "free":
            if op[1] in live:
                p, _, uses = live.pop(op[1])
                uses = sorted(uses)
                if uses:
                    ms = ext.free_marked(p, [handles[s] for s in uses])
                    pending += [([i, s], ms[j], ms[len(uses) + j]) for j, s in enumerate(uses)]
                else:
                    ext.free_(p)
        elif k == "record_stream":
            if op[1] in live:
                ext.record_stream(live[op[1]][0], handles[op[2]])
                if op[2] != live[op[1]][1]:
                    live[op[1]][2].add(op[2])
        elif k == "busy":
            with torch.cuda.stream(streams[op[1]]):
                torch.cuda._sleep(int(op[2] * 1000))
        elif k == "sync":
            torch.cuda.synchronize()
        elif k == "empty_cache":
            torch.cuda.empty_cache()
        elif k == "reset_peak":
            torch.cuda.reset_peak_memory_stats()
        elif k == "reset_accumulated":
            torch.cuda.reset_accumulated_memory_stats()
        elif k == "stats":
            step = dict(torch.cuda.memory_stats())
        else:
            raise ValueError(f"unknown op {op!r}")
        steps.append(step)
    torch.cuda.synchronize()
    for p in pending:
        ext.drop_marker(p[1]); ext.drop_marker(p[2])
    for p, _, _ in live.values():
        ext.free_(p)
    return {"torch": torch.__version__, "conf": prog.get("conf", ""), "fraction": prog.get("fraction"),
            "device_bytes": torch.cuda.get_device_properties(0).total_memory, "segments": segs,
            "steps": steps, "observed": True, "record_stream": "applied"}


def record_stream_works(torch, ext):
    """A block freed after record_stream on a busy stream stays active until that stream is
    done (the check torch_alloc_oracle.py's record() fails)."""
    torch.cuda.init()
    torch.cuda.empty_cache()
    user, busy = torch.cuda.Stream(), torch.cuda.Stream()
    p = ext.alloc(1 << 20, user.cuda_stream)
    with torch.cuda.stream(busy):
        torch.cuda._sleep(100_000_000)
    ext.record_stream(p, busy.cuda_stream)
    ext.free_(p)
    ext.free_(ext.alloc(512, user.cuda_stream))  # processes events: ours is still pending
    pending = torch.cuda.memory_stats()["active_bytes.all.current"] >= 1 << 20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return pending


def child(out_dir, names):
    import torch
    ext = load_ext()
    torch.cuda.init()
    for name in names:
        t0 = time.time()
        prog = json.load(open(os.path.join(out_dir, name + ".program.json")))
        try:
            res = run(torch, ext, prog, "expandable_segments:True" in prog.get("conf", ""))
        except Exception as e:  # one broken program must not cost the others
            print(f"{name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        json.dump(res, open(os.path.join(out_dir, name + ".result.json"), "w"))
        st = res["steps"]
        print(f"{name}: {len(prog['ops'])} ops, {sum(1 for s in st if s and 'oom' in s or s and 'seg' in s)} allocs, "
              f"{sum(1 for s in st if s and s.get('oom'))} OOMs, {len(res['segments'])} segments, "
              f"{sum(len(s['obs']['maybe']) for s in st if s and 'obs' in s)} maybe, conf {prog['conf']!r}, "
              f"fraction {prog['fraction']}, {time.time() - t0:.1f} s", file=sys.stderr, flush=True)


def expandable(prog):
    prog["conf"] = ",".join(filter(None, ["expandable_segments:True", prog["conf"]]))
    return prog


def seeds(text):
    out = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--seeds", default="")
    ap.add_argument("--expandable-seeds", default="")
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--small-seeds", default="", help="short programs (odd seeds with expandable segments)")
    ap.add_argument("--small-ops", type=int, default=30)
    ap.add_argument("--program", nargs="*", default=[], help="NAME.program.json files to run too")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=450, help="seconds; then unfinished groups are stopped")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1:])
    t0 = time.time()
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    progs = {f"seed-{s}": oracle.random_program(s, args.ops) for s in seeds(args.seeds)}
    for s in seeds(args.expandable_seeds):
        progs[f"exp-{s}"] = expandable(oracle.random_program(s, args.ops))
    for s in seeds(args.small_seeds):
        p = oracle.random_program(s, args.small_ops)
        progs[f"small-{s}"] = expandable(p) if s % 2 else p
    for path in args.program:
        progs[os.path.basename(path).removesuffix(".program.json")] = json.load(open(path))
    groups = {}
    for name, p in progs.items():
        json.dump(p, open(os.path.join(args.out, name + ".program.json"), "w"))
        own = "expandable" in p["conf"] and name.startswith("exp-")
        key = (p["conf"], p.get("fraction") is not None, name if own else "")
        groups.setdefault(key, []).append(name)
    import torch  # (build the extension once, before the children load it)
    ext = load_ext()
    try:
        check = "ok" if record_stream_works(torch, ext) else "FAILED: the freed block was reused"
    except RuntimeError as e:
        check = f"FAILED: {e}"
    print(f"record_stream self-check: {check}", file=sys.stderr, flush=True)
    print(f"extension ready after {time.time() - t0:.0f} s; {len(progs)} programs in {len(groups)} processes",
          file=sys.stderr, flush=True)
    queue, running = sorted(groups.items(), key=lambda g: -len(g[1])), []
    while queue or running:
        while queue and len(running) < args.jobs:
            (conf, _, _), names = queue.pop(0)
            log = open(os.path.join(args.out, "logs", f"{names[0]}.log"), "w")
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            cmd = [sys.executable, __file__, "--child", args.out] + names
            running.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), names))
        time.sleep(0.5)
        for r in [r for r in running if r[0].poll() is not None]:
            running.remove(r)
            print(f"group {r[1][0]}.. ({len(r[1])} programs) exited {r[0].returncode} at {time.time() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        if time.time() - t0 > args.deadline:
            for proc, names in running:
                proc.kill()
                print(f"group {names[0]}.. stopped at the deadline", file=sys.stderr, flush=True)
            print(f"{len(queue)} groups never started", file=sys.stderr, flush=True)
            break
    done = sum(1 for n in progs if os.path.exists(os.path.join(args.out, n + ".result.json")))
    print(f"{done} of {len(progs)} programs done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
