//! `Route::NextCapture`: a pool route begun before the capture that fills it, bound to a
//! capture by the first allocation made in one (what PyTorch's pluggable-allocator hook
//! `beginAllocateToPool` needs: its filter is a C++ closure a C function cannot call).
use crate::common;
use common::*;
use ferrocuda_alloc::{CachingAllocator, Route};
use ferrocuda_driver::{Call, Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{CaptureMode, DevicePtr, PoolId, StreamHandle};

fn in_pool(a: &CachingAllocator, pool: PoolId, ptr: DevicePtr) -> bool {
    a.pool_blocks(pool)
        .iter()
        .any(|b| b.ptr == ptr && b.allocated)
}

/// Makes `side` part of the capture running on `s` (an event recorded on `s`, waited on by
/// `side`), as a fork inside a captured region does.
fn fork(fake: &FakeDriver, s: StreamHandle, side: StreamHandle) -> TestResult {
    let ev = fake.event_create(D0, Default::default())?;
    fake.event_record(ev, s)?;
    fake.stream_wait_event(side, ev)?;
    Ok(())
}

/// PyTorch's order: `beginAllocateToPool`, then `cudaStreamBeginCapture`, then the
/// captured work allocates; side streams forked into the capture follow, and an unrelated
/// stream does not.
#[test]
fn the_first_capture_allocation_binds_the_route_and_side_streams_follow() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let (s, side, other) = (new_stream(&fake)?, new_stream(&fake)?, new_stream(&fake)?);
    let pool = PoolId::for_capture();
    a.begin_allocate_to_pool(pool, Route::NextCapture)?;
    fake.stream_begin_capture(s, CaptureMode::Global)?;
    let x = a.allocate(MIB, s)?;
    assert!(in_pool(&a, pool, x.ptr));
    fork(&fake, s, side)?;
    // Another thread (an autograd worker) allocating on the forked stream.
    let y = std::thread::scope(|t| t.spawn(|| a.allocate(3 * MIB, side)).join());
    let y = y.map_err(|_| "the worker panicked")??;
    assert!(
        in_pool(&a, pool, y.ptr),
        "the bound capture takes every thread"
    );
    let z = a.allocate(MIB, other)?;
    assert!(in_pool(&a, PoolId::DEFAULT, z.ptr));
    fork(&fake, side, s)?;
    let graph = fake.stream_end_capture(s)?;
    a.end_allocate_to_pool(pool)?;
    assert_eq!(a.pool_use_count(pool), Some(1));
    a.release_pool(pool)?;
    fake.graph_destroy(graph)?;
    a.check_invariants()?;
    Ok(())
}

/// From `beginAllocateToPool` on, a capture is underway for the allocator, as PyTorch's
/// `captures_underway` says: a free used on another stream records no event, and
/// `empty_cache` frees nothing, even before the capture itself has begun.
#[test]
fn an_unbound_route_is_a_capture_underway() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let (s, side) = (new_stream(&fake)?, new_stream(&fake)?);
    let w = a.allocate(2048, s)?;
    a.record_stream(w.ptr, side)?;
    let pool = PoolId::for_capture();
    a.begin_allocate_to_pool(pool, Route::NextCapture)?;
    let records = fake.calls(Call::EventRecord);
    a.free(w.ptr)?;
    a.empty_cache();
    assert_eq!(fake.calls(Call::EventRecord), records, "deferred");
    assert_eq!(fake.calls(Call::Free), 0, "nothing freed");
    a.end_allocate_to_pool(pool)?;
    a.empty_cache();
    assert!(fake.calls(Call::EventRecord) > records, "recorded after");
    a.check_invariants()?;
    Ok(())
}

/// Two threads begin routes and captures at once: each capture binds the route its own
/// thread began, even when the thread that began the older route allocates first (without
/// the preference for its own thread it would take the newest route, the other's).
#[test]
fn concurrent_unbound_routes_bind_by_thread() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let (pa, pb) = (PoolId::for_capture(), PoolId::for_capture());
    let (sa, sb) = (new_stream(&fake)?, new_stream(&fake)?);
    let barriers = [(); 3].map(|()| std::sync::Barrier::new(2));
    let (ra, rb) = std::thread::scope(|t| {
        let run = |pool: PoolId, s: StreamHandle, first: bool| {
            let (a, fake) = (&a, &fake);
            let [ordered, begun, allocated] = &barriers;
            move || -> Result<bool, String> {
                if !first {
                    ordered.wait();
                }
                a.begin_allocate_to_pool(pool, Route::NextCapture)
                    .map_err(|e| e.to_string())?;
                if first {
                    ordered.wait();
                }
                fake.stream_begin_capture(s, CaptureMode::ThreadLocal)
                    .map_err(|e| e.to_string())?;
                begun.wait();
                if !first {
                    // The other thread allocates first: it must not take this route.
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let x = a.allocate(MIB, s).map_err(|e| e.to_string())?;
                allocated.wait();
                let graph = fake.stream_end_capture(s).map_err(|e| e.to_string())?;
                a.end_allocate_to_pool(pool).map_err(|e| e.to_string())?;
                fake.graph_destroy(graph).map_err(|e| e.to_string())?;
                Ok(in_pool(a, pool, x.ptr))
            }
        };
        let ha = t.spawn(run(pa, sa, false));
        let hb = t.spawn(run(pb, sb, true));
        (ha.join(), hb.join())
    });
    assert!(
        ra.map_err(|_| "thread a panicked")??,
        "a's capture took a's pool"
    );
    assert!(
        rb.map_err(|_| "thread b panicked")??,
        "b's capture took b's pool"
    );
    a.check_invariants()?;
    Ok(())
}

/// A capture another route already names does not bind an unbound route; the next capture
/// does.
#[test]
fn a_named_capture_leaves_an_unbound_route_for_the_next() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let (s1, s2) = (new_stream(&fake)?, new_stream(&fake)?);
    let (named, next) = (PoolId::for_capture(), PoolId::for_capture());
    fake.stream_begin_capture(s1, CaptureMode::Relaxed)?;
    let id = match fake.stream_capture_status(s1)? {
        ferrocuda_types::CaptureStatus::Active { id } => id,
        other => return Err(format!("not capturing: {other:?}").into()),
    };
    a.begin_allocate_to_pool(named, Route::Capture(id))?;
    a.begin_allocate_to_pool(next, Route::NextCapture)?;
    let x = a.allocate(MIB, s1)?;
    assert!(in_pool(&a, named, x.ptr));
    fake.stream_begin_capture(s2, CaptureMode::Relaxed)?;
    let y = a.allocate(MIB, s2)?;
    assert!(in_pool(&a, next, y.ptr));
    for (s, pool) in [(s1, named), (s2, next)] {
        let graph = fake.stream_end_capture(s)?;
        a.end_allocate_to_pool(pool)?;
        fake.graph_destroy(graph)?;
    }
    Ok(())
}

/// Outside a capture the route takes the allocations of the thread that began it (what
/// `torch.cuda.use_mem_pool` asks through the same hook), not other threads'.
#[test]
fn an_unbound_route_takes_its_threads_allocations() -> TestResult {
    let (_fake, a) = setup(80 * GIB, "", Completion::Eager);
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::NextCapture)?;
    let x = a.allocate(5 * MIB, LEGACY)?;
    assert!(in_pool(&a, pool, x.ptr));
    let other = std::thread::scope(|t| t.spawn(|| a.allocate(5 * MIB, LEGACY)).join());
    let other = other.map_err(|_| "the other thread panicked")??;
    assert!(in_pool(&a, PoolId::DEFAULT, other.ptr));
    a.end_allocate_to_pool(pool)?;
    a.free(x.ptr)?;
    a.free(other.ptr)?;
    a.release_pool(pool)?;
    a.check_invariants()?;
    Ok(())
}
