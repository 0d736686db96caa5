//! A tiny two-layer MLP for end-to-end training tests: `linear -> relu -> linear -> MSE`,
//! its forward and backward passes as NVRTC kernels with host twins for the fake device,
//! and training loops (eager, and the whole iteration captured in one graph) that take the
//! "unscale and check" part of an iteration as a closure, for the gradient scaler to plug in.
//!
//! Mixed precision as autocast does it: with [`Precision::F16`] or [`Precision::Bf16`] the
//! linear layers round their inputs, weights and outputs to the lower precision and
//! accumulate in f32 (a cuBLAS GEMM with an f32 compute type), the loss runs in f32 on the
//! upcast output, the gradient entering the linears is rounded back (the cast's backward),
//! weight gradients come out rounded and are upcast into the f32 master gradients. Values
//! are stored in f32 buffers holding exactly the rounded values (storage width is not what
//! these tests are about); the kernels round every operation once, so the twins match the
//! GPU bit for bit.
use crate::{BoxError, D0, TestResult};
use ferrocuda_amp::TensorView;
use ferrocuda_amp::optim::{DeviceOptimizer, Param};
use ferrocuda_driver::FakeDriver;
use ferrocuda_driver::fake::KernelContext;
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::{DeviceBuffer, Function, Module, Runtime, Stream};
use ferrocuda_types::{DevicePtr, KernelArg, LaunchConfig};
use std::sync::Arc;

/// Batch rows, inputs, hidden units, outputs.
const ROWS: usize = 16;
const IN: usize = 8;
const HIDDEN: usize = 32;
const OUT: usize = 4;

/// The precision the linear layers compute in.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Precision {
    F32,
    F16,
    Bf16,
}

impl Precision {
    pub(crate) const ALL: [Precision; 3] = [Precision::F32, Precision::F16, Precision::Bf16];

    fn code(self) -> u32 {
        self as u32
    }

    fn from_code(code: u32) -> Precision {
        match code {
            1 => Precision::F16,
            2 => Precision::Bf16,
            _ => Precision::F32,
        }
    }
}

const MLP_KERNELS: &str = r#"
typedef unsigned int u32;
__device__ __forceinline__ float round_f16(float v) {
    u32 u = __float_as_uint(v), sign = u & 0x80000000u, a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return v;
    if (a >= 0x477ff000u) return __uint_as_float(sign | 0x7f800000u);
    if (a < 0x38800000u) {
        float q = rintf(__fmul_rn(__uint_as_float(a), 16777216.0f));
        return __uint_as_float(sign | __float_as_uint(__fmul_rn(q, 5.9604644775390625e-8f)));
    }
    a += 0xfffu + ((a >> 13) & 1u);
    return __uint_as_float(sign | (a & 0xffffe000u));
}
__device__ __forceinline__ float round_bf16(float v) {
    u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float((u & 0xffff0000u) | 0x00400000u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}
__device__ __forceinline__ float round_lp(float v, u32 lp) {
    return lp == 1u ? round_f16(v) : lp == 2u ? round_bf16(v) : v;
}
// y[r, o] = act(lp(sum_k lp(x[r, k]) * lp(w[o, k]) + lp(b[o])))
extern "C" __global__ void mlp_linear(float* y, const float* x, const float* w, const float* b,
                                      u32 rows, u32 n_in, u32 n_out, u32 relu, u32 lp) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n_out) return;
    u32 r = i / n_out, o = i % n_out;
    float acc = 0.0f;
    for (u32 k = 0; k < n_in; ++k)
        acc = __fadd_rn(acc, __fmul_rn(round_lp(x[r * n_in + k], lp), round_lp(w[o * n_in + k], lp)));
    float v = round_lp(__fadd_rn(acc, round_lp(b[o], lp)), lp);
    y[i] = (relu && v < 0.0f) ? 0.0f : v;
}
// loss = mean((y - t)^2) in f32; dy = lp(scale * (2 / n) * (y - t)).
extern "C" __global__ void mlp_mse(float* loss, float* dy, const float* y, const float* t,
                                   u32 n, const float* scale, u32 lp) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    float s = scale ? *scale : 1.0f;
    float seed = __fmul_rn(s, __fdiv_rn(2.0f, (float)n));
    if (i < n) dy[i] = round_lp(__fmul_rn(seed, __fadd_rn(y[i], -t[i])), lp);
    if (i == 0) {
        float acc = 0.0f;
        for (u32 j = 0; j < n; ++j) {
            float d = __fadd_rn(y[j], -t[j]);
            acc = __fadd_rn(acc, __fmul_rn(d, d));
        }
        loss[0] = __fdiv_rn(acc, (float)n);
    }
}
// dw[o, k] = lp(sum_r dy[r, o] * lp(x[r, k])); db[o] = lp(sum_r dy[r, o]).
extern "C" __global__ void mlp_linear_backward_params(float* dw, float* db, const float* dy,
                                                      const float* x, u32 rows, u32 n_in,
                                                      u32 n_out, u32 lp) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out * (n_in + 1u)) return;
    float acc = 0.0f;
    if (i < n_out * n_in) {
        u32 o = i / n_in, k = i % n_in;
        for (u32 r = 0; r < rows; ++r)
            acc = __fadd_rn(acc, __fmul_rn(dy[r * n_out + o], round_lp(x[r * n_in + k], lp)));
        dw[i] = round_lp(acc, lp);
    } else {
        u32 o = i - n_out * n_in;
        for (u32 r = 0; r < rows; ++r) acc = __fadd_rn(acc, dy[r * n_out + o]);
        db[o] = round_lp(acc, lp);
    }
}
// dx[r, k] = h[r, k] > 0 ? lp(sum_o dy[r, o] * lp(w[o, k])) : 0 (relu's backward on its output).
extern "C" __global__ void mlp_linear_backward_input(float* dx, const float* dy, const float* w,
                                                     const float* h, u32 rows, u32 n_in,
                                                     u32 n_out, u32 lp) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n_in) return;
    u32 r = i / n_in, k = i % n_in;
    float acc = 0.0f;
    for (u32 o = 0; o < n_out; ++o)
        acc = __fadd_rn(acc, __fmul_rn(dy[r * n_out + o], round_lp(w[o * n_in + k], lp)));
    dx[i] = h[i] > 0.0f ? round_lp(acc, lp) : 0.0f;
}
"#;

/// Host twin of `round_f16`: f32 to the nearest f16 (ties to even), back to f32.
fn round_f16(v: f32) -> f32 {
    let u = v.to_bits();
    let (sign, mut a) = (u & 0x8000_0000, u & 0x7fff_ffff);
    if a >= 0x7f80_0000 {
        return v;
    }
    if a >= 0x477f_f000 {
        return f32::from_bits(sign | 0x7f80_0000);
    }
    if a < 0x3880_0000 {
        let q = (f32::from_bits(a) * 16_777_216.0).round_ties_even();
        return f32::from_bits(sign | (q * (1.0 / 16_777_216.0)).to_bits());
    }
    a += 0xfff + ((a >> 13) & 1);
    f32::from_bits(sign | (a & 0xffff_e000))
}

/// Host twin of `round_bf16`.
fn round_bf16(v: f32) -> f32 {
    let u = v.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return f32::from_bits((u & 0xffff_0000) | 0x0040_0000);
    }
    let u = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    f32::from_bits(u & 0xffff_0000)
}

fn round_lp(v: f32, lp: Precision) -> f32 {
    match lp {
        Precision::F32 => v,
        Precision::F16 => round_f16(v),
        Precision::Bf16 => round_bf16(v),
    }
}

/// Checks the rounding twins against `half` on a spread of bit patterns (NaNs: NaN out).
pub(crate) fn check_rounding_against_half() {
    let edges = [
        0x477f_efff,
        0x477f_f000,
        0x3880_0000,
        0x387f_ffff,
        0x7f7f_ffff,
        1,
    ];
    let spread = (0..u32::MAX / 65_521).map(|i| i * 65_521);
    for bits in spread.chain(edges).flat_map(|b| [b, b | 0x8000_0000]) {
        let v = f32::from_bits(bits);
        for (ours, theirs, name) in [
            (round_f16(v), half::f16::from_f32(v).to_f32(), "f16"),
            (round_bf16(v), half::bf16::from_f32(v).to_f32(), "bf16"),
        ] {
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "{name} of {v:e} ({bits:#010x}): {ours:e} vs {theirs:e}"
            );
        }
    }
}

/// A linear layer's sizes.
#[derive(Copy, Clone, Debug)]
struct Shape {
    rows: usize,
    n_in: usize,
    n_out: usize,
}

/// Lower-precision products summed in f32, in the kernels' order.
fn dot(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    (0..n).fold(0.0f32, |acc, k| acc + term(k))
}

fn linear(x: &[f32], w: &[f32], b: &[f32], s: Shape, relu: bool, lp: Precision) -> Vec<f32> {
    let r = |v: f32| round_lp(v, lp);
    (0..s.rows * s.n_out)
        .map(|i| {
            let (row, o) = (i / s.n_out, i % s.n_out);
            let acc = dot(s.n_in, |k| r(x[row * s.n_in + k]) * r(w[o * s.n_in + k]));
            let v = r(acc + r(b[o]));
            if relu && v < 0.0 { 0.0 } else { v }
        })
        .collect()
}

fn mse(y: &[f32], t: &[f32], scale: f32, lp: Precision) -> (f32, Vec<f32>) {
    let n = y.len() as f32;
    let seed = scale * (2.0 / n);
    let dy = y
        .iter()
        .zip(t)
        .map(|(y, t)| round_lp(seed * (y - t), lp))
        .collect();
    let sum = dot(y.len(), |j| (y[j] - t[j]) * (y[j] - t[j]));
    (sum / n, dy)
}

fn linear_backward_params(dy: &[f32], x: &[f32], s: Shape, lp: Precision) -> (Vec<f32>, Vec<f32>) {
    let dw = (0..s.n_out * s.n_in)
        .map(|i| {
            let (o, k) = (i / s.n_in, i % s.n_in);
            let acc = dot(s.rows, |r| {
                dy[r * s.n_out + o] * round_lp(x[r * s.n_in + k], lp)
            });
            round_lp(acc, lp)
        })
        .collect();
    let db = (0..s.n_out)
        .map(|o| round_lp(dot(s.rows, |r| dy[r * s.n_out + o]), lp))
        .collect();
    (dw, db)
}

fn linear_backward_input(dy: &[f32], w: &[f32], h: &[f32], s: Shape, lp: Precision) -> Vec<f32> {
    (0..s.rows * s.n_in)
        .map(|i| {
            let (r, k) = (i / s.n_in, i % s.n_in);
            let acc = dot(s.n_out, |o| {
                dy[r * s.n_out + o] * round_lp(w[o * s.n_in + k], lp)
            });
            if h[i] > 0.0 { round_lp(acc, lp) } else { 0.0 }
        })
        .collect()
}

/// Reads the `(rows, n_in, n_out)` arguments at `first` and the precision at `lp`.
fn shape_args(
    k: &KernelContext<'_>,
    first: usize,
    lp: usize,
) -> Result<(Shape, Precision), String> {
    let arg = |i| k.arg::<u32>(i).map(|v| v as usize);
    let s = Shape {
        rows: arg(first)?,
        n_in: arg(first + 1)?,
        n_out: arg(first + 2)?,
    };
    Ok((s, Precision::from_code(k.arg(lp)?)))
}

/// Registers the host versions of the MLP's kernels on a fake driver.
pub(crate) fn register_fake_mlp_kernels(fake: &FakeDriver) {
    fake.register_kernel("mlp_linear", |k| {
        let (s, lp) = shape_args(k, 4, 8)?;
        let x = k.read::<f32>(k.arg(1)?, s.rows * s.n_in)?;
        let w = k.read::<f32>(k.arg(2)?, s.n_out * s.n_in)?;
        let b = k.read::<f32>(k.arg(3)?, s.n_out)?;
        let y = linear(&x, &w, &b, s, k.arg::<u32>(7)? != 0, lp);
        k.write(k.arg(0)?, &y)
    });
    fake.register_kernel("mlp_mse", |k| {
        let n = k.arg::<u32>(4)? as usize;
        let (y, t) = (k.read::<f32>(k.arg(2)?, n)?, k.read::<f32>(k.arg(3)?, n)?);
        let scale_ptr = k.arg::<DevicePtr>(5)?;
        let scale = if scale_ptr.0 == 0 {
            1.0
        } else {
            k.read::<f32>(scale_ptr, 1)?[0]
        };
        let (loss, dy) = mse(&y, &t, scale, Precision::from_code(k.arg(6)?));
        k.write(k.arg(0)?, &[loss])?;
        k.write(k.arg(1)?, &dy)
    });
    fake.register_kernel("mlp_linear_backward_params", |k| {
        let (s, lp) = shape_args(k, 4, 7)?;
        let dy = k.read::<f32>(k.arg(2)?, s.rows * s.n_out)?;
        let x = k.read::<f32>(k.arg(3)?, s.rows * s.n_in)?;
        let (dw, db) = linear_backward_params(&dy, &x, s, lp);
        k.write(k.arg(0)?, &dw)?;
        k.write(k.arg(1)?, &db)
    });
    fake.register_kernel("mlp_linear_backward_input", |k| {
        let (s, lp) = shape_args(k, 4, 7)?;
        let dy = k.read::<f32>(k.arg(1)?, s.rows * s.n_out)?;
        let w = k.read::<f32>(k.arg(2)?, s.n_out * s.n_in)?;
        let h = k.read::<f32>(k.arg(3)?, s.rows * s.n_in)?;
        k.write(k.arg(0)?, &linear_backward_input(&dy, &w, &h, s, lp))
    });
}

/// The model: parameters (f32 masters) and their gradients, a fixed batch and target, the
/// activations, and the kernels.
#[derive(Debug)]
pub(crate) struct Mlp {
    lp: Precision,
    /// `w1, b1, w2, b2`.
    params: [DeviceBuffer<f32>; 4],
    /// Their gradients, in the same order.
    grads: [DeviceBuffer<f32>; 4],
    x: DeviceBuffer<f32>,
    target: DeviceBuffer<f32>,
    hidden: DeviceBuffer<f32>,
    y: DeviceBuffer<f32>,
    dy: DeviceBuffer<f32>,
    dhidden: DeviceBuffer<f32>,
    loss: DeviceBuffer<f32>,
    /// The loss scale the backward pass is seeded with (the scaler's), 1 when absent.
    loss_scale: Option<DevicePtr>,
    kernels: [Function; 4],
}

const LAYER1: Shape = Shape {
    rows: ROWS,
    n_in: IN,
    n_out: HIDDEN,
};
const LAYER2: Shape = Shape {
    rows: ROWS,
    n_in: HIDDEN,
    n_out: OUT,
};

impl Mlp {
    /// A model with weights drawn from `seed`, targets from a random linear teacher.
    pub(crate) fn new(rt: &Arc<Runtime>, lp: Precision, seed: u64) -> Result<Mlp, BoxError> {
        let mut rng = crate::reference::Rng::new(seed);
        let x = rng.vec(ROWS * IN, 1.0);
        let teacher = rng.vec(OUT * IN, 0.5);
        let target: Vec<f32> = (0..ROWS * OUT)
            .map(|i| dot(IN, |k| teacher[(i % OUT) * IN + k] * x[(i / OUT) * IN + k]))
            .collect();
        let upload = |v: &[f32]| DeviceBuffer::from_slice(rt, D0, v);
        let zeros = |n: usize| DeviceBuffer::filled(rt, D0, n, 0.0f32);
        let params = [
            upload(&rng.vec(HIDDEN * IN, 1.0 / (IN as f32).sqrt()))?,
            zeros(HIDDEN)?,
            upload(&rng.vec(OUT * HIDDEN, 1.0 / (HIDDEN as f32).sqrt()))?,
            zeros(OUT)?,
        ];
        let grads = [
            zeros(HIDDEN * IN)?,
            zeros(HIDDEN)?,
            zeros(OUT * HIDDEN)?,
            zeros(OUT)?,
        ];
        let module = Module::from_cuda_source(rt, D0, "amp_test_mlp", MLP_KERNELS)?;
        let kernels = [
            module.function("mlp_linear")?,
            module.function("mlp_mse")?,
            module.function("mlp_linear_backward_params")?,
            module.function("mlp_linear_backward_input")?,
        ];
        let mlp = Mlp {
            lp,
            params,
            grads,
            x: upload(&x)?,
            target: upload(&target)?,
            hidden: zeros(ROWS * HIDDEN)?,
            y: zeros(ROWS * OUT)?,
            dy: zeros(ROWS * OUT)?,
            dhidden: zeros(ROWS * HIDDEN)?,
            loss: zeros(1)?,
            loss_scale: None,
            kernels,
        };
        rt.current_stream(D0)?.synchronize()?;
        Ok(mlp)
    }

    /// Seeds the backward pass with the f32 at `scale` (the scaler's scale) instead of 1.
    pub(crate) fn set_loss_scale(&mut self, scale: Option<DevicePtr>) {
        self.loss_scale = scale;
    }

    /// The parameters and their gradients, for an optimizer.
    pub(crate) fn params(&self) -> Vec<Param> {
        self.params
            .iter()
            .zip(&self.grads)
            .map(|(p, g)| Param {
                param: TensorView::of(p),
                grad: TensorView::of(g),
            })
            .collect()
    }

    fn launch(&self, stream: &Stream, k: usize, n: usize, args: &[KernelArg<'_>]) -> TestResult {
        let config = LaunchConfig::for_elements(n, 128);
        Ok(stream.launch(&self.kernels[k], &config, args)?)
    }

    fn linear(
        &self,
        stream: &Stream,
        out: &DeviceBuffer<f32>,
        x: &DeviceBuffer<f32>,
        layer: usize,
    ) -> TestResult {
        let (s, relu) = if layer == 0 {
            (LAYER1, 1u32)
        } else {
            (LAYER2, 0)
        };
        let (rows, n_in, n_out, lp) =
            (s.rows as u32, s.n_in as u32, s.n_out as u32, self.lp.code());
        let (w, b) = (&self.params[2 * layer], &self.params[2 * layer + 1]);
        let args = [
            out.arg(),
            x.arg(),
            w.arg(),
            b.arg(),
            KernelArg::value(&rows),
            KernelArg::value(&n_in),
            KernelArg::value(&n_out),
            KernelArg::value(&relu),
            KernelArg::value(&lp),
        ];
        self.launch(stream, 0, s.rows * s.n_out, &args)
    }

    fn backward_params(
        &self,
        stream: &Stream,
        dy: &DeviceBuffer<f32>,
        x: &DeviceBuffer<f32>,
        layer: usize,
    ) -> TestResult {
        let s = if layer == 0 { LAYER1 } else { LAYER2 };
        let (rows, n_in, n_out, lp) =
            (s.rows as u32, s.n_in as u32, s.n_out as u32, self.lp.code());
        let (dw, db) = (&self.grads[2 * layer], &self.grads[2 * layer + 1]);
        let args = [
            dw.arg(),
            db.arg(),
            dy.arg(),
            x.arg(),
            KernelArg::value(&rows),
            KernelArg::value(&n_in),
            KernelArg::value(&n_out),
            KernelArg::value(&lp),
        ];
        self.launch(stream, 2, s.n_out * (s.n_in + 1), &args)
    }

    /// Enqueues the forward pass, the loss and the backward pass on `stream`: the
    /// gradients are overwritten (no zeroing needed), the loss lands in a device scalar.
    pub(crate) fn forward_backward(&self, stream: &Stream) -> TestResult {
        self.linear(stream, &self.hidden, &self.x, 0)?;
        self.linear(stream, &self.y, &self.hidden, 1)?;
        let (n, lp) = ((ROWS * OUT) as u32, self.lp.code());
        let scale = match self.loss_scale {
            Some(ptr) => KernelArg::Ptr { device: D0, ptr },
            None => KernelArg::Value(&[0; 8]),
        };
        let args = [
            self.loss.arg(),
            self.dy.arg(),
            self.y.arg(),
            self.target.arg(),
            KernelArg::value(&n),
            scale,
            KernelArg::value(&lp),
        ];
        self.launch(stream, 1, ROWS * OUT, &args)?;
        self.backward_params(stream, &self.dy, &self.hidden, 1)?;
        let s = LAYER2;
        let (rows, n_in, n_out) = (s.rows as u32, s.n_in as u32, s.n_out as u32);
        let args = [
            self.dhidden.arg(),
            self.dy.arg(),
            self.params[2].arg(),
            self.hidden.arg(),
            KernelArg::value(&rows),
            KernelArg::value(&n_in),
            KernelArg::value(&n_out),
            KernelArg::value(&lp),
        ];
        self.launch(stream, 3, s.rows * s.n_in, &args)?;
        self.backward_params(stream, &self.dhidden, &self.x, 0)
    }

    /// The loss of the last forward pass, after `stream`'s work (a host sync).
    pub(crate) fn loss(&self, stream: &Stream) -> Result<f32, BoxError> {
        stream.synchronize()?;
        Ok(self.loss.to_host()?[0])
    }

    pub(crate) fn params_to_host(&self) -> Result<Vec<Vec<f32>>, BoxError> {
        Ok(self
            .params
            .iter()
            .map(|p| p.to_host())
            .collect::<Result<_, _>>()?)
    }

    pub(crate) fn grads_to_host(&self) -> Result<Vec<Vec<f32>>, BoxError> {
        Ok(self
            .grads
            .iter()
            .map(|g| g.to_host())
            .collect::<Result<_, _>>()?)
    }

    /// The loss and gradients computed on the host from the current parameters, with the
    /// backward pass seeded by `scale`.
    pub(crate) fn host_forward_backward(
        &self,
        scale: f32,
    ) -> Result<(f32, Vec<Vec<f32>>), BoxError> {
        let p = self.params_to_host()?;
        let (x, t, lp) = (self.x.to_host()?, self.target.to_host()?, self.lp);
        let hidden = linear(&x, &p[0], &p[1], LAYER1, true, lp);
        let y = linear(&hidden, &p[2], &p[3], LAYER2, false, lp);
        let (loss, dy) = mse(&y, &t, scale, lp);
        let (dw2, db2) = linear_backward_params(&dy, &hidden, LAYER2, lp);
        let dhidden = linear_backward_input(&dy, &p[2], &hidden, LAYER2, lp);
        let (dw1, db1) = linear_backward_params(&dhidden, &x, LAYER1, lp);
        Ok((loss, vec![dw1, db1, dw2, db2]))
    }
}

/// Enqueues "unscale and check" on a stream; returns the `found_inf` the step reads.
pub(crate) type UnscaleAndCheck<'a> =
    dyn FnMut(&Stream) -> Result<Option<DevicePtr>, BoxError> + 'a;

/// What a training iteration does around the model and the optimizer: where the gradient
/// scaler plugs in.
pub(crate) struct Hooks<'a> {
    /// Sets iteration `i`'s host-side inputs (in stream order on the current stream) before
    /// it runs or replays.
    pub(crate) before: Box<dyn FnMut(usize) -> TestResult + 'a>,
    /// After the backward pass: enqueues "unscale and check" on the stream and returns the
    /// `found_inf` the step reads.
    pub(crate) unscale_and_check: Box<UnscaleAndCheck<'a>>,
    /// After the step: enqueues what follows it (the scaler's `update`).
    pub(crate) after_step: Box<dyn FnMut(&Stream) -> TestResult + 'a>,
}

/// One iteration on `stream`: forward and backward, unscale and check, optimizer step, and
/// what follows the step.
fn enqueue_iteration(
    model: &Mlp,
    opt: &mut dyn DeviceOptimizer,
    stream: &Stream,
    hooks: &mut Hooks<'_>,
) -> TestResult {
    model.forward_backward(stream)?;
    let found_inf = (hooks.unscale_and_check)(stream)?;
    opt.step(stream, found_inf)?;
    (hooks.after_step)(stream)
}

/// Runs `iters` eager iterations on `stream`; returns each iteration's loss.
pub(crate) fn train_eager(
    model: &Mlp,
    opt: &mut dyn DeviceOptimizer,
    stream: &Stream,
    iters: usize,
    hooks: &mut Hooks<'_>,
) -> Result<Vec<f32>, BoxError> {
    let mut losses = Vec::with_capacity(iters);
    for i in 0..iters {
        (hooks.before)(i)?;
        enqueue_iteration(model, opt, stream, hooks)?;
        losses.push(model.loss(stream)?);
    }
    Ok(losses)
}

/// Captures one whole iteration into `graph`, then replays it `iters` times on the current
/// stream; returns each replay's loss.
pub(crate) fn train_captured(
    graph: &CudaGraph,
    model: &Mlp,
    opt: &mut dyn DeviceOptimizer,
    iters: usize,
    hooks: &mut Hooks<'_>,
) -> Result<Vec<f32>, BoxError> {
    let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    enqueue_iteration(model, opt, &stream, hooks)?;
    capture.end()?;
    let current = graph.runtime().current_stream(D0)?;
    let mut losses = Vec::with_capacity(iters);
    for i in 0..iters {
        (hooks.before)(i)?;
        graph.replay(&current)?;
        losses.push(model.loss(&current)?);
    }
    Ok(losses)
}
