//! CPU cost of a steady-state call of a wrapped 10-kernel function (a replay: signature
//! lookup, tree bookkeeping, invariant checks, output handles, `cuGraphLaunch`) against a
//! bare replay of the same 10 kernels captured in a `CudaGraph` (`cuGraphLaunch` and one
//! lock), same process, interleaved, median of 21 rounds. Target: at most 2 us over the
//! bare launch (PyTorch's reduce-overhead: about 40 us). Four calls are measured, with the
//! default two kept instances: with a static input (no copy); with one non-static input
//! copied (`InputFeed::Copy`: by the graph's own copy node, nothing enqueued but the
//! launch); patched, the same buffer each call (nothing to do); patched, alternating
//! between two buffers (each held by a kept instance once both were seen).
//!
//! Then the sweep behind `InputFeed::Auto`'s size threshold: the same call with an input of
//! 4 KiB to 4 MiB that moves on every call, one instance, copied before the replay vs by
//! the graph's copy node vs patched, per-call CPU time (on the fake device the copy runs on
//! the host at enqueue, so its size shows).
//!
//! On the GPU bundle it runs over the real driver (required there: `FERROCUDA_REQUIRE_GPU=1`);
//! elsewhere over the fake device, where the launch itself costs what the fake's does.
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

use criterion::{Criterion, criterion_group};
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_driver::{CudaDriver, Driver, FakeDriver};
use ferrocuda_graph::CudaGraph;
use ferrocuda_graph::trees::{Arg, Ctx, Input, InputFeed, TreeConfig, Trees, WrapOptions, Wrapped};
use ferrocuda_stream::{DeviceBuffer, Function, Module, Runtime, Stream};
use ferrocuda_testkit::{KERNELS, register_fake_kernels};
use ferrocuda_types::{AllocatorConfig, CaptureMode, DeviceIndex, KernelArg, LaunchConfig};
use std::cell::Cell;
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

/// How the steady-state call feeds its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Feed {
    /// Marked static: used in place.
    Static,
    /// Copied into the recording's static input.
    Copied,
    /// Patched into the graph, the same buffer each call: nothing to do.
    Patched,
    /// Patched, alternating between two buffers: one graph update per call.
    PatchedMoving,
}

impl Feed {
    const ALL: [Feed; 4] = [
        Feed::Static,
        Feed::Copied,
        Feed::Patched,
        Feed::PatchedMoving,
    ];

    fn what(self) -> &'static str {
        match self {
            Feed::Static => "static input",
            Feed::Copied => "one copied input",
            Feed::Patched => "one patched input, same buffer",
            Feed::PatchedMoving => "one patched input, alternating buffers",
        }
    }
}

struct Setup {
    rt: Arc<Runtime>,
    stream: Stream,
    bare: CudaGraph,
    tiny: Function,
    allocators: Arc<DeviceAllocators>,
    copying: Tree,
    patching: Tree,
    x: DeviceBuffer<f32>,
    x2: DeviceBuffer<f32>,
    calls: Cell<u64>,
}

fn ten_tiny(stream: &Stream, tiny: &Function, x: KernelArg<'_>) {
    for _ in 0..KERNELS_PER_CALL {
        stream.launch(tiny, &CONFIG, &[x]).expect("launch");
    }
}

/// A tree feeding inputs one way, with the 10-kernel function wrapped in it.
struct Tree {
    trees: Arc<Trees>,
    wrapped: Wrapped,
}

impl Tree {
    fn new(
        rt: &Arc<Runtime>,
        allocators: &Arc<DeviceAllocators>,
        tiny: &Function,
        feed: InputFeed,
        kept_instances: usize,
    ) -> Tree {
        let config = TreeConfig {
            input_feed: feed,
            kept_instances,
            ..TreeConfig::default()
        };
        let trees = Trees::new(rt.clone(), allocators.clone(), DEV, config).expect("trees");
        let tiny = tiny.clone();
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
        Tree { trees, wrapped }
    }

    /// One steady-state step: a new step, the call, its outputs dropped.
    fn call(&self, input: Input<'_>) {
        self.trees.mark_step_begin();
        drop(self.wrapped.call(&[input]).expect("call"));
    }
}

impl Setup {
    fn new() -> Setup {
        let driver = driver();
        let rt = Runtime::new(driver.clone());
        let allocators = DeviceAllocators::new(driver, AllocatorConfig::default(), Caching::On);
        allocators.install(&rt);
        let module = Module::from_cuda_source(&rt, DEV, "trees_bench", KERNELS).expect("compile");
        let tiny = module.function("tiny").expect("tiny kernel");
        let x = DeviceBuffer::<f32>::filled(&rt, DEV, 1, 0.0).expect("buffer");
        let x2 = DeviceBuffer::<f32>::filled(&rt, DEV, 1, 0.0).expect("buffer");
        let stream = rt.new_stream(DEV, 0).expect("stream");
        let _current = rt.stream_guard(&stream).expect("current stream");
        let bare = CudaGraph::new(rt.clone(), allocators.clone(), DEV).expect("graph");
        let capture = bare
            .capture(Some(&stream), None, CaptureMode::ThreadLocal)
            .expect("capture");
        ten_tiny(&stream, &tiny, x.arg());
        capture.end().expect("capture end");
        let kept = TreeConfig::default().kept_instances;
        let copying = Tree::new(&rt, &allocators, &tiny, InputFeed::Copy, kept);
        let patching = Tree::new(&rt, &allocators, &tiny, InputFeed::Patch, kept);
        drop(_current);
        Setup {
            rt,
            stream,
            bare,
            tiny,
            allocators,
            copying,
            patching,
            x,
            x2,
            calls: Cell::new(0),
        }
    }

    /// One steady-state step fed `feed`'s way.
    fn call(&self, feed: Feed) {
        let n = self.calls.get() + 1;
        self.calls.set(n);
        let input = Input::buffer(&self.x);
        match feed {
            Feed::Static => self.copying.call(input.mark_static()),
            Feed::Copied => self.copying.call(input),
            Feed::Patched => self.patching.call(input),
            Feed::PatchedMoving if n.is_multiple_of(2) => {
                self.patching.call(Input::buffer(&self.x2))
            }
            Feed::PatchedMoving => self.patching.call(input),
        }
    }
}

/// Median over 21 rounds (order alternating) of (ours − bare, ours, bare), CPU seconds per
/// call.
fn median_overhead(s: &Setup, feed: Feed) -> (f64, f64, f64) {
    let (batches, per_batch) = (20, 100);
    let round = |tree: bool| {
        let mut cpu = Duration::ZERO;
        for _ in 0..batches {
            s.rt.synchronize(DEV).expect("sync");
            let t = Instant::now();
            for _ in 0..per_batch {
                if tree {
                    s.call(feed);
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

/// Per-call CPU seconds of `f`, median of 11 rounds of 50 calls.
fn median_call(rt: &Runtime, mut f: impl FnMut()) -> f64 {
    let mut rounds: Vec<f64> = (0..11)
        .map(|_| {
            rt.synchronize(DEV).expect("sync");
            let t = Instant::now();
            for _ in 0..50 {
                f();
            }
            t.elapsed().as_secs_f64() / 50.0
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[rounds.len() / 2]
}

/// The sweep behind `InputFeed::Auto`'s threshold: an input moving on every call, one
/// instance per recording (so every move is an update), per size: copied before the replay
/// (what `Auto` does below the threshold: `Auto` with no size large enough), copied by the
/// graph's own copy node (`InputFeed::Copy`, the node pointed at each call's buffer), and
/// patched.
fn threshold_sweep(s: &Setup) {
    for kib in [4usize, 8, 16, 32, 64, 256, 1024, 4096] {
        let n = kib * 1024 / size_of::<f32>();
        let bufs =
            [0.0f32, 1.0].map(|v| DeviceBuffer::<f32>::filled(&s.rt, DEV, n, v).expect("buffer"));
        let never = InputFeed::Auto {
            min_bytes: u64::MAX,
        };
        let trees = [never, InputFeed::Copy, InputFeed::Patch]
            .map(|feed| Tree::new(&s.rt, &s.allocators, &s.tiny, feed, 1));
        let mut times = [0.0; 3];
        for (t, tree) in times.iter_mut().zip(&trees) {
            let mut i = 0usize;
            let mut step = || {
                i += 1;
                tree.call(Input::buffer(&bufs[i % 2]));
            };
            for _ in 0..4 {
                step();
            }
            *t = median_call(&s.rt, step);
        }
        let stats = trees[2].trees.stats();
        assert_eq!(stats.input_copies, 0, "{stats:?}");
        println!(
            "trees: 10-kernel call, input of {kib} KiB moving every call: copied {:.2} us, copied in the graph {:.2} us (one copy node update), patched {:.2} us (one graph update) per call",
            times[0] * 1e6,
            times[1] * 1e6,
            times[2] * 1e6
        );
    }
}

fn trees_bench(c: &mut Criterion) {
    let s = Setup::new();
    let _current = s.rt.stream_guard(&s.stream).expect("current stream");
    for _ in 0..3 {
        for feed in Feed::ALL {
            s.call(feed);
        }
    }
    let mut g = c.benchmark_group("trees");
    g.bench_function("bare_replay_10_kernels", |b| {
        b.iter(|| s.bare.replay(&s.stream).expect("replay"))
    });
    for (feed, name) in Feed::ALL.into_iter().zip([
        "wrapped_call_10_kernels_static",
        "wrapped_call_10_kernels_copied",
        "wrapped_call_10_kernels_patched",
        "wrapped_call_10_kernels_patched_moving",
    ]) {
        g.bench_function(name, |b| b.iter(|| s.call(feed)));
    }
    g.finish();
    for feed in Feed::ALL {
        let (over, ours, bare) = median_overhead(&s, feed);
        println!(
            "trees: wrapped {KERNELS_PER_CALL}-kernel call ({}) {:.2} us CPU, bare replay {:.2} us, over bare {:.2} us (target <= 2 us; interleaved, median of 21)",
            feed.what(),
            ours * 1e6,
            bare * 1e6,
            over * 1e6
        );
    }
    let (copied, patched) = (s.copying.trees.stats(), s.patching.trees.stats());
    assert!(copied.replays > 0 && copied.recordings == 2, "{copied:?}");
    assert!(
        patched.recordings == 1 && patched.input_copies == 0,
        "{patched:?}"
    );
    threshold_sweep(&s);
}

criterion_group!(benches, trees_bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
