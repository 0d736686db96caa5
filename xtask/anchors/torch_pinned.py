"""PyTorch's pinned host memory on the device machine, beside benches/pinned.rs in the same
run: the caching host allocator's alloc+free pair in C++ (`getHostAllocator(kCUDA)`, 1 and 8
threads), `at::empty(..., pinned_memory(true))` made and dropped in C++, and the bandwidth of
a 64 MiB host-to-device copy (plus a stream sync) from pinned and from pageable memory (written
by one thread, as the bench's `Vec` is), and
the same copy back into pinned and into new pageable memory (`Tensor.cpu()`).
Writes torch_pinned.json into $OUT (or the current folder)."""
import os, sys, time, json
import torch
from torch.utils.cpp_extension import load_inline
# The copies are timed, and their pageable source made, as the paired copies do (the bundle
# carries both files).
from torch_copies import pageable_source, rate

CPP = r'''
#include <torch/extension.h>
#include <ATen/cuda/CachingHostAllocator.h>
#include <chrono>
#include <thread>
#include <vector>
static c10::Allocator* host() { return HOST_ALLOCATOR; }
double pair_ns(int64_t size, int64_t iters, int64_t threads) {
  auto work = [&]() {
    for (int64_t i = 0; i < iters; ++i) {
      c10::DataPtr p = host()->allocate(size);  // freed by its deleter at the end of scope
    }
  };
  work();
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int64_t k = 0; k < threads; ++k) ts.emplace_back(work);
  for (auto& t : ts) t.join();
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (double)(iters * threads);
}
double empty_ns(int64_t size, int64_t iters) {
  auto opts = at::TensorOptions().dtype(at::kByte).pinned_memory(true);
  { auto warm = at::empty({size}, opts); }
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    auto t = at::empty({size}, opts);
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (double)iters;
}
'''


def extension():
    """The C++ above, built (or loaded from torch's extension cache)."""
    t = time.perf_counter()
    # The unified host-allocator API (2.7+), else the older CUDA-specific accessor.
    for name, accessor in (("pinned_anchor", "at::getHostAllocator(at::kCUDA)"),
                           ("pinned_anchor_old", "at::cuda::getCachingHostAllocator()")):
        try:
            ext = load_inline(name, cpp_sources=CPP.replace("HOST_ALLOCATOR", accessor),
                              functions=["pair_ns", "empty_ns"], with_cuda=True,
                              extra_cflags=["-O2"], verbose=False)
            print(f"extension built in {time.perf_counter()-t:.0f}s", file=sys.stderr, flush=True)
            return ext
        except Exception as e:  # noqa: BLE001 - try the next accessor
            print(f"{accessor}: {type(e).__name__}", file=sys.stderr, flush=True)
    raise SystemExit("could not build the pinned anchor extension")


def main():
    out = {}
    dev = torch.device("cuda")
    print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
    torch.zeros(1, device=dev)
    ext = extension()
    for size in (4 << 10, 1 << 20, 64 << 20):
        out[f"torch_pinned_pair_ns_{size}"] = ext.pair_ns(size, 200000, 1)
        out[f"torch_pinned_empty_ns_{size}"] = ext.empty_ns(size, 200000)
    out["torch_pinned_pair_ns_1MiB_8threads"] = ext.pair_ns(1 << 20, 100000, 8)

    n = 64 << 20
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    pinned = torch.full((n,), 7, dtype=torch.uint8).pin_memory()
    pageable = pageable_source(n)
    stream = torch.cuda.current_stream()
    def write(src, nb):
        dst.copy_(src, non_blocking=nb); stream.synchronize()
    out["torch_h2d_pinned_GBps"] = rate(lambda: write(pinned, True), n)
    out["torch_h2d_pageable_GBps"] = rate(lambda: write(pageable, False), n)

    # The other way: into a pinned tensor (non-blocking, then a sync), into a pageable one used
    # again (as `DeviceBuffer::copy_to_host`), and `Tensor.cpu()` (a new pageable tensor each
    # time, as `DeviceBuffer::to_host` makes a new `Vec`).
    def pinned_read():
        pinned.copy_(dst, non_blocking=True); stream.synchronize()
    for label, read in (("pinned", pinned_read), ("pageable", lambda: pageable.copy_(dst)),
                        ("cpu", lambda: dst.cpu())):
        out[f"torch_d2h_{label}_GBps"] = rate(read, n)

    for k, v in out.items():
        print(f"{k:40s} {v:12.3f}")
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "torch_pinned.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
