//! Capture and replay, private pools and their lifetime, the capture rules as typed errors,
//! pool sharing, fork/join, THREAD_LOCAL captures, exact memory statistics.
use crate::{D0, N, Setup, TestResult};
use ferrocuda_graph::{CaptureMode, CudaGraph, GraphError, PoolId};
use ferrocuda_stream::{DeviceBuffer, Stream};
use ferrocuda_testkit::Harness;
use ferrocuda_types::{CaptureStatus, DeviceIndex};

/// The `torch.cuda.graph` documentation example: fill the static input, replay, read the
/// static output, which was allocated inside the capture from the graph's private pool.
pub(crate) fn graph_replays_on_static_buffers(h: &Harness) -> TestResult {
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
pub(crate) fn capture_memory_outlives_reset(h: &Harness) -> TestResult {
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
pub(crate) fn capture_rules_are_typed_errors(h: &Harness) -> TestResult {
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

/// A capture left without `end` (a panic, or an early return through `?`) after a kernel
/// was launched into it leaves no half graph: the capture is over, the graph is empty, the
/// pool's use is released (PyTorch leaks it) and the next capture into the same graph works.
pub(crate) fn a_capture_left_without_end_is_discarded(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let g = s.graph()?;
    let stream = s.h.rt.new_stream(D0, 0)?;
    let x = s.buffer(1.0)?;
    let mut seen = None;
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if let Ok(_capture) = g.capture(Some(&stream), None, CaptureMode::ThreadLocal) {
            seen = g.pool();
            let _kept = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N);
            let _ = s.add_one(&stream, &x);
            std::panic::resume_unwind(Box::new("a panic inside the capture"));
        }
    }));
    assert!(
        unwound.is_err(),
        "the capture began and the closure unwound"
    );
    expect_discarded(&s, &g, &stream, seen.ok_or("the capture held a pool")?)?;

    let mut returned_early = || -> TestResult {
        let _capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
        seen = g.pool();
        let _kept = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
        s.add_one(&stream, &x)?;
        Err("an error inside the capture".into())
    };
    assert!(returned_early().is_err());
    expect_discarded(&s, &g, &stream, seen.ok_or("the capture held a pool")?)?;

    let capture = g.capture(Some(&stream), None, CaptureMode::ThreadLocal)?;
    s.add_one(&stream, &x)?;
    capture.end()?;
    g.replay(&stream)?;
    s.expect(&stream, &x, 2.0, "only the last capture's kernel ran")?;
    Ok(())
}

/// `g`, whose capture on `stream` into `pool` was left without `end`, holds nothing.
fn expect_discarded(s: &Setup, g: &CudaGraph, stream: &Stream, pool: PoolId) -> TestResult {
    assert_eq!(g.pool(), None, "the graph holds no pool");
    assert_eq!(
        s.pool_users(pool)?,
        Some(0),
        "the capture released its pool"
    );
    assert_eq!(
        s.h.rt.driver().stream_capture_status(stream.handle())?,
        CaptureStatus::None,
        "the capture is over"
    );
    assert_eq!(
        g.replay(stream),
        Err(GraphError::NothingCaptured),
        "no half graph is kept"
    );
    assert_eq!(g.node_count(), Err(GraphError::NothingCaptured));
    s.allocators.device(D0)?.empty_cache();
    assert_eq!(
        s.pool_users(pool)?,
        None,
        "its memory goes back at the next empty_cache"
    );
    Ok(())
}

/// Two graphs share a pool (`pool=g1.pool()`): the second capture reuses memory the first
/// freed, the pool has two users, and replays in capture order compute the chain.
pub(crate) fn graphs_share_a_pool(h: &Harness) -> TestResult {
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
pub(crate) fn forked_streams_join_the_capture(h: &Harness) -> TestResult {
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
pub(crate) fn thread_local_capture_ignores_other_threads(h: &Harness) -> TestResult {
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

/// Exact reserved and segment deltas across capture, replay, reset, freeing the outputs and
/// `empty_cache` (`test_graph_memory_stats_and_use_result_after_destroy_graph`): a small
/// allocation takes a 2 MiB segment and a 4 MiB one a 20 MiB segment, both in the pool.
pub(crate) fn graph_memory_stats_after_destroy(h: &Harness) -> TestResult {
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
pub(crate) fn record_stream_during_capture_defers_free(h: &Harness) -> TestResult {
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
pub(crate) fn concurrent_replay_with_separate_pools(h: &Harness) -> TestResult {
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

/// Three graphs, each with a temporary and an output: sharing one pool they fit in one
/// small segment, where separate pools take three; replayed in capture order they compute
/// the chain correctly.
pub(crate) fn three_graphs_share_one_segment(h: &Harness) -> TestResult {
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
