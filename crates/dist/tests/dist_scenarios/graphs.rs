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
