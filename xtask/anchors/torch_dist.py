"""PyTorch's side of crates/dist/benches/multi_gpu.rs, on the device machine in the same run:
`dist.all_reduce` (NCCL backend) of 256 MiB fp32 over every visible GPU, one process per GPU
(torch.multiprocessing, init_process_group("nccl") over a file:// rendezvous: no network),
each call followed by torch.cuda.synchronize(); reported as NCCL's bus bandwidth
bytes * 2(n-1)/n / time (median of the calls). Then `t.to("cuda:1")` of 256 MiB plus a
synchronize of both devices, in GB/s. Prints `torch_allreduce_busbw_GBps <value>` and
`torch_peer_copy_GBps <value>` and writes torch_dist.json into $OUT (or the current folder).
Fails (exit 1) on fewer than two GPUs."""
import json, os, statistics, sys, tempfile, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BYTES = 256 << 20
WARMUP, CALLS = 5, 50


def rank_main(rank, world, init, results):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    t = torch.ones(BYTES // 4, dtype=torch.float32, device="cuda")
    for _ in range(WARMUP):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    times = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    results[rank] = statistics.median(times)
    dist.destroy_process_group()


def all_reduce_busbw(world):
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        init = "file://" + os.path.join(tmp, "rendezvous")
        results = manager.dict()
        mp.spawn(rank_main, args=(world, init, results), nprocs=world, join=True)
        secs = max(results.values())  # the slowest rank's median: the collective's time
    return BYTES * 2 * (world - 1) / world / secs / 1e9, secs


def peer_copy_GBps():
    src = torch.ones(BYTES // 4, dtype=torch.float32, device="cuda:0")
    for _ in range(WARMUP):
        src.to("cuda:1")
    times = []
    for _ in range(CALLS):
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst = src.to("cuda:1")
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        times.append(time.perf_counter() - t0)
        del dst
    return BYTES / statistics.median(times) / 1e9


def main():
    world = torch.cuda.device_count()
    if world < 2:
        sys.exit(f"torch_dist.py FAILED: {world} GPU(s) here, it needs two or more")
    print("torch", torch.__version__, torch.cuda.get_device_name(0), f"x{world}",
          "nccl", ".".join(map(str, torch.cuda.nccl.version())), flush=True)
    busbw, secs = all_reduce_busbw(world)
    print(f"torch_allreduce_busbw_GBps {busbw:.2f} (256 MiB fp32, {world} GPUs, "
          f"median {secs * 1e6:.1f} us per call)", flush=True)
    peer = torch.cuda.can_device_access_peer(0, 1)
    copy = peer_copy_GBps()
    print(f"torch_peer_copy_GBps {copy:.2f} (256 MiB, cuda:0 to cuda:1, peer access {peer})",
          flush=True)
    out = {"gpus": world, "torch_allreduce_busbw_GBps": busbw,
           "torch_allreduce_s_per_call": secs, "torch_peer_copy_GBps": copy,
           "peer_access": peer}
    path = os.path.join(os.environ.get("OUT", "."), "torch_dist.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
