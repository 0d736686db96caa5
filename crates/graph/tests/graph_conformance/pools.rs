//! What a capture does with the cache before it starts, and which stream captures share
//! when none is given (issue 12 items 3 and 4); re-capturing in a loop keeps memory flat.
use crate::{D0, N, Setup, TestResult};
use ferrocuda_driver::Call;
use ferrocuda_graph::CaptureMode;
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;
use ferrocuda_types::{KernelArg, LaunchConfig};

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

/// Elements of a 4 MiB `f32` output: a large-pool request, a 20 MiB private segment.
const OUTPUT_LEN: usize = 1 << 20;

/// Re-capturing in a loop, the most common pattern: each round makes a graph, captures a
/// kernel writing a fresh 4 MiB output (a private segment), ends the capture, replays,
/// synchronizes, then drops the output and the graph. Every replay writes what it should,
/// and device memory stays flat: reserved bytes (and, on the fake device, the driver's live
/// allocations) after round 100 are those after round 2. As PyTorch: the dropped graph's
/// pool is freeable (`releasePool` in `CUDAGraph::reset`, aten/src/ATen/cuda/CUDAGraph.cpp)
/// and the next capture's `empty_cache` (torch/cuda/graphs.py, `graph.__enter__`) gives its
/// segment back after synchronizing.
pub(crate) fn recapture_loop_keeps_memory_flat(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let fill = s.h.module()?.function("fill_f32")?;
    let current = s.h.rt.current_stream(D0)?;
    let live = || {
        s.h.fake
            .as_ref()
            .map(|f| f.calls(Call::Malloc) - f.calls(Call::Free))
    };
    let mut after_round_2 = None;
    for round in 0..100u32 {
        let g = s.graph()?;
        let capture = g.capture(None, None, CaptureMode::ThreadLocal)?;
        let stream = capture.stream().clone();
        let output = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, OUTPUT_LEN)?;
        let value = round as f32;
        let n = OUTPUT_LEN as u32;
        let args = [output.arg(), KernelArg::value(&value), KernelArg::value(&n)];
        stream.launch(&fill, &LaunchConfig::for_elements(OUTPUT_LEN, 256), &args)?;
        capture.end()?;
        let pool = g.pool().ok_or("a captured graph holds a pool")?;
        assert!(
            s.in_pool(pool, &output)?,
            "round {round}: the output is private"
        );
        g.replay(&current)?;
        current.synchronize()?;
        // (Reading 4 MiB back every round would make the loop slow on the fake device.)
        if round < 3 || round % 10 == 9 {
            let written = output.to_host()?;
            if let Some(i) = written.iter().position(|&v| v != value) {
                return Err(format!("round {round}: element {i} is {}", written[i]).into());
            }
        }
        drop(output);
        drop(g);
        let now = (alloc.stats().reserved_bytes.all.current, live());
        if round == 1 {
            after_round_2 = Some(now);
        }
        if let Some(expected) = after_round_2 {
            assert_eq!(
                now, expected,
                "round {round}: (reserved bytes, driver allocations) as after round 2"
            );
        }
    }
    alloc.check_invariants()?;
    Ok(())
}
