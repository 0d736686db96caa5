//! CPU time of one mixed-precision iteration's optimizer step, three ways, over AdamW on
//! 200 f32 parameters (100 × 64 Ki + 100 × 4 Ki elements) with f32 gradients:
//! - `pytorch_eager`: PyTorch's sequence (`unscale_`, `step` with its host read of
//!   `found_inf`, `update`), one stream sync per iteration;
//! - `sync_free_eager`: [`ScaledStep::run`] (zero found_inf, unscale and check, AdamW's
//!   self-skipping step, scale update), nothing read back;
//! - `captured`: the same captured once into a CUDA graph and replayed.
//!
//! The sync-free ways are timed in batches of 50 iterations whose enqueue alone is timed
//! (each batch then drains untimed), so the figure is CPU time, not GPU time; PyTorch's way
//! waits for the GPU every iteration, which is its cost. On the GPU bundle it runs over the
//! real driver (required there: `FERROCUDA_REQUIRE_GPU=1`); elsewhere over the fake device,
//! whose kernels run on the host as they are enqueued (its figures say nothing).
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

use criterion::{Criterion, criterion_group};
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_amp::optim::{AdamW, AdamWConfig, Param, register_fake_optim_kernels};
use ferrocuda_amp::scaler::{OptimizerId, register_fake_amp_kernels};
use ferrocuda_amp::{GradScaler, GradScalerConfig, ScaledStep, TensorView};
use ferrocuda_driver::{CudaDriver, Driver, FakeDriver};
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::{DeviceBuffer, Runtime, Stream};
use ferrocuda_types::{AllocatorConfig, DeviceIndex};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEV: DeviceIndex = DeviceIndex(0);
const BATCH: u64 = 50;

fn driver() -> Arc<dyn Driver> {
    let cuda = CudaDriver::new();
    match cuda.unavailable_reason() {
        None => Arc::new(cuda),
        Some(reason) => {
            if std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                eprintln!("step bench: no usable GPU ({reason})");
                std::process::exit(1);
            }
            eprintln!("step bench: no GPU ({reason}); running over the fake device");
            let fake = FakeDriver::default();
            register_fake_amp_kernels(&fake);
            register_fake_optim_kernels(&fake);
            Arc::new(fake)
        }
    }
}

/// Parameters and gradients: 100 × 64 Ki and 100 × 4 Ki f32 elements.
fn model(rt: &Arc<Runtime>) -> (Vec<DeviceBuffer<f32>>, Vec<Param>) {
    let lens = std::iter::repeat_n(64 << 10, 100).chain(std::iter::repeat_n(4096, 100));
    let mut buffers = Vec::new();
    let mut params = Vec::new();
    for len in lens {
        let p = DeviceBuffer::filled(rt, DEV, len, 1.0f32).expect("param");
        let g = DeviceBuffer::filled(rt, DEV, len, 0.5f32).expect("grad");
        params.push(Param {
            param: TensorView::of(&p),
            grad: TensorView::of(&g),
        });
        buffers.extend([p, g]);
    }
    (buffers, params)
}

fn scaled_step(rt: &Arc<Runtime>, params: &[Param], stream: &Stream) -> ScaledStep<AdamW> {
    let scaler = GradScaler::new(rt, DEV, GradScalerConfig::default()).expect("scaler");
    let adamw = AdamW::new(rt, params, AdamWConfig::default()).expect("adamw");
    let grads = params.iter().map(|p| p.grad).collect();
    ScaledStep::new(scaler, adamw, grads, stream).expect("step")
}

/// Time to enqueue `iters` calls of `f`, in batches of [`BATCH`] drained untimed.
fn enqueue_time(stream: &Stream, iters: u64, mut f: impl FnMut()) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BATCH);
        let t = Instant::now();
        (0..n).for_each(|_| f());
        total += t.elapsed();
        stream.synchronize().expect("sync");
        left -= n;
    }
    total
}

fn step(c: &mut Criterion) {
    let rt = Runtime::new(driver());
    let allocators =
        DeviceAllocators::new(rt.driver().clone(), AllocatorConfig::default(), Caching::On);
    allocators.install(&rt);
    let stream = rt.current_stream(DEV).expect("stream");
    let (_buffers, params) = model(&rt);
    let grads: Vec<TensorView> = params.iter().map(|p| p.grad).collect();
    let mut g = c.benchmark_group("step");

    let mut scaler = GradScaler::new(&rt, DEV, GradScalerConfig::default()).expect("scaler");
    let mut adamw = AdamW::new(&rt, &params, AdamWConfig::default()).expect("adamw");
    // `scale(loss)` would make the state first (PyTorch's lazy init).
    scaler.device_state().expect("state");
    let id = OptimizerId::fresh();
    g.bench_function("pytorch_eager", |b| {
        b.iter(|| {
            use ferrocuda_amp::optim::DeviceOptimizer;
            scaler.unscale(id, &grads).expect("unscale_");
            scaler
                .step(id, &grads, || adamw.step(&stream, None).expect("adamw"))
                .expect("step");
            scaler.update().expect("update");
        })
    });

    let mut eager = scaled_step(&rt, &params, &stream);
    g.bench_function("sync_free_eager", |b| {
        b.iter_custom(|iters| enqueue_time(&stream, iters, || eager.run(&stream).expect("run")))
    });

    let mut captured = scaled_step(&rt, &params, &stream);
    stream.synchronize().expect("sync");
    let graph = CudaGraph::new(rt.clone(), allocators.clone(), DEV).expect("graph");
    let capture = graph
        .capture(None, None, CaptureMode::ThreadLocal)
        .expect("capture");
    captured.run(capture.stream()).expect("captured run");
    capture.end().expect("end");
    g.bench_function("captured", |b| {
        b.iter_custom(|iters| {
            enqueue_time(&stream, iters, || graph.replay(&stream).expect("replay"))
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    targets = step
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
