use super::*;
use ferrocuda_alloc::Route;
use ferrocuda_types::{CaptureMode, CaptureStatus, PoolId};

fn capture_id(fake: &FakeDriver, s: StreamHandle) -> Result<u64, Box<dyn std::error::Error>> {
    match fake.stream_capture_status(s)? {
        CaptureStatus::Active { id } => Ok(id),
        other => Err(format!("not capturing: {other:?}").into()),
    }
}

/// `empty_cache` after a capture records and waits for the events of blocks freed
/// during it (PyTorch's `synchronize_and_free_events` calls
/// `insert_events_deferred_until_no_capture` first): the block is free afterwards.
#[test]
fn empty_cache_after_a_capture_frees_its_deferred_blocks() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let (s, side) = (new_stream(&fake)?, new_stream(&fake)?);
    let pool = PoolId::for_capture();
    fake.stream_begin_capture(s, CaptureMode::Global)?;
    a.begin_allocate_to_pool(pool, Route::Capture(capture_id(&fake, s)?))?;
    let x = a.allocate(MIB, s)?;
    a.record_stream(x.ptr, side)?;
    a.free(x.ptr)?; // deferred: no event work during a capture
    a.end_allocate_to_pool(pool)?;
    let graph = fake.stream_end_capture(s)?;
    let pending = |a: &CachingAllocator| {
        a.pool_blocks(pool)
            .iter()
            .any(|b| b.ptr == x.ptr && b.pending_events)
    };
    assert!(pending(&a));
    a.empty_cache();
    assert!(!pending(&a), "the deferred free was processed");
    fake.graph_destroy(graph)?;
    a.check_invariants()?;
    Ok(())
}

/// `cudaMallocMaybeCapturing` relaxes only the capturing thread's allocations: another
/// thread that needs a new segment during a GLOBAL capture invalidates it, as in
/// PyTorch (and as CUDA's rules for a potentially unsafe call say).
#[test]
fn another_threads_new_segment_invalidates_a_global_capture() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let s = new_stream(&fake)?;
    let pool = PoolId::for_capture();
    fake.stream_begin_capture(s, CaptureMode::Global)?;
    a.begin_allocate_to_pool(pool, Route::Capture(capture_id(&fake, s)?))?;
    let _x = a.allocate(MIB, s)?; // the capturing thread: relaxed, fine
    assert!(matches!(
        fake.stream_capture_status(s)?,
        CaptureStatus::Active { .. }
    ));
    let other = std::thread::scope(|t| t.spawn(|| a.allocate(MIB, LEGACY)).join());
    let other = other.map_err(|_| "the other thread panicked")?;
    assert!(matches!(other, Err(AllocError::Driver(_))), "{other:?}");
    assert_eq!(fake.stream_capture_status(s)?, CaptureStatus::Invalidated);
    Ok(())
}

#[test]
fn a_capture_allocates_from_its_pool_and_side_streams_follow() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let (s, side, other) = (new_stream(&fake)?, new_stream(&fake)?, new_stream(&fake)?);
    let pool = PoolId::for_capture();
    fake.stream_begin_capture(s, CaptureMode::Global)?;
    a.begin_allocate_to_pool(pool, Route::Capture(capture_id(&fake, s)?))?;
    let x = a.allocate(MIB, s)?;
    assert!(
        matches!(fake.stream_capture_status(s)?, CaptureStatus::Active { .. }),
        "the segment's cudaMalloc ran in relaxed mode"
    );
    assert!(
        a.pool_blocks(pool)
            .iter()
            .any(|b| b.ptr == x.ptr && b.allocated)
    );
    // A stream forked into the capture allocates from the pool too.
    let ev = fake.event_create(D0, Default::default())?;
    fake.event_record(ev, s)?;
    fake.stream_wait_event(side, ev)?;
    let y = a.allocate(3 * MIB, side)?;
    assert!(a.pool_blocks(pool).iter().any(|b| b.ptr == y.ptr));
    // An unrelated stream does not.
    let z = a.allocate(MIB, other)?;
    assert!(
        a.pool_blocks(PoolId::DEFAULT)
            .iter()
            .any(|b| b.ptr == z.ptr)
    );
    // Frees inside the capture are reused in capture order.
    a.free(x.ptr)?;
    assert_eq!(a.allocate(MIB, s)?.ptr, x.ptr);
    // A free with another stream's use is deferred: no event work during capture.
    let w = a.allocate(2048, s)?;
    a.record_stream(w.ptr, side)?;
    let (records, queries) = (fake.calls(Call::EventRecord), fake.calls(Call::EventQuery));
    a.free(w.ptr)?;
    assert_eq!(
        (fake.calls(Call::EventRecord), fake.calls(Call::EventQuery)),
        (records, queries)
    );
    a.empty_cache();
    assert_eq!(
        fake.calls(Call::Free),
        0,
        "nothing is freed while capturing"
    );
    fake.event_record(ev, side)?;
    fake.stream_wait_event(s, ev)?;
    let graph = fake.stream_end_capture(s)?;
    a.end_allocate_to_pool(pool)?;
    let _ = a.allocate(512, other)?;
    assert!(
        fake.calls(Call::EventRecord) > records + 1,
        "the deferred free recorded its event after the capture"
    );
    assert_eq!(a.pool_use_count(pool), Some(1));
    a.check_invariants()?;
    fake.graph_destroy(graph)?;
    Ok(())
}

#[test]
fn a_released_pool_is_returned_at_the_next_empty_cache() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let x = a.allocate(5 * MIB, LEGACY)?;
    let other_thread = std::thread::scope(|sc| {
        sc.spawn(|| a.allocate(5 * MIB, LEGACY).map(|x| x.ptr))
            .join()
            .expect("thread")
    })?;
    assert!(
        a.pool_blocks(PoolId::DEFAULT)
            .iter()
            .any(|b| b.ptr == other_thread),
        "other threads are not routed"
    );
    a.end_allocate_to_pool(pool)?;
    a.free(other_thread)?;
    a.release_pool(pool)?;
    assert_eq!(a.pool_use_count(pool), Some(0));
    assert!(
        a.pool_blocks(pool)
            .iter()
            .any(|b| b.ptr == x.ptr && b.allocated),
        "outputs outlive their graph"
    );
    a.free(x.ptr)?;
    let frees = fake.calls(Call::Free);
    a.empty_cache();
    assert_eq!(
        fake.calls(Call::Free),
        frees + 2,
        "the pool's segment and the default one"
    );
    assert_eq!(
        (a.pool_use_count(pool), a.pool_blocks(pool).len()),
        (None, 0),
        "the pool is gone"
    );
    a.check_invariants()?;
    Ok(())
}

#[test]
fn pool_requests_are_checked() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let pool = PoolId::handle();
    assert!(
        a.begin_allocate_to_pool(PoolId::DEFAULT, Route::Stream(LEGACY))
            .is_err()
    );
    a.begin_allocate_to_pool(pool, Route::Stream(LEGACY))?;
    let twice = a
        .begin_allocate_to_pool(pool, Route::Stream(LEGACY))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        twice.starts_with("beginAllocateToPool: already recording to mempool_id"),
        "{twice}"
    );
    a.end_allocate_to_pool(pool)?;
    let again = a
        .end_allocate_to_pool(pool)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        again.starts_with("endAllocatePool: not currently recording to mempool_id"),
        "{again}"
    );
    a.release_pool(pool)?;
    assert!(a.release_pool(pool).is_err());
    assert!(PoolId::handle().0 == 0 && PoolId::for_capture().1 == 0);
    Ok(())
}
