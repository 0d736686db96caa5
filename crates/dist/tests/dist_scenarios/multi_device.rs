//! Multi-device scenarios on the fake device (written by an independent audit), judged by
//! PyTorch's rules: peers, copies, guards, per-device allocators, the fake group, the reducer.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::bool_assert_comparison
)]

use ferrocuda_alloc::{AllocError, Caching, DeviceAllocators};
use ferrocuda_dist::{
    BucketCaps, DistError, FakeGroup, ProcessGroup, ReduceOp, Reducer, reduce_found_inf,
};
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver, fake::Completion};
use ferrocuda_stream::{DeviceBuffer, KernelCache, Module, Runtime, StreamError};
use ferrocuda_testkit::{KERNELS, register_fake_kernels};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);
const D2: DeviceIndex = DeviceIndex(2);
const D3: DeviceIndex = DeviceIndex(3);

struct Env {
    fake: Arc<FakeDriver>,
    rt: Arc<Runtime>,
    alloc: Arc<DeviceAllocators>,
}

fn env(n: usize, completion: Completion, no_peer: &[(u16, u16)], conf: &str) -> Env {
    let mut b = FakeDriver::builder().devices(n).completion(completion);
    for &(a, p) in no_peer {
        b = b.no_peer_access(DeviceIndex(a), DeviceIndex(p));
    }
    let fake = Arc::new(b.build());
    register_fake_kernels(&fake);
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    let config = AllocatorConfig::parse(conf).expect("config");
    let alloc = DeviceAllocators::new(fake.clone(), config, Caching::On);
    alloc.install(&rt);
    Env { fake, rt, alloc }
}

/// Runs `f` on another thread; fails the test if it does not finish in `secs`.
fn with_timeout<R: Send + 'static>(
    secs: u64,
    what: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(r)) => r,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("TIMEOUT after {secs}s: {what} hung"),
    }
}

/// One thread per rank, rank i on device i, each with its own ProcessGroup.
fn run_ranks<R: Send + 'static>(
    e: &Env,
    n: usize,
    secs: u64,
    f: impl Fn(usize, Arc<ProcessGroup>, &Arc<Runtime>) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let fake = e.fake.clone();
    let rt = e.rt.clone();
    with_timeout(secs, "ranks", move || {
        let devices: Vec<DeviceIndex> = (0..n as u16).map(DeviceIndex).collect();
        let ranks = FakeGroup::ranks(fake, &devices).unwrap();
        let f = &f;
        let rt = &rt;
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .enumerate()
                .map(|(i, r)| {
                    s.spawn(move || {
                        rt.set_device(DeviceIndex(i as u16)).unwrap();
                        let pg = Arc::new(ProcessGroup::new(rt.clone(), Box::new(r)).unwrap());
                        f(i, pg, rt)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    })
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Integer-valued floats in [-50, 50]: sums are exact.
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (self.next() % 101) as f32 - 50.0).collect()
    }
}

fn data(rank: usize, salt: u64, n: usize) -> Vec<f32> {
    Rng(0x9E37_79B9_7F4A_7C15 ^ (rank as u64 * 7919 + salt * 104_729 + 1)).f32s(n)
}

// ---------------------------------------------------------------------------------------------
// Peer access queries and enabling.
#[test]
fn a01_peer_access_queries_and_enabling() {
    let e = env(3, Completion::Eager, &[(0, 2)], "");
    let rt = &e.rt;
    assert_eq!(
        rt.can_device_access_peer(D0, D0).unwrap(),
        false,
        "a device and itself"
    );
    assert_eq!(rt.can_device_access_peer(D0, D1).unwrap(), true);
    assert_eq!(
        rt.can_device_access_peer(D0, D2).unwrap(),
        false,
        "no_peer_access(0,2)"
    );
    assert_eq!(
        rt.can_device_access_peer(D2, D0).unwrap(),
        true,
        "only 0->2 was refused"
    );
    assert_eq!(
        rt.can_device_access_peer(D0, DeviceIndex(5)),
        Err(StreamError::InvalidDevice { index: 5, count: 3 })
    );
    assert_eq!(
        rt.can_device_access_peer(DeviceIndex(3), D0),
        Err(StreamError::InvalidDevice { index: 3, count: 3 })
    );
    // can_device_access_peer enables nothing.
    assert_eq!(e.fake.calls(Call::EnablePeerAccess), 0);
    assert!(!e.fake.peer_access_enabled(D0, D1));

    // get_p2p_access: diagonal true, enable once, cached.
    assert_eq!(rt.get_p2p_access(D1, D1).unwrap(), true);
    assert_eq!(rt.get_p2p_access(D0, D1).unwrap(), true);
    assert_eq!(rt.get_p2p_access(D0, D1).unwrap(), true);
    assert!(e.fake.peer_access_enabled(D0, D1));
    assert_eq!(
        e.fake.calls(Call::EnablePeerAccess),
        1,
        "enabled once per pair"
    );
    // Enabled behind the runtime's back: "already enabled" is fine.
    e.fake.enable_peer_access(D1, D0).unwrap();
    assert_eq!(rt.get_p2p_access(D1, D0).unwrap(), true);
    // The driver's codes.
    assert_eq!(
        e.fake.enable_peer_access(D1, D0),
        Err(DriverError::PEER_ACCESS_ALREADY_ENABLED)
    );
    assert_eq!(
        e.fake.enable_peer_access(D0, D2),
        Err(DriverError::PEER_ACCESS_UNSUPPORTED)
    );
    assert_eq!(
        e.fake.enable_peer_access(D1, D1),
        Err(DriverError::INVALID_DEVICE)
    );
    // A pair that cannot: PyTorch's get_p2p_access answers false (no error, nothing enabled).
    assert_eq!(rt.get_p2p_access(D0, D2).unwrap(), false);
    assert!(!e.fake.peer_access_enabled(D0, D2));
    assert_eq!(
        rt.get_p2p_access(D0, DeviceIndex(9)),
        Err(StreamError::InvalidDevice { index: 9, count: 3 })
    );
    // Documented difference: a failed enable is returned and not cached; the retry works.
    e.fake
        .fail_nth(Call::EnablePeerAccess, 1, DriverError::INVALID_VALUE);
    assert!(rt.get_p2p_access(D2, D1).is_err());
    assert!(!e.fake.peer_access_enabled(D2, D1));
    assert_eq!(rt.get_p2p_access(D2, D1).unwrap(), true);
    assert!(e.fake.peer_access_enabled(D2, D1));

    // Many threads racing for one pair: enabled exactly once, everyone true.
    let before = e.fake.calls(Call::EnablePeerAccess);
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| assert_eq!(rt.get_p2p_access(D1, D2).unwrap(), true));
        }
    });
    assert_eq!(e.fake.calls(Call::EnablePeerAccess) - before, 1);
}

// ---------------------------------------------------------------------------------------------
// Copies between devices, with and without peer access, both ways.
#[test]
fn a02_copies_between_devices_with_and_without_peer_access() {
    let e = env(3, Completion::Eager, &[(0, 2), (2, 0)], "");
    let rt = &e.rt;
    rt.set_device(D1).unwrap();
    let n = 3000;
    let v0 = data(0, 1, n);
    let v1 = data(1, 1, n);
    let v2 = data(2, 1, n);
    let b0 = DeviceBuffer::from_slice(rt, D0, &v0).unwrap();
    let b1 = DeviceBuffer::from_slice(rt, D1, &v1).unwrap();
    let b2 = DeviceBuffer::from_slice(rt, D2, &v2).unwrap();
    let t0 = DeviceBuffer::<f32>::filled(rt, D0, n, 0.0).unwrap();
    let t1 = DeviceBuffer::<f32>::filled(rt, D1, n, 0.0).unwrap();
    let t2 = DeviceBuffer::<f32>::filled(rt, D2, n, 0.0).unwrap();

    t1.copy_from(&b0).unwrap(); // 0 -> 1, peer
    assert_eq!(t1.to_host().unwrap(), v0, "0->1");
    t0.copy_from(&b1).unwrap(); // 1 -> 0, peer
    assert_eq!(t0.to_host().unwrap(), v1, "1->0");
    let pc = e.fake.peer_copies();
    assert_eq!(
        (pc.direct, pc.staged),
        (2, 0),
        "peer copies over the link: {pc:?}"
    );
    t2.copy_from(&b0).unwrap(); // 0 -> 2, staged
    assert_eq!(t2.to_host().unwrap(), v0, "0->2 staged");
    t0.copy_from(&b2).unwrap(); // 2 -> 0, staged
    assert_eq!(t0.to_host().unwrap(), v2, "2->0 staged");
    let pc = e.fake.peer_copies();
    assert_eq!((pc.direct, pc.staged), (2, 2), "{pc:?}");
    t2.copy_from(&b1).unwrap(); // 1 -> 2 direct
    assert_eq!(t2.to_host().unwrap(), v1, "1->2");
    t1.copy_from(&b2).unwrap(); // 2 -> 1 direct
    assert_eq!(t1.to_host().unwrap(), v2, "2->1");
    // Source untouched.
    assert_eq!(b0.to_host().unwrap(), v0);
    assert_eq!(b2.to_host().unwrap(), v2);
    // Current device unchanged by copies.
    assert_eq!(rt.current_device(), D1);
    // Length mismatch is typed.
    let short = DeviceBuffer::<f32>::filled(rt, D1, n - 1, 0.0).unwrap();
    assert_eq!(
        short.copy_from(&b0),
        Err(StreamError::LengthMismatch {
            expected: n - 1,
            found: n
        })
    );
    // Nothing leaked across devices in the allocators' books.
    for d in [D0, D1, D2] {
        e.alloc.device(d).unwrap().check_invariants().unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// A copy between devices is ordered after both devices' current streams, and a kernel
//    later on the destination's stream sees the data (manual completion).
#[test]
fn a03_copy_is_ordered_after_source_and_destination_streams() {
    let e = env(2, Completion::Manual, &[], "");
    let rt = &e.rt;
    // Non-default current streams on both devices.
    let s0 = rt.stream_from_pool(D0, false).unwrap();
    let s1 = rt.stream_from_pool(D1, false).unwrap();
    rt.set_stream(&s0).unwrap();
    rt.set_stream(&s1).unwrap();
    rt.set_device(D0).unwrap();
    assert_eq!(rt.current_stream(D0).unwrap(), s0);
    assert_eq!(rt.current_stream(D1).unwrap(), s1);

    let n = 1024usize;
    let v = data(0, 3, n);
    let src = DeviceBuffer::<f32>::uninit(rt, D0, n).unwrap();
    let dst = DeviceBuffer::<f32>::uninit(rt, D1, n).unwrap();
    src.copy_from_host(&v).unwrap(); // pending on s0
    dst.fill(7.0).unwrap(); // pending on s1
    assert!(e.fake.pending(s0.handle()).unwrap() >= 1);
    assert!(e.fake.pending(s1.handle()).unwrap() >= 1);
    dst.copy_from(&src).unwrap();
    // Advancing only the source stream must stop before the copy: the destination's fill
    // has not run (the copy waits for the destination's current stream).
    e.fake.advance(s0.handle(), None).unwrap();
    assert!(
        e.fake.pending(s0.handle()).unwrap() > 0,
        "the copy ran on the source stream before the destination's pending work"
    );
    // Now a kernel on the destination's stream, after the copy.
    let m1 = Module::from_cuda_source(rt, D1, "audit", KERNELS).unwrap();
    let f = m1.function("add_one_f32").unwrap();
    let nn = n as u32;
    s1.launch(
        &f,
        &LaunchConfig::for_elements(n, 128),
        &[dst.arg(), KernelArg::value(&nn)],
    )
    .unwrap();
    // Advance the destination's stream first: it must not run the kernel before the copy.
    e.fake.advance(s1.handle(), None).unwrap();
    e.fake.advance_all();
    let want: Vec<f32> = v.iter().map(|x| x + 1.0).collect();
    assert_eq!(
        dst.to_host().unwrap(),
        want,
        "kernel after the copy saw the copied data"
    );
    assert_eq!(rt.current_device(), D0);

    // And the other way round: writes on the destination after the copy (on its current
    // stream) must not be overtaken; pending source work before the copy must be included.
    let src2 = DeviceBuffer::<f32>::uninit(rt, D1, n).unwrap();
    let dst2 = DeviceBuffer::<f32>::uninit(rt, D0, n).unwrap();
    let v2 = data(1, 3, n);
    src2.copy_from_host(&v2).unwrap(); // pending on s1
    dst2.copy_from(&src2).unwrap(); // copy on s1 (source), dst stream s0 waits
    assert_eq!(
        dst2.to_host().unwrap(),
        v2,
        "1->0 read on the destination's stream"
    );
}

// ---------------------------------------------------------------------------------------------
// Device guards nest across devices and restore on drop and on panic.
#[test]
fn a04_device_guards_nest_and_restore_on_panic() {
    let e = env(4, Completion::Eager, &[], "");
    let rt = &e.rt;
    assert_eq!(rt.current_device(), D0);
    {
        let g1 = rt.device_guard(D1).unwrap();
        assert_eq!(g1.previous(), D0);
        assert_eq!(rt.current_device(), D1);
        {
            let g3 = rt.device_guard(D3).unwrap();
            assert_eq!(g3.previous(), D1);
            assert_eq!(rt.current_device(), D3);
            {
                let _g2 = rt.device_guard(D2).unwrap();
                assert_eq!(rt.current_device(), D2);
                // A refused guard changes nothing.
                assert!(matches!(
                    rt.device_guard(DeviceIndex(4)),
                    Err(StreamError::InvalidDevice { index: 4, count: 4 })
                ));
                assert_eq!(rt.current_device(), D2);
            }
            assert_eq!(rt.current_device(), D3);
        }
        assert_eq!(rt.current_device(), D1);
    }
    assert_eq!(rt.current_device(), D0);

    // Panic inside nested guards: every guard unwinds, device 0 again.
    let rt2 = rt.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _a = rt2.device_guard(D2).unwrap();
        let _b = rt2.device_guard(D3).unwrap();
        let _c = rt2.device_guard(D1).unwrap();
        panic!("boom");
    }));
    assert!(r.is_err());
    assert_eq!(rt.current_device(), D0, "after panic");

    // Per thread: another thread starts on device 0 whatever this one does.
    let _g = rt.device_guard(D2).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(rt.current_device(), D0);
            let _g = rt.device_guard(D3).unwrap();
            assert_eq!(rt.current_device(), D3);
        });
    });
    assert_eq!(rt.current_device(), D2);
}

// ---------------------------------------------------------------------------------------------
// Stream guards: per-device current stream; a guard on device 1 sets and restores both.
#[test]
fn a05_stream_guard_on_other_device_sets_and_restores_both() {
    let e = env(3, Completion::Eager, &[], "");
    let rt = &e.rt;
    let def0 = rt.default_stream(D0).unwrap();
    let def1 = rt.default_stream(D1).unwrap();
    let def2 = rt.default_stream(D2).unwrap();
    let s1 = rt.stream_from_pool(D1, false).unwrap();
    let s1b = rt.new_stream(D1, 0).unwrap();
    let s2 = rt.stream_from_pool(D2, true).unwrap();
    rt.set_device(D0).unwrap();
    {
        let _g = rt.stream_guard(&s1).unwrap();
        assert_eq!(rt.current_device(), D1);
        assert_eq!(rt.current_stream(D1).unwrap(), s1);
        assert_eq!(
            rt.current_stream(D0).unwrap(),
            def0,
            "other devices' streams untouched"
        );
        {
            let _h = rt.stream_guard(&s2).unwrap();
            assert_eq!(rt.current_device(), D2);
            assert_eq!(rt.current_stream(D2).unwrap(), s2);
            assert_eq!(rt.current_stream(D1).unwrap(), s1);
            {
                let _k = rt.stream_guard(&s1b).unwrap();
                assert_eq!(rt.current_device(), D1);
                assert_eq!(rt.current_stream(D1).unwrap(), s1b);
            }
            assert_eq!(rt.current_device(), D2);
            assert_eq!(rt.current_stream(D1).unwrap(), s1);
        }
        assert_eq!(rt.current_device(), D1);
        assert_eq!(rt.current_stream(D2).unwrap(), def2);
        // Work in the guard runs on s1: a buffer allocated here is tagged with s1.
        let b = DeviceBuffer::<f32>::filled(rt, D1, 16, 1.0).unwrap();
        assert_eq!(b.to_host().unwrap(), vec![1.0; 16]);
    }
    assert_eq!(rt.current_device(), D0);
    assert_eq!(rt.current_stream(D1).unwrap(), def1);
    assert_eq!(rt.current_stream(D2).unwrap(), def2);

    // Panic inside a stream guard restores stream and device.
    let rt2 = rt.clone();
    let s1c = s1.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _d = rt2.device_guard(D2).unwrap();
        let _g = rt2.stream_guard(&s1c).unwrap();
        panic!("boom");
    }));
    assert!(r.is_err());
    assert_eq!(rt.current_device(), D0);
    assert_eq!(rt.current_stream(D1).unwrap(), def1);

    // Another thread has its own current streams.
    rt.set_stream(&s1).unwrap();
    rt.set_device(D0).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| assert_eq!(rt.current_stream(D1).unwrap(), def1));
    });
    assert_eq!(rt.current_stream(D1).unwrap(), s1);
}

// ---------------------------------------------------------------------------------------------
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
// Collectives give the mathematically right results (4 ranks, random data).
#[test]
fn a08_collectives_match_reference_four_ranks() {
    let e = env(4, Completion::Eager, &[], "");
    let n = 37usize;
    let world = 4usize;
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        assert_eq!(pg.rank(), rank);
        assert_eq!(pg.size(), world);
        let mut results: Vec<(String, Vec<f32>)> = Vec::new();
        for (salt, op) in [
            (1, ReduceOp::Sum),
            (2, ReduceOp::Avg),
            (3, ReduceOp::Max),
            (4, ReduceOp::Min),
            (5, ReduceOp::Product),
        ] {
            let b = DeviceBuffer::from_slice(rt, dev, &data(rank, salt, n)).unwrap();
            pg.all_reduce(&b, op).unwrap().wait().unwrap();
            results.push((format!("{op:?}"), b.to_host().unwrap()));
        }
        let b = DeviceBuffer::from_slice(rt, dev, &data(rank, 6, n)).unwrap();
        pg.broadcast(&b, 2).unwrap().wait().unwrap();
        results.push(("broadcast".into(), b.to_host().unwrap()));
        let input = DeviceBuffer::from_slice(rt, dev, &data(rank, 7, n * world)).unwrap();
        let output = DeviceBuffer::<f32>::filled(rt, dev, n, 0.0).unwrap();
        pg.reduce_scatter(&output, &input, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        results.push(("reduce_scatter".into(), output.to_host().unwrap()));
        let input = DeviceBuffer::from_slice(rt, dev, &data(rank, 8, n)).unwrap();
        let output = DeviceBuffer::<f32>::filled(rt, dev, n * world, 0.0).unwrap();
        pg.all_gather(&output, &input).unwrap().wait().unwrap();
        results.push(("all_gather".into(), output.to_host().unwrap()));
        // i64 sum.
        let iv: Vec<i64> = (0..n as i64).map(|i| i * (rank as i64 + 1) - 3).collect();
        let ib = DeviceBuffer::from_slice(rt, dev, &iv).unwrap();
        pg.all_reduce(&ib, ReduceOp::Sum).unwrap().wait().unwrap();
        let got: Vec<f32> = ib.to_host().unwrap().iter().map(|&x| x as f32).collect();
        results.push(("i64 sum".into(), got));
        results
    });
    let inputs = |salt, len| (0..world).map(|r| data(r, salt, len)).collect::<Vec<_>>();
    let fold = |salt: u64, len: usize, f: &dyn Fn(f32, f32) -> f32| -> Vec<f32> {
        let ins = inputs(salt, len);
        (0..len)
            .map(|i| ins[1..].iter().fold(ins[0][i], |a, v| f(a, v[i])))
            .collect()
    };
    let sum = fold(1, n, &|a, b| a + b);
    let avg: Vec<f32> = fold(2, n, &|a, b| a + b)
        .iter()
        .map(|s| s / world as f32)
        .collect();
    let max = fold(3, n, &f32::max);
    let min = fold(4, n, &f32::min);
    let prod = fold(5, n, &|a, b| a * b);
    let bcast = data(2, 6, n);
    let rs_all = fold(7, n * world, &|a, b| a + b);
    let ag: Vec<f32> = inputs(8, n).concat();
    let isum: Vec<f32> = (0..n as i64)
        .map(|i| (1..=world as i64).map(|r| i * r - 3).sum::<i64>() as f32)
        .collect();
    for (rank, res) in out.iter().enumerate() {
        let want = [
            sum.clone(),
            avg.clone(),
            max.clone(),
            min.clone(),
            prod.clone(),
            bcast.clone(),
            rs_all[rank * n..(rank + 1) * n].to_vec(),
            ag.clone(),
            isum.clone(),
        ];
        for ((name, got), want) in res.iter().zip(want.iter()) {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                    "rank {rank} {name}[{i}]: got {g}, want {w}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Send and receive: a ring over 4 ranks, in both directions.
#[test]
fn a09_send_recv_ring() {
    let e = env(4, Completion::Eager, &[], "");
    let n = 65usize;
    let world = 4usize;
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let next = (rank + 1) % world;
        let prev = (rank + world - 1) % world;
        let mine = DeviceBuffer::from_slice(rt, dev, &data(rank, 11, n)).unwrap();
        let got = DeviceBuffer::<f32>::filled(rt, dev, n, 0.0).unwrap();
        // Even ranks send first, odd receive first: no cycle of blocking sends.
        if rank % 2 == 0 {
            pg.send(&mine, next).unwrap();
            pg.recv(&got, prev).unwrap().wait().unwrap();
        } else {
            pg.recv(&got, prev).unwrap().wait().unwrap();
            pg.send(&mine, next).unwrap();
        }
        let fwd = got.to_host().unwrap();
        // The other way.
        let got2 = DeviceBuffer::<f32>::filled(rt, dev, n, 0.0).unwrap();
        if rank % 2 == 0 {
            pg.send(&mine, prev).unwrap();
            pg.recv(&got2, next).unwrap().wait().unwrap();
        } else {
            pg.recv(&got2, next).unwrap().wait().unwrap();
            pg.send(&mine, prev).unwrap();
        }
        // Send to self, or to no rank: typed.
        let selfsend = pg.send(&mine, rank).err();
        let outside = pg.recv(&got, world).err();
        (fwd, got2.to_host().unwrap(), selfsend, outside)
    });
    for (rank, (fwd, bwd, selfsend, outside)) in out.into_iter().enumerate() {
        assert_eq!(
            fwd,
            data((rank + world - 1) % world, 11, n),
            "rank {rank} from prev"
        );
        assert_eq!(
            bwd,
            data((rank + 1) % world, 11, n),
            "rank {rank} from next"
        );
        assert_eq!(selfsend, Some(DistError::InvalidRank { rank, size: world }));
        assert_eq!(
            outside,
            Some(DistError::InvalidRank {
                rank: world,
                size: world
            })
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Mismatched calls are typed errors on every rank, and the group still works afterwards.
#[test]
fn a10_mismatched_collectives_are_typed_errors() {
    let e = env(3, Completion::Eager, &[], "");
    let world = 3usize;
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let mut errs = Vec::new();
        // Counts disagree.
        let b = DeviceBuffer::<f32>::filled(rt, dev, 4 + usize::from(rank == 1), 1.0).unwrap();
        errs.push(pg.all_reduce(&b, ReduceOp::Sum).err());
        // Roots disagree.
        let b = DeviceBuffer::<f32>::filled(rt, dev, 4, 1.0).unwrap();
        errs.push(pg.broadcast(&b, rank % 2).err());
        // Operations disagree.
        let op = if rank == 2 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        errs.push(pg.all_reduce(&b, op).err());
        // Types disagree: i32 on rank 0, f32 elsewhere.
        if rank == 0 {
            let bi = DeviceBuffer::<i32>::filled(rt, dev, 4, 1).unwrap();
            errs.push(pg.all_reduce(&bi, ReduceOp::Sum).err());
        } else {
            errs.push(pg.all_reduce(&b, ReduceOp::Sum).err());
        }
        // Kinds disagree.
        if rank == 0 {
            errs.push(pg.broadcast(&b, 0).err());
        } else {
            errs.push(pg.all_reduce(&b, ReduceOp::Sum).err());
        }
        // Local errors (no rendezvous): root out of range, wrong device, wrong lengths.
        let local = vec![
            pg.broadcast(&b, world).err(),
            pg.all_reduce(
                &DeviceBuffer::<f32>::filled(rt, DeviceIndex(((rank + 1) % world) as u16), 4, 0.0)
                    .unwrap(),
                ReduceOp::Sum,
            )
            .err(),
            pg.reduce_scatter(&b, &b, ReduceOp::Sum).err(),
            pg.all_gather(&b, &b).err(),
        ];
        // Still works.
        let ok = DeviceBuffer::<f32>::filled(rt, dev, 4, (rank + 1) as f32).unwrap();
        pg.all_reduce(&ok, ReduceOp::Sum).unwrap().wait().unwrap();
        (errs, local, ok.to_host().unwrap())
    });
    for (rank, (errs, local, ok)) in out.into_iter().enumerate() {
        for (i, err) in errs.iter().enumerate() {
            assert!(
                matches!(err, Some(DistError::Mismatched(_))),
                "rank {rank} mismatch #{i}: {err:?}"
            );
        }
        assert_eq!(
            local[0],
            Some(DistError::InvalidRank {
                rank: world,
                size: world
            })
        );
        assert!(
            matches!(local[1], Some(DistError::DeviceMismatch { .. })),
            "{:?}",
            local[1]
        );
        assert!(
            matches!(local[2], Some(DistError::LengthMismatch { .. })),
            "{:?}",
            local[2]
        );
        assert!(
            matches!(local[3], Some(DistError::LengthMismatch { .. })),
            "{:?}",
            local[3]
        );
        assert_eq!(ok, vec![6.0; 4], "rank {rank} after errors");
    }
}

// ---------------------------------------------------------------------------------------------
// A rank that drops out: the others must not hang forever.
#[test]
fn a11_rank_dropping_out_does_not_hang_forever() {
    let e = env(2, Completion::Eager, &[], "");
    let fake = e.fake.clone();
    let rt = e.rt.clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut ranks = FakeGroup::ranks(fake, &[D0, D1]).unwrap();
        let r1 = ranks.pop().unwrap();
        let r0 = ranks.pop().unwrap();
        // Rank 1 leaves: its process group is made and dropped without a call.
        let gone = std::thread::spawn({
            let rt = rt.clone();
            move || drop(ProcessGroup::new(rt, Box::new(r1)).unwrap())
        });
        gone.join().unwrap();
        let pg = ProcessGroup::new(rt.clone(), Box::new(r0)).unwrap();
        let b = DeviceBuffer::<f32>::filled(&rt, D0, 8, 1.0).unwrap();
        let r = pg.all_reduce(&b, ReduceOp::Sum).map(drop);
        let _ = tx.send(format!("{r:?}"));
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(r) => assert!(
            r.starts_with("Err"),
            "the survivor's all_reduce returned {r}"
        ),
        Err(_) => panic!(
            "rank 0's all_reduce still blocked 10 s after rank 1 dropped its process group \
             (no timeout, no error)"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Reducer: reverse-order buckets, launched when full and in order, averaged results.
#[test]
fn a12_reducer_buckets_and_average() {
    let e = env(3, Completion::Eager, &[], "");
    let world = 3usize;
    let lens = [3usize, 5, 2, 4, 6];
    let caps = BucketCaps {
        first_bytes: 16,
        bytes: 24,
    };
    assert_eq!(
        ferrocuda_dist::assign_buckets(&lens, caps),
        vec![vec![4], vec![3, 2], vec![1, 0]]
    );
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let mut red = Reducer::new(rt.clone(), pg.clone(), &lens, caps, ReduceOp::Avg).unwrap();
        assert_eq!(red.buckets(), vec![vec![4], vec![3, 2], vec![1, 0]]);
        let mut per_iter = Vec::new();
        for iter in 0..2u64 {
            let grads: Vec<DeviceBuffer<f32>> = lens
                .iter()
                .enumerate()
                .map(|(p, &l)| {
                    DeviceBuffer::from_slice(rt, dev, &data(rank, 100 * iter + p as u64, l))
                        .unwrap()
                })
                .collect();
            let mut launched_after = Vec::new();
            // Rank 0: reverse order (as autograd); others: forward order.
            let order: Vec<usize> = if rank == 0 {
                (0..5).rev().collect()
            } else {
                (0..5).collect()
            };
            for &p in &order {
                red.grad_ready(p, &grads[p]).unwrap();
                launched_after.push(red.launched().to_vec());
            }
            let double = red.grad_ready(order[0], &grads[order[0]]).err();
            let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
            red.finish(&refs).unwrap();
            let vals: Vec<Vec<f32>> = grads.iter().map(|g| g.to_host().unwrap()).collect();
            per_iter.push((launched_after, double, vals));
        }
        // finish before every gradient: DDP's error.
        let g = DeviceBuffer::<f32>::filled(rt, dev, 6, 0.0).unwrap();
        let early_grads: Vec<DeviceBuffer<f32>> = lens
            .iter()
            .map(|&l| DeviceBuffer::filled(rt, dev, l, 0.0).unwrap())
            .collect();
        let refs: Vec<&DeviceBuffer<f32>> = early_grads.iter().collect();
        let _ = g;
        let early = red.finish(&refs).err();
        (per_iter, early)
    });
    for (rank, (per_iter, early)) in out.into_iter().enumerate() {
        assert!(
            matches!(early, Some(DistError::Reducer(_))),
            "rank {rank}: {early:?}"
        );
        for (iter, (launched_after, double, vals)) in per_iter.into_iter().enumerate() {
            if rank == 0 {
                assert_eq!(
                    launched_after,
                    vec![vec![0], vec![0], vec![0, 1], vec![0, 1], vec![0, 1, 2]],
                    "rank 0 iter {iter}: buckets launched as they fill"
                );
            } else {
                assert_eq!(
                    launched_after,
                    vec![vec![], vec![], vec![], vec![], vec![0, 1, 2]],
                    "rank {rank} iter {iter}: launched only in order"
                );
            }
            assert!(matches!(double, Some(DistError::Reducer(_))), "{double:?}");
            for (p, &l) in lens.iter().enumerate() {
                let want: Vec<f32> = (0..l)
                    .map(|i| {
                        (0..world)
                            .map(|r| data(r, 100 * iter as u64 + p as u64, l)[i])
                            .sum::<f32>()
                            / world as f32
                    })
                    .collect();
                for (i, (g, w)) in vals[p].iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() < 1e-4,
                        "rank {rank} iter {iter} param {p}[{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// found_inf reduced across ranks with max: any rank's inf reaches all; Sum reducer too.
#[test]
fn a13_found_inf_and_sum_reducer() {
    let e = env(4, Completion::Manual, &[], "");
    let world = 4usize;
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let fi =
            DeviceBuffer::<f32>::from_slice(rt, dev, &[if rank == 2 { 1.0 } else { 0.0 }]).unwrap();
        reduce_found_inf(&pg, &fi).unwrap();
        let seen = fi.to_host().unwrap()[0];
        let none = DeviceBuffer::<f32>::from_slice(rt, dev, &[0.0]).unwrap();
        reduce_found_inf(&pg, &none).unwrap();
        let seen_none = none.to_host().unwrap()[0];
        // A Sum reducer with one bucket per parameter (caps of 1 byte).
        let lens = [7usize, 1, 9];
        let caps = BucketCaps {
            first_bytes: 1,
            bytes: 1,
        };
        let mut red = Reducer::new(rt.clone(), pg.clone(), &lens, caps, ReduceOp::Sum).unwrap();
        let grads: Vec<DeviceBuffer<f32>> = lens
            .iter()
            .enumerate()
            .map(|(p, &l)| {
                DeviceBuffer::from_slice(rt, dev, &data(rank, 50 + p as u64, l)).unwrap()
            })
            .collect();
        for p in (0..3).rev() {
            red.grad_ready(p, &grads[p]).unwrap();
        }
        let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
        red.finish(&refs).unwrap();
        let vals: Vec<Vec<f32>> = grads.iter().map(|g| g.to_host().unwrap()).collect();
        (seen, seen_none, vals)
    });
    for (rank, (seen, seen_none, vals)) in out.into_iter().enumerate() {
        assert_eq!(seen, 1.0, "rank {rank} did not see rank 2's inf");
        assert_eq!(seen_none, 0.0, "rank {rank}");
        for (p, &l) in [7usize, 1, 9].iter().enumerate() {
            let want: Vec<f32> = (0..l)
                .map(|i| (0..world).map(|r| data(r, 50 + p as u64, l)[i]).sum())
                .collect();
            assert_eq!(vals[p], want, "rank {rank} param {p}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Collectives in manual completion: ordered after every rank's pending work; the current
//     stream waits only through Work::wait.
#[test]
fn a14_collective_stream_order_manual_completion() {
    let e = env(2, Completion::Manual, &[], "");
    let fake = e.fake.clone();
    let out = run_ranks(&e, 2, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        // A side stream as current stream: the comm stream must wait for it.
        let side = rt.stream_from_pool(dev, true).unwrap();
        let _g = rt.stream_guard(&side).unwrap();
        let b = DeviceBuffer::<f32>::uninit(rt, dev, 16).unwrap();
        b.fill((rank + 1) as f32 * 10.0).unwrap(); // pending
        let w = pg.all_reduce(&b, ReduceOp::Sum).unwrap();
        let done_early = w.is_completed().unwrap();
        w.wait().unwrap();
        let v = b.to_host().unwrap();
        let _ = &fake;
        (done_early, v)
    });
    for (rank, (done_early, v)) in out.into_iter().enumerate() {
        assert!(
            !done_early,
            "rank {rank}: collective completed before pending inputs ran"
        );
        assert_eq!(v, vec![30.0; 16], "rank {rank}");
    }
}

// ---------------------------------------------------------------------------------------------
// A small exchange ordered as the fake group needs it (its send is a host rendezvous
//     with the receiver, documented on `ProcessGroup::send`): rank 0 sends then receives,
//     rank 1 receives then sends.
#[test]
fn a15_ordered_send_recv_exchange() {
    let e = env(2, Completion::Eager, &[], "");
    let out = run_ranks(&e, 2, 10, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let mine = DeviceBuffer::<f32>::filled(rt, dev, 4, rank as f32 + 1.0).unwrap();
        let got = DeviceBuffer::<f32>::filled(rt, dev, 4, 0.0).unwrap();
        let other = 1 - rank;
        if rank == 0 {
            pg.send(&mine, other).unwrap().wait().unwrap();
            pg.recv(&got, other).unwrap().wait().unwrap();
        } else {
            pg.recv(&got, other).unwrap().wait().unwrap();
            pg.send(&mine, other).unwrap().wait().unwrap();
        }
        got.to_host().unwrap()
    });
    assert_eq!(out[0], vec![2.0; 4]);
    assert_eq!(out[1], vec![1.0; 4]);
}

// ---------------------------------------------------------------------------------------------
// Reducer given a gradient on another device than its group.
#[test]
fn a16_reducer_refuses_gradient_on_another_device() {
    let e = env(2, Completion::Eager, &[], "");
    let rt = &e.rt;
    let rank = FakeGroup::ranks(e.fake.clone(), &[D0])
        .unwrap()
        .pop()
        .unwrap();
    let pg = Arc::new(ProcessGroup::new(rt.clone(), Box::new(rank)).unwrap());
    let mut red = Reducer::new(
        rt.clone(),
        pg.clone(),
        &[4],
        BucketCaps::default(),
        ReduceOp::Sum,
    )
    .unwrap();
    let wrong = DeviceBuffer::<f32>::from_slice(rt, D1, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let r = red.grad_ready(0, &wrong);
    assert!(
        matches!(r, Err(DistError::DeviceMismatch { .. })),
        "grad_ready with a gradient on cuda:1 for a group on cuda:0 returned {r:?}"
    );
    // And finish writing results into a buffer of another device.
    let mut red = Reducer::new(rt.clone(), pg, &[4], BucketCaps::default(), ReduceOp::Sum).unwrap();
    let right = DeviceBuffer::<f32>::from_slice(rt, D0, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    red.grad_ready(0, &right).unwrap();
    let r = red.finish(&[&wrong]);
    assert!(
        matches!(r, Err(DistError::DeviceMismatch { .. })),
        "finish into a gradient on cuda:1 for a group on cuda:0 returned {r:?}"
    );
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
