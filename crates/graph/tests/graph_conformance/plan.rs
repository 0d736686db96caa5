//! The graph-memory planner against real captures: a decode loop of eight batch sizes,
//! warmed up eagerly with its requests recorded, planned, then captured largest first into
//! one shared pool (as vLLM captures); after every capture the pool reserves exactly what
//! the plan said, with the outputs kept (graphs that own them) and with them freed
//! (vLLM's weak references), and every graph replays to its eager result.
use crate::{BoxError, D0, N, Setup, TestResult};
use ferrocuda_alloc::{AfterCapture, CaptureRequests, plan_pool};
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::{DeviceBuffer, Stream};
use ferrocuda_testkit::Harness;
use ferrocuda_types::AllocatorConfig;

/// The batch sizes, captured largest first.
const BATCHES: [usize; 8] = [48, 32, 24, 16, 8, 4, 2, 1];
/// Elements of one token's hidden state.
const HIDDEN: usize = 4096;

/// One decode step for `batch` tokens on `stream` (buffers come from the current stream:
/// the capture's, or `stream` made current for the warm-up): a hidden state, an MLP's
/// widened temporary, a scratch of attention's size; returns the output, which holds
/// `2 * 3 * 0.5 * input` in its first `N` elements.
fn decode_step(
    s: &Setup<'_>,
    stream: &Stream,
    input: &DeviceBuffer<f32>,
    batch: usize,
) -> Result<DeviceBuffer<f32>, BoxError> {
    let rt = &s.h.rt;
    let hidden = DeviceBuffer::<f32>::uninit(rt, D0, (batch * HIDDEN).max(N))?;
    s.scale(stream, &hidden, input, 2.0)?;
    let wide = DeviceBuffer::<f32>::uninit(rt, D0, 4 * batch * HIDDEN)?;
    s.scale(stream, &wide, &hidden, 3.0)?;
    drop(hidden);
    let scratch = DeviceBuffer::<f32>::uninit(rt, D0, batch * 64 * 1024)?;
    s.scale(stream, &scratch, &wide, 1.0)?;
    drop(wide);
    let out = DeviceBuffer::<f32>::uninit(rt, D0, (batch * HIDDEN).max(N))?;
    s.scale(stream, &out, &scratch, 0.5)?;
    Ok(out)
}

/// Checks that the first `N` elements of a step's output (what its kernels write) are 3.
fn expect_head(stream: &Stream, out: &DeviceBuffer<f32>, what: &str) -> TestResult {
    stream.synchronize()?;
    let values = out.to_host()?;
    match values[..N].iter().position(|&v| v != 3.0) {
        None => Ok(()),
        Some(i) => Err(format!("{what}: element {i} is {}, expected 3", values[i]).into()),
    }
}

fn decode_loop(h: &Harness, after: AfterCapture) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let input = s.buffer(1.0)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    // Warm-up: each size once, eagerly, on a side stream, its requests recorded.
    let side = s.h.rt.new_stream(D0, 0)?;
    let mut recorded: Vec<CaptureRequests> = Vec::new();
    for &batch in &BATCHES {
        let _current = s.h.rt.stream_guard(&side)?;
        let (out, requests) = alloc.record_requests(&[], || decode_step(&s, &side, &input, batch));
        expect_head(&side, &out?, "warm-up")?;
        recorded.push(requests);
    }
    let config = AllocatorConfig::default();
    let plan = plan_pool(&config, &recorded, after)?;
    let (kept, freed) = (
        plan_pool(&config, &recorded, AfterCapture::KeepOutputs)?,
        plan_pool(&config, &recorded, AfterCapture::FreeOutputs)?,
    );
    assert!(
        freed.reserved_bytes < kept.reserved_bytes,
        "freed outputs leave the pool room: {freed:?} against {kept:?}"
    );

    let mut graphs: Vec<(CudaGraph, Option<DeviceBuffer<f32>>)> = Vec::new();
    let mut pool = None;
    let mut reserved = Vec::new();
    for &batch in &BATCHES {
        let g = s.graph()?;
        let capture = g.capture(None, pool, CaptureMode::ThreadLocal)?;
        let stream = capture.stream().clone();
        let out = decode_step(&s, &stream, &input, batch)?;
        capture.end()?;
        let id = g.pool().ok_or("a captured graph holds a pool")?;
        pool = Some(id);
        // Freed outputs: the pool may hand their memory to the next capture.
        let out = (after == AfterCapture::KeepOutputs).then_some(out);
        reserved.push(alloc.pool_reserved_bytes(id));
        graphs.push((g, out));
    }
    assert_eq!(
        plan.reserved_after, reserved,
        "{after:?}: planned against captured, after each capture"
    );
    assert!(plan.reserved_bytes >= 20 << 20, "{plan:?}");
    let current = s.h.rt.current_stream(D0)?;
    for (g, out) in &graphs {
        g.replay(&current)?;
        if let Some(out) = out {
            expect_head(&current, out, "replay")?;
        }
    }
    alloc.check_invariants()?;
    Ok(())
}

/// Captures keep their outputs: the plan equals the shared pool after each of 8 captures.
pub(crate) fn the_plan_equals_a_decode_loops_captures(h: &Harness) -> TestResult {
    decode_loop(h, AfterCapture::KeepOutputs)
}

/// Outputs freed after each capture (vLLM's weak references): the plan still equals.
pub(crate) fn the_plan_equals_captures_that_free_their_outputs(h: &Harness) -> TestResult {
    decode_loop(h, AfterCapture::FreeOutputs)
}
