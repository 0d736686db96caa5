//! CUDA graph replay: a `CudaGraph` captured through `Stream::launch` vs the same kernels
//! captured and launched with bare driver calls (`RawLaunch::capture_chain`), same process,
//! one run, interleaved. Prints:
//! - the GPU time per kernel of a 1000-kernel chain replay, ours over raw (target <= 1.02);
//! - the CPU cost of one replay of a 10-node graph, and of a graphed-callable call (input
//!   check, order check, replay), over bare `cuGraphLaunch` (target: <= 1.5 us more);
//! - feeding new inputs to a graph of 8 kernels over 1 MiB inputs: `update_inputs` (pointer
//!   patching) + replay vs copying into the static inputs + replay, per step.
//!
//! Needs a GPU. Without one it says it was skipped, and fails when `FERROCUDA_REQUIRE_GPU=1`
//! (the GPU bundle sets it).
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

use criterion::{Criterion, criterion_group};
use ferrocuda::alloc::{Caching, DeviceAllocators};
use ferrocuda::driver::{CudaDriver, Driver, RawGraph, RawLaunch};
use ferrocuda::graph::{
    Callable, CaptureMode, CudaGraph, GraphedCallables, GraphedOptions, make_graphed_callables,
};
use ferrocuda::stream::{DeviceBuffer, Function, Module, Runtime, Stream};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use ferrocuda_testkit::KERNELS;
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEV: DeviceIndex = DeviceIndex(0);
const CHAIN: usize = 1000;
const SMALL: usize = 10;

struct Setup {
    rt: Arc<Runtime>,
    allocators: Arc<DeviceAllocators>,
    scale: Function,
    /// The kernel and the buffer the graphs launch with: alive as long as the graphs.
    _tiny: Function,
    _x: DeviceBuffer<f32>,
    stream: Stream,
    raw: RawLaunch,
    chain: (CudaGraph, RawGraph),
    small: (CudaGraph, RawGraph),
    graphed: GraphedCallables<f32>,
}

const CONFIG: LaunchConfig = LaunchConfig {
    grid: (1, 1, 1),
    block: (32, 1, 1),
    shared_mem_bytes: 0,
};

impl Setup {
    fn new() -> Option<Setup> {
        let driver = Arc::new(CudaDriver::new());
        if let Some(reason) = driver.unavailable_reason() {
            eprintln!("graph bench skipped: no usable GPU ({reason})");
            if std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                std::process::exit(1);
            }
            return None;
        }
        let rt = Runtime::new(driver.clone());
        let allocators =
            DeviceAllocators::new(driver.clone(), AllocatorConfig::default(), Caching::On);
        allocators.install(&rt);
        let module = Module::from_cuda_source(&rt, DEV, "bench", KERNELS).expect("compile");
        let tiny = module.function("tiny").expect("tiny kernel");
        let scale = module.function("scale_f32").expect("scale kernel");
        let x = DeviceBuffer::<f32>::filled(&rt, DEV, 1, 0.0).expect("buffer");
        let stream = rt.new_stream(DEV, 0).expect("stream");
        let image = driver
            .compile_source(DEV, KERNELS, "bench_raw")
            .expect("compile raw");
        let mut raw = RawLaunch::new(driver.clone(), DEV, &image, "tiny", CONFIG, &[x.ptr().0])
            .expect("raw launch");
        let captured = |n: usize| {
            let g = CudaGraph::new(rt.clone(), allocators.clone(), DEV).expect("graph");
            let capture = g
                .capture(Some(&stream), None, CaptureMode::ThreadLocal)
                .expect("capture");
            for _ in 0..n {
                stream.launch(&tiny, &CONFIG, &[x.arg()]).expect("launch");
            }
            capture.end().expect("capture end");
            g
        };
        let chain = (
            captured(CHAIN),
            raw.capture_chain(CHAIN).expect("raw chain"),
        );
        let small = (
            captured(SMALL),
            raw.capture_chain(SMALL).expect("raw small"),
        );
        let ten_launches: Callable<'_, f32> = Box::new(|inputs| {
            let s = rt.current_stream(DEV)?;
            for _ in 0..SMALL {
                s.launch(&tiny, &CONFIG, &[inputs[0].arg()])?;
            }
            Ok(vec![])
        });
        let sample = DeviceBuffer::<f32>::filled(&rt, DEV, 1, 0.0).expect("buffer");
        let graphed = make_graphed_callables(
            &rt,
            &allocators,
            DEV,
            vec![ten_launches],
            vec![vec![sample]],
            GraphedOptions::default(),
        )
        .expect("graphed callable");
        Some(Setup {
            rt,
            allocators,
            scale,
            _tiny: tiny,
            _x: x,
            stream,
            raw,
            chain,
            small,
            graphed,
        })
    }

    fn sync(&self) {
        self.stream.synchronize().expect("sync");
        let raw_stream = self.raw.stream();
        self.rt
            .driver()
            .stream_synchronize(raw_stream)
            .expect("sync");
        self.rt.synchronize(DEV).expect("sync");
    }
}

/// Which replay path a measurement takes.
#[derive(Clone, Copy)]
enum Path {
    Ours,
    Raw,
    Graphed,
}

impl Setup {
    fn replay(&self, large: bool, path: Path) {
        let (g, raw) = if large { &self.chain } else { &self.small };
        match path {
            Path::Ours => g.replay(&self.stream).expect("replay"),
            Path::Raw => self.raw.launch_graph(raw).expect("raw launch"),
            Path::Graphed => {
                let input = &self.graphed.inputs(0).expect("inputs")[0];
                self.graphed.call(0, &[input]).expect("call");
            }
        }
    }
}

/// Median over 21 rounds (order alternating) of ours / raw.
fn median_ratio(mut round: impl FnMut(Path) -> f64, ours: Path) -> (f64, f64, f64) {
    let mut rows: Vec<(f64, f64, f64)> = (0..21)
        .map(|i| {
            let (o, r) = if i % 2 == 0 {
                let r = round(Path::Raw);
                (round(ours), r)
            } else {
                let o = round(ours);
                (o, round(Path::Raw))
            };
            (o / r, o, r)
        })
        .collect();
    rows.sort_by(|a, b| a.0.total_cmp(&b.0));
    rows[rows.len() / 2]
}

fn chain_replay(s: &Setup) {
    let replays = 20;
    let (ratio, ours, raw) = median_ratio(
        |path| {
            s.sync();
            let t = Instant::now();
            for _ in 0..replays {
                s.replay(true, path);
            }
            s.sync();
            t.elapsed().as_secs_f64() / (replays * CHAIN) as f64
        },
        Path::Ours,
    );
    println!(
        "graph replay, {CHAIN}-kernel chain (GPU time per kernel, interleaved, median of 21): ferrocuda {:.3} us, raw cuGraphLaunch {:.3} us, ratio {ratio:.3} (target <= 1.02)",
        ours * 1e6,
        raw * 1e6
    );
}

fn small_replay_cpu(s: &Setup, path: Path, what: &str) {
    let (batches, per_batch) = (50, 100);
    let (ratio, ours, raw) = median_ratio(
        |path| {
            let mut cpu = Duration::ZERO;
            for _ in 0..batches {
                let t = Instant::now();
                for _ in 0..per_batch {
                    s.replay(false, path);
                }
                cpu += t.elapsed();
                s.sync();
            }
            cpu.as_secs_f64() / (batches * per_batch) as f64
        },
        path,
    );
    println!(
        "{what}, {SMALL}-node graph (CPU time per call, interleaved, median of 21): ferrocuda {:.3} us, raw cuGraphLaunch {:.3} us, {:+.3} us more, ratio {ratio:.3} (target <= +1.5 us)",
        ours * 1e6,
        raw * 1e6,
        (ours - raw) * 1e6
    );
}

/// Per step: new inputs reach the graph by pointer patching or by copying, then it replays.
/// The inputs alternate between two sets of buffers; the patched graph keeps `keep`
/// instances (`CudaGraph::keep_instances`: with 1 each step updates it, with 2 each set
/// has its own instance after the first two steps).
fn patch_vs_copy(s: &Setup, keep: usize) {
    const INPUTS: usize = 8;
    const LEN: usize = 1 << 18; // 1 MiB of f32
    let buffers = |v: f32| -> Vec<DeviceBuffer<f32>> {
        (0..INPUTS)
            .map(|_| DeviceBuffer::filled(&s.rt, DEV, LEN, v).expect("buffer"))
            .collect()
    };
    let (statics, outputs, a, b) = (buffers(0.0), buffers(0.0), buffers(1.0), buffers(2.0));
    // Two graphs of the same work: one always reads the static inputs (copy path), the
    // other is repointed at each step's inputs (patch path).
    let (n, two) = (LEN as u32, 2.0f32);
    let config = LaunchConfig::for_elements(LEN, 256);
    let captured = || {
        let g = CudaGraph::new(s.rt.clone(), s.allocators.clone(), DEV).expect("graph");
        let capture = g
            .capture(Some(&s.stream), None, CaptureMode::ThreadLocal)
            .expect("capture");
        for (y, x) in outputs.iter().zip(&statics) {
            let args = [
                y.arg(),
                x.arg(),
                KernelArg::value(&two),
                KernelArg::value(&n),
            ];
            s.stream.launch(&s.scale, &config, &args).expect("launch");
        }
        capture.end().expect("capture end");
        g
    };
    let (copied, patched) = (captured(), captured());
    patched.keep_instances(keep);
    let _on_stream = s.rt.stream_guard(&s.stream).expect("guard");
    let mut current = &statics;
    let mut step = 0usize;
    let (ratio, patch, copy) = median_ratio(
        |path| {
            let steps = 50;
            s.sync();
            let t = Instant::now();
            for _ in 0..steps {
                step += 1;
                let next = if step.is_multiple_of(2) { &a } else { &b };
                match path {
                    Path::Raw => {
                        for (x, new) in statics.iter().zip(next) {
                            x.copy_from(new).expect("copy");
                        }
                        copied.replay(&s.stream).expect("replay");
                    }
                    _ => {
                        let pairs: Vec<_> = current.iter().zip(next.iter()).collect();
                        patched.update_inputs(&pairs).expect("update_inputs");
                        current = next;
                        patched.replay(&s.stream).expect("replay");
                    }
                }
                s.stream.synchronize().expect("sync");
            }
            t.elapsed().as_secs_f64() / steps as f64
        },
        Path::Ours,
    );
    println!(
        "graph inputs, {INPUTS} x 1 MiB, {keep} kept instance(s) (per step incl. replay and sync, interleaved, median of 21): update_inputs {:.2} us, copy into static inputs {:.2} us, ratio {ratio:.3}",
        patch * 1e6,
        copy * 1e6
    );
}

fn replay_criterion(c: &mut Criterion) {
    let Some(s) = Setup::new() else { return };
    let mut group = c.benchmark_group("graph_replay_10_nodes");
    for (name, path) in [
        ("raw_cuGraphLaunch", Path::Raw),
        ("ferrocuda_replay", Path::Ours),
    ] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    s.replay(false, path);
                }
                let cpu = t.elapsed();
                s.sync();
                cpu
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = replay_criterion
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    let Some(s) = Setup::new() else { return };
    chain_replay(&s);
    small_replay_cpu(&s, Path::Ours, "graph replay");
    small_replay_cpu(&s, Path::Graphed, "graphed callable call");
    patch_vs_copy(&s, 1);
    patch_vs_copy(&s, 2);
}
