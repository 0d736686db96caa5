//! Collectives captured into a CUDA graph on the fake device (graphs spec §10 item 8): a
//! one-rank group's all-reduce, with the process group's stream protocol (the communication
//! stream forked from the capture and joined back by `Work::wait`), captured in
//! thread-local mode so that another thread's driver calls meanwhile (a watchdog's event
//! queries, an allocation) do not invalidate it (in global mode the watchdog's allocation is
//! refused with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, as CUDA does); every replay runs the
//! collective again.
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_dist::{FakeGroup, ProcessGroup, ReduceOp};
use ferrocuda_driver::{Driver, FakeDriver};
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::{DeviceBuffer, KernelCache, Runtime};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, EventFlags};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

#[test]
fn a_captured_all_reduce_replays_and_a_watchdog_thread_does_not_break_the_capture() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().devices(2).build());
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    let allocators = DeviceAllocators::new(fake.clone(), AllocatorConfig::default(), Caching::On);
    allocators.install(&rt);
    let rank = FakeGroup::ranks(fake.clone(), &[D0])?
        .pop()
        .ok_or("no rank")?;
    let pg = ProcessGroup::new(rt.clone(), Box::new(rank.clone()))?;
    let b = DeviceBuffer::filled(&rt, D0, 64, 0.0f32)?;
    pg.all_reduce(&b, ReduceOp::Sum)?.wait()?; // warm-up, eager
    assert_eq!(rank.completed(), 1);

    let graph = CudaGraph::new(rt.clone(), allocators.clone(), D0)?;
    let watched = fake.event_create(DeviceIndex(1), EventFlags::default())?;
    {
        let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?;
        b.fill(3.0)?;
        pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
        // A watchdog thread polls events and allocates while the capture is under way.
        std::thread::scope(|s| {
            s.spawn(|| -> Result<(), ferrocuda_driver::DriverError> {
                fake.event_query(watched)?;
                let p = fake.malloc(DeviceIndex(1), 1 << 20)?;
                fake.free(DeviceIndex(1), p)
            })
            .join()
            .map_err(|_| "the watchdog panicked")
        })??;
        capture.end()?;
    }
    assert_eq!(rank.completed(), 1, "captured, not run");
    b.fill(0.0)?;
    let stream = rt.current_stream(D0)?;
    for replay in 1..=3 {
        graph.replay(&stream)?;
        assert_eq!(b.to_host()?, vec![3.0; 64]);
        assert_eq!(rank.completed(), 1 + replay, "the collective ran again");
    }
    Ok(())
}

/// A group with a watchdog (`with_timeout`) captures an all-reduce in global mode: the
/// captured collective is not watched (its event belongs to the capture; querying it would
/// invalidate a global capture), so nothing times out while the graph is not replayed, and
/// every replay runs it.
#[test]
fn a_watched_group_captures_without_its_watchdog_touching_the_capture() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().build());
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    let allocators = DeviceAllocators::new(fake.clone(), AllocatorConfig::default(), Caching::On);
    allocators.install(&rt);
    let rank = FakeGroup::ranks(fake.clone(), &[D0])?
        .pop()
        .ok_or("no rank")?;
    let pg = ProcessGroup::new(rt.clone(), Box::new(rank.clone()))?
        .with_timeout(std::time::Duration::from_millis(20))?;
    let b = DeviceBuffer::filled(&rt, D0, 16, 1.0f32)?;
    pg.all_reduce(&b, ReduceOp::Sum)?.synchronize()?;
    let graph = CudaGraph::new(rt.clone(), allocators.clone(), D0)?;
    {
        let capture = graph.capture(None, None, CaptureMode::Global)?;
        pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
        // Several watchdog periods pass while the capture is under way.
        std::thread::sleep(std::time::Duration::from_millis(100));
        capture.end()?;
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(pg.error(), None, "the captured collective was not watched");
    let stream = rt.current_stream(D0)?;
    graph.replay(&stream)?;
    stream.synchronize()?;
    assert_eq!(rank.completed(), 2, "the warm-up and one replay");
    pg.all_reduce(&b, ReduceOp::Sum)?.synchronize()?;
    assert_eq!(pg.error(), None);
    Ok(())
}
