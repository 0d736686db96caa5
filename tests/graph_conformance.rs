//! CUDA graphs with private pools, written once over a backend: the fake device in CI, the
//! real driver in the GPU bundle (`#[ignore]`d without a GPU: skipped, with the reason).
//! The `torch.cuda.graph` example, pool routing and lifetime, the capture rules as typed
//! errors, a panic inside a capture, pool sharing, fork/join, THREAD_LOCAL captures,
//! graphed callables, exact memory statistics, graph-safe Philox RNG.
use ferrocuda::alloc::DeviceAllocators;
use ferrocuda::driver::{Call, DriverError};
use ferrocuda::graph::{
    Callable, CaptureMode, CudaGraph, GraphError, GraphedOptions, InputUpdate, PhiloxGenerator,
    PoolId, make_graphed_callables, register_fake_philox,
};
use ferrocuda::stream::conformance::{Harness, KERNELS};
use ferrocuda::stream::{DeviceBuffer, Function, Module, Stream};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use std::sync::Arc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TestResult = Result<(), BoxError>;
const D0: DeviceIndex = DeviceIndex(0);
const N: usize = 1024;

/// A harness with a caching allocator installed, and a graph over it.
struct Setup<'h> {
    h: &'h Harness,
    allocators: Arc<DeviceAllocators>,
    scale: Function,
    add_one: Function,
}

impl Setup<'_> {
    fn new(h: &Harness) -> Result<Setup<'_>, BoxError> {
        if let Some(fake) = &h.fake {
            register_fake_philox(fake);
        }
        let allocators =
            DeviceAllocators::new(h.rt.driver().clone(), AllocatorConfig::default(), true);
        allocators.install(&h.rt);
        let module = Module::from_cuda_source(&h.rt, D0, "graph_conformance", KERNELS)?;
        Ok(Setup {
            scale: module.function("scale_f32")?,
            add_one: module.function("add_one_f32")?,
            h,
            allocators,
        })
    }

    fn graph(&self) -> Result<CudaGraph, GraphError> {
        CudaGraph::new(self.h.rt.clone(), self.allocators.clone(), D0)
    }

    fn buffer(&self, value: f32) -> Result<DeviceBuffer<f32>, BoxError> {
        Ok(DeviceBuffer::filled(&self.h.rt, D0, N, value)?)
    }

    /// `y = a * x` on `stream`.
    fn scale(
        &self,
        stream: &Stream,
        y: &DeviceBuffer<f32>,
        x: &DeviceBuffer<f32>,
        a: f32,
    ) -> TestResult {
        let n = N as u32;
        let args = [y.arg(), x.arg(), KernelArg::value(&a), KernelArg::value(&n)];
        Ok(stream.launch(&self.scale, &LaunchConfig::for_elements(N, 256), &args)?)
    }

    /// `x += 1` on `stream`.
    fn add_one(&self, stream: &Stream, x: &DeviceBuffer<f32>) -> TestResult {
        let n = N as u32;
        let args = [x.arg(), KernelArg::value(&n)];
        Ok(stream.launch(&self.add_one, &LaunchConfig::for_elements(N, 256), &args)?)
    }

    fn pool_users(&self, pool: PoolId) -> Result<Option<u32>, BoxError> {
        Ok(self.allocators.device(D0)?.pool_use_count(pool))
    }

    fn in_pool(&self, pool: PoolId, buf: &DeviceBuffer<f32>) -> Result<bool, BoxError> {
        let blocks = self.allocators.device(D0)?.pool_blocks(pool);
        Ok(blocks.iter().any(|b| b.allocated && b.ptr == buf.ptr()))
    }

    /// Checks that every element of `buf` is `expected`, after `stream`'s work.
    fn expect(
        &self,
        stream: &Stream,
        buf: &DeviceBuffer<f32>,
        expected: f32,
        what: &str,
    ) -> TestResult {
        stream.synchronize()?;
        let values = buf.to_host()?;
        match values.iter().position(|&v| v != expected) {
            None => Ok(()),
            Some(i) => {
                Err(format!("{what}: element {i} is {}, expected {expected}", values[i]).into())
            }
        }
    }
}

/// The `torch.cuda.graph` documentation example: fill the static input, replay, read the
/// static output, which was allocated inside the capture from the graph's private pool.
fn graph_replays_on_static_buffers(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let static_input = s.buffer(1.0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let static_output = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &static_output, &static_input, 2.0)?;
    capture.end()?;
    let pool = g.pool().ok_or("a captured graph holds a pool")?;
    assert!(
        s.in_pool(pool, &static_output)?,
        "the output was allocated in the private pool"
    );
    assert!(
        !s.in_pool(pool, &static_input)?,
        "the input was allocated before the capture"
    );
    assert_eq!(s.pool_users(pool)?, Some(1));
    assert!(g.node_count()? >= 1);
    // As in PyTorch: fill the input and replay on the current stream, in stream order.
    let current = s.h.rt.current_stream(D0)?;
    for round in 0..3 {
        let v = round as f32 + 3.0;
        static_input.copy_from_host(&vec![v; N])?;
        g.replay(&current)?;
        s.expect(&current, &static_output, 2.0 * v, &format!("round {round}"))?;
    }
    Ok(())
}

/// Allocations made during the capture stay valid after `reset`; the pool's memory goes
/// back to the driver once they are freed and the cache is emptied.
fn capture_memory_outlives_reset(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let g = s.graph()?;
    let input = s.buffer(5.0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let scratch = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &scratch, &input, 3.0)?;
    let output = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &output, &scratch, 1.0)?;
    drop(scratch);
    capture.end()?;
    let pool = g.pool().ok_or("a captured graph holds a pool")?;
    g.replay(&stream)?;
    s.expect(&stream, &output, 15.0, "output")?;
    let reserved_with_pool = alloc.stats().reserved_bytes.all.current;
    g.reset()?;
    assert_eq!(g.pool(), None);
    assert!(matches!(
        g.replay(&stream),
        Err(GraphError::NothingCaptured)
    ));
    s.expect(&stream, &output, 15.0, "the output outlives reset")?;
    alloc.empty_cache();
    assert!(
        !alloc.pool_blocks(pool).is_empty(),
        "a live block keeps its segment"
    );
    drop(output);
    alloc.empty_cache();
    assert!(alloc.pool_blocks(pool).is_empty());
    assert_eq!(s.pool_users(pool)?, None);
    assert!(alloc.stats().reserved_bytes.all.current < reserved_with_pool);
    alloc.check_invariants()?;
    Ok(())
}

/// Each capture rule PyTorch leaves to a CUDA error or a hang is a typed error here.
fn capture_rules_are_typed_errors(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let (g, other) = (s.graph()?, s.graph()?);
    let legacy = s.h.rt.default_stream(D0)?;
    let stream = s.h.rt.new_stream(D0, 0)?;
    assert_eq!(
        g.capture_begin(&legacy, None, CaptureMode::Global),
        Err(GraphError::DefaultStream)
    );
    assert_eq!(g.replay(&stream), Err(GraphError::NothingCaptured));
    assert_eq!(g.upload(&stream), Err(GraphError::NothingCaptured));
    assert_eq!(g.capture_end(), Err(GraphError::NotCapturing));
    assert!(matches!(
        CudaGraph::new(s.h.rt.clone(), s.allocators.clone(), DeviceIndex(7)),
        Err(GraphError::Stream(_))
    ));

    g.capture_begin(&stream, None, CaptureMode::ThreadLocal)?;
    assert_eq!(
        g.capture_begin(&stream, None, CaptureMode::ThreadLocal),
        Err(GraphError::AlreadyCaptured)
    );
    assert_eq!(
        other.capture_begin(&stream, None, CaptureMode::ThreadLocal),
        Err(GraphError::NestedCapture)
    );
    let pool = g.pool().ok_or("capturing graph holds a pool")?;
    assert_eq!(g.capture_end(), Err(GraphError::EmptyCapture));
    assert_eq!(
        (g.pool(), s.pool_users(pool)?),
        (None, None),
        "an empty capture releases its pool"
    );

    let x = s.buffer(0.0)?;
    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let pool = g.pool().ok_or("capturing graph holds a pool")?;
    s.add_one(&stream, &x)?;
    assert!(
        stream.synchronize().is_err(),
        "a synchronize inside a capture is refused"
    );
    assert_eq!(capture.end(), Err(GraphError::Invalidated));
    assert_eq!(
        (g.pool(), s.pool_users(pool)?),
        (None, None),
        "an invalidated capture releases its pool"
    );

    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    s.add_one(&stream, &x)?;
    assert!(
        x.to_host().is_err(),
        "a host read inside a capture is refused"
    );
    assert_eq!(capture.end(), Err(GraphError::Invalidated));

    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    s.add_one(&stream, &x)?;
    capture.end()?;
    s.expect(&stream, &x, 0.0, "captured work runs only on replay")?;
    g.replay(&stream)?;
    g.replay(&stream)?;
    s.expect(&stream, &x, 2.0, "the graph works after failed captures")?;
    alloc.check_invariants()?;
    Ok(())
}

/// A panic inside a capture ends it and releases its pool (PyTorch leaks both); the next
/// capture on the same stream works.
fn panic_inside_capture_releases_pool(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let stream = s.h.rt.new_stream(D0, 0)?;
    let x = s.buffer(1.0)?;
    let mut seen = None;
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if let Ok(_capture) = g.capture(Some(&stream), None, CaptureMode::ThreadLocal) {
            seen = g.pool();
            let _kept = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N);
            std::panic::resume_unwind(Box::new("a panic inside the capture"));
        }
    }));
    assert!(
        unwound.is_err(),
        "the capture began and the closure unwound"
    );
    let pool = seen.ok_or("the capture held a pool")?;
    assert_eq!(g.pool(), None);
    assert_eq!(
        s.pool_users(pool)?,
        Some(0),
        "the panicking capture released its pool"
    );
    s.allocators.device(D0)?.empty_cache();
    assert_eq!(
        s.pool_users(pool)?,
        None,
        "its memory goes back at the next empty_cache"
    );
    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    s.add_one(&stream, &x)?;
    capture.end()?;
    g.replay(&stream)?;
    s.expect(&stream, &x, 2.0, "x")?;
    Ok(())
}

/// Two graphs share a pool (`pool=g1.pool()`): the second capture reuses memory the first
/// freed, the pool has two users, and replays in capture order compute the chain.
fn graphs_share_a_pool(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let (g1, g2) = (s.graph()?, s.graph()?);
    let input = s.buffer(2.0)?;
    let capture = g1.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let temp = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &temp, &input, 10.0)?;
    let mid = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &mid, &temp, 0.5)?;
    let temp_address = temp.ptr();
    drop(temp);
    capture.end()?;
    let pool = g1.pool().ok_or("g1 holds a pool")?;

    let capture = g2.capture(Some(&stream), Some(pool), CaptureMode::ThreadLocal)?;
    let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &out, &mid, 3.0)?;
    capture.end()?;
    assert_eq!(g2.pool(), Some(pool));
    assert_eq!(s.pool_users(pool)?, Some(2));
    assert_eq!(
        out.ptr(),
        temp_address,
        "g2 reuses the block g1 freed in the shared pool"
    );
    assert!(s.in_pool(pool, &out)? && s.in_pool(pool, &mid)?);
    g1.replay(&stream)?;
    g2.replay(&stream)?;
    s.expect(&stream, &out, 30.0, "out")?;
    g1.reset()?;
    assert_eq!(s.pool_users(pool)?, Some(1));
    drop(g2);
    assert_eq!(
        s.pool_users(pool)?,
        Some(0),
        "blocks still live keep the pool"
    );
    Ok(())
}

/// Work forked to a side stream must be joined before the capture ends; a fork that is
/// joined captures both branches, and the side stream's allocations land in the pool.
fn forked_streams_join_the_capture(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let stream = s.h.rt.new_stream(D0, 0)?;
    let side = s.h.rt.new_stream(D0, 0)?;
    let (a, b) = (s.buffer(0.0)?, s.buffer(0.0)?);

    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let pool = g.pool().ok_or("capturing graph holds a pool")?;
    side.wait_stream(&stream)?;
    s.add_one(&side, &b)?;
    assert_eq!(capture.end(), Err(GraphError::Unjoined));
    assert_eq!(
        s.pool_users(pool)?,
        None,
        "an unjoined capture releases its pool"
    );

    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let pool = g.pool().ok_or("capturing graph holds a pool")?;
    side.wait_stream(&stream)?;
    let side_scratch = {
        let _on_side = s.h.rt.stream_guard(&side)?;
        DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?
    };
    s.add_one(&side, &b)?;
    s.scale(&side, &side_scratch, &b, 1.0)?;
    s.add_one(&stream, &a)?;
    stream.wait_stream(&side)?;
    capture.end()?;
    assert!(g.node_count()? >= 3, "both branches are in the graph");
    assert!(
        s.in_pool(pool, &side_scratch)?,
        "the side stream allocates from the pool"
    );
    g.replay(&stream)?;
    s.expect(&stream, &a, 1.0, "a")?;
    s.expect(&stream, &b, 1.0, "b")?;
    Ok(())
}

/// A THREAD_LOCAL capture lets other threads allocate (from the default pool) while it
/// records; the capture is unharmed.
fn thread_local_capture_ignores_other_threads(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let x = s.buffer(0.0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let pool = g.pool().ok_or("capturing graph holds a pool")?;
    s.add_one(&stream, &x)?;
    let elsewhere = std::thread::scope(|scope| {
        scope
            .spawn(|| -> Result<DeviceBuffer<f32>, String> {
                let own = s.h.rt.new_stream(D0, 0).map_err(|e| e.to_string())?;
                let _guard = s.h.rt.stream_guard(&own).map_err(|e| e.to_string())?;
                let buf =
                    DeviceBuffer::<f32>::uninit(&s.h.rt, D0, 4 * N).map_err(|e| e.to_string())?;
                own.synchronize().map_err(|e| e.to_string())?;
                Ok(buf)
            })
            .join()
            .map_err(|_| "the other thread panicked".to_string())?
    })?;
    capture.end()?;
    assert!(
        !s.in_pool(pool, &elsewhere)?,
        "another thread's allocation stays out of the pool"
    );
    g.replay(&stream)?;
    s.expect(&stream, &x, 1.0, "x")?;
    Ok(())
}

/// `make_graphed_callables`: warm-up runs, one shared pool, static inputs copied into only
/// when a different buffer is passed, outputs chained from one callable to the next, the
/// replay order checked in debug builds.
fn graphed_callables_chain(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let runs = std::cell::Cell::new(0);
    let double: Callable<'_, f32> = Box::new(|inputs| {
        runs.set(runs.get() + 1);
        let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
        s.scale(&s.h.rt.current_stream(D0)?, &y, &inputs[0], 2.0)?;
        Ok(vec![y])
    });
    let triple: Callable<'_, f32> = Box::new(|inputs| {
        let z = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
        s.scale(&s.h.rt.current_stream(D0)?, &z, &inputs[0], 3.0)?;
        Ok(vec![z])
    });
    let graphed = make_graphed_callables(
        &s.h.rt,
        &s.allocators,
        D0,
        vec![double, triple],
        vec![vec![s.buffer(0.0)?], vec![s.buffer(0.0)?]],
        GraphedOptions::default(),
    )?;
    assert_eq!(runs.get(), 4, "3 warm-up runs and the capture");
    assert_eq!(
        s.pool_users(graphed.pool())?,
        Some(2),
        "both graphs share the pool"
    );
    let stream = s.h.rt.current_stream(D0)?;
    for v in [4.0f32, 5.0] {
        let x = s.buffer(v)?;
        let y = graphed.call(0, &[&x])?;
        assert!(s.in_pool(graphed.pool(), &y[0])?);
        let z = graphed.call(1, &[&y[0]])?;
        s.expect(&stream, &z[0], 6.0 * v, "triple(double(x))")?;
    }
    let static_x = &graphed.inputs(0)?[0];
    static_x.copy_from_host(&vec![7.0; N])?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    let y = graphed.call(0, &[static_x])?;
    s.expect(
        &stream,
        &y[0],
        14.0,
        "the static input itself is not copied",
    )?;
    if cfg!(debug_assertions) {
        assert_eq!(
            graphed.call(0, &[static_x]).err(),
            Some(GraphError::ReplayOrder {
                expected: 1,
                found: 0
            })
        );
    }
    assert!(matches!(
        graphed.call(1, &[]),
        Err(GraphError::InputCount {
            expected: 1,
            found: 0
        })
    ));
    assert!(matches!(
        graphed.call(2, &[]),
        Err(GraphError::NoSuchCallable { index: 2, count: 2 })
    ));

    let failing: Callable<'_, f32> = Box::new(|_| Err("no kernel for this".into()));
    let err = make_graphed_callables(
        &s.h.rt,
        &s.allocators,
        D0,
        vec![failing],
        vec![vec![]],
        GraphedOptions::default(),
    );
    assert!(matches!(err, Err(GraphError::Callable { index: 0, .. })));
    let err = make_graphed_callables::<f32>(
        &s.h.rt,
        &s.allocators,
        D0,
        vec![],
        vec![vec![]],
        GraphedOptions::default(),
    );
    assert!(matches!(
        err,
        Err(GraphError::SampleCount {
            callables: 0,
            samples: 1
        })
    ));
    Ok(())
}

/// Exact reserved and segment deltas across capture, replay, reset, freeing the outputs and
/// `empty_cache` (`test_graph_memory_stats_and_use_result_after_destroy_graph`): a small
/// allocation takes a 2 MiB segment and a 4 MiB one a 20 MiB segment, both in the pool.
fn graph_memory_stats_after_destroy(h: &Harness) -> TestResult {
    const MIB: i64 = 1 << 20;
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let input = s.buffer(1.0)?;
    let stats = || {
        let st = alloc.stats();
        (
            st.reserved_bytes.all.current,
            st.segment.all.current,
            st.allocated_bytes.all.current,
        )
    };
    let (reserved0, segments0, allocated0) = stats();
    let g = s.graph()?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let small = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &small, &input, 2.0)?;
    let large = DeviceBuffer::<u8>::uninit(&s.h.rt, D0, 4 << 20)?;
    capture.end()?;
    let expect = |reserved: i64, segments: i64, allocated: i64, when: &str| -> TestResult {
        let got = stats();
        let want = (
            reserved0 + reserved,
            segments0 + segments,
            allocated0 + allocated,
        );
        if got == want {
            Ok(())
        } else {
            Err(
                format!("{when}: (reserved, segments, allocated) {got:?}, expected {want:?}")
                    .into(),
            )
        }
    };
    let live = 4096 + (4 << 20);
    expect(22 * MIB, 2, live, "after capture")?;
    g.replay(&stream)?;
    s.expect(&stream, &small, 2.0, "small")?;
    expect(22 * MIB, 2, live, "after replay")?;
    drop(g);
    expect(
        22 * MIB,
        2,
        live,
        "after the graph is gone, its outputs live",
    )?;
    s.expect(
        &stream,
        &small,
        2.0,
        "the output is usable after the graph is gone",
    )?;
    drop(small);
    drop(large);
    expect(22 * MIB, 2, 0, "freed, still cached")?;
    alloc.empty_cache();
    expect(0, 0, 0, "after empty_cache")?;
    alloc.check_invariants()?;
    Ok(())
}

/// `record_stream` during a capture defers the free to after the capture (PyTorch's
/// deferred frees): the block is not handed out again inside the capture.
fn record_stream_during_capture_defers_free(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let g = s.graph()?;
    let side = s.h.rt.new_stream(D0, 0)?;
    let x = s.buffer(1.0)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let pool = g.pool().ok_or("capturing graph holds a pool")?;
    let tmp = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &tmp, &x, 2.0)?;
    side.wait_stream(&stream)?;
    s.add_one(&side, &tmp)?;
    tmp.record_stream(&side)?;
    let tmp_address = tmp.ptr();
    drop(tmp);
    let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    assert_ne!(
        out.ptr(),
        tmp_address,
        "a block used by another captured stream is not reused in the capture"
    );
    stream.wait_stream(&side)?;
    s.scale(&stream, &out, &x, 5.0)?;
    capture.end()?;
    g.replay(&stream)?;
    s.expect(&stream, &out, 5.0, "out")?;
    let tmp_block = alloc
        .pool_blocks(pool)
        .into_iter()
        .find(|b| b.ptr == tmp_address);
    assert_eq!(
        tmp_block.map(|b| b.allocated),
        Some(false),
        "the deferred free landed after the capture"
    );
    alloc.check_invariants()?;
    Ok(())
}

/// Graphs with their own pools replay concurrently on two streams without touching each
/// other's memory.
fn concurrent_replay_with_separate_pools(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let (g1, g2) = (s.graph()?, s.graph()?);
    let (s1, s2) = (s.h.rt.new_stream(D0, 0)?, s.h.rt.new_stream(D0, 0)?);
    let (x1, x2) = (s.buffer(1.0)?, s.buffer(2.0)?);
    let mut outputs = Vec::new();
    for (g, st, x, a) in [(&g1, &s1, &x1, 10.0), (&g2, &s2, &x2, 100.0)] {
        let capture = g.capture(Some(st), None, CaptureMode::ThreadLocal)?;
        let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
        s.scale(st, &y, x, a)?;
        capture.end()?;
        outputs.push(y);
    }
    let (p1, p2) = (g1.pool().ok_or("g1 pool")?, g2.pool().ok_or("g2 pool")?);
    assert_ne!(p1, p2);
    assert!(s.in_pool(p1, &outputs[0])? && s.in_pool(p2, &outputs[1])?);
    for _ in 0..3 {
        g1.replay(&s1)?;
        g2.replay(&s2)?;
    }
    s.expect(&s1, &outputs[0], 10.0, "g1")?;
    s.expect(&s2, &outputs[1], 200.0, "g2")?;
    Ok(())
}

fn draw(s: &Setup, generator: &PhiloxGenerator, stream: &Stream) -> Result<Vec<f32>, BoxError> {
    let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    generator.uniform(&out, stream)?;
    stream.synchronize()?;
    Ok(out.to_host()?)
}

/// Graph-safe Philox: replays draw exactly what eager calls from the same seed draw, in
/// sequence with eager draws between them; capture does not move the offset, each replay
/// moves it by the captured total; several generators advance independently.
fn rng_replays_match_eager(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let current = s.h.rt.current_stream(D0)?;
    let reference = PhiloxGenerator::new(&s.h.rt, D0, 42)?;
    let eager: Vec<Vec<f32>> = (0..4)
        .map(|_| draw(&s, &reference, &current))
        .collect::<Result<_, _>>()?;
    assert!(eager[0] != eager[1], "consecutive draws differ");
    assert!(
        eager.iter().flatten().all(|v| (0.0..1.0).contains(v)),
        "uniform in [0, 1)"
    );
    assert!(
        eager[0].iter().any(|&v| v != eager[0][0]),
        "a draw is not constant"
    );
    assert_eq!(reference.offset(), 16, "4 offset units per draw");

    let generator = PhiloxGenerator::new(&s.h.rt, D0, 42)?;
    let unregistered = PhiloxGenerator::new(&s.h.rt, D0, 1)?;
    let g = s.graph()?;
    g.register_generator(&generator)?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    generator.uniform(&out, &stream)?;
    assert!(
        matches!(g.register_generator(&generator), Err(GraphError::Rng(_))),
        "no registration while capturing"
    );
    assert!(
        matches!(generator.manual_seed(7), Err(GraphError::Rng(_))),
        "no reseeding while capturing"
    );
    generator.manual_seed(42)?;
    assert!(matches!(
        unregistered.uniform(&out, &stream),
        Err(GraphError::Rng(_))
    ));
    capture.end()?;
    assert_eq!(generator.offset(), 0, "capture does not move the offset");
    for (i, expected) in [(0, &eager[0]), (1, &eager[1])] {
        g.replay(&stream)?;
        stream.synchronize()?;
        assert!(
            out.to_host()? == *expected,
            "replay {i} draws the eager numbers"
        );
    }
    assert_eq!(generator.offset(), 8);
    assert!(
        draw(&s, &generator, &current)? == eager[2],
        "an eager draw between replays"
    );
    g.replay(&stream)?;
    stream.synchronize()?;
    assert!(
        out.to_host()? == eager[3],
        "the replay after it continues the sequence"
    );

    // A generator records into one capture at a time; the refused capture leaves the
    // other one intact.
    let (g_a, g_b) = (s.graph()?, s.graph()?);
    g_a.register_generator(&generator)?;
    g_b.register_generator(&generator)?;
    let side = s.h.rt.new_stream(D0, 0)?;
    g_a.capture_begin(&stream, None, CaptureMode::ThreadLocal)?;
    assert!(matches!(
        g_b.capture_begin(&side, None, CaptureMode::ThreadLocal),
        Err(GraphError::Rng(_))
    ));
    assert_eq!(g_b.pool(), None);
    generator.uniform(&out, &stream)?;
    g_a.capture_end()?;
    g_a.replay(&stream)?;
    assert_eq!(generator.offset(), 20, "16 before g_a, +4 by its replay");
    let (a, b) = (
        PhiloxGenerator::new(&s.h.rt, D0, 5)?,
        PhiloxGenerator::new(&s.h.rt, D0, 6)?,
    );
    let g2 = s.graph()?;
    g2.register_generator(&a)?;
    g2.register_generator(&b)?;
    let capture = g2.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let draws: Vec<DeviceBuffer<f32>> = (0..3)
        .map(|_| DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N))
        .collect::<Result<_, _>>()?;
    a.uniform(&draws[0], &stream)?;
    a.uniform(&draws[1], &stream)?;
    b.uniform(&draws[2], &stream)?;
    capture.end()?;
    g2.replay(&stream)?;
    assert_eq!((a.offset(), b.offset()), (8, 4));
    g2.replay(&stream)?;
    assert_eq!((a.offset(), b.offset()), (16, 8));
    Ok(())
}

/// `update_inputs` repoints a captured graph at other buffers without copying: replays
/// then read the new inputs, untouched arguments stay, and the old buffers are unused.
fn update_inputs_patches_pointers(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let (x, other) = (s.buffer(1.0)?, s.buffer(0.0)?);
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &y, &x, 2.0)?;
    s.add_one(&stream, &other)?;
    capture.end()?;
    g.replay(&stream)?;
    s.expect(&stream, &y, 2.0, "before the update")?;
    let (x2, y2) = (s.buffer(21.0)?, s.buffer(0.0)?);
    s.h.rt.current_stream(D0)?.synchronize()?;
    assert_eq!(
        g.update_inputs(&[(&x, &x2), (&y, &y2)])?,
        InputUpdate::InPlace { arguments: 2 }
    );
    x.copy_from_host(&vec![-1.0; N])?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    g.replay(&stream)?;
    s.expect(&stream, &y2, 42.0, "the replay reads x2 and writes y2")?;
    s.expect(&stream, &y, 2.0, "the old output is no longer written")?;
    s.expect(&stream, &other, 2.0, "the unpatched node still runs")?;
    assert!(matches!(
        g.update_inputs(&[(&x2, &s.buffer(0.0)?)]),
        Ok(InputUpdate::InPlace { arguments: 1 })
    ));
    let short = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, 1)?;
    assert!(matches!(
        g.update_inputs(&[(&x2, &short)]),
        Err(GraphError::Stream(_))
    ));
    let empty = s.graph()?;
    assert_eq!(
        empty.update_inputs(&[(&x, &x2)]),
        Err(GraphError::NothingCaptured)
    );
    Ok(())
}

/// A two-layer MLP step: `h = relu(W1 x + b1)`, `y = W2 h + b2`, then `b2 -= lr * y`.
const MLP_KERNELS: &str = r#"
extern "C" __global__ void linear_f32(float* y, const float* w, const float* x, const float* b,
                                      unsigned int n_in, unsigned int n_out, unsigned int relu) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out) return;
    float acc = b[i];
    for (unsigned int j = 0; j < n_in; ++j) acc += w[i * n_in + j] * x[j];
    y[i] = (relu && acc < 0.0f) ? 0.0f : acc;
}
extern "C" __global__ void sgd_f32(float* p, const float* g, float lr, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] -= lr * g[i];
}
"#;

const MLP: (usize, usize, usize) = (16, 32, 8);

fn register_fake_mlp(h: &Harness) {
    let Some(fake) = &h.fake else { return };
    fake.register_kernel("linear_f32", |k| {
        let (y, w, x, b) = (k.arg(0)?, k.arg(1)?, k.arg(2)?, k.arg(3)?);
        let (n_in, n_out, relu) = (
            k.arg::<u32>(4)? as usize,
            k.arg::<u32>(5)? as usize,
            k.arg::<u32>(6)? != 0,
        );
        let (w, x, b) = (
            k.read::<f32>(w, n_in * n_out)?,
            k.read::<f32>(x, n_in)?,
            k.read::<f32>(b, n_out)?,
        );
        let out: Vec<f32> = (0..n_out)
            .map(|i| {
                let acc = (0..n_in).fold(b[i], |acc, j| acc + w[i * n_in + j] * x[j]);
                if relu && acc < 0.0 { 0.0 } else { acc }
            })
            .collect();
        k.write(y, &out)
    });
    fake.register_kernel("sgd_f32", |k| {
        let (p, g, lr, n) = (
            k.arg(0)?,
            k.arg(1)?,
            k.arg::<f32>(2)?,
            k.arg::<u32>(3)? as usize,
        );
        let (pv, gv) = (k.read::<f32>(p, n)?, k.read::<f32>(g, n)?);
        let out: Vec<f32> = pv.iter().zip(&gv).map(|(p, g)| p - lr * g).collect();
        k.write(p, &out)
    });
}

/// The MLP's parameters and its input, deterministic.
struct Mlp {
    w1: DeviceBuffer<f32>,
    b1: DeviceBuffer<f32>,
    w2: DeviceBuffer<f32>,
    b2: DeviceBuffer<f32>,
    x: DeviceBuffer<f32>,
    linear: Function,
    sgd: Function,
}

impl Mlp {
    fn new(s: &Setup) -> Result<Mlp, BoxError> {
        register_fake_mlp(s.h);
        let module = Module::from_cuda_source(&s.h.rt, D0, "graph_mlp", MLP_KERNELS)?;
        let (i, h, o) = MLP;
        let values = |n: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|k| ((k * 37 % 19) as f32 - 9.0) * scale)
                .collect()
        };
        let rt = &s.h.rt;
        let mlp = Mlp {
            w1: DeviceBuffer::from_slice(rt, D0, &values(h * i, 0.05))?,
            b1: DeviceBuffer::from_slice(rt, D0, &values(h, 0.1))?,
            w2: DeviceBuffer::from_slice(rt, D0, &values(o * h, 0.03))?,
            b2: DeviceBuffer::from_slice(rt, D0, &values(o, 0.2))?,
            x: DeviceBuffer::from_slice(rt, D0, &values(i, 1.0))?,
            linear: module.function("linear_f32")?,
            sgd: module.function("sgd_f32")?,
        };
        // The uploads ran on the current stream; the steps run on another.
        rt.current_stream(D0)?.synchronize()?;
        Ok(mlp)
    }

    /// The forward pass on `stream`, into buffers allocated here (from the graph's pool
    /// when capturing).
    fn forward(&self, s: &Setup, stream: &Stream) -> Result<DeviceBuffer<f32>, BoxError> {
        let (i, h, o) = MLP;
        let hidden = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, h)?;
        let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, o)?;
        for (out, w, x, b, n_in, n_out, relu) in [
            (&hidden, &self.w1, &self.x, &self.b1, i, h, 1u32),
            (&y, &self.w2, &hidden, &self.b2, h, o, 0),
        ] {
            let (n_in, n_out) = (n_in as u32, n_out as u32);
            let args = [
                out.arg(),
                w.arg(),
                x.arg(),
                b.arg(),
                KernelArg::value(&n_in),
                KernelArg::value(&n_out),
                KernelArg::value(&relu),
            ];
            stream.launch(
                &self.linear,
                &LaunchConfig::for_elements(n_out as usize, 32),
                &args,
            )?;
        }
        Ok(y)
    }

    /// `b2 -= 0.1 * y` on `stream`.
    fn update(&self, stream: &Stream, y: &DeviceBuffer<f32>) -> TestResult {
        let (lr, n) = (0.1f32, MLP.2 as u32);
        let args = [
            self.b2.arg(),
            y.arg(),
            KernelArg::value(&lr),
            KernelArg::value(&n),
        ];
        Ok(stream.launch(
            &self.sgd,
            &LaunchConfig::for_elements(n as usize, 32),
            &args,
        )?)
    }

    fn state(&self, stream: &Stream) -> Result<Vec<f32>, BoxError> {
        stream.synchronize()?;
        Ok(self.b2.to_host()?)
    }
}

/// Whole-step capture of an MLP training step, and partial capture (forward only, update
/// eager): replays give bit for bit what eager steps give.
fn mlp_step_whole_and_partial_capture(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let stream = s.h.rt.new_stream(D0, 0)?;
    let eager = Mlp::new(&s)?;
    let mut expected = Vec::new();
    for _ in 0..3 {
        let y = eager.forward(&s, &stream)?;
        eager.update(&stream, &y)?;
        expected.push(eager.state(&stream)?);
    }
    assert!(
        expected[0] != expected[1],
        "the step changes the parameters"
    );

    let whole = Mlp::new(&s)?;
    let g = s.graph()?;
    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let y = whole.forward(&s, &stream)?;
    whole.update(&stream, &y)?;
    capture.end()?;
    for (step, want) in expected.iter().enumerate() {
        g.replay(&stream)?;
        let got = whole.state(&stream)?;
        assert!(
            got == *want,
            "whole-step replay {step} equals the eager step: {got:?} vs {want:?}"
        );
    }

    let partial = Mlp::new(&s)?;
    let forward = s.graph()?;
    let capture = forward.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    let y = partial.forward(&s, &stream)?;
    capture.end()?;
    for (step, want) in expected.iter().enumerate() {
        forward.replay(&stream)?;
        partial.update(&stream, &y)?;
        assert!(
            partial.state(&stream)? == *want,
            "partial capture step {step} equals the eager step"
        );
    }
    Ok(())
}

/// Three graphs, each with a temporary and an output: sharing one pool they fit in one
/// small segment, where separate pools take three; replayed in capture order they compute
/// the chain correctly.
fn three_graphs_share_one_segment(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let stream = s.h.rt.new_stream(D0, 0)?;
    let input = s.buffer(1.0)?;
    let mut reserved_by_sharing = Vec::new();
    for shared in [true, false] {
        let before = alloc.stats().reserved_bytes.all.current;
        let graphs = [s.graph()?, s.graph()?, s.graph()?];
        let mut outputs: Vec<DeviceBuffer<f32>> = Vec::new();
        let mut pool = None;
        for g in &graphs {
            let source = outputs.last().unwrap_or(&input);
            let capture = g.capture(
                Some(&stream),
                if shared { pool } else { None },
                CaptureMode::ThreadLocal,
            )?;
            let temp = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
            s.scale(&stream, &temp, source, 2.0)?;
            let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
            s.scale(&stream, &out, &temp, 1.0)?;
            drop(temp);
            capture.end()?;
            pool = g.pool();
            outputs.push(out);
        }
        for g in &graphs {
            g.replay(&stream)?;
        }
        s.expect(
            &stream,
            &outputs[2],
            8.0,
            "three doublings in capture order",
        )?;
        reserved_by_sharing.push(alloc.stats().reserved_bytes.all.current - before);
        drop(outputs);
        drop(graphs);
        alloc.empty_cache();
    }
    assert_eq!(
        reserved_by_sharing,
        vec![2 << 20, 3 * (2 << 20)],
        "one shared small segment vs three"
    );
    Ok(())
}

/// When the driver refuses the in-place update, `update_inputs` instantiates the patched
/// graph again (fake device: the refusal is injected).
#[test]
fn update_inputs_reinstantiates_when_refused() -> TestResult {
    let h = ferrocuda::stream::conformance::fake_harness();
    let fake = h.fake.clone().ok_or("the fake harness has a fake driver")?;
    let s = Setup::new(&h)?;
    let g = s.graph()?;
    let (x, x2) = (s.buffer(1.0)?, s.buffer(4.0)?);
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &y, &x, 2.0)?;
    capture.end()?;
    let instantiated = fake.calls(Call::GraphInstantiate);
    fake.fail_nth(
        Call::GraphExecUpdate,
        1,
        DriverError::GRAPH_EXEC_UPDATE_FAILURE,
    );
    s.h.rt.current_stream(D0)?.synchronize()?;
    assert_eq!(
        g.update_inputs(&[(&x, &x2)])?,
        InputUpdate::Reinstantiated { arguments: 1 }
    );
    assert_eq!(fake.calls(Call::GraphInstantiate), instantiated + 1);
    g.replay(&stream)?;
    s.expect(&stream, &y, 8.0, "the new instance reads x2")
}

ferrocuda::stream::both_backends!(
    graph_replays_on_static_buffers,
    capture_memory_outlives_reset,
    capture_rules_are_typed_errors,
    panic_inside_capture_releases_pool,
    graphs_share_a_pool,
    forked_streams_join_the_capture,
    thread_local_capture_ignores_other_threads,
    graphed_callables_chain,
    graph_memory_stats_after_destroy,
    record_stream_during_capture_defers_free,
    concurrent_replay_with_separate_pools,
    rng_replays_match_eager,
    update_inputs_patches_pointers,
    mlp_step_whole_and_partial_capture,
    three_graphs_share_one_segment,
);
