"""The all-reduce of 256 MiB fp32 under torchrun, ferrocuda's workers against PyTorch's, in
one run on the two-GPU machine (run by the bundle's run.sh with MULTI_GPU=1):

    python3 torchrun_allreduce.py ./multi_torchrun_multigpu

Each round starts `torchrun --nproc_per_node=2` twice: the ferrocuda workers
(FERROCUDA_MULTIGPU_WORKER=bench, with PyTorch's libnccl first on LD_LIBRARY_PATH, so both
sides run one NCCL) and this script as PyTorch's workers
(`dist.all_reduce`, NCCL); both do 5 warm-ups and 50 calls each followed by a host wait and
report NCCL's bus bandwidth over the median call. Three rounds, alternating which goes
first; prints each side's median over the rounds and the ratio, writes
torchrun_allreduce.json into $OUT (or the current folder). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0) on both sides.
"""
import json, os, re, statistics, subprocess, sys, tempfile, time

BYTES = 256 << 20


def torch_worker():
    import torch
    import torch.distributed as dist
    rank = int(os.environ["LOCAL_RANK"])
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    t = torch.ones(BYTES // 4, dtype=torch.float32, device=dev)
    for _ in range(5):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    n = dist.get_world_size()
    busbw = BYTES * 2 * (n - 1) / n / statistics.median(times) / 1e9
    if dist.get_rank() == 0:
        print(f"torch_torchrun_allreduce_busbw_GBps {busbw:.2f}", flush=True)
    dist.destroy_process_group()


def run(cmd, env, key):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    m = re.search(key + r" ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode != 0 or not m:
        raise SystemExit(f"{cmd} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return float(m.group(1))


def main(binary):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    ours_cmd = torchrun + ["--no-python", os.path.abspath(binary)]
    torch_cmd = torchrun + [os.path.abspath(__file__), "worker"]
    # Both sides on the same NCCL: PyTorch's wheel's, found first by ours too (ferrocuda
    # opens `libnccl.so` by that name: a folder where that name is PyTorch's library).
    import nvidia.nccl
    nccl = tempfile.mkdtemp(prefix="torch_nccl_")
    os.symlink(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"),
               os.path.join(nccl, "libnccl.so"))
    ld = ":".join(p for p in [nccl, os.environ.get("LD_LIBRARY_PATH", "")] if p)
    ours_env = dict(env, FERROCUDA_MULTIGPU_WORKER="bench", LD_LIBRARY_PATH=ld)
    ours, theirs = [], []
    for round_ in range(3):
        sides = [("ours", ours_cmd, ours_env, "ferrocuda_torchrun_allreduce_busbw_GBps", ours),
                 ("torch", torch_cmd, env, "torch_torchrun_allreduce_busbw_GBps", theirs)]
        for name, cmd, e, key, into in (sides if round_ % 2 == 0 else sides[::-1]):
            into.append(run(cmd, e, key))
            print(f"round {round_} {name}: {into[-1]:.2f} GB/s", flush=True)
    result = {"ferrocuda_GBps": statistics.median(ours), "torch_GBps": statistics.median(theirs),
              "rounds": {"ferrocuda": ours, "torch": theirs}}
    result["ratio"] = result["ferrocuda_GBps"] / result["torch_GBps"]
    print(f"all_reduce 256 MiB fp32 under torchrun: ferrocuda {result['ferrocuda_GBps']:.2f} GB/s, "
          f"PyTorch {result['torch_GBps']:.2f} GB/s, ratio {result['ratio']:.3f} (target >= 0.98)")
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "torchrun_allreduce.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        torch_worker()
    else:
        main(sys.argv[1])
