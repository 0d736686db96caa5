"""PyTorch's side of run.sh's paired pageable copies: one round of a 64 MiB copy from a
pageable tensor to the device (`copy_`, then a stream sync) and back into the same tensor
(`copy_`), 30 copies each after 3 unmeasured. Prints "H2D_GBps D2H_GBps" on one line.

The source is filled by one thread, as the bench's `vec![7u8; n]` is, so that both sides
copy from memory prepared alike: `torch.full` fills with its intra-op threads otherwise, and
on the H200 host our copy came to 0.885 and 0.949 of PyTorch's from such a source against
1.000 from one filled by one thread (intervals overlapping; docs/measurements/
h200_2026-11-30i)."""
import time
import torch


def rate(copy, n):
    """GB/s of `copy` (which moves `n` bytes), 30 calls after 3 unmeasured."""
    for _ in range(3):
        copy()
    start = time.perf_counter()
    for _ in range(30):
        copy()
    return n * 30 / (time.perf_counter() - start) / 1e9


def pageable_source(n):
    """`n` pageable bytes of 7, written by one thread as the bench's `vec![7u8; n]` is."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    host = torch.full((n,), 7, dtype=torch.uint8)
    torch.set_num_threads(threads)
    return host


def main():
    n = 64 << 20
    host = pageable_source(n)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    to_device = rate(lambda: (dev.copy_(host), stream.synchronize()), n)
    back = rate(lambda: host.copy_(dev), n)
    print("%.3f %.3f" % (to_device, back))


if __name__ == "__main__":
    main()
