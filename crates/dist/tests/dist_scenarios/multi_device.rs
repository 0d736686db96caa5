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

/// One caching allocator per device, expandable segments opened to peers, streams of
/// another device.
mod allocators;

/// Collectives and the reducer over the fake group: results, ordering, mismatches, a rank
/// that drops out.
mod collectives;
