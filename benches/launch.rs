//! Eager launch of a tiny kernel: through `Stream::launch` vs a raw cudarc
//! `result::launch_kernel`, same kernel, same process, one run. Prints the ratios.
//!
//! Needs a GPU. Without one it says it was skipped, and fails when `FERROCUDA_REQUIRE_GPU=1`
//! (the GPU bundle sets it).
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

use criterion::{Criterion, criterion_group};
use ferrocuda::driver::{CudaDriver, Driver, RawLaunch};
use ferrocuda::stream::{DeviceBuffer, Function, Module, Runtime, Stream};
use ferrocuda::types::{DeviceIndex, LaunchConfig};
use ferrocuda_testkit::KERNELS;
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEV: DeviceIndex = DeviceIndex(0);

/// Everything both paths launch with: the same kernel, buffer and configuration.
struct Setup {
    driver: Arc<CudaDriver>,
    tiny: Function,
    x: DeviceBuffer<f32>,
    stream: Stream,
    config: LaunchConfig,
    raw: RawLaunch,
}

impl Setup {
    fn new() -> Option<Setup> {
        let driver = Arc::new(CudaDriver::new());
        if let Some(reason) = driver.unavailable_reason() {
            eprintln!("launch bench skipped: no usable GPU ({reason})");
            if std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                std::process::exit(1);
            }
            return None;
        }
        let rt = Runtime::new(driver.clone());
        let module = Module::from_cuda_source(&rt, DEV, "bench", KERNELS).expect("compile");
        let tiny = module.function("tiny").expect("tiny kernel");
        let x = DeviceBuffer::<f32>::filled(&rt, DEV, 1, 0.0).expect("buffer");
        let stream = rt.new_stream(DEV, 0).expect("stream");
        let config = LaunchConfig {
            grid: (1, 1, 1),
            block: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let image = driver
            .compile_source(DEV, KERNELS, "bench_raw")
            .expect("compile raw");
        let raw = RawLaunch::new(driver.clone(), DEV, &image, "tiny", config, &[x.ptr().0])
            .expect("raw launch");
        Some(Setup {
            driver,
            tiny,
            x,
            stream,
            config,
            raw,
        })
    }

    fn ours(&self) {
        self.stream
            .launch(&self.tiny, &self.config, &[self.x.arg()])
            .expect("launch");
    }

    fn raw(&mut self) {
        self.raw.launch().expect("raw launch");
    }

    fn sync(&self) {
        self.stream.synchronize().expect("sync");
        self.driver
            .stream_synchronize(self.raw.stream())
            .expect("sync");
    }
}

fn launch_overhead(c: &mut Criterion) {
    let Some(mut s) = Setup::new() else { return };
    let mut group = c.benchmark_group("launch");
    group.bench_function("raw_cudarc", |b| b.iter(|| s.raw()));
    s.sync();
    group.bench_function("ferrocuda_stream", |b| b.iter(|| s.ours()));
    s.sync();
    group.finish();
}

/// Criterion measures the two one after the other, so drift between them lands in its
/// ratio. Here they alternate: 20 rounds of 20 000 launches each (synchronized before the
/// clock stops), the order flipped every round; the median of the per-round ratios.
fn interleaved_ratio() {
    let Some(mut s) = Setup::new() else { return };
    let n = 20_000;
    let time = |s: &mut Setup, ours: bool| {
        let t = Instant::now();
        for _ in 0..n {
            if ours { s.ours() } else { s.raw() }
        }
        s.sync();
        t.elapsed().as_secs_f64()
    };
    let mut ratios: Vec<f64> = (0..20)
        .map(|round| {
            let (a, b) = if round % 2 == 0 {
                let raw = time(&mut s, false);
                (time(&mut s, true), raw)
            } else {
                let ours = time(&mut s, true);
                (ours, time(&mut s, false))
            };
            a / b
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    println!(
        "launch overhead (interleaved, 20 rounds x {n}): median ratio {:.3}, range {:.3}..{:.3} (target <= 1.05)",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1]
    );
}

/// Reads criterion's `statistic` ("median" or "mean") for `launch/<name>`, in nanoseconds.
fn estimate_ns(name: &str, statistic: &str) -> Option<f64> {
    let home = std::env::var("CRITERION_HOME").unwrap_or_else(|_| "target/criterion".into());
    let path = std::path::Path::new(&home)
        .join("launch")
        .join(name)
        .join("new/estimates.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    json[statistic]["point_estimate"].as_f64()
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .sample_size(40);
    targets = launch_overhead
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    for statistic in ["median", "mean"] {
        if let (Some(ours), Some(raw)) = (
            estimate_ns("ferrocuda_stream", statistic),
            estimate_ns("raw_cudarc", statistic),
        ) {
            println!(
                "launch overhead ({statistic}, sequential): ferrocuda Stream::launch {ours:.1} ns, raw cudarc launch_kernel {raw:.1} ns, ratio {:.3} (target <= 1.05)",
                ours / raw
            );
        }
    }
    interleaved_ratio();
}
