//! A decode loop, eager and through CUDA-graph trees (`torch.compile(mode="reduce-overhead")`'s
//! runtime): an MLP-style step of 22 kernel launches over weights passed as static inputs, a
//! batch that changes every step (1 to 8 rows, padded by the trees to buckets 1, 2, 4, 8),
//! each step run eagerly and then through `Trees::wrap` after `mark_step_begin`. The two give
//! the same bits (the same kernels on the same rows; padding rows are zeros and rows are
//! independent). Prints, per bucket and overall, warm-ups, recordings and replays, and the
//! median CPU time per step, eager vs trees, with the speedup (and the GPU time between
//! events around the step, on the GPU), over the steps after each bucket's first two.
//! Before each step that will record, the graph-memory planner (`Trees::plan`) says what
//! the tree's pool will reserve once it has; the example checks the pool after the
//! recording against it and fails if they differ.
//! Runs on the GPU when one is present (and `FERROCUDA_BACKEND=fake` does not ask for the
//! fake device) and on the fake device otherwise, and says which.
//!
//! `cargo run --release --example decode -- [steps]` (default 400 on the GPU, 48 on the fake
//! device; at least 12)
use ferrocuda::alloc::{DeviceAllocators, caching_from_env};
use ferrocuda::driver::{FakeDriver, KernelContext};
use ferrocuda::graph::CallableError;
use ferrocuda::graph::trees::{
    Arg, Buckets, Ctx, FunctionId, Input, Out, Served, TreeConfig, TreeEvent, WrapOptions,
};
use ferrocuda::graph::{Trees, Wrapped};
use ferrocuda::stream::{DeviceBuffer, Event, Function, Module, Runtime, Stream};
use ferrocuda::types::{AllocatorConfig, DType, DeviceIndex, EventFlags, KernelArg, LaunchConfig};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// Model width, MLP hidden width, output width, layers.
const D: usize = 256;
const F: usize = 512;
const V: usize = 512;
const LAYERS: usize = 4;
/// Weights per layer: norm gain, up weight and bias, down weight and bias.
const PER_LAYER: usize = 5;
/// Weights: per layer, then the final norm gain, head weight and bias.
const WEIGHTS: usize = LAYERS * PER_LAYER + 3;
/// Batch sizes pad up to these.
const BUCKETS: [usize; 4] = [1, 2, 4, 8];
const DEV: DeviceIndex = DeviceIndex(0);

/// Weights are `[n_in][n_out]` so that neighbouring threads read neighbouring addresses.
const KERNELS: &str = r#"
extern "C" __global__ void decode_rmsnorm(float* y, const float* x, const float* g,
                                          unsigned int rows, unsigned int d) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * d) return;
    const float* row = x + (i / d) * d;
    float ss = 0.0f;
    for (unsigned int j = 0; j < d; ++j) ss += row[j] * row[j];
    y[i] = x[i] * (1.0f / sqrtf(ss / (float)d + 1e-5f)) * g[i % d];
}
extern "C" __global__ void decode_linear(float* y, const float* x, const float* w,
                                         const float* b, unsigned int rows,
                                         unsigned int n_in, unsigned int n_out) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n_out) return;
    unsigned int r = i / n_out, o = i % n_out;
    float acc = b[o];
    for (unsigned int j = 0; j < n_in; ++j) acc += x[r * n_in + j] * w[j * n_out + o];
    y[i] = acc;
}
extern "C" __global__ void decode_silu(float* y, const float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] / (1.0f + expf(-x[i]));
}
extern "C" __global__ void decode_add(float* y, const float* a, const float* b, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}
"#;

/// Arguments `from..from + N` of a fake launch, `u32` sizes.
fn sizes<const N: usize>(k: &KernelContext<'_>, from: usize) -> Result<[usize; N], String> {
    let mut out = [0; N];
    for (i, v) in out.iter_mut().enumerate() {
        *v = k.arg::<u32>(from + i)? as usize;
    }
    Ok(out)
}

/// An elementwise fake kernel `y = op(a, b)` (or `op(a, a)` without `b`).
fn elementwise(
    k: &mut KernelContext<'_>,
    binary: bool,
    op: fn(f32, f32) -> f32,
) -> Result<(), String> {
    let [n] = sizes::<1>(k, if binary { 3 } else { 2 })?;
    let a = k.read::<f32>(k.arg(1)?, n)?;
    let b = if binary {
        k.read::<f32>(k.arg(2)?, n)?
    } else {
        a.clone()
    };
    let y: Vec<f32> = a.iter().zip(&b).map(|(a, b)| op(*a, *b)).collect();
    k.write(k.arg(0)?, &y)
}

/// Host twins of [`KERNELS`] for the fake device: the same formulas, each output's sum in
/// the same order (eager and trees both run these there, so they agree bit for bit).
fn register_fake(fake: &FakeDriver) {
    fake.register_kernel("decode_rmsnorm", |k| {
        let [rows, d] = sizes::<2>(k, 3)?;
        let (x, g) = (
            k.read::<f32>(k.arg(1)?, rows * d)?,
            k.read::<f32>(k.arg(2)?, d)?,
        );
        let mut y = Vec::with_capacity(rows * d);
        for row in x.chunks_exact(d.max(1)) {
            let ss = row.iter().fold(0.0f32, |acc, v| acc + v * v);
            let inv = 1.0 / (ss / d as f32 + 1e-5).sqrt();
            y.extend(row.iter().zip(&g).map(|(v, g)| v * inv * g));
        }
        k.write(k.arg(0)?, &y)
    });
    fake.register_kernel("decode_linear", |k| {
        let [rows, n_in, n_out] = sizes::<3>(k, 4)?;
        let x = k.read::<f32>(k.arg(1)?, rows * n_in)?;
        let w = k.read::<f32>(k.arg(2)?, n_in * n_out)?;
        let b = k.read::<f32>(k.arg(3)?, n_out)?;
        let mut y = Vec::with_capacity(rows * n_out);
        for row in x.chunks_exact(n_in.max(1)) {
            // Output by output, the sum runs over j in order, as each GPU thread's does.
            let mut acc = b.clone();
            for (xj, wj) in row.iter().zip(w.chunks_exact(n_out.max(1))) {
                acc.iter_mut().zip(wj).for_each(|(a, w)| *a += xj * w);
            }
            y.extend(acc);
        }
        k.write(k.arg(0)?, &y)
    });
    fake.register_kernel("decode_silu", |k| {
        elementwise(k, false, |x, _| x / (1.0 + (-x).exp()))
    });
    fake.register_kernel("decode_add", |k| elementwise(k, true, |a, b| a + b));
}

/// Something a kernel can write: an eager buffer or memory a wrapped function allocated.
trait Activation {
    fn arg(&self) -> KernelArg<'static>;
}

impl Activation for DeviceBuffer<f32> {
    fn arg(&self) -> KernelArg<'static> {
        DeviceBuffer::arg(self)
    }
}

impl Activation for Out {
    fn arg(&self) -> KernelArg<'static> {
        Out::arg(self)
    }
}

/// The decode step's kernels and weights.
#[derive(Debug)]
struct Model {
    rmsnorm: Function,
    linear: Function,
    silu: Function,
    add: Function,
    /// Per layer [`PER_LAYER`] buffers, then the final norm gain, head weight and bias.
    weights: Vec<DeviceBuffer<f32>>,
    /// The weights as kernel arguments (the eager step's).
    weight_args: Vec<KernelArg<'static>>,
}

fn launch(s: &Stream, f: &Function, n: usize, args: &[KernelArg<'_>]) -> Result<(), CallableError> {
    Ok(s.launch(f, &LaunchConfig::for_elements(n.max(1), 128), args)?)
}

impl Model {
    fn new(rt: &Arc<Runtime>) -> Result<Model, CallableError> {
        let module = Module::from_cuda_source(rt, DEV, "decode_example", KERNELS)?;
        // (elements, centre, spread): norm gains near 1, weights and biases near 0.
        let mut shapes = Vec::with_capacity(WEIGHTS);
        for _ in 0..LAYERS {
            shapes.extend([
                (D, 1.0, 0.1),
                (D * F, 0.0, 0.06),
                (F, 0.0, 0.02),
                (F * D, 0.0, 0.04),
                (D, 0.0, 0.02),
            ]);
        }
        shapes.extend([(D, 1.0, 0.1), (D * V, 0.0, 0.06), (V, 0.0, 0.02)]);
        let mut weights = Vec::with_capacity(shapes.len());
        for (i, &(n, centre, spread)) in shapes.iter().enumerate() {
            let values: Vec<f32> = (random(n, 1000 + i as u64).iter())
                .map(|v| centre + spread * v)
                .collect();
            weights.push(DeviceBuffer::from_slice(rt, DEV, &values)?);
        }
        rt.current_stream(DEV)?.synchronize()?;
        Ok(Model {
            rmsnorm: module.function("decode_rmsnorm")?,
            linear: module.function("decode_linear")?,
            silu: module.function("decode_silu")?,
            add: module.function("decode_add")?,
            weight_args: weights.iter().map(|w| w.arg()).collect(),
            weights,
        })
    }

    /// One decode step over `rows` rows of `x` (`rows` × [`D`]) on `s`: per layer
    /// `x += W2 silu(W1 rmsnorm(x) + b1) + b2`, then `rmsnorm(x) Wh + bh` (`rows` × [`V`]),
    /// 22 launches. `alloc(cols)` gives `rows` × `cols` floats.
    fn step<B: Activation>(
        &self,
        s: &Stream,
        x: KernelArg<'static>,
        rows: usize,
        w: &[KernelArg<'static>],
        mut alloc: impl FnMut(usize) -> Result<B, CallableError>,
    ) -> Result<B, CallableError> {
        let layers = w.chunks_exact(PER_LAYER);
        let [g, wh, bh] = *layers.remainder() else {
            return Err(format!("{} weights, expected {}", w.len(), WEIGHTS).into());
        };
        let mut h: Option<B> = None;
        for p in layers {
            let [g1, w1, b1, w2, b2] = *p else {
                return Err("a layer has five weights".into());
            };
            let cur = h.as_ref().map_or(x, Activation::arg);
            let n = self.norm(s, &mut alloc, cur, g1, rows)?;
            let u = self.dense(s, &mut alloc, n.arg(), (w1, b1), rows, (D, F))?;
            let a = alloc(F)?;
            let nf = (rows * F) as u32;
            let args = [a.arg(), u.arg(), KernelArg::value(&nf)];
            launch(s, &self.silu, rows * F, &args)?;
            let o = self.dense(s, &mut alloc, a.arg(), (w2, b2), rows, (F, D))?;
            let next = alloc(D)?;
            let nd = (rows * D) as u32;
            let args = [next.arg(), cur, o.arg(), KernelArg::value(&nd)];
            launch(s, &self.add, rows * D, &args)?;
            h = Some(next);
        }
        let last = h.as_ref().map_or(x, Activation::arg);
        let n = self.norm(s, &mut alloc, last, g, rows)?;
        self.dense(s, &mut alloc, n.arg(), (wh, bh), rows, (D, V))
    }

    /// `rmsnorm(x) * g` into a new `rows` × [`D`].
    fn norm<B: Activation>(
        &self,
        s: &Stream,
        alloc: &mut impl FnMut(usize) -> Result<B, CallableError>,
        x: KernelArg<'static>,
        g: KernelArg<'static>,
        rows: usize,
    ) -> Result<B, CallableError> {
        let y = alloc(D)?;
        let (r, d) = (rows as u32, D as u32);
        let args = [y.arg(), x, g, KernelArg::value(&r), KernelArg::value(&d)];
        launch(s, &self.rmsnorm, rows * D, &args)?;
        Ok(y)
    }

    /// `x W + b` into a new `rows` × `n_out`.
    fn dense<B: Activation>(
        &self,
        s: &Stream,
        alloc: &mut impl FnMut(usize) -> Result<B, CallableError>,
        x: KernelArg<'static>,
        (w, b): (KernelArg<'static>, KernelArg<'static>),
        rows: usize,
        (n_in, n_out): (usize, usize),
    ) -> Result<B, CallableError> {
        let y = alloc(n_out)?;
        let (r, i, o) = (rows as u32, n_in as u32, n_out as u32);
        let args = [
            y.arg(),
            x,
            w,
            b,
            KernelArg::value(&r),
            KernelArg::value(&i),
            KernelArg::value(&o),
        ];
        launch(s, &self.linear, rows * n_out, &args)?;
        Ok(y)
    }

    /// The eager step on the current stream, allocating through the caching allocator.
    fn eager(
        &self,
        rt: &Arc<Runtime>,
        x: &DeviceBuffer<f32>,
        rows: usize,
    ) -> Result<DeviceBuffer<f32>, CallableError> {
        let s = rt.current_stream(DEV)?;
        self.step(&s, x.arg(), rows, &self.weight_args, |cols| {
            Ok(DeviceBuffer::uninit(rt, DEV, rows * cols)?)
        })
    }
}

/// The step wrapped by a tree: input 0 is the activation (`rows` × [`D`], padded to a
/// bucket), the others the weights (static).
fn wrap_step(trees: &Arc<Trees>, model: Arc<Model>) -> Result<Wrapped, CallableError> {
    let f = move |ctx: &mut Ctx<'_>, a: &[Arg]| -> Result<Vec<Out>, CallableError> {
        let [x, w @ ..] = a else {
            return Err("no activation input".into());
        };
        let rows = x.shape().dims().first().copied().unwrap_or(0);
        let weights: Vec<KernelArg<'static>> = w.iter().map(Arg::arg).collect();
        let ctx = &*ctx;
        let y = model.step(ctx.stream(), x.arg(), rows, &weights, |cols| {
            Ok(ctx.alloc(DType::F32, &[rows, cols])?)
        })?;
        Ok(vec![y])
    };
    let options = WrapOptions {
        name: "decode_step".into(),
        buckets: Some(Buckets::new(&BUCKETS)?),
        ..WrapOptions::default()
    };
    Ok(trees.wrap(f, options))
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// The batch size of each step: each group of four steps visits the four buckets in a
/// random order, with a random size inside each (so every bucket gets a quarter).
fn schedule(steps: usize) -> Vec<usize> {
    let r = random(2 * steps + 8, 7);
    let mut out = Vec::with_capacity(steps + 4);
    for chunk in r.chunks_exact(8) {
        let mut order: Vec<(usize, f32)> = (0..BUCKETS.len()).zip(chunk.iter().copied()).collect();
        order.sort_by(|a, b| a.1.total_cmp(&b.1));
        for ((b, _), u) in order.into_iter().zip(&chunk[4..]) {
            let lo = b.checked_sub(1).map_or(0, |p| BUCKETS[p]);
            let span = BUCKETS[b] - lo;
            let pick = ((u + 1.0) / 2.0 * span as f32) as usize;
            out.push(lo + 1 + pick.min(span - 1));
        }
    }
    out.truncate(steps);
    out
}

/// The GPU's runtime and caching allocators when there is a usable GPU, else a fake device
/// with the kernels' host twins (configured from the environment as the global one is).
fn runtime() -> Result<(Arc<Runtime>, Arc<DeviceAllocators>), CallableError> {
    let gpu = ferrocuda::runtime();
    if gpu.is_available() && gpu.driver().backend() == "cuda" {
        return Ok((gpu.clone(), ferrocuda::memory::allocators()?.clone()));
    }
    let why = if gpu.driver().backend() == "fake" {
        "FERROCUDA_BACKEND=fake".to_owned()
    } else {
        let e = gpu.driver().device_count().err();
        format!(
            "no usable GPU: {}",
            e.map_or("no device".into(), |e| e.to_string())
        )
    };
    println!("{why}: running on the fake device");
    let fake = FakeDriver::default();
    register_fake(&fake);
    let fake = Arc::new(fake);
    let rt = Runtime::new(fake.clone());
    let config = AllocatorConfig::from_env().map_err(|e| e.to_string())?;
    let caching = caching_from_env(|k| std::env::var(k)).map_err(|e| e.to_string())?;
    let allocators = DeviceAllocators::new(fake, config, caching);
    allocators.install(&rt);
    Ok((rt, allocators))
}

/// CPU time to enqueue a step and, on the GPU, the time between events around it.
struct Timer {
    rt: Arc<Runtime>,
    events: Option<(Event, Event)>,
}

impl Timer {
    fn new(rt: &Arc<Runtime>, on_gpu: bool) -> Result<Timer, CallableError> {
        let timing = EventFlags {
            timing: true,
            ..EventFlags::default()
        };
        let events = if on_gpu {
            Some((rt.new_event(timing)?, rt.new_event(timing)?))
        } else {
            None
        };
        Ok(Timer {
            rt: rt.clone(),
            events,
        })
    }

    /// Runs `f` between the events; its result and its CPU time in µs.
    fn time<T>(
        &self,
        f: impl FnOnce() -> Result<T, CallableError>,
    ) -> Result<(T, f64), CallableError> {
        let s = self.rt.current_stream(DEV)?;
        if let Some((start, _)) = &self.events {
            start.record(&s)?;
        }
        let t0 = Instant::now();
        let out = f()?;
        let cpu = t0.elapsed().as_secs_f64() * 1e6;
        if let Some((_, end)) = &self.events {
            end.record(&s)?;
        }
        Ok((out, cpu))
    }

    /// µs between the events of the last [`Timer::time`], once its results were read.
    fn gpu(&self) -> Result<Option<f64>, CallableError> {
        match &self.events {
            Some((start, end)) => Ok(Some(f64::from(start.elapsed_time(end)?) * 1e3)),
            None => Ok(None),
        }
    }
}

/// One step's figures.
#[derive(Debug)]
struct Sample {
    bucket: usize,
    served: Served,
    cpu: [f64; 2],
    gpu: [Option<f64>; 2],
    /// For a recording that was planned: the planned and the real bytes of the pool after it.
    planned: Option<(u64, u64)>,
}

/// The planner's view of the steps: the function each bucket warmed up and has not
/// recorded yet, planned before its next step.
#[derive(Default)]
struct Planner {
    warmed: std::collections::HashMap<usize, FunctionId>,
}

impl Planner {
    /// Before a step of `bucket`: the function it warmed up and the pool's bytes once
    /// that function is recorded, if it warmed one up.
    fn before(
        &self,
        trees: &Trees,
        bucket: usize,
    ) -> Result<Option<(FunctionId, u64)>, CallableError> {
        let Some(&fid) = self.warmed.get(&bucket) else {
            return Ok(None);
        };
        Ok(Some((fid, trees.plan(&[fid])?.reserved_bytes)))
    }

    /// After the step: remembers a warm-up's function; for the planned function's
    /// recording, the planned and the real bytes of the pool.
    fn after(
        &mut self,
        f: &Wrapped,
        allocators: &DeviceAllocators,
        bucket: usize,
        served: &Served,
        plan: Option<(FunctionId, u64)>,
    ) -> Result<Option<(u64, u64)>, CallableError> {
        let Some(&fid) = f.functions().first() else {
            return Ok(None);
        };
        match served {
            Served::Warmup => {
                self.warmed.insert(bucket, fid);
                Ok(None)
            }
            Served::Recorded => {
                self.warmed.remove(&bucket);
                let pool = f.trees().pool();
                let real = allocators.device(DEV)?.pool_reserved_bytes(pool);
                Ok(plan
                    .filter(|(p, _)| *p == fid)
                    .map(|(_, bytes)| (bytes, real)))
            }
            _ => Ok(None),
        }
    }
}

/// The first `want.len()` values of `got` have the bits of `want`, all finite.
fn same_bits(step: usize, want: &[f32], got: &[f32]) -> Result<(), CallableError> {
    let head = got.get(..want.len()).ok_or_else(|| {
        format!(
            "step {step}: trees gave {} values, eager {}",
            got.len(),
            want.len()
        )
    })?;
    if let Some(i) = (want.iter().zip(head)).position(|(a, b)| a.to_bits() != b.to_bits()) {
        return Err(format!(
            "step {step}: element {i} is {} through the trees, {} eagerly",
            head[i], want[i]
        )
        .into());
    }
    if let Some(i) = want.iter().position(|v| !v.is_finite()) {
        return Err(format!("step {step}: element {i} is {}", want[i]).into());
    }
    Ok(())
}

/// Runs each step eagerly, then through the trees, checks that they agree, and times both.
fn run_steps(
    rt: &Arc<Runtime>,
    allocators: &DeviceAllocators,
    model: &Model,
    f: &Wrapped,
    timer: &Timer,
    sizes: &[usize],
) -> Result<Vec<Sample>, CallableError> {
    let mut xs = Vec::with_capacity(sizes.len());
    for (i, &rows) in sizes.iter().enumerate() {
        let values = random(rows * D, i as u64);
        xs.push((rows, DeviceBuffer::from_slice(rt, DEV, &values)?));
    }
    rt.current_stream(DEV)?.synchronize()?;
    let Some((_, first)) = xs.first() else {
        return Ok(Vec::new());
    };
    let mut inputs = vec![Input::buffer(first)];
    inputs.extend(model.weights.iter().map(|w| Input::buffer(w).mark_static()));
    let trees = f.trees();
    let mut planner = Planner::default();
    let mut samples = Vec::with_capacity(xs.len());
    for (step, (rows, x)) in xs.iter().enumerate() {
        let bucket = (BUCKETS.iter().position(|&b| b >= *rows))
            .ok_or_else(|| format!("no bucket for {rows} rows"))?;
        let (out, eager_cpu) = timer.time(|| model.eager(rt, x, *rows))?;
        let want = out.to_host()?;
        let eager_gpu = timer.gpu()?;
        drop(out);
        inputs[0] = Input::shaped(x, &[*rows, D])?;
        let plan = planner.before(trees, bucket)?;
        let (call, trees_cpu) = timer.time(|| {
            trees.mark_step_begin();
            Ok(f.call(&inputs)?)
        })?;
        let got = (call.outputs.first().ok_or("the step has no output")?).to_host::<f32>()?;
        let trees_gpu = timer.gpu()?;
        same_bits(step, &want, &got)?;
        let planned = planner.after(f, allocators, bucket, &call.served, plan)?;
        samples.push(Sample {
            bucket,
            served: call.served,
            cpu: [eager_cpu, trees_cpu],
            gpu: [eager_gpu, trees_gpu],
            planned,
        });
    }
    Ok(samples)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// One row of the table over `samples`: medians over the steady steps (all but the
/// warm-up and the recording of each bucket; replays, or eager runs where the trees skip).
fn row(label: &str, samples: &[&Sample], on_gpu: bool) -> String {
    let count = |k: fn(&Served) -> bool| samples.iter().filter(|s| k(&s.served)).count();
    let steady: Vec<&&Sample> = (samples.iter())
        .filter(|s| !matches!(s.served, Served::Warmup | Served::Recorded))
        .collect();
    let cpu = |i: usize| median(steady.iter().map(|s| s.cpu[i]).collect());
    let gpu = |i: usize| median(steady.iter().filter_map(|s| s.gpu[i]).collect());
    let mut line = format!(
        "{label:>6} {:>6} {:>7} {:>5} {:>7} {:>7} | {:>9.1} {:>9.1} {:>7.1}x",
        samples.len(),
        count(|s| *s == Served::Warmup),
        count(|s| *s == Served::Recorded),
        count(|s| *s == Served::Replayed),
        count(|s| matches!(s, Served::Eager(_))),
        cpu(0),
        cpu(1),
        cpu(0) / cpu(1),
    );
    if on_gpu {
        line += &format!(
            " | {:>9.1} {:>9.1} {:>7.1}x",
            gpu(0),
            gpu(1),
            gpu(0) / gpu(1)
        );
    }
    line
}

/// The table: per bucket and overall.
fn report(samples: &[Sample], on_gpu: bool) {
    let mut header = format!(
        "{:>6} {:>6} {:>7} {:>5} {:>7} {:>7} | {:>9} {:>9} {:>8}",
        "bucket",
        "steps",
        "warm-up",
        "rec",
        "replays",
        "skipped",
        "CPU eager",
        "CPU trees",
        "speedup"
    );
    if on_gpu {
        header += &format!(" | {:>9} {:>9} {:>8}", "GPU eager", "GPU trees", "speedup");
    }
    println!("{header}");
    for (b, size) in BUCKETS.iter().enumerate() {
        let of: Vec<&Sample> = samples.iter().filter(|s| s.bucket == b).collect();
        println!("{}", row(&size.to_string(), &of, on_gpu));
    }
    let all: Vec<&Sample> = samples.iter().collect();
    println!("{}", row("all", &all, on_gpu));
    let first: Vec<&Sample> = (samples.iter())
        .filter(|s| matches!(s.served, Served::Warmup | Served::Recorded))
        .collect();
    let total = |i: usize| first.iter().map(|s| s.cpu[i]).sum::<f64>() / 1e3;
    println!(
        "first calls (warm-up and recording of each bucket, {} steps): {:.2} ms CPU through the trees, {:.2} ms eagerly",
        first.len(),
        total(1),
        total(0)
    );
}

/// Every recording planned before it ran left the pool with the planned bytes.
fn check_plans(samples: &[Sample]) -> Result<(), CallableError> {
    let plans: Vec<(usize, (u64, u64))> = (samples.iter().enumerate())
        .filter_map(|(i, s)| s.planned.map(|p| (i, p)))
        .collect();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    for &(step, (planned, real)) in &plans {
        if planned != real {
            return Err(format!(
                "step {step}: the planner said the pool would reserve {planned} bytes after this recording, it reserves {real}"
            )
            .into());
        }
    }
    let Some(&(_, (_, last))) = plans.last() else {
        return Err("no recording was planned before it ran".into());
    };
    println!(
        "planner: {} recordings planned before they ran (Trees::plan), the pool after each equal to its plan ({:.1} MiB after the last)",
        plans.len(),
        mib(last)
    );
    Ok(())
}

fn main() -> ExitCode {
    match decode() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode: {e}");
            ExitCode::FAILURE
        }
    }
}

fn decode() -> Result<(), CallableError> {
    let (rt, allocators) = runtime()?;
    let on_gpu = rt.driver().backend() == "cuda";
    let steps = match std::env::args().nth(1) {
        Some(s) => s
            .parse::<usize>()
            .map_err(|e| format!("steps {s:?}: {e}"))?,
        None if on_gpu => 400,
        None => 48,
    };
    if steps < 12 {
        return Err(format!("{steps} steps: at least 12 (3 per bucket) are needed").into());
    }
    let props = rt.device_properties(DEV)?;
    println!(
        "backend: {} | cuda:0 = {}",
        rt.driver().backend(),
        props.name
    );
    let model = Arc::new(Model::new(&rt)?);
    let trees = Trees::new(rt.clone(), allocators.clone(), DEV, TreeConfig::default())?;
    let f = wrap_step(&trees, model.clone())?;
    println!(
        "step: {LAYERS} layers x (rmsnorm, linear {D}->{F}, silu, linear {F}->{D}, residual add) + rmsnorm + linear {D}->{V} = {} kernels; {} weights as static inputs",
        LAYERS * PER_LAYER + 2,
        WEIGHTS
    );
    println!(
        "{steps} steps of 1 to {} rows (padded to buckets {BUCKETS:?} by the trees), each run eagerly, then through the trees (mark_step_begin, call); times are medians in µs per step over the steps after each bucket's warm-up and recording",
        BUCKETS[BUCKETS.len() - 1]
    );
    let timer = Timer::new(&rt, on_gpu)?;
    let samples = run_steps(&rt, &allocators, &model, &f, &timer, &schedule(steps))?;
    report(&samples, on_gpu);
    check_plans(&samples)?;
    if !on_gpu {
        println!(
            "(on the fake device each kernel runs on the host as it is launched: these CPU times are mostly kernel time, and the rows the trees pad cost real work; the launch overhead that graphs save shows on the GPU)"
        );
    }
    let stats = trees.stats();
    println!(
        "trees: {} warm-ups, {} recordings, {} replays, {} eager calls, {} recorded nodes",
        stats.warmups,
        stats.recordings,
        stats.replays,
        stats.eager_calls,
        trees.nodes().len()
    );
    // One `NewShape` per bucket is expected; anything else (a skip, a warning) is news.
    for event in trees.take_events() {
        if !matches!(event, TreeEvent::NewShape { .. }) {
            println!("  event: {event:?}");
        }
    }
    println!(
        "outputs: eager and trees bitwise equal on all {} steps",
        samples.len()
    );
    let place = if on_gpu { "the GPU" } else { "the fake device" };
    println!("decode done on {place}");
    Ok(())
}
