use super::*;

// PinnedBuffer non-blocking copies hold the block until the copy completes.
#[test]
fn pinned_buffer_nonblocking_copy_holds_block() -> R {
    let e = env("")?;
    e.h.rt.set_host_memory(e.host.clone());
    let rt = &e.h.rt;
    let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let staged = PinnedBuffer::from_slice(rt, &v)?;
    let addr = staged.range().unwrap().addr();
    let dev = DeviceBuffer::<f32>::uninit(rt, D0, v.len())?;
    staged.copy_to_device(&dev, true)?;
    drop(staged);
    let other = PinnedBuffer::<f32>::uninit(rt, 1000)?;
    let other_addr = other.range().unwrap().addr();
    assert_ne!(other_addr, addr, "reused before the copy completed");
    drop(other);
    rt.synchronize(D0)?;
    assert_eq!(dev.to_host()?, v);
    let again = PinnedBuffer::<f32>::uninit(rt, 1000)?;
    let a2 = again.range().unwrap().addr();
    assert!(a2 == addr || a2 == other_addr);
    assert_eq!(e.fake.calls(Call::HostAlloc), 2);
    // D2H non-blocking, read after sync.
    let back = PinnedBuffer::<f32>::uninit(rt, 1000)?;
    back.copy_from_device(&dev, true)?;
    rt.synchronize(D0)?;
    assert_eq!(back.to_vec()?, v);
    // Empty buffer: null range, nothing counted.
    let before = e.m();
    let empty = PinnedBuffer::<f32>::uninit(rt, 0)?;
    assert!(empty.range().is_none());
    drop(empty);
    assert_eq!(e.m(), before);
    drop((again, back));
    rt.synchronize(D0)?;
    let probe = e.host.allocate(1 << 20, leg())?; // processes the events
    e.host.free(probe.addr())?;
    let m = e.m();
    assert_eq!(m["active_requests.current"], 0);
    e.inv();
    Ok(())
}

// Bad input: typed errors, no panic, statistics untouched.
#[test]
fn bad_inputs_are_typed_errors() -> R {
    let e = env("")?;
    let keep = e.host.allocate(4096, leg())?;
    let zero = e.host.allocate(0, leg())?;
    assert_eq!(zero.bytes, 0);
    e.host.free(zero.addr())?;
    let before = e.m();
    assert!(matches!(
        e.host.allocate(u64::MAX, leg()),
        Err(AllocError::HostRequestTooLarge(_))
    ));
    assert!(matches!(
        e.host.allocate((1 << 63) + 1, leg()),
        Err(AllocError::HostRequestTooLarge(_))
    ));
    // Exactly 2^63: the driver refuses, a typed error.
    let huge = e.host.allocate(1 << 63, leg());
    assert!(huge.is_err(), "{huge:?}");
    let huge = e.host.allocate((1 << 62) + 1, leg());
    assert!(huge.is_err(), "{huge:?}");
    assert!(matches!(
        e.host.free(0xdead_beef),
        Err(AllocError::InvalidHostPointer(0xdead_beef))
    ));
    assert!(matches!(
        e.host.free(keep.addr() + 1),
        Err(AllocError::InvalidHostPointer(_))
    ));
    assert!(!e.host.record_event(0x1234, leg())?);
    let mut after = e.m();
    // failed allocations may be timed? they must not count as allocations
    after.retain(|k, _| !k.starts_with("host_"));
    let mut b2 = before.clone();
    b2.retain(|k, _| !k.starts_with("host_"));
    assert_eq!(after, b2, "errors changed statistics");
    e.host.free(keep.addr())?;
    let snap = e.m();
    assert!(matches!(
        e.host.free(keep.addr()),
        Err(AllocError::InvalidHostPointer(_))
    ));
    assert!(matches!(
        e.host.record_event(keep.addr(), leg()),
        Err(AllocError::HostBlockNotAllocated(_))
    ));
    assert_eq!(e.m(), snap, "double free changed statistics");
    e.inv();
    // Malformed configuration strings.
    for bad in [
        "pinned_num_register_threads:3",
        "pinned_num_register_threads:0",
        "pinned_num_register_threads:256",
        "pinned_num_register_threads:-4",
        "pinned_use_cuda_host_register:maybe",
        "pinned_max_cached_size_mb:",
        "pinned_max_cached_size_mb:abc",
        "pinned_max_round_threshold_mb:-1",
        "pinned_reserve_segment_size_mb:99999999999999999999999",
        "pinned_bogus_key:1",
        "pinned_use_background_threads",
        ":::",
    ] {
        let r = std::panic::catch_unwind(|| AllocatorConfig::parse(bad));
        match r {
            Ok(Ok(c)) => panic!("{bad:?} accepted: {c:?}"),
            Ok(Err(_)) => {}
            Err(_) => panic!("{bad:?} panicked"),
        }
        let cfg_before = e.host.config();
        assert!(e.host.update_config(bad).is_err(), "update {bad:?}");
        assert_eq!(
            e.host.config(),
            cfg_before,
            "failed update changed config: {bad:?}"
        );
    }
    Ok(())
}

// A stream of a device that does not exist; driver failures in free/query.
#[test]
fn wrong_device_and_driver_failures() -> R {
    let e = env("")?;
    let bad = StreamHandle {
        device: DeviceIndex(9),
        raw: 0,
    };
    let a = e.host.allocate(4096, bad)?; // default pool, no routing: fine
    let rec = e.host.record_event(a.addr(), bad);
    let freed = e.host.free(a.addr());
    assert!(
        rec.is_err() || freed.is_err(),
        "bad device accepted: {rec:?} {freed:?}"
    );
    e.inv();
    assert!(matches!(
        e.host.free(a.addr()),
        Err(AllocError::InvalidHostPointer(_))
    ));
    assert!(DeviceBuffer::<f32>::uninit(&e.h.rt, DeviceIndex(9), 4).is_err());
    // Event record failure: returned, block retired; with catch-all swallowed.
    let s = e.stream()?;
    let b = e.host.allocate(4096, leg())?;
    e.host.record_event(b.addr(), s.handle())?;
    e.fake
        .fail_nth(Call::EventRecord, 1, DriverError::INVALID_VALUE);
    assert!(e.host.free(b.addr()).is_err());
    let c = e.host.allocate(4096, leg())?;
    assert_ne!(c.addr(), b.addr(), "retired block reused");
    e.inv();
    e.host.update_config("pinned_free_catch_all:True")?;
    e.host.record_event(c.addr(), s.handle())?;
    e.fake
        .fail_nth(Call::EventRecord, 1, DriverError::INVALID_VALUE);
    e.host.free(c.addr())?;
    assert_eq!(e.host.suppressed_free_errors(), 1);
    e.inv();
    // Event query failure: the allocation errors, the block is never reused, later fine.
    e.busy(s.handle())?;
    let d = e.host.allocate(64, leg())?;
    e.host.record_event(d.addr(), s.handle())?;
    e.host.free(d.addr())?;
    e.fake.advance(s.handle(), None)?;
    e.fake
        .fail_nth(Call::EventQuery, 1, DriverError::INVALID_VALUE);
    assert!(e.host.allocate(64, leg()).is_err());
    let f = e.host.allocate(64, leg())?;
    assert_ne!(f.addr(), d.addr());
    e.inv();
    // Failing host alloc: typed error, nothing counted.
    let before = e.m();
    e.fake
        .fail_nth(Call::HostAlloc, 1, DriverError::OUT_OF_MEMORY);
    assert!(e.host.allocate(1 << 20, leg()).is_err());
    let mut a1 = e.m();
    let mut b1 = before.clone();
    a1.retain(|k, _| !k.starts_with("host_"));
    b1.retain(|k, _| !k.starts_with("host_"));
    assert_eq!(a1, b1);
    // Failing host free in empty_cache: error, stats stay consistent.
    let g = e.host.allocate(1 << 16, leg())?;
    e.host.free(g.addr())?;
    e.fake
        .fail_nth(Call::HostFree, 1, DriverError::INVALID_VALUE);
    let _ = e.host.empty_cache();
    e.inv();
    Ok(())
}

// Many threads: exact totals.
#[test]
fn concurrent_threads_exact_statistics() -> R {
    let e = env("")?;
    let s = e.stream()?;
    const T: usize = 6;
    const N: usize = 400;
    let sh = s.handle();
    std::thread::scope(|sc| {
        for t in 0..T {
            let host = e.host.clone();
            sc.spawn(move || {
                let mut live = Vec::new();
                let mut seed = (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                for i in 0..N {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let size = 1 + seed % 20_000;
                    let r = host.allocate(size, leg()).unwrap();
                    assert!(r.bytes >= size);
                    if i % 3 == 0 {
                        host.record_event(r.addr(), sh).unwrap();
                    }
                    live.push(r);
                    if live.len() > 4 || i % 2 == 0 {
                        let x = live.remove((seed % live.len() as u64) as usize);
                        host.free(x.addr()).unwrap();
                    }
                }
                for x in live {
                    host.free(x.addr()).unwrap();
                }
            });
        }
    });
    e.fake.advance_all();
    e.host.empty_cache()?;
    let m = e.m();
    let total = (T * N) as i64;
    assert_eq!(m["active_requests.allocated"], total);
    assert_eq!(m["active_requests.freed"], total);
    assert_eq!(m["active_requests.current"], 0);
    assert_eq!(m["active_bytes.current"], 0);
    assert_eq!(m["active_bytes.allocated"], m["active_bytes.freed"]);
    assert_eq!(m["allocations.current"], 0);
    assert_eq!(m["allocated_bytes.current"], 0);
    assert_eq!(m["num_host_alloc"], e.fake.calls(Call::HostAlloc) as i64);
    assert_eq!(m["num_host_free"], e.fake.calls(Call::HostFree) as i64);
    assert_eq!(m["num_host_alloc"], m["num_host_free"]);
    assert_eq!(m["host_alloc_time.count"], m["num_host_alloc"]);
    assert_eq!(m["allocated_bytes.allocated"], m["allocated_bytes.freed"]);
    e.inv();
    Ok(())
}

// Background thread processes events of the default pool.
#[test]
fn background_thread_processes_events() -> R {
    let e = env("pinned_use_background_threads:True")?;
    let s = e.stream()?;
    e.busy(s.handle())?;
    let a = e.host.allocate(4096, leg())?;
    e.host.record_event(a.addr(), s.handle())?;
    e.host.free(a.addr())?;
    e.fake.advance(s.handle(), None)?;
    let mut ok = false;
    for _ in 0..200 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        if e.m()["active_requests.current"] == 0 {
            ok = true;
            break;
        }
    }
    assert!(ok, "background thread never processed the event");
    let b = e.host.allocate(4096, leg())?;
    assert_eq!(b.addr(), a.addr());
    e.inv();
    Ok(())
}

fn env2() -> Result<Env, Box<dyn std::error::Error>> {
    use ferrocuda_driver::Completion;
    let fake = Arc::new(
        FakeDriver::builder()
            .devices(2)
            .completion(Completion::Manual)
            .build(),
    );
    let rt = ferrocuda_stream::Runtime::new(fake.clone());
    let h = Harness::new(rt, Some(fake.clone()));
    let drv = h.rt.driver().clone();
    let host = HostAllocator::new(drv.clone(), PinnedConfig::default());
    Ok(Env { h, fake, drv, host })
}

// Two devices: events are pooled per device; a block used on device 1 then one used on
// device 0 (and a non-blocking copy to device 1) all work.
#[test]
fn two_devices_event_pool_per_device() -> R {
    let e = env2()?;
    let s1 = e.h.rt.new_stream(DeviceIndex(1), 0)?;
    let s0 = e.h.rt.new_stream(D0, 0)?;
    for round in 0..3 {
        let a = e.host.allocate(4096, leg())?;
        e.host.record_event(a.addr(), s1.handle())?;
        e.host.free(a.addr())?;
        e.fake.advance_all();
        let b = e.host.allocate(8192, leg())?; // processes: event back to its pool
        e.host.record_event(b.addr(), s0.handle())?;
        e.host
            .free(b.addr())
            .map_err(|x| format!("round {round}: dev0 free: {x}"))?;
        e.fake.advance_all();
        let c = e.host.allocate(16, leg())?;
        e.host.record_event(c.addr(), s1.handle())?;
        e.host.record_event(c.addr(), s0.handle())?;
        e.host
            .free(c.addr())
            .map_err(|x| format!("round {round}: both free: {x}"))?;
        e.fake.advance_all();
    }
    e.host.empty_cache()?;
    let m = e.m();
    assert_eq!(m["allocations.current"], 0);
    assert_eq!(m["active_requests.current"], 0);
    e.inv();
    // PinnedBuffer non-blocking copy to device 1.
    e.h.rt.set_host_memory(e.host.clone());
    let v: Vec<i32> = (0..3000).collect();
    let pb = PinnedBuffer::from_slice(&e.h.rt, &v)?;
    let d1 = DeviceBuffer::<i32>::uninit(&e.h.rt, DeviceIndex(1), v.len())?;
    pb.copy_to_device(&d1, true)?;
    let addr = pb.range().unwrap().addr();
    drop(pb);
    let other = PinnedBuffer::<i32>::uninit(&e.h.rt, 3000)?;
    assert_ne!(other.range().unwrap().addr(), addr);
    e.h.rt.synchronize(DeviceIndex(1))?;
    assert_eq!(d1.to_host()?, v);
    e.inv();
    Ok(())
}

// Concurrent allocate/free/record with empty_cache, stats and resets on other threads.
#[test]
fn concurrent_with_empty_cache_and_readers() -> R {
    let e = env("pinned_max_cached_size_mb:1")?;
    let s = e.stream()?;
    let sh = s.handle();
    let stop = std::sync::atomic::AtomicBool::new(false);
    const T: usize = 4;
    const N: usize = 300;
    std::thread::scope(|sc| {
        let host = &e.host;
        let stop = &stop;
        let fake = &e.fake;
        sc.spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                host.empty_cache().unwrap();
                let m = host.stats().to_map();
                assert!(m["allocations.current"] >= 0 && m["active_requests.current"] >= 0);
                host.check_invariants().unwrap();
                fake.advance_all();
                std::thread::yield_now();
            }
        });
        let hs: Vec<_> = (0..T)
            .map(|t| {
                sc.spawn(move || {
                    let mut seed = (t as u64 + 7).wrapping_mul(0x2545_f491_4f6c_dd1d);
                    for i in 0..N {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        let size = if i % 10 == 0 {
                            (1 << 20) + seed % (1 << 20)
                        } else {
                            1 + seed % 9000
                        };
                        let r = host.allocate(size, leg()).unwrap();
                        if i % 2 == 0 {
                            host.record_event(r.addr(), sh).unwrap();
                        }
                        host.free(r.addr()).unwrap();
                        // Racing record on a freed block: typed error or Ok(false).
                        let _ = host.record_event(r.addr(), sh);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    e.fake.advance_all();
    e.host.empty_cache()?;
    let m = e.m();
    let total = (T * N) as i64;
    assert_eq!(m["active_requests.allocated"], total);
    assert_eq!(m["active_requests.freed"], total);
    assert_eq!(m["active_requests.current"], 0);
    assert_eq!(m["allocations.current"], 0, "{m:?}");
    assert_eq!(m["num_host_alloc"], e.fake.calls(Call::HostAlloc) as i64);
    assert_eq!(m["num_host_free"], e.fake.calls(Call::HostFree) as i64);
    assert_eq!(m["allocated_bytes.allocated"], m["allocated_bytes.freed"]);
    e.inv();
    Ok(())
}

// Blocking copies record no event (the block is reusable at once); absurd PinnedBuffer
// lengths are errors.
#[test]
fn blocking_copy_and_huge_buffers() -> R {
    let e = env("")?;
    e.h.rt.set_host_memory(e.host.clone());
    let rt = &e.h.rt;
    let v: Vec<f32> = vec![1.5; 2000];
    let dev = DeviceBuffer::<f32>::uninit(rt, D0, v.len())?;
    let pb = PinnedBuffer::from_slice(rt, &v)?;
    let addr = pb.range().unwrap().addr();
    let rec = e.fake.calls(Call::EventRecord);
    pb.copy_to_device(&dev, false)?;
    assert_eq!(dev.to_host()?, v);
    drop(pb);
    assert_eq!(
        e.fake.calls(Call::EventRecord),
        rec,
        "blocking copy recorded an event"
    );
    let pb2 = PinnedBuffer::<f32>::uninit(rt, 2000)?;
    assert_eq!(pb2.range().unwrap().addr(), addr);
    pb2.copy_from_device(&dev, false)?;
    assert_eq!(pb2.to_vec()?, v);
    // Length mismatch: error, nothing recorded.
    let short = DeviceBuffer::<f32>::uninit(rt, D0, 10)?;
    assert!(pb2.copy_to_device(&short, true).is_err());
    drop(pb2);
    let before = e.m();
    for len in [usize::MAX, usize::MAX / 8, 1usize << 61] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            PinnedBuffer::<f64>::uninit(rt, len).map(|_| ())
        }));
        match r {
            Ok(Err(_)) => {}
            Ok(Ok(())) => panic!("{len} elements accepted"),
            Err(_) => panic!("{len} elements panicked"),
        }
    }
    let mut a = e.m();
    let mut b = before;
    a.retain(|k, _| !k.starts_with("host_"));
    b.retain(|k, _| !k.starts_with("host_"));
    assert_eq!(a, b);
    e.inv();
    Ok(())
}

// Partial event failures: a block whose free recorded only some of its events (or one
// of whose events failed its query) is never handed out again, even when the surviving
// events complete.
#[test]
fn partial_event_failures_never_reuse() -> R {
    let e = env("")?;
    let s1 = e.stream()?;
    let s2 = e.stream()?;
    let a = e.host.allocate(4096, leg())?;
    e.host.record_event(a.addr(), s1.handle())?;
    e.host.record_event(a.addr(), s2.handle())?;
    e.fake
        .fail_nth(Call::EventRecord, 2, DriverError::INVALID_VALUE);
    let r = e.host.free(a.addr());
    assert!(r.is_err(), "{r:?}");
    e.fake.advance_all();
    let mut got = Vec::new();
    for _ in 0..4 {
        let x = e.host.allocate(4096, leg())?;
        e.fake.advance_all();
        got.push(x.addr());
    }
    assert!(!got.contains(&a.addr()), "retired block handed out again");
    e.inv();
    for x in got {
        e.host.free(x)?;
    }
    // A failed query of one of two events.
    let b = e.host.allocate(1 << 16, leg())?;
    e.host.record_event(b.addr(), s1.handle())?;
    e.host.record_event(b.addr(), s2.handle())?;
    e.host.free(b.addr())?;
    e.fake.advance_all();
    e.fake
        .fail_nth(Call::EventQuery, 1, DriverError::INVALID_VALUE);
    let r = e.host.allocate(1 << 16, leg());
    let mut got = Vec::new();
    if let Ok(x) = r {
        got.push(x.addr());
    }
    for _ in 0..3 {
        got.push(e.host.allocate(1 << 16, leg())?.addr());
    }
    assert!(
        !got.contains(&b.addr()),
        "block with a failed query handed out again"
    );
    e.inv();
    // empty_cache with a failing query: error, books intact.
    let c = e.host.allocate(1 << 10, leg())?;
    e.host.record_event(c.addr(), s1.handle())?;
    e.host.free(c.addr())?;
    e.fake.advance_all();
    e.fake
        .fail_nth(Call::EventQuery, 1, DriverError::INVALID_VALUE);
    assert!(e.host.empty_cache().is_err());
    e.inv();
    Ok(())
}
