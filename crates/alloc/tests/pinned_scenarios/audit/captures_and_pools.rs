use super::*;

// Captures: private pool, no events recorded during capture, used blocks retired,
// event queries of the default pool do not break a global-mode capture.
#[test]
fn capture_private_pool_and_retirement() -> R {
    let e = env("")?;
    let cap = e.stream()?;
    let other = e.stream()?;
    let slow = e.stream()?;
    // A default-pool block cached, and one waiting on a pending event.
    let p = e.host.allocate(4096, leg())?;
    e.host.free(p.addr())?;
    e.busy(slow.handle())?;
    let q = e.host.allocate(8192, leg())?;
    e.host.record_event(q.addr(), slow.handle())?;
    e.host.free(q.addr())?;

    let pool = e.capture(&cap, CaptureMode::Global)?;
    let a = e.host.allocate(4096, cap.handle())?;
    assert_ne!(
        a.addr(),
        p.addr(),
        "capture must not take a default-pool block"
    );
    // Default pool allocation on another stream during capture (processes events).
    let o = e.host.allocate(4096, other.handle())?;
    assert_eq!(
        o.addr(),
        p.addr(),
        "non-capturing stream uses the default pool"
    );
    assert!(
        matches!(
            e.drv.stream_capture_status(cap.handle())?,
            CaptureStatus::Active { .. }
        ),
        "allocator broke the capture"
    );
    let rec0 = e.fake.calls(Call::EventRecord);
    e.host.record_event(a.addr(), cap.handle())?;
    e.host.free(a.addr())?;
    assert_eq!(
        e.fake.calls(Call::EventRecord),
        rec0,
        "no events during capture"
    );
    let b = e.host.allocate(4096, cap.handle())?;
    assert_ne!(b.addr(), a.addr(), "a captured-and-used block is retired");
    assert!(
        matches!(
            e.drv.stream_capture_status(cap.handle())?,
            CaptureStatus::Active { .. }
        ),
        "capture invalidated"
    );
    e.drv.stream_end_capture(cap.handle())?;
    e.host.end_allocate_to_pool(pool)?;
    // After the capture, allocations on that stream go to the default pool again.
    let after = e.host.allocate(4096, cap.handle())?;
    assert_ne!(after.addr(), a.addr());
    assert_ne!(after.addr(), b.addr());
    e.host.free(b.addr())?;
    let after2 = e.host.allocate(4096, leg())?;
    assert_ne!(
        after2.addr(),
        b.addr(),
        "private-pool block must not leak into default"
    );
    e.host.release_pool(pool)?;
    e.fake.advance(slow.handle(), None)?;
    let hf = e.fake.calls(Call::HostFree);
    e.host.empty_cache()?;
    // q (default, event done) and b (freeable private pool) go back; a stays retired.
    assert_eq!(e.fake.calls(Call::HostFree) - hf, 2);
    e.inv();
    Ok(())
}

// A default-pool block used by the capturing stream during a capture and freed then:
// its event is recorded into the capture (PyTorch's `free`), so the next default-pool
// allocation's event query fails with CUDA_ERROR_CAPTURED_EVENT and the capture is
// invalidated, as PyTorch's throwing query does (docs/pinned.md); the block is never handed
// out while the graph might read it.
#[test]
fn default_block_used_in_capture() -> R {
    let e = env("")?;
    let cap = e.stream()?;
    let other = e.stream()?;
    let a = e.host.allocate(4096, leg())?;
    let pool = e.capture(&cap, CaptureMode::Global)?;
    e.host.record_event(a.addr(), cap.handle())?; // non_blocking copy during capture
    e.host.free(a.addr())?;
    let status = e.drv.stream_capture_status(cap.handle())?;
    assert!(
        matches!(status, CaptureStatus::Active { .. }),
        "after free: {status:?}"
    );
    // An eager allocation on another stream, same thread, during the capture.
    let b = e.host.allocate(4096, other.handle());
    assert!(
        matches!(&b, Err(AllocError::Driver(d)) if *d == DriverError::CAPTURED_EVENT),
        "eager allocation during capture: {b:?}"
    );
    let status = e.drv.stream_capture_status(cap.handle())?;
    assert_eq!(status, CaptureStatus::Invalidated);
    let _ = e.drv.stream_end_capture(cap.handle());
    e.host.end_allocate_to_pool(pool)?;
    let c = e.host.allocate(4096, other.handle())?;
    assert_ne!(
        c.addr(),
        a.addr(),
        "the block whose event failed is never reused"
    );
    Ok(())
}

// Private pool lifecycle: an in-use private block freed after the pool was released
// goes back to the driver at empty_cache and the pool is forgotten.
#[test]
fn private_pool_forgotten_after_release() -> R {
    let e = env("")?;
    let cap = e.stream()?;
    let pool = e.capture(&cap, CaptureMode::ThreadLocal)?;
    let a = e.host.allocate(1000, cap.handle())?;
    let b = e.host.allocate(3000, cap.handle())?;
    e.drv.stream_end_capture(cap.handle())?;
    e.host.end_allocate_to_pool(pool)?;
    assert_eq!(e.host.private_pool_count(), 1);
    e.host.free(a.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 0, "held pool is not emptied");
    e.host.release_pool(pool)?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    assert_eq!(e.host.private_pool_count(), 1, "b still owned");
    e.host.free(b.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 2);
    assert_eq!(e.host.private_pool_count(), 0);
    let m = e.m();
    assert_eq!((m["allocations.current"], m["num_host_free"]), (0, 2));
    // Releasing again / unknown pools: typed errors, no panic.
    assert!(e.host.release_pool(pool).is_err());
    assert!(e.host.end_allocate_to_pool(PoolId(999, 0)).is_err());
    e.inv();
    Ok(())
}

// Dropping the allocator gives cached blocks back and leaves in-use ones alone.
#[test]
fn drop_returns_cached_blocks() -> R {
    let e = env("")?;
    let a = e.host.allocate(100, leg())?;
    let _b = e.host.allocate(200, leg())?;
    e.host.free(a.addr())?;
    let Env {
        h,
        fake,
        drv: _,
        host,
    } = e;
    drop(host);
    assert_eq!(fake.calls(Call::HostFree), 1);
    drop(h);
    Ok(())
}

// Pool API misuse: typed errors, no panic.
#[test]
fn pool_api_misuse_typed() -> R {
    let e = env("")?;
    let pool = PoolId::for_capture();
    assert!(e.host.end_allocate_to_pool(pool).is_err());
    assert!(e.host.release_pool(pool).is_err());
    e.host
        .begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    assert!(
        e.host
            .begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
            .is_err(),
        "already recording to this pool"
    );
    // Routing active: a stream of a device that does not exist.
    let bad = StreamHandle {
        device: DeviceIndex(9),
        raw: 77,
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.host.allocate(64, bad)));
    assert!(r.is_ok(), "panicked");
    // Thread route: allocations of this thread go to the private pool.
    let a = e.host.allocate(64, leg())?;
    e.host.end_allocate_to_pool(pool)?;
    e.host.free(a.addr())?;
    let b = e.host.allocate(64, leg())?;
    assert_ne!(
        b.addr(),
        a.addr(),
        "private block leaked into the default pool"
    );
    e.host.release_pool(pool)?;
    assert!(e.host.release_pool(pool).is_err(), "released twice");
    e.host.empty_cache()?;
    assert_eq!(e.host.private_pool_count(), 0);
    e.inv();
    Ok(())
}

// Private-pool blocks count in the statistics like any other (PyTorch's stats_ are
// global).
#[test]
fn private_pool_blocks_in_stats() -> R {
    let e = env("")?;
    let cap = e.stream()?;
    let pool = e.capture(&cap, CaptureMode::Relaxed)?;
    let a = e.host.allocate(1000, cap.handle())?;
    let b = e.host.allocate(1000, cap.handle())?;
    let m = e.m();
    assert_eq!(
        (
            m["allocations.current"],
            m["allocated_bytes.current"],
            m["active_requests.current"]
        ),
        (2, 2048, 2)
    );
    e.host.free(a.addr())?; // unused: back to its pool
    let m = e.m();
    assert_eq!(m["active_requests.current"], 1);
    let c = e.host.allocate(600, cap.handle())?;
    assert_eq!(
        c.addr(),
        a.addr(),
        "unused capture block reused within its pool"
    );
    e.host.record_event(b.addr(), cap.handle())?;
    e.host.free(b.addr())?; // used: retired
    e.drv.stream_end_capture(cap.handle())?;
    e.host.end_allocate_to_pool(pool)?;
    e.host.free(c.addr())?;
    e.host.release_pool(pool)?;
    e.host.empty_cache()?;
    let m = e.m();
    assert_eq!(
        m["allocations.current"], 1,
        "only the retired block remains"
    );
    assert_eq!(m["num_host_free"], 1);
    e.inv();
    Ok(())
}
