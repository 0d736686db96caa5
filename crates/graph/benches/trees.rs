//! CPU cost of a steady-state call of a wrapped 10-kernel function (a replay: signature
//! lookup, tree bookkeeping, invariant checks, output handles, `cuGraphLaunch`) against a
//! bare replay of the same 10 kernels captured in a `CudaGraph` (`cuGraphLaunch` and one
//! lock), same process, interleaved, median of 21 rounds. Target: at most 2 us over the
//! bare launch (PyTorch's reduce-overhead: about 40 us). Two calls are measured: with a
//! static input (no copy), and with one non-static input (one 4-byte copy enqueued).
//!
//! On the GPU bundle it runs over the real driver (required there: `FERROCUDA_REQUIRE_GPU=1`);
//! elsewhere over the fake device, where the launch itself costs what the fake's does.
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

use criterion::{Criterion, criterion_group};
use ferrocuda_alloc::DeviceAllocators;
use ferrocuda_driver::{CudaDriver, Driver, FakeDriver};
use ferrocuda_graph::CudaGraph;
use ferrocuda_graph::trees::{Arg, Ctx, Input, TreeConfig, Trees, WrapOptions, Wrapped};
use ferrocuda_stream::conformance::{KERNELS, register_fake_kernels};
use ferrocuda_stream::{DeviceBuffer, Function, Module, Runtime, Stream};
use ferrocuda_types::{AllocatorConfig, CaptureMode, DeviceIndex, KernelArg, LaunchConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEV: DeviceIndex = DeviceIndex(0);
const KERNELS_PER_CALL: usize = 10;
const CONFIG: LaunchConfig = LaunchConfig {
    grid: (1, 1, 1),
    block: (32, 1, 1),
    shared_mem_bytes: 0,
};

fn driver() -> Arc<dyn Driver> {
    let cuda = CudaDriver::new();
    match cuda.unavailable_reason() {
        None => Arc::new(cuda),
        Some(reason) => {
            if std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                eprintln!("trees bench: no usable GPU ({reason})");
                std::process::exit(1);
            }
            eprintln!("trees bench: no GPU ({reason}); measuring over the fake device");
            let fake = FakeDriver::default();
            register_fake_kernels(&fake);
            Arc::new(fake)
        }
    }
}

struct Setup {
    rt: Arc<Runtime>,
    stream: Stream,
    bare: CudaGraph,
    trees: Arc<Trees>,
    wrapped: Wrapped,
    x: DeviceBuffer<f32>,
    _allocators: Arc<DeviceAllocators>,
}

fn ten_tiny(stream: &Stream, tiny: &Function, x: KernelArg<'_>) {
    for _ in 0..KERNELS_PER_CALL {
        stream.launch(tiny, &CONFIG, &[x]).expect("launch");
    }
}

impl Setup {
    fn new() -> Setup {
        let driver = driver();
        let rt = Runtime::new(driver.clone());
        let allocators = DeviceAllocators::new(driver, AllocatorConfig::default(), true);
        allocators.install(&rt);
        let module = Module::from_cuda_source(&rt, DEV, "trees_bench", KERNELS).expect("compile");
        let tiny = module.function("tiny").expect("tiny kernel");
        let x = DeviceBuffer::<f32>::filled(&rt, DEV, 1, 0.0).expect("buffer");
        let stream = rt.new_stream(DEV, 0).expect("stream");
        let _current = rt.stream_guard(&stream).expect("current stream");
        let bare = CudaGraph::new(rt.clone(), allocators.clone(), DEV).expect("graph");
        let capture = bare
            .capture(Some(&stream), None, CaptureMode::ThreadLocal)
            .expect("capture");
        ten_tiny(&stream, &tiny, x.arg());
        capture.end().expect("capture end");
        let trees =
            Trees::new(rt.clone(), allocators.clone(), DEV, TreeConfig::default()).expect("trees");
        let wrapped = trees.wrap(
            move |ctx: &mut Ctx<'_>, a: &[Arg]| {
                ten_tiny(ctx.stream(), &tiny, a[0].arg());
                Ok(vec![ctx.alloc_shape(a[0].dtype(), a[0].shape())?])
            },
            WrapOptions {
                name: "ten_kernels".into(),
                ..WrapOptions::default()
            },
        );
        drop(_current);
        Setup {
            rt,
            stream,
            bare,
            trees,
            wrapped,
            x,
            _allocators: allocators,
        }
    }

    /// One steady-state step: a new step, the call, its outputs dropped.
    fn call(&self, copied: bool) {
        self.trees.mark_step_begin();
        let input = if copied {
            Input::buffer(&self.x)
        } else {
            Input::buffer(&self.x).mark_static()
        };
        drop(self.wrapped.call(&[input]).expect("call"));
    }
}

/// Median over 21 rounds (order alternating) of (ours − bare, ours, bare), CPU seconds per
/// call.
fn median_overhead(s: &Setup, copied: bool) -> (f64, f64, f64) {
    let (batches, per_batch) = (20, 100);
    let round = |tree: bool| {
        let mut cpu = Duration::ZERO;
        for _ in 0..batches {
            s.rt.synchronize(DEV).expect("sync");
            let t = Instant::now();
            for _ in 0..per_batch {
                if tree {
                    s.call(copied);
                } else {
                    s.bare.replay(&s.stream).expect("replay");
                }
            }
            cpu += t.elapsed();
        }
        cpu.as_secs_f64() / (batches * per_batch) as f64
    };
    let mut rows: Vec<(f64, f64, f64)> = (0..21)
        .map(|i| {
            let (o, b) = if i % 2 == 0 {
                let b = round(false);
                (round(true), b)
            } else {
                let o = round(true);
                (o, round(false))
            };
            (o - b, o, b)
        })
        .collect();
    rows.sort_by(|a, b| a.0.total_cmp(&b.0));
    rows[rows.len() / 2]
}

fn trees_bench(c: &mut Criterion) {
    let s = Setup::new();
    let _current = s.rt.stream_guard(&s.stream).expect("current stream");
    for _ in 0..3 {
        s.call(false);
        s.call(true);
    }
    let mut g = c.benchmark_group("trees");
    g.bench_function("bare_replay_10_kernels", |b| {
        b.iter(|| s.bare.replay(&s.stream).expect("replay"))
    });
    g.bench_function("wrapped_call_10_kernels_static", |b| {
        b.iter(|| s.call(false))
    });
    g.bench_function("wrapped_call_10_kernels_copied", |b| {
        b.iter(|| s.call(true))
    });
    g.finish();
    for (copied, what) in [(false, "static input"), (true, "one copied input")] {
        let (over, ours, bare) = median_overhead(&s, copied);
        println!(
            "trees: wrapped {KERNELS_PER_CALL}-kernel call ({what}) {:.2} us CPU, bare replay {:.2} us, over bare {:.2} us (target <= 2 us; interleaved, median of 21)",
            ours * 1e6,
            bare * 1e6,
            over * 1e6
        );
    }
    let stats = s.trees.stats();
    assert!(stats.replays > 0 && stats.recordings == 2, "{stats:?}");
}

criterion_group!(benches, trees_bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
