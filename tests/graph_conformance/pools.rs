//! What a capture does with the cache before it starts, and which stream captures share
//! when none is given (issue 12 items 3 and 4).
use crate::{D0, N, Setup, TestResult};
use ferrocuda::graph::CaptureMode;
use ferrocuda::stream::DeviceBuffer;
use ferrocuda::stream::conformance::Harness;

/// A 4 MiB buffer of `f32`: a large-pool request, served from a 20 MiB segment.
const FOUR_MIB: usize = 1 << 20;

/// `torch.cuda.graph.__enter__` synchronizes and empties the cache before the capture, so
/// a loop of capture, replay and drop (each round's graph gone before the next) stays at
/// the memory of one round: 100 rounds reserve what the first did.
pub(crate) fn capture_empties_the_cache_first(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let input = s.buffer(1.0)?;
    let current = s.h.rt.current_stream(D0)?;
    let mut first = None;
    for round in 0..100 {
        let g = s.graph()?;
        let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
        let stream = capture.stream().clone();
        let temporary = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, FOUR_MIB)?;
        s.scale(&stream, &temporary, &input, 2.0)?;
        let output = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
        s.scale(&stream, &output, &temporary, 3.0)?;
        drop(temporary);
        let during = alloc.stats().reserved_bytes.all.current;
        capture.end()?;
        g.replay(&current)?;
        s.expect(&current, &output, 6.0, &format!("round {round}"))?;
        let after = alloc.stats().reserved_bytes.all.current;
        let first = *first.get_or_insert((during, after));
        assert_eq!(
            (during, after),
            first,
            "round {round}: reserved (during the capture, after the replay) as in the first round"
        );
    }
    alloc.check_invariants()?;
    Ok(())
}

/// Captures that share a pool and name no stream capture on one stream (PyTorch's
/// class-level `torch.cuda.graph.default_capture_stream`), so the second reuses the block
/// the first freed: one small segment, where a stream per capture takes two.
pub(crate) fn captures_sharing_a_pool_share_a_stream(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let (g1, g2) = (s.graph()?, s.graph()?);
    let input = s.buffer(2.0)?;
    let before = alloc.stats().reserved_bytes.all.current;
    let capture = g1.capture(None, None, CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let temporary = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &temporary, &input, 10.0)?;
    let mid = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &mid, &temporary, 0.5)?;
    let freed = temporary.ptr();
    drop(temporary);
    capture.end()?;
    let pool = g1.pool().ok_or("g1 holds a pool")?;

    let capture = g2.capture(None, Some(pool), CaptureMode::ThreadLocal)?;
    assert_eq!(
        capture.stream(),
        &stream,
        "both captures run on the default capture stream"
    );
    let side = capture.stream().clone();
    let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&side, &out, &mid, 3.0)?;
    capture.end()?;
    assert_eq!(out.ptr(), freed, "g2 reuses the block g1 freed");
    assert_eq!(
        alloc.stats().reserved_bytes.all.current - before,
        2 << 20,
        "one small segment for both graphs"
    );
    let current = s.h.rt.current_stream(D0)?;
    g1.replay(&current)?;
    g2.replay(&current)?;
    s.expect(&current, &out, 30.0, "out")?;
    Ok(())
}
