"""PyTorch's cuBLAS and cuFFT on the device machine, beside crates/mathlib/benches/gemm.rs
and fft.rs in the same run. GEMM: torch.matmul (out=) in bf16 and fp16 at 4096^3 and 8192x8192x1024, fp32 with TF32
("high") at 4096^3 -- wall time of many GEMMs queued back to back, then a synchronize, per
GEMM, after two seconds of the same GEMMs: the H200 slows its clocks within a fraction of a
second of full load (a GEMM 11% faster in the first few milliseconds), and both sides are
measured in that steady state -- and the host's cost of one 64^3 fp32 torch.matmul call (100 queued, the
synchronize not timed). Column-major there, row-major here: the same FLOPs and shapes.
FFT: torch.fft.fft of 2^20 complex fp32 points, batch 16, its plan cached (the same
two-second heating, then transforms back to back), and the host's cost of a 256-point
torch.fft.fft(out=) call with its plan cached. Writes torch_mathlib.json into $OUT (or the
current folder)."""
import os, time, json
import torch

dev = torch.device("cuda")
print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
out = {}

def per_gemm_ns(dtype, m, n, k, tf32=False, reps=50):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.zeros(m, k, device=dev, dtype=dtype)
    b = torch.zeros(k, n, device=dev, dtype=dtype)
    c = torch.empty(m, n, device=dev, dtype=dtype)
    heat = time.perf_counter()
    while time.perf_counter() - heat < 2.0:
        for _ in range(10):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
    samples = []
    for _ in range(20):
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) / reps * 1e9)
    torch.backends.cuda.matmul.allow_tf32 = False
    samples.sort()
    return samples[len(samples) // 2]

for name, dtype, m, n, k, tf32 in [
    ("bf16_4096", torch.bfloat16, 4096, 4096, 4096, False),
    ("f16_4096", torch.float16, 4096, 4096, 4096, False),
    ("bf16_8192x8192x1024", torch.bfloat16, 8192, 8192, 1024, False),
    ("f16_8192x8192x1024", torch.float16, 8192, 8192, 1024, False),
    ("f32_tf32_4096", torch.float32, 4096, 4096, 4096, True),
]:
    ns = per_gemm_ns(dtype, m, n, k, tf32)
    out[f"torch_gemm_ns_{name}"] = ns
    print(f"{name}: {ns / 1e3:.1f} us, {2 * m * n * k / ns / 1e3:.1f} TFLOP/s", flush=True)

a = torch.zeros(64, 64, device=dev)
b = torch.zeros(64, 64, device=dev)
c = torch.empty(64, 64, device=dev)
torch.matmul(a, b, out=c)
torch.cuda.synchronize()
samples = []
for _ in range(200):
    t = time.perf_counter()
    for _ in range(100):
        torch.matmul(a, b, out=c)
    samples.append((time.perf_counter() - t) / 100 * 1e9)
    torch.cuda.synchronize()
samples.sort()
out["torch_gemm_ns_f32_64_call"] = samples[len(samples) // 2]
print(f"f32 64^3 call: {out['torch_gemm_ns_f32_64_call']:.0f} ns host time (median)", flush=True)
def steady_ns(f, reps=50):
    heat = time.perf_counter()
    while time.perf_counter() - heat < 2.0:
        for _ in range(10):
            f()
        torch.cuda.synchronize()
    samples = []
    for _ in range(20):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) / reps * 1e9)
    samples.sort()
    return samples[len(samples) // 2]

x = torch.zeros(16, 1 << 20, device=dev, dtype=torch.complex64)
y = torch.empty_like(x)
out["torch_fft_ns_c2c_2p20_batch16"] = steady_ns(lambda: torch.fft.fft(x, out=y))
print(f"fft 2^20 x16: {out['torch_fft_ns_c2c_2p20_batch16'] / 1e3:.1f} us", flush=True)
xs = torch.zeros(256, device=dev, dtype=torch.complex64)
ys = torch.empty_like(xs)
torch.fft.fft(xs, out=ys)
torch.cuda.synchronize()
samples = []
for _ in range(200):
    t = time.perf_counter()
    for _ in range(100):
        torch.fft.fft(xs, out=ys)
    samples.append((time.perf_counter() - t) / 100 * 1e9)
    torch.cuda.synchronize()
samples.sort()
out["torch_fft_ns_c2c_256_call"] = samples[len(samples) // 2]
print(f"fft 256 call: {out['torch_fft_ns_c2c_256_call']:.0f} ns host time (median)", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "torch_mathlib.json"), "w"), indent=1)
