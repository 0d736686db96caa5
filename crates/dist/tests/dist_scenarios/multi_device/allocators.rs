use super::*;

// One caching allocator per device: exact independent statistics, wrong-device frees,
//    empty_cache of one device only.
#[test]
fn a06_per_device_allocators_stats_wrong_device_free_and_empty_cache() {
    let e = env(3, Completion::Eager, &[], "");
    let rt = &e.rt;
    let a0 = DeviceBuffer::<u8>::uninit(rt, D0, 1000).unwrap(); // 1024 small
    let a1 = DeviceBuffer::<u8>::uninit(rt, D1, 3 << 20).unwrap(); // 3 MiB large
    let a1b = DeviceBuffer::<u8>::uninit(rt, D1, 100).unwrap(); // 512 small
    let st0 = e.alloc.device(D0).unwrap().stats();
    let st1 = e.alloc.device(D1).unwrap().stats();
    let st2 = e.alloc.device(D2).unwrap().stats();
    assert_eq!(st0.allocated_bytes.all.current, 1024);
    assert_eq!(st0.reserved_bytes.all.current, 2 << 20);
    assert_eq!(st0.allocation.all.current, 1);
    assert_eq!(st1.allocated_bytes.all.current, (3 << 20) + 512);
    assert_eq!(st1.reserved_bytes.all.current, (20 << 20) + (2 << 20));
    assert_eq!(st1.allocation.all.current, 2);
    assert_eq!(st1.segment.all.current, 2);
    assert_eq!(st2.allocated_bytes.all.current, 0);
    assert_eq!(st2.reserved_bytes.all.current, 0);

    // Freeing device 0's pointer on device 1's allocator: typed error, books unchanged.
    let err = e.alloc.device(D1).unwrap().free(a0.ptr());
    assert_eq!(err, Err(AllocError::InvalidPointer(a0.ptr())));
    let err = rt.memory().free(D2, a1.ptr());
    assert!(
        err.is_err(),
        "freeing device 1's pointer on device 2: {err:?}"
    );
    assert_eq!(
        e.alloc
            .device(D0)
            .unwrap()
            .stats()
            .allocated_bytes
            .all
            .current,
        1024
    );
    assert_eq!(
        e.alloc
            .device(D1)
            .unwrap()
            .stats()
            .allocated_bytes
            .all
            .current,
        (3 << 20) + 512
    );

    // Free everything on device 0 and 1; empty device 0's cache only.
    drop(a0);
    drop(a1);
    drop(a1b);
    assert_eq!(
        e.alloc
            .device(D0)
            .unwrap()
            .stats()
            .allocated_bytes
            .all
            .current,
        0
    );
    assert_eq!(
        e.alloc
            .device(D1)
            .unwrap()
            .stats()
            .allocated_bytes
            .all
            .current,
        0
    );
    let free_before = rt.mem_get_info(D1).unwrap().0;
    e.alloc.device(D0).unwrap().empty_cache();
    assert_eq!(
        e.alloc
            .device(D0)
            .unwrap()
            .stats()
            .reserved_bytes
            .all
            .current,
        0
    );
    assert_eq!(
        e.alloc
            .device(D1)
            .unwrap()
            .stats()
            .reserved_bytes
            .all
            .current,
        (20 << 20) + (2 << 20),
        "empty_cache of device 0 released device 1's cache"
    );
    assert_eq!(rt.mem_get_info(D1).unwrap().0, free_before);
    // Device 1's cache is still reused: no new segment.
    let nd_before = e.alloc.device(D1).unwrap().stats().num_device_alloc;
    let again = DeviceBuffer::<u8>::uninit(rt, D1, 3 << 20).unwrap();
    assert_eq!(
        e.alloc.device(D1).unwrap().stats().num_device_alloc,
        nd_before
    );
    drop(again);
    e.alloc.device(D1).unwrap().empty_cache();
    assert_eq!(
        e.alloc
            .device(D1)
            .unwrap()
            .stats()
            .reserved_bytes
            .all
            .current,
        0
    );
    // Index past the end: typed.
    assert!(matches!(
        e.alloc.device(DeviceIndex(3)),
        Err(AllocError::NoSuchDevice {
            device: 3,
            count: 3
        })
    ));
    // Concurrent allocations on different devices from different threads stay exact.
    std::thread::scope(|s| {
        for d in 0..3u16 {
            s.spawn(move || {
                let mut keep = Vec::new();
                for i in 0..50usize {
                    keep.push(
                        DeviceBuffer::<u8>::uninit(rt, DeviceIndex(d), 512 * (i % 5 + 1)).unwrap(),
                    );
                }
            });
        }
    });
    for d in 0..3u16 {
        let a = e.alloc.device(DeviceIndex(d)).unwrap();
        assert_eq!(a.stats().allocated_bytes.all.current, 0);
        assert_eq!(
            a.stats().allocation.all.allocated,
            if d == 0 {
                51
            } else if d == 1 {
                53
            } else {
                50
            }
        );
        a.check_invariants().unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// Expandable segments opened to a peer: memory mapped before and after peer access, and
//    memory re-mapped after empty_cache.
#[test]
fn a07_expandable_segments_open_to_peers_before_and_after() {
    let e = env(2, Completion::Eager, &[], "expandable_segments:True");
    let rt = &e.rt;
    let n = (4 << 20) / 4; // 4 MiB of f32
    let before = DeviceBuffer::<f32>::filled(rt, D1, n, 0.0).unwrap(); // mapped before
    let src = DeviceBuffer::<f32>::from_slice(rt, D0, &data(0, 7, n)).unwrap();
    before.copy_from(&src).unwrap(); // enables 0 -> 1 and copies directly
    assert!(e.fake.peer_access_enabled(D0, D1));
    assert_eq!(e.alloc.device(D1).unwrap().peers(), vec![D0]);
    assert_eq!(before.to_host().unwrap(), data(0, 7, n));
    // Mapped after: grows device 1's segment.
    let mut after = Vec::new();
    for i in 0..6 {
        let b = DeviceBuffer::<f32>::filled(rt, D1, n * (i + 1), 0.0).unwrap();
        let s = DeviceBuffer::<f32>::from_slice(rt, D0, &data(i, 8, n * (i + 1))).unwrap();
        b.copy_from(&s).unwrap();
        assert_eq!(b.to_host().unwrap(), data(i, 8, n * (i + 1)), "after #{i}");
        after.push(b);
    }
    let pc = e.fake.peer_copies();
    assert_eq!(pc.staged, 0, "{pc:?}");
    assert_eq!(pc.direct, 7, "{pc:?}");
    // Freed, emptied (unmapped), mapped again: still open to device 0.
    drop(after);
    drop(before);
    e.alloc.device(D1).unwrap().empty_cache();
    assert_eq!(
        e.alloc
            .device(D1)
            .unwrap()
            .stats()
            .reserved_bytes
            .all
            .current,
        0
    );
    let re = DeviceBuffer::<f32>::filled(rt, D1, 3 * n, 0.0).unwrap();
    let s = DeviceBuffer::<f32>::from_slice(rt, D0, &data(9, 9, 3 * n)).unwrap();
    re.copy_from(&s).unwrap();
    assert_eq!(
        re.to_host().unwrap(),
        data(9, 9, 3 * n),
        "re-mapped after empty_cache"
    );
    // The other direction: device 1 copies into device 0's expandable memory.
    let d0buf = DeviceBuffer::<f32>::filled(rt, D0, 3 * n, 0.0).unwrap();
    d0buf.copy_from(&re).unwrap(); // on device 1's stream: enables 1 -> 0
    assert_eq!(d0buf.to_host().unwrap(), data(9, 9, 3 * n));
    assert_eq!(e.alloc.device(D0).unwrap().peers(), vec![D1]);
    // Small pool on device 1 is expandable too: mapped after, accessible.
    let small = DeviceBuffer::<f32>::filled(rt, D1, 100, 0.0).unwrap();
    let ssrc = DeviceBuffer::<f32>::from_slice(rt, D0, &data(3, 3, 100)).unwrap();
    small.copy_from(&ssrc).unwrap();
    assert_eq!(small.to_host().unwrap(), data(3, 3, 100));
    assert_eq!(e.fake.peer_copies().staged, 0);
}

// ---------------------------------------------------------------------------------------------
// Peer access enabled while another thread keeps growing device 1's expandable segment.
#[test]
fn a07b_peer_enable_races_with_segment_growth() {
    let e = env(2, Completion::Eager, &[], "expandable_segments:True");
    let rt = e.rt.clone();
    let n = (2 << 20) / 4;
    let grown: Vec<DeviceBuffer<f32>> = with_timeout(30, "race", move || {
        std::thread::scope(|s| {
            let grower = s.spawn(|| {
                let mut v = Vec::new();
                for _ in 0..40 {
                    v.push(DeviceBuffer::<f32>::filled(&rt, D1, n, 0.0).unwrap());
                }
                v
            });
            std::thread::sleep(Duration::from_millis(1));
            assert!(rt.get_p2p_access(D0, D1).unwrap());
            grower.join().unwrap()
        })
    });
    let rt = &e.rt;
    let src = DeviceBuffer::<f32>::from_slice(rt, D0, &data(1, 1, n)).unwrap();
    for (i, b) in grown.iter().enumerate() {
        b.copy_from(&src)
            .unwrap_or_else(|err| panic!("buffer {i} not open to device 0: {err}"));
    }
    assert_eq!(e.fake.peer_copies().staged, 0);
}

// ---------------------------------------------------------------------------------------------
// record_stream with a stream of another device: freeing must not block the host
//     (PyTorch records the event on the stream's device).
#[test]
fn a17_record_stream_of_another_device_does_not_block_free() {
    let e = env(2, Completion::Manual, &[], "");
    let rt = &e.rt;
    let s1 = rt.stream_from_pool(D1, false).unwrap();
    let b0 = DeviceBuffer::<f32>::filled(rt, D0, 1024, 1.0).unwrap();
    rt.synchronize(D0).unwrap();
    b0.record_stream(&s1).unwrap();
    // Pending work on device 1's stream.
    let x1 = DeviceBuffer::<f32>::uninit(rt, D1, 1024).unwrap();
    {
        let _g = rt.stream_guard(&s1).unwrap();
        x1.fill(2.0).unwrap();
    }
    let pending_before = e.fake.pending(s1.handle()).unwrap();
    assert!(pending_before > 0);
    let syncs_before =
        e.fake.calls(Call::StreamSynchronize) + e.fake.calls(Call::DeviceSynchronize);
    let ptr = b0.ptr();
    drop(b0);
    let syncs = e.fake.calls(Call::StreamSynchronize) + e.fake.calls(Call::DeviceSynchronize)
        - syncs_before;
    let pending_after = e.fake.pending(s1.handle()).unwrap();
    // No host synchronisation: an event of device 1 is recorded on s1 (one more item
    // queued there), as PyTorch's `insert_events` does on the stream's device.
    assert_eq!(
        (syncs, pending_after),
        (0, pending_before + 1),
        "freeing a buffer recorded on a device-1 stream synchronised the host \
         ({syncs} sync calls, pending on s1 {pending_before} -> {pending_after})"
    );
    // And the block is not reused before s1's work completes.
    let again = DeviceBuffer::<f32>::uninit(rt, D0, 1024).unwrap();
    assert_ne!(again.ptr(), ptr, "reused before device 1's stream finished");
}

// ---------------------------------------------------------------------------------------------
// Peer access recorded by the allocator before expandable segments are switched on, with
//     two peers, and a cuMemSetAccess failure while opening that is retried.
#[test]
fn a18_expandable_toggled_after_peer_access_and_set_access_failure() {
    let e = env(3, Completion::Eager, &[], "");
    let rt = &e.rt;
    let n = 1 << 18;
    let s0 = DeviceBuffer::<f32>::from_slice(rt, D0, &data(0, 1, n)).unwrap();
    let s2 = DeviceBuffer::<f32>::from_slice(rt, D2, &data(2, 1, n)).unwrap();
    let t1 = DeviceBuffer::<f32>::filled(rt, D1, n, 0.0).unwrap();
    t1.copy_from(&s0).unwrap(); // 0 -> 1 enabled
    t1.copy_from(&s2).unwrap(); // 2 -> 1 enabled
    assert_eq!(e.alloc.device(D1).unwrap().peers(), vec![D0, D2]);
    e.alloc.set_settings("expandable_segments:True").unwrap();
    for (src, v) in [(&s0, data(0, 1, n)), (&s2, data(2, 1, n))] {
        let t = DeviceBuffer::<f32>::filled(rt, D1, n, 0.0).unwrap();
        t.copy_from(src).unwrap();
        assert_eq!(t.to_host().unwrap(), v);
    }
    let pc = e.fake.peer_copies();
    assert_eq!((pc.direct, pc.staged), (4, 0), "{pc:?}");

    // Device 2's expandable memory, mapped before 0 -> 2 is enabled; the first opening fails.
    // 3 MiB: a fresh expandable segment (not the cached rest of s2's cuMemAlloc segment).
    let t2 = DeviceBuffer::<f32>::filled(rt, D2, 3 * n, 0.0).unwrap();
    let s0 = DeviceBuffer::<f32>::from_slice(rt, D0, &data(0, 1, 3 * n)).unwrap();
    e.fake
        .fail_nth(Call::VmSetAccess, 1, DriverError::INVALID_VALUE);
    let r = t2.copy_from(&s0);
    assert!(
        r.is_err(),
        "the injected cuMemSetAccess failure was not reported: {r:?}"
    );
    assert!(e.alloc.device(D2).unwrap().peers().is_empty());
    t2.copy_from(&s0).unwrap(); // retried: enabled (already enabled in the driver) and opened
    assert_eq!(t2.to_host().unwrap(), data(0, 1, 3 * n));
    assert_eq!(e.alloc.device(D2).unwrap().peers(), vec![D0]);
    let t2b = DeviceBuffer::<f32>::filled(rt, D2, 4 * n, 0.0).unwrap();
    let big = DeviceBuffer::<f32>::from_slice(rt, D0, &data(5, 5, 4 * n)).unwrap();
    t2b.copy_from(&big).unwrap();
    assert_eq!(t2b.to_host().unwrap(), data(5, 5, 4 * n));
}
