//! A free racing with the start or the end of a stream capture: another thread drops a block
//! that `record_stream` tied to the stream being captured, at a moment the allocator does not
//! (yet, or any more) route that capture. PyTorch's `free` (c10/cuda/CUDACachingAllocator.cpp)
//! defers such a block to `needs_events_deferred_until_no_capture` while a capture is
//! underway, and `insert_events_deferred_until_no_capture` records its events once none is;
//! after the capture ends and the stream's work completes, the next request of that size on
//! that stream gets the block back. Recording the end-of-life event on the capturing stream
//! instead would put it into the graph, where it never completes: the block would be lost
//! for good.
use crate::common;
use common::*;
use ferrocuda_alloc::{CachingAllocator, Route};
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{CaptureMode, CaptureStatus, DevicePtr, MemsetValue, PoolId, StreamHandle};
use std::sync::Arc;

/// The moment, relative to the capture's driver calls and the allocator's routing, at which
/// the other thread frees the block.
#[derive(Clone, Copy, Debug)]
enum Moment {
    /// After `cuStreamBeginCapture`, before the allocator is told of the capture.
    BeginThenRoute,
    /// After `cuStreamEndCapture`, before `endAllocateToPool` (PyTorch's `capture_end`).
    EndThenUnroute,
    /// After the route ends, before `cuStreamEndCapture` (the other order of the two).
    UnrouteThenEnd,
}

fn capture_id(fake: &FakeDriver, s: StreamHandle) -> Result<u64, Box<dyn std::error::Error>> {
    match fake.stream_capture_status(s)? {
        CaptureStatus::Active { id } => Ok(id),
        other => Err(format!("not capturing: {other:?}").into()),
    }
}

/// Frees `ptr` on another thread (an autograd worker dropping a tensor), and waits for it.
fn free_elsewhere(a: &CachingAllocator, ptr: DevicePtr) -> TestResult {
    let freed = std::thread::scope(|t| t.spawn(|| a.free(ptr)).join());
    freed.map_err(|_| "the freeing thread panicked")??;
    Ok(())
}

fn pending(a: &CachingAllocator) -> usize {
    a.blocks().iter().filter(|b| b.pending_events).count()
}

/// The allocator, the driver, the freed block's address and its stream, after a race.
type Raced = (Arc<FakeDriver>, CachingAllocator, DevicePtr, StreamHandle);

/// A 1 MiB block of stream `home`, written on the capture stream `s` before the capture
/// (manual completion: that work is still queued) and tied to `s` by `record_stream`, is freed
/// by another thread at `moment`. Returns the allocator, the driver, the block's address and
/// `home`, once the capture has ended (and been destroyed) and `s` has been synchronized.
fn race(moment: Moment) -> Result<Raced, Box<dyn std::error::Error>> {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let (home, s) = (new_stream(&fake)?, new_stream(&fake)?);
    let x = a.allocate(MIB, home)?;
    fake.memset_async(x.ptr, MemsetValue::U8(1), MIB, s)?;
    a.record_stream(x.ptr, s)?;
    let pool = PoolId::for_capture();
    fake.stream_begin_capture(s, CaptureMode::ThreadLocal)?;
    if let Moment::BeginThenRoute = moment {
        free_elsewhere(&a, x.ptr)?;
    }
    a.begin_allocate_to_pool(pool, Route::Capture(capture_id(&fake, s)?))?;
    let inside = a.allocate(MIB, s)?;
    fake.memset_async(inside.ptr, MemsetValue::U8(2), MIB, s)?;
    let graph = if let Moment::UnrouteThenEnd = moment {
        a.end_allocate_to_pool(pool)?;
        free_elsewhere(&a, x.ptr)?;
        fake.stream_end_capture(s)?
    } else {
        let graph = fake.stream_end_capture(s)?;
        if let Moment::EndThenUnroute = moment {
            free_elsewhere(&a, x.ptr)?;
        }
        a.end_allocate_to_pool(pool)?;
        graph
    };
    assert_eq!(
        fake.graph_node_count(graph)?,
        1,
        "{moment:?}: the capture holds its memset and nothing of the allocator's"
    );
    fake.graph_destroy(graph)?;
    a.free(inside.ptr)?;
    a.release_pool(pool)?;
    // The stream's work (the memset enqueued before the capture) completes.
    fake.stream_synchronize(s)?;
    Ok((fake, a, x.ptr, home))
}

/// Freed between `cuStreamBeginCapture` and the allocator being told of the capture: the
/// allocator finds the stream capturing and defers the block as it would during any capture.
/// Its event is recorded when the capture's route ends, so once the stream's work completed
/// the next request of its size on its stream gets it back.
#[test]
fn a_free_between_begin_capture_and_the_route_comes_back() -> TestResult {
    let (_fake, a, x, home) = race(Moment::BeginThenRoute)?;
    let again = a.allocate(MIB, home)?;
    assert_eq!(
        again.ptr, x,
        "the block freed as the capture began is reused"
    );
    assert_eq!(pending(&a), 0, "no block waits for an event");
    a.check_invariants()?;
    Ok(())
}

/// Freed between `cuStreamEndCapture` and `endAllocateToPool` (PyTorch's `capture_end`
/// order): deferred as during the capture, and its event recorded by `endAllocateToPool`,
/// the first allocator call with no capture underway, before the stream's work completes.
#[test]
fn a_free_between_end_capture_and_the_unroute_comes_back() -> TestResult {
    let (_fake, a, x, home) = race(Moment::EndThenUnroute)?;
    let again = a.allocate(MIB, home)?;
    assert_eq!(
        again.ptr, x,
        "the block freed as the capture ended is reused"
    );
    assert_eq!(pending(&a), 0, "no block waits for an event");
    a.check_invariants()?;
    Ok(())
}

/// Freed after the route ended but while the stream still captures: deferred too (its event
/// is recorded at the next allocation, once the capture has ended), never recorded into the
/// graph. Once that event has completed the block comes back.
#[test]
fn a_free_after_the_unroute_while_still_capturing_is_not_lost() -> TestResult {
    let (fake, a, x, home) = race(Moment::UnrouteThenEnd)?;
    let first = a.allocate(MIB, home)?;
    fake.advance_all();
    let again = a.allocate(MIB, home)?;
    assert!(
        first.ptr == x || again.ptr == x,
        "the block freed as the capture ended is reused"
    );
    assert_eq!(pending(&a), 0, "no block waits for an event");
    a.check_invariants()?;
    Ok(())
}
