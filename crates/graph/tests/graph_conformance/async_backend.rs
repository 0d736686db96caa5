//! Captures under `backend:cudaMallocAsync` (PyTorch's `CudaMallocAsyncAllocator` with
//! `torch.cuda.graph`): what the capture allocates is the graph's memory, outside the
//! pool's figures; frees of memory from before the capture wait for its end; one capture
//! at a time; a capture left without `end` ends the allocator's capture too; graphed
//! callables.
use crate::callables::double_and_triple;
use crate::{D0, N, Setup, TestResult};
use ferrocuda_alloc::{AllocError, AsyncAllocator, HostAllocator};
use ferrocuda_driver::DriverError;
use ferrocuda_graph::{
    CaptureMemory, CaptureMode, CudaGraph, GraphError, GraphedOptions, make_graphed_callables,
};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;
use ferrocuda_types::PinnedConfig;
use std::sync::Arc;

/// The kernels of [`Setup`], with the runtime's memory served by a cudaMallocAsync
/// allocator and graphs capturing through it.
pub(crate) struct AsyncSetup<'h> {
    pub(crate) s: Setup<'h>,
    pub(crate) allocator: Arc<AsyncAllocator>,
    pub(crate) memory: CaptureMemory,
}

impl AsyncSetup<'_> {
    pub(crate) fn new(h: &Harness) -> Result<AsyncSetup<'_>, crate::BoxError> {
        let s = Setup::new(h)?;
        let driver = h.rt.driver().clone();
        let allocator = AsyncAllocator::new(driver.clone());
        let host = HostAllocator::new(driver, PinnedConfig::default());
        h.rt.set_memory(allocator.clone());
        h.rt.set_host_memory(host.clone());
        let memory = CaptureMemory::Async {
            device: allocator.clone(),
            host,
        };
        Ok(AsyncSetup {
            s,
            allocator,
            memory,
        })
    }

    pub(crate) fn graph(&self) -> Result<CudaGraph, GraphError> {
        CudaGraph::new(self.s.h.rt.clone(), self.memory.clone(), D0)
    }

    fn allocated(&self) -> Result<i64, AllocError> {
        Ok(self.allocator.stats(D0)?.to_map()["allocated_bytes.all.current"])
    }
}

/// The `torch.cuda.graph` example under the async backend: the static output and a
/// temporary are allocated during the capture (graph memory: the pool's figures do not
/// move), replays compute into the output, and the output freed after the graph is reset
/// is an uncaptured free of a captured allocation (PyTorch's warning).
pub(crate) fn async_capture_replays_into_graph_memory(h: &Harness) -> TestResult {
    let a = AsyncSetup::new(h)?;
    let s = &a.s;
    let g = a.graph()?;
    let input = s.buffer(1.0)?;
    let allocated = a.allocated()?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    assert!(a.allocator.capture_underway());
    let temporary = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &temporary, &input, 2.0)?;
    let output = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &output, &temporary, 3.0)?;
    drop(temporary);
    capture.end()?;
    assert!(!a.allocator.capture_underway());
    // Read after the capture: the driver refuses the pool's attributes during one.
    assert_eq!(
        a.allocated()?,
        allocated,
        "graph memory is outside the pool"
    );
    assert!(g.node_count()? >= 5, "two kernels, two allocations, a free");
    let current = s.h.rt.current_stream(D0)?;
    for round in 0..3 {
        let v = round as f32 + 1.0;
        input.copy_from_host(&vec![v; N])?;
        g.replay(&current)?;
        s.expect(&current, &output, 6.0 * v, &format!("round {round}"))?;
    }
    g.reset()?;
    s.expect(&current, &output, 18.0, "the output outlives reset")?;
    assert!(a.allocator.take_warnings().is_empty());
    drop(output);
    let warnings = a.allocator.take_warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].starts_with("Attempting uncaptured free of a captured allocation"));
    assert_eq!(a.allocated()?, allocated);
    Ok(())
}

/// The statistics read the pool's attributes, which the driver refuses during a capture
/// from the capturing thread: `memory_stats()` inside `torch.cuda.graph` under PyTorch's
/// cudaMallocAsync backend fails the same way, and the capture is invalidated. A capture
/// that is the device's first use under this backend still captures (the device is set up
/// before the capture begins, as PyTorch's graph-state tensors set it up).
pub(crate) fn async_stats_during_a_capture_invalidate_it(h: &Harness) -> TestResult {
    let a = AsyncSetup::new(h)?;
    let s = &a.s;
    let g = a.graph()?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let first = DeviceBuffer::<f32>::filled(&s.h.rt, D0, N, 5.0)?;
    let refused = a.allocator.stats(D0);
    assert!(
        matches!(&refused, Err(AllocError::Driver(e)) if *e == DriverError::STREAM_CAPTURE_UNSUPPORTED),
        "{refused:?}"
    );
    assert!(matches!(capture.end(), Err(GraphError::Invalidated)));
    assert!(
        !a.allocator.capture_underway(),
        "the allocator's capture ended too"
    );
    drop(first);
    let again = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let out = DeviceBuffer::<f32>::filled(&s.h.rt, D0, N, 7.0)?;
    again.end()?;
    let current = s.h.rt.current_stream(D0)?;
    g.replay(&current)?;
    s.expect(&current, &out, 7.0, "the second capture replays")?;
    Ok(())
}

/// A buffer from before the capture dropped during it stays allocated (the replay still
/// reads it) until the first allocation after the capture; a second graph cannot begin
/// capturing meanwhile (PyTorch's "Only one capture at a time is allowed in a process.").
pub(crate) fn async_capture_defers_uncaptured_frees_one_capture_at_a_time(
    h: &Harness,
) -> TestResult {
    let a = AsyncSetup::new(h)?;
    let s = &a.s;
    let g = a.graph()?;
    let other = a.graph()?;
    let input = s.buffer(4.0)?;
    let output = s.buffer(0.0)?;
    let allocated = a.allocated()?;
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    s.scale(&stream, &output, &input, 0.5)?;
    drop(input);
    let second = s.h.rt.new_stream(D0, 0)?;
    let refused = other.capture_begin(&second, None, CaptureMode::ThreadLocal);
    match &refused {
        Err(e @ GraphError::Alloc(AllocError::CaptureUnderway)) => assert_eq!(
            e.to_string(),
            "Only one capture at a time is allowed in a process."
        ),
        other => return Err(format!("a second capture: {other:?}").into()),
    }
    capture.end()?;
    let warnings = a.allocator.take_warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].starts_with("freeAsync() was called on an uncaptured allocation"));
    let current = s.h.rt.current_stream(D0)?;
    g.replay(&current)?;
    s.expect(&current, &output, 2.0, "the dropped input is still there")?;
    assert_eq!(a.allocated()?, allocated, "the free waits");
    let next = s.buffer(1.0)?;
    assert_eq!(
        a.allocated()?,
        allocated,
        "the deferred free ran at the next allocation, which took its place in the count"
    );
    drop(next);
    // With the first capture over, the other graph captures.
    let capture = other.capture(Some(&second), None, CaptureMode::ThreadLocal)?;
    s.scale(&second, &output, &output, 2.0)?;
    capture.end()?;
    other.replay(&current)?;
    s.expect(&current, &output, 4.0, "the second graph")?;
    Ok(())
}

/// A capture left by an early return (its guard dropped without `end`) ends the
/// allocator's capture: the next one begins.
pub(crate) fn async_capture_left_without_end_ends_the_allocators(h: &Harness) -> TestResult {
    let a = AsyncSetup::new(h)?;
    let s = &a.s;
    let g = a.graph()?;
    let input = s.buffer(1.0)?;
    let attempt = || -> TestResult {
        let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
        let scratch = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
        s.scale(capture.stream(), &scratch, &input, 2.0)?;
        Err("an early return".into())
    };
    assert!(attempt().is_err());
    assert!(!a.allocator.capture_underway());
    let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let output = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(capture.stream(), &output, &input, 5.0)?;
    capture.end()?;
    let current = s.h.rt.current_stream(D0)?;
    g.replay(&current)?;
    s.expect(&current, &output, 5.0, "output")?;
    Ok(())
}

/// `make_graphed_callables` under the async backend: the callables are captured one after
/// the other (one capture at a time), their outputs are graph memory, chained calls compute
/// as eagerly.
pub(crate) fn async_graphed_callables_chain(h: &Harness) -> TestResult {
    let a = AsyncSetup::new(h)?;
    let s = &a.s;
    let runs = std::cell::Cell::new(0);
    let graphed = make_graphed_callables(
        &s.h.rt,
        a.memory.clone(),
        D0,
        double_and_triple(s, &runs),
        vec![vec![s.buffer(0.0)?], vec![s.buffer(0.0)?]],
        GraphedOptions::default(),
    )?;
    assert!(!a.allocator.capture_underway());
    assert_eq!(runs.get(), 4, "3 warm-up runs and the capture");
    let stream = s.h.rt.current_stream(D0)?;
    for v in [4.0f32, 5.0] {
        let x = s.buffer(v)?;
        let y = graphed.call(0, &[&x])?;
        let z = graphed.call(1, &[&y[0]])?;
        s.expect(&stream, &z[0], 6.0 * v, "triple(double(x))")?;
    }
    Ok(())
}
