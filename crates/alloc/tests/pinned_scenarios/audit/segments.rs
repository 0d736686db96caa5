use super::*;

// Register path: malloc + prefault split + register, and the way back is remembered.
#[test]
fn register_path_and_config_change() -> R {
    let e = env("pinned_use_cuda_host_register:True,pinned_num_register_threads:4")?;
    let big = e.host.allocate(60 * 1024, leg())?; // 64 KiB: 4 parts
    assert_eq!(big.bytes, 64 * 1024);
    assert_eq!(e.fake.calls(Call::HostMalloc), 1);
    assert_eq!(e.fake.calls(Call::HostRegister), 1);
    assert_eq!(e.fake.calls(Call::HostPrefault), 4);
    assert_eq!(e.fake.calls(Call::HostAlloc), 0);
    let small = e.host.allocate(8 * 1024, leg())?; // < 4 KiB * 4: one part
    assert_eq!(e.fake.calls(Call::HostPrefault), 5);
    e.host
        .update_config("pinned_use_cuda_host_register:False")?;
    let plain = e.host.allocate(1 << 20, leg())?;
    assert_eq!(e.fake.calls(Call::HostAlloc), 1);
    assert_eq!(e.fake.calls(Call::HostMalloc), 2);
    for x in [big, small, plain] {
        e.host.free(x.addr())?;
    }
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostUnregister), 2);
    assert_eq!(e.fake.calls(Call::HostMfree), 2);
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    let m = e.m();
    assert_eq!((m["num_host_alloc"], m["num_host_free"]), (3, 3));
    assert_eq!(m["host_alloc_time.count"], 3);
    assert_eq!(m["host_free_time.count"], 3);
    // Register round trip through a PinnedBuffer.
    let e2 = env("pinned_use_cuda_host_register:True,pinned_num_register_threads:2")?;
    e2.h.rt.set_host_memory(e2.host.clone());
    let v: Vec<f32> = (0..5000).map(|i| i as f32).collect();
    let pb = PinnedBuffer::from_slice(&e2.h.rt, &v)?;
    let dev = DeviceBuffer::<f32>::uninit(&e2.h.rt, D0, v.len())?;
    pb.copy_to_device(&dev, false)?;
    assert_eq!(dev.to_host()?, v);
    e.inv();
    e2.inv();
    Ok(())
}

// Reserve segment: one slab, 4 KiB pieces, never freed, space not handed out again.
#[test]
fn reserve_segment_carving() -> R {
    let e = env("pinned_reserve_segment_size_mb:1")?;
    let a = e.host.allocate(100, leg())?;
    assert_eq!(a.bytes, 128);
    assert_eq!(e.fake.calls(Call::HostAlloc), 1, "the slab");
    let b = e.host.allocate(5000, leg())?;
    assert_eq!(b.bytes, 8192);
    assert_eq!(e.fake.calls(Call::HostAlloc), 1, "carved from the slab");
    assert_eq!(b.base, a.base, "same slab");
    assert!(b.addr() >= a.addr() + 4096, "4 KiB steps");
    let m = e.m();
    assert_eq!(m["allocations.current"], 2, "slab not counted, pieces are");
    assert_eq!(m["allocated_bytes.current"], 128 + 8192);
    assert_eq!(m["num_host_alloc"], 2);
    assert_eq!(
        m["host_alloc_time.count"], 1,
        "only the slab's driver call is timed"
    );
    e.host.free(a.addr())?;
    e.host.free(b.addr())?;
    let a2 = e.host.allocate(120, leg())?;
    assert_eq!(a2.addr(), a.addr(), "cached piece reused");
    e.host.free(a2.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 0, "slab never freed");
    let m = e.m();
    assert_eq!(m["allocations.current"], 0);
    assert_eq!(m["allocated_bytes.current"], 0);
    assert_eq!(m["num_host_free"], 2);
    assert_eq!(m["host_free_time.count"], 0, "no driver free was made");
    let c = e.host.allocate(100, leg())?;
    assert_eq!(e.fake.calls(Call::HostAlloc), 1);
    assert!(
        c.addr() >= b.addr() + 8192,
        "forgotten slab space not handed out again"
    );
    // Exhaust the slab: the rest goes to cudaHostAlloc.
    let big = e.host.allocate(600 * 1024, leg())?; // 1 MiB rounded: does not fit
    assert_eq!(e.fake.calls(Call::HostAlloc), 2);
    assert_ne!(big.base, a.base);
    e.host.free(big.addr())?;
    e.host.free(c.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    e.inv();
    Ok(())
}

// pinned_max_cached_size_mb: larger blocks go back to the driver when free.
#[test]
fn max_cached_size_releases_large_blocks() -> R {
    let e = env("pinned_max_cached_size_mb:1")?;
    let s = e.stream()?;
    let a = e.host.allocate(MIB + MIB / 2, leg())?;
    assert_eq!(a.bytes, MIB + MIB / 2, "above the cache limit: exact");
    e.host.free(a.addr())?;
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    let m = e.m();
    assert_eq!(
        (
            m["allocations.current"],
            m["num_host_free"],
            m["active_requests.current"]
        ),
        (0, 1, 0)
    );
    let small = e.host.allocate(MIB, leg())?;
    e.host.free(small.addr())?;
    assert_eq!(e.fake.calls(Call::HostFree), 1, "1 MiB is cached");
    e.busy(s.handle())?;
    let b = e.host.allocate(3 * MIB, leg())?;
    e.host.record_event(b.addr(), s.handle())?;
    e.host.free(b.addr())?;
    assert_eq!(e.fake.calls(Call::HostFree), 1, "waits for its event");
    e.fake.advance(s.handle(), None)?;
    let _t = e.host.allocate(16, leg())?;
    assert_eq!(
        e.fake.calls(Call::HostFree),
        2,
        "released once its event completed"
    );
    let m = e.m();
    assert_eq!(m["allocations.current"], 2);
    assert_eq!(m["allocated_bytes.current"], (MIB + 16) as i64);
    assert_eq!(m["active_requests.current"], 1);
    e.inv();
    Ok(())
}

// Driver failures on the register path: no leak, nothing counted.
#[test]
fn register_path_failures_do_not_leak() -> R {
    let e = env("pinned_use_cuda_host_register:True,pinned_num_register_threads:2")?;
    e.fake
        .fail_nth(Call::HostRegister, 1, DriverError::OUT_OF_MEMORY);
    let r = e.host.allocate(1 << 16, leg());
    assert!(r.is_err(), "{r:?}");
    assert_eq!(
        e.fake.calls(Call::HostMalloc),
        e.fake.calls(Call::HostMfree),
        "malloc'd memory leaked after a failed cudaHostRegister"
    );
    let m = e.m();
    assert_eq!((m["allocations.current"], m["num_host_alloc"]), (0, 0));
    e.fake
        .fail_nth(Call::HostPrefault, 1, DriverError::INVALID_VALUE);
    let r = e.host.allocate(1 << 16, leg());
    assert!(r.is_err(), "{r:?}");
    assert_eq!(
        e.fake.calls(Call::HostMalloc),
        e.fake.calls(Call::HostMfree),
        "malloc'd memory leaked after a failed pre-fault"
    );
    let ok = e.host.allocate(1 << 16, leg())?;
    e.host.free(ok.addr())?;
    e.host.empty_cache()?;
    assert_eq!(
        e.fake.calls(Call::HostRegister),
        e.fake.calls(Call::HostUnregister) + 1
    );
    e.inv();
    Ok(())
}

// Reserve pieces are disjoint (data round trip) and pieces above the cache limit are
// not handed to cudaFreeHost.
#[test]
fn reserve_pieces_disjoint_and_cache_limit() -> R {
    let e = env("pinned_reserve_segment_size_mb:4,pinned_max_cached_size_mb:1")?;
    e.h.rt.set_host_memory(e.host.clone());
    let bufs: Vec<PinnedBuffer<i32>> = (0..6)
        .map(|i| PinnedBuffer::from_slice(&e.h.rt, &vec![i; 1000 + 700 * i as usize]))
        .collect::<Result<_, _>>()?;
    assert_eq!(e.fake.calls(Call::HostAlloc), 1);
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(
            b.to_vec()?,
            vec![i as i32; 1000 + 700 * i],
            "piece {i} overwritten"
        );
    }
    drop(bufs);
    // 2 MiB exact (above the cache limit), carved from the 4 MiB slab.
    let big = e.host.allocate(2 * MIB, leg())?;
    assert_eq!(e.fake.calls(Call::HostAlloc), 1, "carved");
    let freed = e.host.free(big.addr());
    assert!(freed.is_ok(), "{freed:?}");
    assert_eq!(
        e.fake.calls(Call::HostFree),
        0,
        "slab piece handed to cudaFreeHost"
    );
    assert!(
        matches!(
            e.host.free(big.addr()),
            Err(AllocError::InvalidHostPointer(_))
        ),
        "piece still known"
    );
    let m = e.m();
    assert_eq!(m["active_requests.current"], 0);
    e.inv();
    // The slab's rest is now under 2 MiB: a new driver allocation, released at its free.
    let again = e.host.allocate(2 * MIB, leg())?;
    assert!(again.bytes >= 2 * MIB);
    e.host.free(again.addr())?;
    e.host.empty_cache()?;
    assert_eq!(
        e.fake.calls(Call::HostFree),
        e.fake.calls(Call::HostAlloc) - 1
    );
    e.inv();
    Ok(())
}

// Toggling the register path while threads allocate: every block goes back the way it
// was made.
#[test]
fn concurrent_config_toggle_way_back() -> R {
    let e = env("pinned_num_register_threads:2")?;
    std::thread::scope(|sc| {
        let host = &e.host;
        let t = sc.spawn(move || {
            for i in 0..200 {
                let v = if i % 2 == 0 { "True" } else { "False" };
                host.update_config(&format!("pinned_use_cuda_host_register:{v}"))
                    .unwrap();
                if i % 7 == 0 {
                    host.empty_cache().unwrap();
                }
                std::thread::yield_now();
            }
        });
        for k in 0..3u64 {
            sc.spawn(move || {
                for i in 0..300u64 {
                    let r = host
                        .allocate(4096 + ((i * 7919 + k) % 60_000), leg())
                        .unwrap();
                    host.free(r.addr()).unwrap();
                }
            });
        }
        t.join().unwrap();
    });
    e.host.empty_cache()?;
    let f = &e.fake;
    assert_eq!(f.calls(Call::HostAlloc), f.calls(Call::HostFree));
    assert_eq!(f.calls(Call::HostMalloc), f.calls(Call::HostMfree));
    assert_eq!(f.calls(Call::HostRegister), f.calls(Call::HostUnregister));
    let m = e.m();
    assert_eq!(
        m["num_host_alloc"] as u64,
        f.calls(Call::HostAlloc) + f.calls(Call::HostRegister)
    );
    assert_eq!(m["allocations.current"], 0);
    e.inv();
    Ok(())
}

// Background thread releases a block above the cache limit once its event completed.
#[test]
fn background_thread_releases_large_block() -> R {
    let e = env("pinned_use_background_threads:True,pinned_max_cached_size_mb:1")?;
    let s = e.stream()?;
    e.busy(s.handle())?;
    let a = e.host.allocate(3 * MIB, leg())?;
    e.host.record_event(a.addr(), s.handle())?;
    e.host.free(a.addr())?;
    e.fake.advance(s.handle(), None)?;
    let mut done = false;
    for _ in 0..200 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        if e.fake.calls(Call::HostFree) == 1 {
            done = true;
            break;
        }
    }
    assert!(done, "never released");
    let m = e.m();
    assert_eq!(
        (
            m["allocations.current"],
            m["active_requests.current"],
            m["num_host_free"]
        ),
        (0, 0, 1)
    );
    e.inv();
    let Env { host, .. } = e;
    drop(host); // the background thread ends with it
    Ok(())
}

// Reserve segment configured by update before the first slow path; not after. Drop
// frees the slab only when no piece is in use.
#[test]
fn reserve_config_update_and_drop() -> R {
    let e = env("")?;
    e.host.update_config("pinned_reserve_segment_size_mb:1")?;
    let a = e.host.allocate(100, leg())?;
    let b = e.host.allocate(100, leg())?;
    assert_eq!(
        e.fake.calls(Call::HostAlloc),
        1,
        "slab from the updated config"
    );
    assert_eq!(a.base, b.base);
    e.host.free(a.addr())?;
    e.host.free(b.addr())?;
    let Env { h, fake, host, .. } = e;
    drop(host);
    assert_eq!(fake.calls(Call::HostFree), 1, "slab given back at drop");
    drop(h);

    let e = env("")?;
    let first = e.host.allocate(100, leg())?;
    e.host.update_config("pinned_reserve_segment_size_mb:1")?;
    let second = e.host.allocate(5000, leg())?;
    assert_eq!(
        e.fake.calls(Call::HostAlloc),
        2,
        "no slab after the first slow path"
    );
    assert_ne!(first.base, second.base);
    e.inv();

    let e = env("pinned_reserve_segment_size_mb:1")?;
    let keep = e.host.allocate(100, leg())?;
    let Env { h, fake, host, .. } = e;
    drop(host);
    assert_eq!(
        fake.calls(Call::HostFree),
        0,
        "slab freed under a live piece"
    );
    let _ = keep;
    drop(h);
    Ok(())
}

// A failed driver allocation is not timed (PyTorch throws before timing); 128 register
// threads on a small block pre-fault in one part.
#[test]
fn failed_alloc_not_timed_and_thread_cap() -> R {
    let e = env("pinned_use_cuda_host_register:True,pinned_num_register_threads:128")?;
    let a = e.host.allocate(64 * 1024, leg())?; // < 4 KiB * 128
    assert_eq!(e.fake.calls(Call::HostPrefault), 1);
    let big = e.host.allocate(1 << 20, leg())?; // 256 pages / 128 parts
    assert_eq!(e.fake.calls(Call::HostPrefault), 1 + 128);
    let before = e.m();
    e.fake
        .fail_nth(Call::HostRegister, 1, DriverError::OUT_OF_MEMORY);
    assert!(e.host.allocate(1 << 22, leg()).is_err());
    let after = e.m();
    assert_eq!(
        after["host_alloc_time.count"], before["host_alloc_time.count"],
        "failed allocation timed"
    );
    assert_eq!(after, before, "failed allocation changed statistics");
    e.host.free(a.addr())?;
    e.host.free(big.addr())?;
    e.inv();
    Ok(())
}
