//! Scenarios of CUDA graph capture under `backend:cudaMallocAsync` (PyTorch's
//! CUDAMallocAsyncAllocator.cpp with CUDAGraph.cpp), on the fake device: threads, side streams,
//! record_stream, unjoined and invalidated captures, double and foreign frees, the memory
//! fraction, out of memory during a capture, destroyed streams.
use crate::async_backend::AsyncSetup;
use crate::{BoxError, D0, N, TestResult};
use ferrocuda_alloc::{AllocError, AsyncAllocator};
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver};
use ferrocuda_graph::{CaptureMemory, CaptureMode, CudaGraph, GraphError};
use ferrocuda_stream::{DeviceBuffer, Stream, StreamError};
use ferrocuda_testkit::{Harness, fake_harness};
use ferrocuda_types::{CaptureStatus, DevicePtr};
use std::sync::Arc;

type Res<T> = Result<T, BoxError>;
const MIB: i64 = 1 << 20;
const ONE_CAPTURE: &str = "Only one capture at a time is allowed in a process.";
const CAPTURED_FREE: &str = "Attempting uncaptured free of a captured allocation with address";
const DEFERRED_FREE: &str =
    "freeAsync() was called on an uncaptured allocation during graph capture";

/// An [`AsyncSetup`] over a fake harness, with the scenarios' helpers.
struct Fx<'h> {
    h: &'h Harness,
    a: Arc<AsyncAllocator>,
    memory: CaptureMemory,
    base: AsyncSetup<'h>,
}

impl<'h> Fx<'h> {
    fn new(h: &'h Harness) -> Res<Fx<'h>> {
        let base = AsyncSetup::new(h)?;
        Ok(Fx {
            h,
            a: base.allocator.clone(),
            memory: base.memory.clone(),
            base,
        })
    }

    fn fake(&self) -> Res<&Arc<FakeDriver>> {
        Ok(self.h.fake.as_ref().ok_or("a fake harness")?)
    }

    fn graph(&self) -> Result<CudaGraph, GraphError> {
        self.base.graph()
    }

    fn stat(&self, key: &str) -> Res<i64> {
        Ok(self.a.stats(D0)?.to_map()[key])
    }

    fn figures(&self) -> Res<[i64; 5]> {
        Ok([
            self.stat("allocated_bytes.all.current")?,
            self.stat("allocated_bytes.all.peak")?,
            self.stat("active_bytes.all.current")?,
            self.stat("reserved_bytes.all.current")?,
            self.stat("reserved_bytes.all.peak")?,
        ])
    }

    fn buf(&self, v: f32) -> Res<DeviceBuffer<f32>> {
        self.base.s.buffer(v)
    }

    fn uninit(&self, n: usize) -> Res<DeviceBuffer<f32>> {
        Ok(DeviceBuffer::uninit(&self.h.rt, D0, n)?)
    }

    fn scale(
        &self,
        s: &Stream,
        y: &DeviceBuffer<f32>,
        x: &DeviceBuffer<f32>,
        a: f32,
    ) -> TestResult {
        self.base.s.scale(s, y, x, a)
    }

    fn add_one(&self, s: &Stream, x: &DeviceBuffer<f32>) -> TestResult {
        self.base.s.add_one(s, x)
    }

    fn current(&self) -> Res<Stream> {
        Ok(self.h.rt.current_stream(D0)?)
    }

    fn expect(&self, buf: &DeviceBuffer<f32>, v: f32, what: &str) -> TestResult {
        self.h.rt.synchronize(D0)?;
        let values = buf.to_host()?;
        match values.iter().position(|&x| x != v) {
            None => Ok(()),
            Some(i) => Err(format!("{what}: element {i} is {}, expected {v}", values[i]).into()),
        }
    }

    /// A memory fraction whose limit is exactly `bytes`.
    fn limit_to(&self, bytes: u64) -> TestResult {
        let (_, total) = self.h.rt.driver().mem_get_info(D0)?;
        self.a
            .set_memory_fraction((bytes as f64 + 0.5) / total as f64, D0)?;
        Ok(())
    }
}

fn starts(w: &[String], i: usize, prefix: &str) -> bool {
    w.get(i).is_some_and(|s| s.starts_with(prefix))
}

/// A second capture (another graph, another thread, another stream) is refused with
/// PyTorch's text by `capture_begin`; the first capture is untouched and replays; a graph
/// that is not capturing cannot end the allocator's capture.
#[test]
fn second_capture_begin_from_another_thread_is_refused_and_first_survives() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let input = f.buf(3.0)?;
    let g1 = f.graph()?;
    let idle = f.graph()?;
    let cap = g1.capture(None, None, CaptureMode::ThreadLocal)?;
    let s1 = cap.stream().clone();
    let out = f.uninit(N)?;
    f.scale(&s1, &out, &input, 2.0)?;
    let (rt, memory) = (f.h.rt.clone(), f.memory.clone());
    let refusal = std::thread::scope(|sc| {
        sc.spawn(move || -> Result<String, String> {
            let g2 = CudaGraph::new(rt.clone(), memory, D0).map_err(|e| e.to_string())?;
            let s2 = rt.new_stream(D0, 0).map_err(|e| e.to_string())?;
            Ok(
                match g2.capture_begin(&s2, None, CaptureMode::ThreadLocal) {
                    Ok(()) => "began".to_string(),
                    Err(e) => e.to_string(),
                },
            )
        })
        .join()
        .map_err(|_| "thread panicked".to_string())?
    })?;
    assert_eq!(refusal, ONE_CAPTURE, "capture_begin from another thread");
    assert!(
        f.a.capture_underway(),
        "the refusal left the first capture underway"
    );
    // A graph with no capture cannot end (or reset away) the allocator's capture.
    assert!(matches!(idle.capture_end(), Err(GraphError::NotCapturing)));
    idle.reset()?;
    assert!(f.a.capture_underway());
    cap.end()?;
    assert!(!f.a.capture_underway());
    g1.replay(&f.current()?)?;
    f.expect(&out, 6.0, "first graph after the refusal")?;
    Ok(())
}

/// `capture` from another thread while a capture is underway synchronizes the device first
/// (as `torch.cuda.graph.__enter__` runs `torch.cuda.synchronize()`): the driver refuses the
/// synchronize (900) and invalidates the capture underway, whatever its mode, as an H200
/// does (docs/measurements/h200_2026-12-01h/ctx_sync_probe.py). The first capture's end
/// then reports the invalidation and releases its pool; the allocator's capture is over.
#[test]
fn second_capture_from_another_thread_breaks_the_first_with_its_synchronize() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let input = f.buf(3.0)?;
    for mode in [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ] {
        let g1 = f.graph()?;
        let cap = g1.capture(None, None, mode)?;
        let out = f.uninit(N)?;
        f.scale(cap.stream(), &out, &input, 2.0)?;
        let (rt, memory) = (f.h.rt.clone(), f.memory.clone());
        let second = std::thread::scope(|sc| {
            sc.spawn(move || -> Result<Result<(), GraphError>, String> {
                let g2 = CudaGraph::new(rt.clone(), memory, D0).map_err(|e| e.to_string())?;
                let s2 = rt.new_stream(D0, 0).map_err(|e| e.to_string())?;
                Ok(g2.capture(Some(&s2), None, mode).map(drop))
            })
            .join()
            .map_err(|_| "thread panicked".to_string())?
        })?;
        assert!(
            matches!(
                second,
                Err(GraphError::Stream(StreamError::Driver(e)))
                    if e == DriverError::STREAM_CAPTURE_UNSUPPORTED
            ),
            "{mode:?}: the second capture's synchronize is refused, got {second:?}"
        );
        assert!(
            matches!(cap.end(), Err(GraphError::Invalidated)),
            "{mode:?}: the first capture was invalidated"
        );
        assert!(!f.a.capture_underway(), "{mode:?}: no capture is left");
        assert!(
            matches!(g1.replay(&f.current()?), Err(GraphError::NothingCaptured)),
            "{mode:?}: nothing to replay"
        );
        drop(out);
    }
    // The device works on afterwards, and a capture from this thread succeeds.
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let out = f.uninit(N)?;
    f.scale(cap.stream(), &out, &input, 2.0)?;
    cap.end()?;
    g.replay(&f.current()?)?;
    f.expect(&out, 6.0, "a capture after the broken ones")?;
    Ok(())
}

/// Allocations and frees during the capture are graph memory: allocated, active and
/// reserved figures (current and peak) do not move with the capture, over
/// replays, or when the held output is finally freed (PyTorch's warning, naming it).
#[test]
fn captured_memory_stays_outside_every_pool_figure() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let input = f.buf(1.0)?;
    f.h.rt.synchronize(D0)?;
    f.a.empty_cache()?;
    let before = f.figures()?;
    assert_eq!(before[0], 2 * MIB, "one 2 MiB block for the input");
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let big = f.uninit(3 << 18)?; // 3 MiB
    let tmp = f.uninit(N)?;
    f.scale(&s, &tmp, &input, 2.0)?;
    let out = f.uninit(N)?;
    f.scale(&s, &out, &tmp, 3.0)?;
    drop(tmp);
    drop(big);
    // Read after the capture: the driver refuses the pool's attributes during one.
    cap.end()?;
    assert_eq!(f.figures()?, before, "after the capture");
    assert_eq!(g.node_count()?, 7, "3 allocations, 2 kernels, 2 frees");
    let current = f.current()?;
    for v in [1.0f32, 2.0, 5.0] {
        input.copy_from_host(&vec![v; N])?;
        g.replay(&current)?;
        f.expect(&out, 6.0 * v, "replay")?;
        assert_eq!(f.figures()?, before, "after a replay");
    }
    assert!(f.a.take_warnings().is_empty());
    let addr = out.ptr();
    drop(out);
    let w = f.a.take_warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].starts_with(&format!("{CAPTURED_FREE} {:#x}", addr.0)),
        "{w:?}"
    );
    assert_eq!(f.figures()?, before, "after the output is freed");
    g.reset()?;
    Ok(())
}

/// Buffers from before the capture dropped during it: one warning (the first address),
/// nothing freed during the capture (an allocation inside it does not flush them), nor by
/// a 0-byte allocation after it; the next real allocation outside a capture frees both (the
/// record_stream'd one through the unifying stream). A later capture does not warn again.
#[test]
fn uncaptured_frees_wait_for_the_next_uncaptured_allocation() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let rt = &f.h.rt;
    let current = f.current()?;
    let x = f.buf(1.0)?;
    let y = f.buf(2.0)?;
    let side = rt.new_stream(D0, 0)?;
    side.wait_stream(&current)?;
    f.add_one(&side, &y)?;
    y.record_stream(&side)?;
    rt.synchronize(D0)?;
    f.a.empty_cache()?;
    let base = f.stat("allocated_bytes.all.current")?;
    assert_eq!(base, 4 * MIB);
    let xp = x.ptr();
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let out = f.uninit(N)?;
    f.scale(&s, &out, &x, 2.0)?;
    drop(x);
    drop(y);
    let w = f.a.take_warnings();
    assert_eq!(w.len(), 1, "warned once: {w:?}");
    assert!(
        w[0].starts_with(&format!("{DEFERRED_FREE} (address = {:#x})", xp.0)),
        "{w:?}"
    );
    let tmp = f.uninit(N)?;
    f.add_one(&s, &tmp)?;
    drop(tmp);
    cap.end()?;
    assert_eq!(
        f.stat("allocated_bytes.all.current")?,
        base,
        "after the capture"
    );
    let frees = f.fake()?.calls(Call::MemFreeAsync);
    let waits = f.fake()?.calls(Call::StreamWaitEvent);
    assert_eq!(f.a.allocate(D0, 0, current.handle())?, DevicePtr(0));
    assert_eq!(
        f.fake()?.calls(Call::MemFreeAsync),
        frees,
        "0 bytes flushes nothing"
    );
    let next = f.buf(5.0)?;
    assert_eq!(
        f.fake()?.calls(Call::MemFreeAsync) - frees,
        2,
        "both deferred frees ran"
    );
    assert!(
        f.fake()?.calls(Call::StreamWaitEvent) - waits >= 2,
        "the unifying stream waited on y's creation and side streams"
    );
    rt.synchronize(D0)?;
    assert_eq!(
        f.stat("allocated_bytes.all.current")?,
        2 * MIB,
        "only `next` is left"
    );
    // Another capture with another deferred free: TORCH_WARN_ONCE does not warn again.
    let w2 = f.buf(0.0)?;
    let g2 = f.graph()?;
    let cap2 = g2.capture(None, None, CaptureMode::ThreadLocal)?;
    f.add_one(cap2.stream(), &next)?;
    drop(w2);
    cap2.end()?;
    assert!(f.a.take_warnings().is_empty(), "warned once per process");
    drop(out);
    Ok(())
}

/// Two graphs, each with a held output: interleaved replays write each output at its
/// address (auto-free-on-launch); after `reset` the output keeps the last replay's values
/// and the other graph still replays; freeing each names its own address.
#[test]
fn held_outputs_survive_interleaved_replays_and_reset() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let input = f.buf(1.0)?;
    let g1 = f.graph()?;
    let cap = g1.capture(None, None, CaptureMode::ThreadLocal)?;
    let out1 = f.uninit(N)?;
    f.scale(cap.stream(), &out1, &input, 2.0)?;
    cap.end()?;
    let g2 = f.graph()?;
    let cap = g2.capture(None, None, CaptureMode::ThreadLocal)?;
    let out2 = f.uninit(N)?;
    f.scale(cap.stream(), &out2, &input, 10.0)?;
    cap.end()?;
    assert_ne!(out1.ptr(), out2.ptr());
    let current = f.current()?;
    for v in [1.0f32, 3.0, 4.0] {
        input.copy_from_host(&vec![v; N])?;
        g1.replay(&current)?;
        g2.replay(&current)?;
        g1.replay(&current)?;
        f.expect(&out1, 2.0 * v, "out1")?;
        f.expect(&out2, 10.0 * v, "out2")?;
    }
    g1.reset()?;
    f.expect(&out1, 8.0, "out1 after reset")?;
    input.copy_from_host(&vec![7.0; N])?;
    g2.replay(&current)?;
    f.expect(&out2, 70.0, "out2 after g1's reset")?;
    f.expect(&out1, 8.0, "out1 untouched by g2")?;
    let (p1, p2) = (out1.ptr(), out2.ptr());
    drop(out1);
    drop(out2);
    let w = f.a.take_warnings();
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].starts_with(&format!("{CAPTURED_FREE} {:#x}", p1.0)),
        "{w:?}"
    );
    assert!(
        w[1].starts_with(&format!("{CAPTURED_FREE} {:#x}", p2.0)),
        "{w:?}"
    );
    Ok(())
}

/// PyTorch's Note [Avoid dangling free streams during CUDA graph capture], its own
/// example: fork side stream B from capture stream A, create T in B, join A with B, and
/// T's destructor runs after the join. PyTorch's `CUDAGraph::capture_end` calls
/// `endAllocateToPool` (which joins B) only after `cudaStreamEndCapture`, so the capture
/// is unjoined there, and here; unlike PyTorch (whose check throws before
/// `endAllocateToPool`), the allocator's capture is over and the graph captures again.
#[test]
fn side_stream_tensor_freed_after_the_rejoin_does_not_dangle() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let rt = &f.h.rt;
    let input = f.buf(2.0)?;
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let out = f.uninit(N)?;
    let side = rt.new_stream(D0, 0)?;
    side.wait_stream(&s)?;
    let t = {
        let _on_side = rt.stream_guard(&side)?;
        f.uninit(N)?
    };
    f.scale(&side, &t, &input, 3.0)?;
    f.scale(&side, &out, &t, 2.0)?;
    s.wait_stream(&side)?;
    drop(t); // after the join: a free node on B
    let ended = cap.end();
    assert!(
        matches!(ended, Err(GraphError::Unjoined)),
        "capture end: {ended:?}"
    );
    assert!(!f.a.capture_underway());
    drop(out);
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let out = f.uninit(N)?;
    f.scale(cap.stream(), &out, &input, 3.0)?;
    cap.end()?;
    g.replay(&f.current()?)?;
    f.expect(&out, 6.0, "replay of the second capture")?;
    Ok(())
}

/// A captured buffer used on a side stream (record_stream) and freed during the capture
/// is freed on the unifying stream after waiting for both; that stream is joined only after
/// the capture ended (PyTorch's order), so the capture is unjoined; the allocator's capture
/// is over all the same.
#[test]
fn record_streamed_captured_buffer_freed_in_capture_is_joined() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let rt = &f.h.rt;
    let input = f.buf(4.0)?;
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let tmp = f.uninit(N)?;
    let out = f.uninit(N)?;
    f.scale(&s, &tmp, &input, 1.0)?;
    let side = rt.new_stream(D0, 0)?;
    side.wait_stream(&s)?;
    f.add_one(&side, &tmp)?;
    tmp.record_stream(&side)?;
    s.wait_stream(&side)?;
    f.scale(&s, &out, &tmp, 2.0)?;
    drop(tmp);
    let ended = cap.end();
    assert!(
        matches!(ended, Err(GraphError::Unjoined)),
        "capture end: {ended:?}"
    );
    assert!(!f.a.capture_underway());
    Ok(())
}

/// An unjoined side stream: the capture fails with `Unjoined`, the allocator's capture
/// is over, figures are back after the drops, and the same graph then captures and replays.
#[test]
fn unjoined_capture_fails_cleanly_and_the_graph_captures_again() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let rt = &f.h.rt;
    let input = f.buf(1.0)?;
    rt.synchronize(D0)?;
    f.a.empty_cache()?;
    let base = f.figures()?;
    let g = f.graph()?;
    let side = rt.new_stream(D0, 0)?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    side.wait_stream(&s)?;
    let t = {
        let _on_side = rt.stream_guard(&side)?;
        f.uninit(N)?
    };
    f.scale(&side, &t, &input, 2.0)?;
    let ended = cap.end();
    assert!(matches!(ended, Err(GraphError::Unjoined)), "{ended:?}");
    assert!(!f.a.capture_underway());
    drop(t);
    let _ = f.a.take_warnings();
    assert_eq!(f.figures()?, base, "nothing left behind");
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let out = f.uninit(N)?;
    f.scale(cap.stream(), &out, &input, 5.0)?;
    cap.end()?;
    g.replay(&f.current()?)?;
    f.expect(&out, 5.0, "second capture")?;
    Ok(())
}

/// A capture invalidated by an illegal call (synchronizing the capturing stream), with a
/// captured temporary freed inside the broken capture: the capture fails with
/// `Invalidated`, the allocator's capture is over, and the allocator's own count (what the
/// memory fraction checks) is back to the input alone: the whole limit is usable again.
#[test]
fn invalidated_capture_leaves_no_capture_and_no_counted_bytes() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let rt = &f.h.rt;
    let input = f.buf(1.0)?; // 4 KiB counted
    let limit: u64 = 8 << 20;
    f.limit_to(limit)?;
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let tmp = f.uninit(1 << 20)?; // 4 MiB, captured
    f.add_one(&s, &tmp)?;
    assert!(
        s.synchronize().is_err(),
        "synchronizing a capturing stream is refused"
    );
    drop(tmp); // freed inside the broken capture
    let ended = cap.end();
    assert!(matches!(ended, Err(GraphError::Invalidated)), "{ended:?}");
    assert!(!f.a.capture_underway());
    let _ = f.a.take_warnings();
    // Everything but the input is gone: the rest of the limit can be allocated.
    let rest = (limit as usize - N * 4) / 4;
    let fill = DeviceBuffer::<f32>::uninit(rt, D0, rest);
    assert!(
        fill.is_ok(),
        "allocating up to the limit: {:?}",
        fill.err().map(|e| e.to_string())
    );
    drop(fill);
    // The next capture works.
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let out = f.uninit(N)?;
    f.scale(cap.stream(), &out, &input, 9.0)?;
    cap.end()?;
    g.replay(&f.current()?)?;
    f.expect(&out, 9.0, "capture after the invalidated one")?;
    Ok(())
}

/// THREAD_LOCAL capture: another thread allocates, fills, reads and frees a buffer on its
/// own stream meanwhile. That memory is the pool's (counted while alive), its work runs
/// eagerly and is not in the graph.
#[test]
fn other_threads_allocation_during_thread_local_capture_is_not_captured() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let input = f.buf(2.0)?;
    f.h.rt.synchronize(D0)?;
    let base = f.stat("allocated_bytes.all.current")?;
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let out = f.uninit(N)?;
    f.scale(&s, &out, &input, 4.0)?;
    let (rt, a) = (f.h.rt.clone(), f.a.clone());
    let seen = std::thread::scope(|sc| {
        sc.spawn(move || -> Result<(i64, Vec<f32>, i64), String> {
            let e = |e: &dyn std::fmt::Display| e.to_string();
            let mine = rt.new_stream(D0, 0).map_err(|x| e(&x))?;
            let _g = rt.stream_guard(&mine).map_err(|x| e(&x))?;
            let b = DeviceBuffer::<f32>::filled(&rt, D0, N, 7.0).map_err(|x| e(&x))?;
            mine.synchronize().map_err(|x| e(&x))?;
            let values = b.to_host().map_err(|x| e(&x))?;
            let during = a.stats(D0).map_err(|x| e(&x))?.to_map()["allocated_bytes.all.current"];
            drop(b);
            let after = a.stats(D0).map_err(|x| e(&x))?.to_map()["allocated_bytes.all.current"];
            Ok((during, values, after))
        })
        .join()
        .map_err(|_| "thread panicked".to_string())?
    })?;
    let (during, values, after) = seen;
    assert!(values.iter().all(|&v| v == 7.0), "the other thread's data");
    assert_eq!(
        during,
        base + 2 * MIB,
        "the other thread's buffer is pool memory"
    );
    assert_eq!(after, base, "and is freed at once");
    let ended = cap.end();
    assert!(
        ended.is_ok(),
        "capture end after the other thread (and its stream) finished: {ended:?}; \
         allocator capture_underway = {}",
        f.a.capture_underway()
    );
    assert_eq!(
        g.node_count()?,
        2,
        "only this thread's allocation and kernel"
    );
    g.replay(&f.current()?)?;
    f.expect(&out, 8.0, "replay")?;
    Ok(())
}

/// Double frees: a captured pointer freed twice in the capture, a captured output freed
/// twice after it (one warning), are refused by the allocator; and the driver refuses a
/// graph memory pointer freed twice and a captured free of memory not from the graph.
#[test]
fn double_frees_and_foreign_frees_are_refused() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let fake = f.fake()?.clone();
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let p = f.a.allocate(D0, 4096, s.handle())?;
    let o = f.a.allocate(D0, 4096, s.handle())?;
    f.a.free(p)?;
    assert!(matches!(f.a.free(p), Err(AllocError::InvalidPointer(q)) if q == p));
    cap.end()?;
    g.replay(&f.current()?)?;
    f.h.rt.synchronize(D0)?;
    f.a.free(o)?;
    assert!(matches!(f.a.free(o), Err(AllocError::InvalidPointer(q)) if q == o));
    let w = f.a.take_warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(starts(&w, 0, CAPTURED_FREE));
    // The driver's rules, on a raw capture of its own.
    let raw = f.h.rt.new_stream(D0, 0)?;
    let other = f.h.rt.new_stream(D0, 0)?;
    let pool_mem = fake.mem_alloc_async(D0, 4096, other.handle())?;
    fake.stream_begin_capture(raw.handle(), CaptureMode::ThreadLocal)?;
    let gm = fake.mem_alloc_async(D0, 4096, raw.handle())?;
    fake.mem_free_async(gm, raw.handle())?;
    assert_eq!(
        fake.mem_free_async(gm, raw.handle()),
        Err(DriverError::INVALID_VALUE)
    );
    assert_eq!(
        fake.mem_free_async(pool_mem, raw.handle()),
        Err(DriverError::INVALID_VALUE)
    );
    let graph = fake.stream_end_capture(raw.handle());
    if let Ok(graph) = graph {
        fake.graph_destroy(graph)?;
    }
    fake.mem_free_async(pool_mem, other.handle())?;
    Ok(())
}

/// A capture discarded (guard dropped) while a captured buffer is still alive and a
/// pre-capture buffer was dropped in it: the allocator's capture is over; freeing the
/// captured buffer is PyTorch's uncaptured free of a captured allocation; the deferred
/// free runs at the next allocation; the graph captures again.
#[test]
fn discarded_capture_with_live_captured_buffer_and_deferred_free() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let rt = &f.h.rt;
    let x = f.buf(3.0)?;
    let input = f.buf(1.0)?;
    rt.synchronize(D0)?;
    let g = f.graph()?;
    let keep = {
        let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
        let keep = f.uninit(N)?;
        f.scale(cap.stream(), &keep, &x, 2.0)?;
        drop(x);
        keep
        // `cap` dropped without end: discarded
    };
    assert!(!f.a.capture_underway());
    let w = f.a.take_warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(starts(&w, 0, DEFERRED_FREE));
    drop(keep);
    let w = f.a.take_warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(starts(&w, 0, CAPTURED_FREE));
    assert_eq!(f.stat("allocated_bytes.all.current")?, 4 * MIB, "x waits");
    let next = f.buf(0.0)?;
    rt.synchronize(D0)?;
    assert_eq!(
        f.stat("allocated_bytes.all.current")?,
        4 * MIB,
        "x gone, next in"
    );
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let out = f.uninit(N)?;
    f.scale(cap.stream(), &out, &input, 3.0)?;
    cap.end()?;
    g.replay(&f.current()?)?;
    f.expect(&out, 3.0, "after the discarded capture")?;
    drop(next);
    Ok(())
}

/// The memory fraction counts captured allocations (PyTorch's `pytorch_used_bytes`):
/// past the limit a captured allocation is refused with PyTorch's text, the capture goes
/// on, a captured free gives the bytes back, and the graph ends and replays.
#[test]
fn memory_fraction_counts_captured_bytes_and_a_refusal_keeps_the_capture() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let input = f.buf(1.0)?; // 4 KiB
    f.limit_to(64 << 10)?;
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let a1 = f.uninit(8192)?; // 32 KiB
    let refused = DeviceBuffer::<f32>::uninit(&f.h.rt, D0, 8192);
    let text = refused.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text.contains("Allocation on device 0 would exceed allowed memory"),
        "{text}"
    );
    assert!(
        text.contains("Currently allocated     : 36.00 KiB"),
        "{text}"
    );
    drop(a1);
    let a3 = f.uninit(8192)?;
    let out = f.uninit(N)?;
    f.scale(&s, &out, &input, 2.0)?;
    drop(a3);
    cap.end()?;
    g.replay(&f.current()?)?;
    f.expect(&out, 2.0, "replay")?;
    Ok(())
}

/// An allocation the device cannot serve during a capture: the out-of-memory error is
/// reported (PyTorch: OutOfMemoryError, catchable) and the capture stays valid: no
/// synchronization of the capturing stream (CUDA invalidates a capture on that).
#[test]
fn pool_out_of_memory_during_capture_does_not_invalidate_it() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let input = f.buf(1.0)?;
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let syncs = f.fake()?.calls(Call::StreamSynchronize);
    let huge = f.a.allocate(D0, 200 << 30, s.handle());
    assert!(
        matches!(huge, Err(AllocError::PoolOutOfMemory(_))),
        "{huge:?}"
    );
    let status = f.fake()?.stream_capture_status(s.handle())?;
    assert!(
        matches!(status, CaptureStatus::Active { .. }),
        "capture status after the refused allocation: {status:?} \
         (stream_synchronize calls during it: {})",
        f.fake()?.calls(Call::StreamSynchronize) - syncs
    );
    let out = f.uninit(N)?;
    f.scale(&s, &out, &input, 2.0)?;
    let ended = cap.end();
    assert!(ended.is_ok(), "capture end after a caught OOM: {ended:?}");
    g.replay(&f.current()?)?;
    f.expect(&out, 2.0, "replay")?;
    Ok(())
}

/// A side stream that allocated and freed during the capture, joined, and dropped
/// before the end (a Rust scope): whatever the end reports, the allocator's capture must be
/// over, so the next capture begins.
#[test]
fn side_stream_dropped_before_end_does_not_wedge_the_allocator() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let rt = &f.h.rt;
    let input = f.buf(1.0)?;
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let s = cap.stream().clone();
    let out = f.uninit(N)?;
    {
        let side = rt.new_stream(D0, 0)?;
        side.wait_stream(&s)?;
        let _on_side = rt.stream_guard(&side)?;
        let t = f.uninit(N)?;
        f.scale(&side, &t, &input, 2.0)?;
        f.scale(&side, &out, &t, 2.0)?;
        drop(t);
        s.wait_stream(&side)?;
    }
    let ended = cap.end();
    let g2 = f.graph()?;
    let again = g2
        .capture(None, None, CaptureMode::ThreadLocal)
        .map(|c| c.end());
    assert!(
        !f.a.capture_underway(),
        "capture still underway after end: end = {ended:?}; next capture = {:?}",
        again.as_ref().map_err(|e| e.to_string())
    );
    assert!(
        matches!(again, Ok(Err(GraphError::EmptyCapture)) | Ok(Ok(()))),
        "next capture: {again:?}"
    );
    Ok(())
}

/// A deferred free of a buffer record_stream'd onto a stream dropped since must not make
/// the next (unrelated) allocation fail or lose the other deferred frees.
#[test]
fn deferred_free_with_a_dropped_recorded_stream_does_not_fail_the_next_allocation() -> TestResult {
    let h = fake_harness();
    let f = Fx::new(&h)?;
    let rt = &f.h.rt;
    let current = f.current()?;
    let x = f.buf(1.0)?;
    let y = f.buf(1.0)?;
    {
        let side = rt.new_stream(D0, 0)?;
        side.wait_stream(&current)?;
        f.add_one(&side, &x)?;
        x.record_stream(&side)?;
    }
    rt.synchronize(D0)?;
    let g = f.graph()?;
    let cap = g.capture(None, None, CaptureMode::ThreadLocal)?;
    let out = f.uninit(N)?;
    f.scale(cap.stream(), &out, &y, 1.0)?;
    drop(x);
    drop(y);
    cap.end()?;
    let next = DeviceBuffer::<f32>::filled(rt, D0, N, 0.0);
    let retry = DeviceBuffer::<f32>::filled(rt, D0, N, 0.0);
    rt.synchronize(D0)?;
    assert!(
        next.is_ok(),
        "allocation after the capture: {:?}; a retry: {:?}; allocated now: {} bytes",
        next.as_ref().err().map(|e| e.to_string()),
        retry.as_ref().err().map(|e| e.to_string()),
        f.stat("allocated_bytes.all.current")?
    );
    drop(retry);
    let after = f.stat("allocated_bytes.all.current")?;
    assert!(
        after <= 2 * MIB,
        "deferred frees ran: {after} bytes allocated"
    );
    Ok(())
}
