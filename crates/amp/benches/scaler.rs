//! The scaler's non-finite check + unscale over 200 × 1 Mi + 200 × 4 Ki gradients (the issue's
//! figure), for fp32, fp16 and bf16, against a plain device-to-device copy of the same bytes
//! in the same run: both read and write every byte once, so the copy's time over the
//! kernel's is the fraction of copy bandwidth the kernel reaches (target ≥ 92%; PyTorch's
//! fp32 kernel reaches 79%). Printed as `scaler: <dtype> ... % of copy` after criterion's
//! own figures.
//!
//! On the GPU bundle it runs over the real driver (required there: `FERROCUDA_REQUIRE_GPU=1`);
//! elsewhere over the fake device with 8 × 64 Ki + 8 × 4 Ki elements, so that CI runs it
//! quickly (its figures then say nothing about speed).
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

use criterion::{Criterion, Throughput, criterion_group};
use ferrocuda_amp::scaler::register_fake_amp_kernels;
use ferrocuda_amp::{GradScaler, GradScalerConfig, TensorView};
use ferrocuda_driver::{CudaDriver, Driver, FakeDriver};
use ferrocuda_stream::{DeviceBuffer, Runtime, Stream};
use ferrocuda_types::{DType, DeviceIndex};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEV: DeviceIndex = DeviceIndex(0);

/// The driver, and whether it is the fake one.
fn driver() -> (Arc<dyn Driver>, bool) {
    let cuda = CudaDriver::new();
    match cuda.unavailable_reason() {
        None => (Arc::new(cuda), false),
        Some(reason) => {
            if std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                eprintln!("scaler bench: no usable GPU ({reason})");
                std::process::exit(1);
            }
            eprintln!("scaler bench: no GPU ({reason}); running over the fake device");
            let fake = FakeDriver::default();
            register_fake_amp_kernels(&fake);
            (Arc::new(fake), true)
        }
    }
}

/// One gradient list of `dtype`: `large` × `large_len` and `small` × 4 Ki elements.
struct Grads {
    _buffers: Vec<DeviceBuffer<u8>>,
    views: Vec<TensorView>,
    bytes: u64,
}

fn grads(rt: &Arc<Runtime>, dtype: DType, large: usize, large_len: u64) -> Grads {
    let lens = std::iter::repeat_n(large_len, large).chain(std::iter::repeat_n(4096, large));
    let mut buffers = Vec::new();
    let mut views = Vec::new();
    for len in lens {
        let bytes = len as usize * dtype.size();
        // 0x3c00 / 0x3f80 / 0x3f80_0000 patterns: every element finite.
        let buf = DeviceBuffer::<u8>::filled(rt, DEV, bytes, 0x3c).expect("gradient");
        views.push(TensorView {
            device: DEV,
            ptr: buf.ptr(),
            len,
            dtype,
        });
        buffers.push(buf);
    }
    let bytes = views.iter().map(TensorView::bytes).sum();
    Grads {
        _buffers: buffers,
        views,
        bytes,
    }
}

/// Seconds per call of `f`, the best of `rounds` batches of `reps` (after one warm-up call).
fn seconds(stream: &Stream, rounds: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    stream.synchronize().expect("sync");
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            stream.synchronize().expect("sync");
            t.elapsed().as_secs_f64() / reps as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn unscale(c: &mut Criterion) {
    let (driver, fake) = driver();
    let rt = Runtime::new(driver);
    let (large, large_len) = if fake { (8, 64 << 10) } else { (200, 1 << 20) };
    let stream = rt.current_stream(DEV).expect("stream");
    let config = GradScalerConfig {
        init_scale: 2.0,
        ..GradScalerConfig::default()
    };
    let mut scaler = GradScaler::new(&rt, DEV, config).expect("scaler");
    let state = scaler.device_state().expect("state").expect("enabled");
    let (found_inf, inv_scale) = (state.found_inf(), state.inv_scale());
    let mut summary = Vec::new();
    let mut g = c.benchmark_group("scaler");
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let list = grads(&rt, dtype, large, large_len);
        let src = DeviceBuffer::<u8>::filled(&rt, DEV, list.bytes as usize, 1).expect("src");
        let dst = DeviceBuffer::<u8>::uninit(&rt, DEV, list.bytes as usize).expect("dst");
        let mut run = || {
            scaler
                .foreach_non_finite_check_and_unscale(&stream, &list.views, found_inf, inv_scale)
                .expect("unscale");
        };
        let copy = || dst.copy_from(&src).expect("copy");
        let (rounds, reps) = if fake { (2, 2) } else { (10, 20) };
        let t_copy = seconds(&stream, rounds, reps, copy);
        let t_unscale = seconds(&stream, rounds, reps, &mut run);
        summary.push((dtype, list.bytes, t_copy, t_unscale));
        g.throughput(Throughput::Bytes(2 * list.bytes));
        g.bench_function(format!("check_unscale_{dtype:?}"), |b| {
            b.iter(|| {
                run();
                stream.synchronize().expect("sync");
            })
        });
        g.bench_function(format!("copy_{dtype:?}"), |b| {
            b.iter(|| {
                copy();
                stream.synchronize().expect("sync");
            })
        });
    }
    g.finish();
    for (dtype, bytes, t_copy, t_unscale) in summary {
        let gbs = |t: f64| 2.0 * bytes as f64 / t / 1e9;
        eprintln!(
            "scaler: {dtype:?} check+unscale of {large} x {large_len} + {large} x 4096 elements \
             ({bytes} bytes): {:.1} GB/s vs copy {:.1} GB/s = {:.1}% of copy{}",
            gbs(t_unscale),
            gbs(t_copy),
            100.0 * t_copy / t_unscale,
            if fake { " (fake device)" } else { "" }
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(10);
    targets = unscale
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
