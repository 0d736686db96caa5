//! The optimizer kernels: CUDA C++ compiled at run time (NVRTC), and their host twins for the
//! fake device.
//!
//! Every multiply, add, divide and square root is written with an explicitly rounded
//! intrinsic (`__fmul_rn`, `__fadd_rn`, `__fdiv_rn`, `__fsqrt_rn`, `__dmul_rn`, ...), so the
//! compiler cannot contract a multiply and an add into a fused multiply-add: each operation
//! rounds once, as Rust's `f32` arithmetic does, and the host twins give the GPU's results
//! bit for bit. The twins below port the kernels line for line; keep the two in step.
//!
//! Multi-tensor launches (PyTorch's `multi_tensor_apply`, `aten/src/ATen/native/cuda/
//! MultiTensorApply.cuh`) take two device tables built once at construction: one row of
//! `u64` per tensor, and one `(tensor, chunk)` pair of `u32` per block, each block covering
//! [`CHUNK`] elements of one tensor. So hundreds of tensors take one launch.
use ferrocuda_driver::FakeDriver;
use ferrocuda_driver::fake::KernelContext;
use ferrocuda_types::DevicePtr;

/// Elements (bytes for [`OPTIM_KERNELS`]'s `masked_copy`) one block of a multi-tensor
/// launch covers. Must equal `CHUNK` in the CUDA source.
pub(crate) const CHUNK: u64 = 4096;
/// Threads per block of a multi-tensor launch.
pub(crate) const THREADS: u32 = 256;

/// Index of the step count (f32, as PyTorch's capturable `state['step']`) in an optimizer's
/// device scalars.
pub(crate) const STEP: usize = 0;
/// Index of the count of skipped steps.
pub(crate) const SKIPPED: usize = 1;
/// Index of Adam's bias correction `1 - beta1^step`.
pub(crate) const BIAS_CORRECTION1: usize = 2;
/// Index of Adam's `sqrt(1 - beta2^step)`.
pub(crate) const BIAS_CORRECTION2_SQRT: usize = 3;
/// Index of the learning rate (on the device, so a captured step follows `set_lr`).
pub(crate) const LR: usize = 4;
/// Length of the device scalars (padded).
pub(crate) const SCALARS: usize = 8;

/// Bit of the `flags` argument: negate the gradient (`maximize=True`).
pub(crate) const FLAG_MAXIMIZE: u32 = 1;
/// Bit of the `flags` argument: Nesterov momentum (SGD) or AMSGrad (AdamW).
pub(crate) const FLAG_VARIANT: u32 = 2;

/// Gradient dtype codes of a table row.
pub(crate) const GRAD_F32: u64 = 0;
/// IEEE half.
pub(crate) const GRAD_F16: u64 = 1;
/// bfloat16.
pub(crate) const GRAD_BF16: u64 = 2;

/// `u64`s per tensor row of the SGD and AdamW tables: param, grad, len, state offset, grad
/// dtype code.
pub(crate) const STEP_ROW: usize = 5;
/// `u64`s per tensor row of the masked fallback's table: live address, bytes, scratch offset.
pub(crate) const COPY_ROW: usize = 3;

/// The optimizer kernels, as CUDA C++.
pub const OPTIM_KERNELS: &str = r#"
#define CHUNK 4096ull
#define FLAG_MAXIMIZE 1u
#define FLAG_VARIANT 2u
typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
    u32 sign = ((u32)h & 0x8000u) << 16;
    u32 e = ((u32)h >> 10) & 0x1fu, m = (u32)h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e == 0u) return __uint_as_float(sign | __float_as_uint(__fmul_rn((float)m, 5.9604644775390625e-8f)));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
__device__ __forceinline__ float load_grad(u64 ptr, u64 i, u64 dtype) {
    if (dtype == 0ull) return ((const float*)ptr)[i];
    unsigned short h = ((const unsigned short*)ptr)[i];
    if (dtype == 2ull) return __uint_as_float((u32)h << 16);
    return f16_bits_to_f32(h);
}
__device__ __forceinline__ bool skip_step(const float* found_inf) {
    return found_inf != 0 && *found_inf != 0.0f;
}
__device__ __forceinline__ double pow_steps(double base, u64 n) {
    double r = 1.0;
    while (n) {
        if (n & 1ull) r = __dmul_rn(r, base);
        base = __dmul_rn(base, base);
        n >>= 1;
    }
    return r;
}
// The range of the tensor row this block covers.
__device__ __forceinline__ const u64* block_range(const u64* table, const u32* chunks,
                                                  u32 row_len, u64 len_index,
                                                  u64* start, u64* end) {
    const u64* row = table + (u64)row_len * chunks[2 * blockIdx.x];
    *start = (u64)chunks[2 * blockIdx.x + 1] * CHUNK;
    *end = min(*start + CHUNK, row[len_index]);
    return row;
}

// One thread: advance the step count (or the skip count), refresh Adam's bias corrections.
extern "C" __global__ void optim_prologue(const float* found_inf, float* scalars,
                                          float beta1, float beta2) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    if (skip_step(found_inf)) { scalars[1] = __fadd_rn(scalars[1], 1.0f); return; }
    float step = __fadd_rn(scalars[0], 1.0f);
    scalars[0] = step;
    u64 n = (u64)step;
    scalars[2] = (float)__dadd_rn(1.0, -pow_steps((double)beta1, n));
    scalars[3] = (float)__dsqrt_rn(__dadd_rn(1.0, -pow_steps((double)beta2, n)));
}

// torch/optim/sgd.py `_single_tensor_sgd`, every tensor of the table in one launch.
extern "C" __global__ void sgd_multi_tensor(const u64* table, const u32* chunks,
                                            const float* found_inf, const float* scalars,
                                            float* momentum_buffer, float momentum,
                                            float dampening, float weight_decay, u32 flags) {
    if (skip_step(found_inf)) return;
    u64 start, end;
    const u64* row = block_range(table, chunks, 5u, 2ull, &start, &end);
    float* p = (float*)row[0];
    float* buf = momentum_buffer ? momentum_buffer + row[3] : 0;
    float neg_lr = -scalars[4];
    bool first = scalars[0] == 1.0f;
    float keep = __fadd_rn(1.0f, -dampening);
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        float param = p[i];
        float g = load_grad(row[1], i, row[4]);
        if (flags & FLAG_MAXIMIZE) g = -g;
        if (weight_decay != 0.0f) g = __fadd_rn(g, __fmul_rn(weight_decay, param));
        if (momentum != 0.0f) {
            float b = first ? g : __fadd_rn(__fmul_rn(buf[i], momentum), __fmul_rn(keep, g));
            buf[i] = b;
            g = (flags & FLAG_VARIANT) ? __fadd_rn(g, __fmul_rn(momentum, b)) : b;
        }
        p[i] = __fadd_rn(param, __fmul_rn(neg_lr, g));
    }
}

// aten/src/ATen/native/cuda/fused_adam_utils.cuh `adam_math` (ADAMW mode), in f32.
extern "C" __global__ void adamw_multi_tensor(const u64* table, const u32* chunks,
                                              const float* found_inf, const float* scalars,
                                              float* exp_avg, float* exp_avg_sq,
                                              float* max_exp_avg_sq, float beta1, float beta2,
                                              float eps, float weight_decay, u32 flags) {
    if (skip_step(found_inf)) return;
    u64 start, end;
    const u64* row = block_range(table, chunks, 5u, 2ull, &start, &end);
    float* p = (float*)row[0];
    float* m1 = exp_avg + row[3];
    float* m2 = exp_avg_sq + row[3];
    float* mx = (flags & FLAG_VARIANT) ? max_exp_avg_sq + row[3] : 0;
    float lr = scalars[4], bc1 = scalars[2], bc2_sqrt = scalars[3];
    float step_size = __fdiv_rn(lr, bc1);
    float lr_wd = __fmul_rn(lr, weight_decay);
    float one_minus_beta1 = __fadd_rn(1.0f, -beta1), one_minus_beta2 = __fadd_rn(1.0f, -beta2);
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        float param = p[i];
        float g = load_grad(row[1], i, row[4]);
        if (flags & FLAG_MAXIMIZE) g = -g;
        if (weight_decay != 0.0f) param = __fadd_rn(param, -__fmul_rn(lr_wd, param));
        float m = __fadd_rn(__fmul_rn(beta1, m1[i]), __fmul_rn(one_minus_beta1, g));
        float v = __fadd_rn(__fmul_rn(beta2, m2[i]), __fmul_rn(__fmul_rn(one_minus_beta2, g), g));
        m1[i] = m;
        m2[i] = v;
        float s = v;
        if (mx) { float old = mx[i]; s = (old < v) ? v : old; mx[i] = s; }
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(s), bc2_sqrt), eps);
        p[i] = __fadd_rn(param, -__fdiv_rn(__fmul_rn(step_size, m), denom));
    }
}

// The masked fallback: when found_inf is set, snapshot (restore == 0) every listed array
// into scratch, or copy the snapshot back (restore != 0). Clean steps return at once.
extern "C" __global__ void masked_copy(const u64* table, const u32* chunks,
                                       const float* found_inf, unsigned char* scratch,
                                       u32 restore) {
    if (!skip_step(found_inf)) return;
    u64 start, end;
    const u64* row = block_range(table, chunks, 3u, 1ull, &start, &end);
    unsigned char* live = (unsigned char*)row[0];
    unsigned char* snap = scratch + row[2];
    for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
        if (restore) live[i] = snap[i]; else snap[i] = live[i];
    }
}
"#;

/// Host twin of `f16_bits_to_f32` (exact; NaN payloads kept as the kernel keeps them).
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let (e, m) = ((h >> 10) & 0x1f, h & 0x3ff);
    if e == 0x1f {
        return f32::from_bits(sign | 0x7f80_0000 | (m << 13));
    }
    if e == 0 {
        return f32::from_bits(sign | (m as f32 * (1.0 / 16_777_216.0)).to_bits());
    }
    f32::from_bits(sign | ((e + 112) << 23) | (m << 13))
}

/// Host twin of `pow_steps`: `base^n` by squaring, each product rounded once.
pub(crate) fn pow_steps(mut base: f64, mut n: u64) -> f64 {
    let mut r = 1.0;
    while n != 0 {
        if n & 1 == 1 {
            r *= base;
        }
        base *= base;
        n >>= 1;
    }
    r
}

/// `found_inf` argument `index` is set (a null pointer never skips).
fn skip_step(k: &KernelContext<'_>, index: usize) -> Result<bool, String> {
    let ptr = k.arg::<DevicePtr>(index)?;
    Ok(ptr.0 != 0 && k.read::<f32>(ptr, 1)?[0] != 0.0)
}

/// One block's work: the tensor row and the element range it covers.
struct BlockRange {
    row: Vec<u64>,
    start: u64,
    end: u64,
}

/// The ranges of every block of a multi-tensor launch, read from its tables (arguments 0
/// and 1) as the blocks of the CUDA kernel read them.
fn block_ranges(
    k: &KernelContext<'_>,
    row_len: usize,
    len_index: usize,
) -> Result<Vec<BlockRange>, String> {
    let (table, chunks) = (k.arg::<DevicePtr>(0)?, k.arg::<DevicePtr>(1)?);
    let blocks = k.config.grid.0 as usize;
    let pairs = k.read::<u32>(chunks, 2 * blocks)?;
    pairs
        .chunks_exact(2)
        .map(|pair| {
            let at = table.offset(8 * row_len as u64 * u64::from(pair[0]));
            let row = k.read::<u64>(at, row_len)?;
            let start = u64::from(pair[1]) * CHUNK;
            let end = (start + CHUNK).min(row[len_index]);
            Ok(BlockRange { row, start, end })
        })
        .collect()
}

/// Reads `n` f32 at element `first` of the array at `base`.
fn read_f32(k: &KernelContext<'_>, base: u64, first: u64, n: usize) -> Result<Vec<f32>, String> {
    k.read::<f32>(DevicePtr(base + 4 * first), n)
}

/// Writes f32 values at element `first` of the array at `base`.
fn write_f32(
    k: &mut KernelContext<'_>,
    base: u64,
    first: u64,
    values: &[f32],
) -> Result<(), String> {
    k.write(DevicePtr(base + 4 * first), values)
}

/// The gradients of a row's range, upcast to f32 as `load_grad` does.
fn read_grads(k: &KernelContext<'_>, r: &BlockRange) -> Result<Vec<f32>, String> {
    let n = (r.end - r.start) as usize;
    match r.row[4] {
        GRAD_F32 => read_f32(k, r.row[1], r.start, n),
        code => {
            let bits = k.read::<u16>(DevicePtr(r.row[1] + 2 * r.start), n)?;
            Ok(bits
                .into_iter()
                .map(|h| match code {
                    GRAD_BF16 => f32::from_bits(u32::from(h) << 16),
                    _ => f16_bits_to_f32(h),
                })
                .collect())
        }
    }
}

/// Host twin of `optim_prologue`.
fn prologue(k: &mut KernelContext<'_>) -> Result<(), String> {
    let scalars = k.arg::<DevicePtr>(1)?;
    let mut s = k.read::<f32>(scalars, SCALARS)?;
    if skip_step(k, 0)? {
        s[SKIPPED] += 1.0;
    } else {
        let (beta1, beta2) = (k.arg::<f32>(2)?, k.arg::<f32>(3)?);
        s[STEP] += 1.0;
        let n = s[STEP] as u64;
        s[BIAS_CORRECTION1] = (1.0 - pow_steps(f64::from(beta1), n)) as f32;
        s[BIAS_CORRECTION2_SQRT] = (1.0 - pow_steps(f64::from(beta2), n)).sqrt() as f32;
    }
    k.write(scalars, &s)
}

/// SGD's hyperparameters as the kernel receives them.
#[derive(Copy, Clone, Debug)]
pub(crate) struct SgdArgs {
    pub(crate) neg_lr: f32,
    pub(crate) first: bool,
    pub(crate) momentum: f32,
    pub(crate) dampening: f32,
    pub(crate) weight_decay: f32,
    pub(crate) flags: u32,
}

/// Host twin of one element of `sgd_multi_tensor`: the new parameter, and the new momentum
/// buffer value when momentum is on.
pub(crate) fn sgd_element(a: &SgdArgs, param: f32, grad: f32, buf: f32) -> (f32, f32) {
    let mut g = if a.flags & FLAG_MAXIMIZE != 0 {
        -grad
    } else {
        grad
    };
    if a.weight_decay != 0.0 {
        g += a.weight_decay * param;
    }
    let mut b = buf;
    if a.momentum != 0.0 {
        b = if a.first {
            g
        } else {
            buf * a.momentum + (1.0 - a.dampening) * g
        };
        g = if a.flags & FLAG_VARIANT != 0 {
            g + a.momentum * b
        } else {
            b
        };
    }
    (param + a.neg_lr * g, b)
}

/// Host twin of `sgd_multi_tensor`.
fn sgd(k: &mut KernelContext<'_>) -> Result<(), String> {
    if skip_step(k, 2)? {
        return Ok(());
    }
    let s = k.read::<f32>(k.arg(3)?, SCALARS)?;
    let buffer = k.arg::<DevicePtr>(4)?;
    let a = SgdArgs {
        neg_lr: -s[LR],
        first: s[STEP] == 1.0,
        momentum: k.arg(5)?,
        dampening: k.arg(6)?,
        weight_decay: k.arg(7)?,
        flags: k.arg(8)?,
    };
    for r in block_ranges(k, STEP_ROW, 2)? {
        let n = (r.end - r.start) as usize;
        let mut params = read_f32(k, r.row[0], r.start, n)?;
        let grads = read_grads(k, &r)?;
        let buf_base = buffer.0 + 4 * r.row[3];
        let uses_buffer = a.momentum != 0.0 && buffer.0 != 0;
        let mut bufs = if uses_buffer {
            read_f32(k, buf_base, r.start, n)?
        } else {
            vec![0.0; n]
        };
        for ((p, g), b) in params.iter_mut().zip(&grads).zip(bufs.iter_mut()) {
            (*p, *b) = sgd_element(&a, *p, *g, *b);
        }
        write_f32(k, r.row[0], r.start, &params)?;
        if uses_buffer {
            write_f32(k, buf_base, r.start, &bufs)?;
        }
    }
    Ok(())
}

/// AdamW's hyperparameters as the kernel derives them.
#[derive(Copy, Clone, Debug)]
pub(crate) struct AdamWArgs {
    pub(crate) step_size: f32,
    pub(crate) lr_wd: f32,
    pub(crate) bc2_sqrt: f32,
    pub(crate) beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) eps: f32,
    pub(crate) weight_decay: f32,
    pub(crate) flags: u32,
}

/// AdamW's per-element state: first and second moments and the running maximum of the
/// second (AMSGrad).
#[derive(Copy, Clone, Debug)]
pub(crate) struct Moments {
    pub(crate) m: f32,
    pub(crate) v: f32,
    pub(crate) max_v: f32,
}

/// Host twin of one element of `adamw_multi_tensor`.
pub(crate) fn adamw_element(a: &AdamWArgs, param: f32, grad: f32, s: Moments) -> (f32, Moments) {
    let g = if a.flags & FLAG_MAXIMIZE != 0 {
        -grad
    } else {
        grad
    };
    let mut param = param;
    if a.weight_decay != 0.0 {
        param += -(a.lr_wd * param);
    }
    let m = a.beta1 * s.m + (1.0 - a.beta1) * g;
    let v = a.beta2 * s.v + (1.0 - a.beta2) * g * g;
    let mut max_v = s.max_v;
    let mut denom_of = v;
    if a.flags & FLAG_VARIANT != 0 {
        max_v = if s.max_v < v { v } else { s.max_v };
        denom_of = max_v;
    }
    let denom = denom_of.sqrt() / a.bc2_sqrt + a.eps;
    (param + -(a.step_size * m / denom), Moments { m, v, max_v })
}

/// Host twin of `adamw_multi_tensor`.
fn adamw(k: &mut KernelContext<'_>) -> Result<(), String> {
    if skip_step(k, 2)? {
        return Ok(());
    }
    let s = k.read::<f32>(k.arg(3)?, SCALARS)?;
    let (m1, m2, mx) = (
        k.arg::<DevicePtr>(4)?.0,
        k.arg::<DevicePtr>(5)?.0,
        k.arg::<DevicePtr>(6)?.0,
    );
    let weight_decay: f32 = k.arg(10)?;
    let a = AdamWArgs {
        step_size: s[LR] / s[BIAS_CORRECTION1],
        lr_wd: s[LR] * weight_decay,
        bc2_sqrt: s[BIAS_CORRECTION2_SQRT],
        beta1: k.arg(7)?,
        beta2: k.arg(8)?,
        eps: k.arg(9)?,
        weight_decay,
        flags: k.arg(11)?,
    };
    let amsgrad = a.flags & FLAG_VARIANT != 0;
    for r in block_ranges(k, STEP_ROW, 2)? {
        let n = (r.end - r.start) as usize;
        let at = |base: u64| base + 4 * r.row[3];
        let mut params = read_f32(k, r.row[0], r.start, n)?;
        let grads = read_grads(k, &r)?;
        let mut ms = read_f32(k, at(m1), r.start, n)?;
        let mut vs = read_f32(k, at(m2), r.start, n)?;
        let mut maxes = if amsgrad {
            read_f32(k, at(mx), r.start, n)?
        } else {
            vec![0.0; n]
        };
        for i in 0..n {
            let s = Moments {
                m: ms[i],
                v: vs[i],
                max_v: maxes[i],
            };
            let (p, s) = adamw_element(&a, params[i], grads[i], s);
            (params[i], ms[i], vs[i], maxes[i]) = (p, s.m, s.v, s.max_v);
        }
        write_f32(k, r.row[0], r.start, &params)?;
        write_f32(k, at(m1), r.start, &ms)?;
        write_f32(k, at(m2), r.start, &vs)?;
        if amsgrad {
            write_f32(k, at(mx), r.start, &maxes)?;
        }
    }
    Ok(())
}

/// Host twin of `masked_copy`.
fn masked_copy(k: &mut KernelContext<'_>) -> Result<(), String> {
    if !skip_step(k, 2)? {
        return Ok(());
    }
    let scratch = k.arg::<DevicePtr>(3)?;
    let restore = k.arg::<u32>(4)? != 0;
    for r in block_ranges(k, COPY_ROW, 1)? {
        let n = (r.end - r.start) as usize;
        let live = DevicePtr(r.row[0] + r.start);
        let snap = scratch.offset(r.row[2] + r.start);
        let (from, to) = if restore { (snap, live) } else { (live, snap) };
        let bytes = k.read::<u8>(from, n)?;
        k.write(to, &bytes)?;
    }
    Ok(())
}

/// Registers the host versions of [`OPTIM_KERNELS`] on a fake driver, replacing ones
/// registered before. Not needed to use the optimizers: loading their kernels on a fake
/// device provides them.
pub fn register_fake_optim_kernels(fake: &FakeDriver) {
    fake.register_kernel("optim_prologue", prologue);
    fake.register_kernel("sgd_multi_tensor", sgd);
    fake.register_kernel("adamw_multi_tensor", adamw);
    fake.register_kernel("masked_copy", masked_copy);
}

/// Provides the host versions on a fake driver, keeping any a test registered itself: what
/// loading the optimizers' kernels on a fake device does.
pub(crate) fn provide_fake_optim_kernels(fake: &FakeDriver) {
    fake.provide_kernel("optim_prologue", prologue);
    fake.provide_kernel("sgd_multi_tensor", sgd);
    fake.provide_kernel("adamw_multi_tensor", adamw);
    fake.provide_kernel("masked_copy", masked_copy);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_decoding_is_exact() {
        for bits in 0..=u16::MAX {
            let ours = f16_bits_to_f32(bits);
            let theirs = half::f16::from_bits(bits).to_f32();
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "bits {bits:#06x}: {ours} vs {theirs}"
            );
        }
    }

    #[test]
    fn pow_steps_matches_powi() {
        for n in [0u64, 1, 2, 3, 10, 1000] {
            let (ours, theirs) = (pow_steps(0.999, n), 0.999f64.powi(n as i32));
            assert!(
                (ours - theirs).abs() <= 1e-13 * theirs,
                "n {n}: {ours} vs {theirs}"
            );
        }
    }
}
