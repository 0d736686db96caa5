//! The pinned host allocator's behaviour on the fake device, exactly: rounding and the
//! `pinned_max_*` thresholds, LIFO reuse per bucket, reuse only after every using stream's
//! event completed (oldest first, a pass stopping at the first not ready), capture-used
//! blocks retired, private pools, the register path and its pre-fault split, the reserve
//! segment, the background thread, `empty_cache`, statistics with PyTorch's keys, no
//! driver call made under the allocator's lock, and what a dropped allocator gives back.
#![allow(clippy::panic)]
use ferrocuda_alloc::{AllocError, HostAllocator, Route};
use ferrocuda_driver::fake::{Call, Completion};
use ferrocuda_driver::{Driver, DriverError, FakeDriver};
use ferrocuda_types::{
    AllocatorConfig, CaptureMode, CaptureStatus, DeviceIndex, PoolId, StreamFlags, StreamHandle,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

type TestResult = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
const LEGACY: StreamHandle = StreamHandle::legacy(D0);
const MIB: u64 = 1 << 20;

fn setup(config: &str, completion: Completion) -> (Arc<FakeDriver>, Arc<HostAllocator>) {
    let fake = Arc::new(FakeDriver::builder().completion(completion).build());
    let config = AllocatorConfig::parse(config).unwrap_or_else(|e| panic!("{e}"));
    (fake.clone(), HostAllocator::new(fake, config.pinned))
}

fn stream(fake: &FakeDriver) -> Result<StreamHandle, DriverError> {
    fake.stream_create(
        D0,
        StreamFlags {
            non_blocking: true,
            priority: 0,
        },
    )
}

fn stat(a: &HostAllocator, key: &str) -> i64 {
    a.stats().to_map()[key]
}

/// Keeps the stream busy (a pending item in manual completion).
fn busy(fake: &FakeDriver, s: StreamHandle) -> Result<(), DriverError> {
    let ev = fake.event_create(D0, Default::default())?;
    fake.event_record(ev, s)
}

#[test]
fn sizes_round_to_powers_of_two_below_the_thresholds() -> TestResult {
    let (_, a) = setup("", Completion::Eager);
    for (asked, got) in [(1, 1), (3, 4), (40_960, 65_536), (MIB + 1, 2 * MIB)] {
        assert_eq!(a.allocate(asked, LEGACY)?.bytes, got, "{asked}");
    }
    let (_, a) = setup("pinned_max_round_threshold_mb:1", Completion::Eager);
    assert_eq!(a.allocate(MIB - 1, LEGACY)?.bytes, MIB);
    assert_eq!(a.allocate(MIB + 1, LEGACY)?.bytes, MIB + 1, "exact above");
    let (_, a) = setup("pinned_max_cached_size_mb:2", Completion::Eager);
    assert_eq!(a.allocate(3 * MIB, LEGACY)?.bytes, 3 * MIB, "exact above");
    assert_eq!(a.allocate(3 * MIB / 2, LEGACY)?.bytes, 2 * MIB);
    // 0 bytes: the null range, nothing counted; past 2^63: refused.
    assert_eq!(a.allocate(0, LEGACY)?.addr(), 0);
    a.free(0)?;
    assert!(matches!(
        a.allocate((1 << 63) + 1, LEGACY),
        Err(AllocError::HostRequestTooLarge(_))
    ));
    assert_eq!(stat(&a, "allocations.current"), 2);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn freed_blocks_come_back_newest_first_per_bucket() -> TestResult {
    let (fake, a) = setup("", Completion::Eager);
    let x = a.allocate(100, LEGACY)?;
    let y = a.allocate(120, LEGACY)?;
    a.free(x.addr())?;
    a.free(y.addr())?;
    // Same bucket (128): the newest free block first, whatever the request within it.
    assert_eq!(a.allocate(65, LEGACY)?.addr(), y.addr());
    assert_eq!(a.allocate(128, LEGACY)?.addr(), x.addr());
    // Another bucket does not take them; blocks are never split.
    let z = a.allocate(64, LEGACY)?;
    assert!(z.addr() != x.addr() && z.addr() != y.addr());
    assert_eq!(fake.calls(Call::HostAlloc), 3);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn unrounded_blocks_in_one_bucket_are_taken_only_when_large_enough() -> TestResult {
    // PyTorch #192722: a 150 MiB block cached in bucket 28 must not serve 200 MiB.
    let (_, a) = setup(
        "pinned_max_round_threshold_mb:128,pinned_max_cached_size_mb:1024",
        Completion::Eager,
    );
    let small = a.allocate(150 * MIB, LEGACY)?;
    a.free(small.addr())?;
    let big = a.allocate(200 * MIB, LEGACY)?;
    assert_ne!(big.addr(), small.addr());
    assert_eq!(big.bytes, 200 * MIB);
    a.free(big.addr())?;
    // 140 MiB fits either: the newest large-enough block, the 200 MiB one.
    assert_eq!(a.allocate(140 * MIB, LEGACY)?.addr(), big.addr());
    assert_eq!(a.allocate(140 * MIB, LEGACY)?.addr(), small.addr());
    assert_eq!(stat(&a, "active_bytes.current"), (350 * MIB) as i64);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn a_block_is_reused_only_after_every_using_stream_completed() -> TestResult {
    let (fake, a) = setup("", Completion::Manual);
    let (s1, s2) = (stream(&fake)?, stream(&fake)?);
    let x = a.allocate(4096, LEGACY)?;
    busy(&fake, s1)?;
    busy(&fake, s2)?;
    assert!(a.record_event(x.addr(), s1)?);
    assert!(a.record_event(x.addr(), s2)?);
    assert!(a.record_event(x.addr(), s1)?, "recorded once per stream");
    a.free(x.addr())?;
    assert_eq!(fake.calls(Call::EventRecord), 2 + 2);
    assert_eq!(stat(&a, "active_requests.current"), 1, "waits for events");
    let y = a.allocate(4096, LEGACY)?;
    assert_ne!(y.addr(), x.addr(), "s1 and s2 still run");
    fake.advance(s1, None)?;
    let z = a.allocate(4096, LEGACY)?;
    assert_ne!(z.addr(), x.addr(), "s2 still runs");
    fake.advance(s2, None)?;
    assert_eq!(a.allocate(4096, LEGACY)?.addr(), x.addr(), "both done");
    // The events are pooled: a second round makes none.
    let created = fake.calls(Call::EventCreate);
    busy(&fake, s1)?;
    a.record_event(y.addr(), s1)?;
    a.free(y.addr())?;
    fake.advance(s1, None)?;
    assert_eq!(a.allocate(4096, LEGACY)?.addr(), y.addr());
    assert_eq!(
        fake.calls(Call::EventCreate),
        created + 1,
        "only `busy` made one"
    );
    a.check_invariants()?;
    Ok(())
}

#[test]
fn events_are_processed_oldest_first_and_a_pass_stops_at_one_not_ready() -> TestResult {
    let (fake, a) = setup("", Completion::Manual);
    let (slow, fast) = (stream(&fake)?, stream(&fake)?);
    let x = a.allocate(1000, LEGACY)?;
    let y = a.allocate(1000, LEGACY)?;
    busy(&fake, slow)?;
    busy(&fake, fast)?;
    a.record_event(x.addr(), slow)?;
    a.record_event(y.addr(), fast)?;
    a.free(x.addr())?;
    a.free(y.addr())?;
    fake.advance(fast, None)?;
    // y's event completed, but x's is older and not ready: the pass stops there.
    let z = a.allocate(1000, LEGACY)?;
    assert!(z.addr() != x.addr() && z.addr() != y.addr());
    fake.advance(slow, None)?;
    assert_eq!(
        a.allocate(1000, LEGACY)?.addr(),
        y.addr(),
        "newest free first"
    );
    assert_eq!(a.allocate(1000, LEGACY)?.addr(), x.addr());
    a.check_invariants()?;
    Ok(())
}

#[test]
fn host_memory_stats_follow_pytorchs_test() -> TestResult {
    // test_cuda.py's test_host_memory_stats: 10 Ki and 20 Ki floats, pinned.
    let (_, a) = setup("", Completion::Eager);
    let zero = a.stats().to_map();
    assert!(zero.values().all(|&v| v == 0), "{zero:?}");
    let t1 = a.allocate(10 * 1024 * 4, LEGACY)?;
    let t2 = a.allocate(20 * 1024 * 4, LEGACY)?;
    let bytes = (16 * 1024 * 4 + 32 * 1024 * 4) as i64;
    let m = a.stats().to_map();
    for prefix in ["active_requests", "allocations"] {
        for suffix in ["allocated", "current", "peak"] {
            assert_eq!(m[&format!("{prefix}.{suffix}")], 2, "{prefix}.{suffix}");
        }
    }
    for prefix in ["allocated_bytes", "active_bytes"] {
        for suffix in ["allocated", "current", "peak"] {
            assert_eq!(m[&format!("{prefix}.{suffix}")], bytes, "{prefix}.{suffix}");
        }
    }
    assert_eq!((m["num_host_alloc"], m["host_alloc_time.count"]), (2, 2));
    // Live blocks survive empty_cache.
    a.empty_cache()?;
    assert_eq!(a.stats().to_map(), m);
    // Freed and emptied (PyTorch #169561's extension of the test).
    a.free(t1.addr())?;
    a.free(t2.addr())?;
    let m = a.stats().to_map();
    assert_eq!(
        (m["active_requests.current"], m["active_bytes.current"]),
        (0, 0)
    );
    assert_eq!(
        (m["active_requests.freed"], m["active_bytes.freed"]),
        (2, bytes)
    );
    a.empty_cache()?;
    let m = a.stats().to_map();
    assert_eq!(
        (m["allocations.current"], m["allocated_bytes.current"]),
        (0, 0)
    );
    assert_eq!((m["num_host_free"], m["host_free_time.count"]), (2, 2));
    a.reset_peak_stats();
    a.reset_accumulated_stats();
    let m = a.stats().to_map();
    assert!(
        m.iter()
            .all(|(k, &v)| v == 0 || k.ends_with(".total") && v >= 0),
        "{m:?}"
    );
    Ok(())
}

#[test]
fn active_peaks_are_summed_per_bucket_as_pytorchs() -> TestResult {
    let (_, a) = setup("", Completion::Eager);
    let x = a.allocate(64, LEGACY)?;
    a.free(x.addr())?;
    let y = a.allocate(128, LEGACY)?;
    // At most one block was active at a time, but each bucket peaked at one.
    assert_eq!(stat(&a, "active_requests.peak"), 2);
    assert_eq!(stat(&a, "active_bytes.peak"), 64 + 128);
    assert_eq!(stat(&a, "allocations.peak"), 2);
    a.reset_peak_stats();
    assert_eq!(stat(&a, "active_requests.peak"), 1);
    a.free(y.addr())?;
    Ok(())
}

#[test]
fn blocks_above_the_cache_limit_go_back_when_free() -> TestResult {
    let (fake, a) = setup("pinned_max_cached_size_mb:1", Completion::Manual);
    let s = stream(&fake)?;
    let x = a.allocate(3 * MIB, LEGACY)?;
    a.free(x.addr())?;
    assert_eq!(
        (fake.calls(Call::HostFree), stat(&a, "num_host_free")),
        (1, 1)
    );
    // With a stream use, once its event completes (seen at the next allocation).
    let y = a.allocate(3 * MIB, LEGACY)?;
    busy(&fake, s)?;
    a.record_event(y.addr(), s)?;
    a.free(y.addr())?;
    assert_eq!(fake.calls(Call::HostFree), 1);
    fake.advance(s, None)?;
    let small = a.allocate(512, LEGACY)?;
    assert_eq!(fake.calls(Call::HostFree), 2);
    a.free(small.addr())?;
    assert_eq!(
        stat(&a, "allocations.current"),
        1,
        "the small one is cached"
    );
    a.check_invariants()?;
    Ok(())
}

fn begin_capture(fake: &FakeDriver, s: StreamHandle) -> Result<u64, DriverError> {
    fake.stream_begin_capture(s, CaptureMode::ThreadLocal)?;
    match fake.stream_capture_status(s)? {
        CaptureStatus::Active { id } => Ok(id),
        _ => Err(DriverError::ILLEGAL_STATE),
    }
}

#[test]
fn captures_allocate_from_private_pools_and_retire_used_blocks() -> TestResult {
    let (fake, a) = setup("", Completion::Manual);
    let s = stream(&fake)?;
    let cached = a.allocate(4096, LEGACY)?;
    a.free(cached.addr())?;
    let id = begin_capture(&fake, s)?;
    let pool = PoolId::for_capture();
    a.begin_allocate_to_pool(pool, Route::Capture(id))?;
    let used = a.allocate(4096, s)?;
    assert_ne!(
        used.addr(),
        cached.addr(),
        "a private pool does not take default blocks"
    );
    let unused = a.allocate(4096, s)?;
    // A non-capturing stream still gets the default pool.
    let outside = a.allocate(4096, LEGACY)?;
    assert_eq!(outside.addr(), cached.addr());
    a.record_event(used.addr(), s)?;
    let records = fake.calls(Call::EventRecord);
    a.free(used.addr())?;
    a.free(unused.addr())?;
    assert_eq!(
        fake.calls(Call::EventRecord),
        records,
        "no event during capture"
    );
    assert_eq!(
        a.allocate(4096, s)?.addr(),
        unused.addr(),
        "unused: reusable"
    );
    fake.stream_end_capture(s)?;
    a.end_allocate_to_pool(pool)?;
    fake.advance_all();
    // Routing ended: the default pool again; the used block stays retired for good.
    let after = a.allocate(4096, LEGACY)?;
    assert!(after.addr() != used.addr() && after.addr() != unused.addr());
    a.release_pool(pool)?;
    a.empty_cache()?;
    assert_eq!(
        a.private_pool_count(),
        1,
        "the retired block keeps its pool"
    );
    assert_eq!(stat(&a, "active_requests.current"), 4);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn a_freeable_private_pool_is_emptied_and_forgotten() -> TestResult {
    let (_, a) = setup("", Completion::Eager);
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let x = a.allocate(MIB, LEGACY)?;
    a.end_allocate_to_pool(pool)?;
    a.free(x.addr())?;
    // Held: empty_cache leaves it; its block serves neither the default pool.
    a.empty_cache()?;
    assert_eq!(stat(&a, "allocations.current"), 1);
    assert_ne!(a.allocate(MIB, LEGACY)?.addr(), x.addr());
    a.release_pool(pool)?;
    a.empty_cache()?;
    assert_eq!(a.private_pool_count(), 0);
    assert_eq!(
        stat(&a, "allocations.current"),
        1,
        "the default block, in use"
    );
    for bad in [
        a.release_pool(pool),
        a.end_allocate_to_pool(pool),
        a.begin_allocate_to_pool(PoolId::DEFAULT, Route::Stream(LEGACY)),
    ] {
        assert!(matches!(bad, Err(AllocError::Pool(_))), "{bad:?}");
    }
    a.check_invariants()?;
    Ok(())
}

#[test]
fn the_register_path_prefaults_across_threads_and_unregisters_on_release() -> TestResult {
    let (fake, a) = setup(
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
        Completion::Eager,
    );
    let big = a.allocate(16 * MIB, LEGACY)?;
    assert_eq!(
        (
            fake.calls(Call::HostMalloc),
            fake.calls(Call::HostPrefault),
            fake.calls(Call::HostRegister),
            fake.calls(Call::HostAlloc)
        ),
        (1, 8, 1, 0)
    );
    assert_eq!(fake.host_registered(big.base), Some(true));
    // malloc's pointer is 16 bytes past a page: every page boundary inside is touched.
    assert_eq!(fake.host_prefaulted_pages(big.base), Some(16 * MIB / 4096));
    // Below a page per thread (16 KiB < 8 x 4 KiB): one pre-fault.
    let small = a.allocate(16 * 1024, LEGACY)?;
    assert_eq!(fake.calls(Call::HostPrefault), 9);
    // The method is remembered per block: switching back to cudaHostAlloc still
    // unregisters and frees these.
    a.update_config("pinned_use_cuda_host_register:False")?;
    a.free(big.addr())?;
    a.free(small.addr())?;
    a.empty_cache()?;
    assert_eq!(
        (
            fake.calls(Call::HostUnregister),
            fake.calls(Call::HostMfree),
            fake.calls(Call::HostFree)
        ),
        (2, 2, 0)
    );
    a.allocate(10, LEGACY)?;
    assert_eq!(fake.calls(Call::HostAlloc), 1);
    assert_eq!(stat(&a, "host_alloc_time.count"), 3);
    Ok(())
}

#[test]
fn the_reserve_segment_serves_small_requests_and_is_never_freed() -> TestResult {
    let (fake, a) = setup("pinned_reserve_segment_size_mb:1", Completion::Eager);
    let x = a.allocate(100, LEGACY)?;
    let y = a.allocate(5000, LEGACY)?;
    assert_eq!(fake.calls(Call::HostAlloc), 1, "the slab only");
    assert_eq!((x.offset, y.offset), (0, 4096), "4 KiB steps");
    assert_eq!(x.base, y.base);
    assert_eq!((x.bytes, y.bytes), (128, 8192));
    assert_eq!(stat(&a, "num_host_alloc"), 2);
    assert_eq!(
        stat(&a, "host_alloc_time.count"),
        1,
        "the slab's allocation"
    );
    // Too large for what is left: the slow path.
    let z = a.allocate(MIB, LEGACY)?;
    assert_eq!((fake.calls(Call::HostAlloc), z.offset), (2, 0));
    for r in [x, y, z] {
        a.free(r.addr())?;
    }
    a.empty_cache()?;
    assert_eq!(fake.calls(Call::HostFree), 1, "z only; the slab stays");
    assert_eq!(stat(&a, "allocations.current"), 0);
    // PyTorch forgets emptied reserve pieces: the slab's front is not handed out again.
    assert_eq!(a.allocate(100, LEGACY)?.offset, 4096 + 8192);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn the_reserve_size_is_read_once_at_the_first_slow_path() -> TestResult {
    let (fake, a) = setup("", Completion::Eager);
    a.allocate(100, LEGACY)?;
    a.update_config("pinned_reserve_segment_size_mb:1")?;
    assert_eq!(a.allocate(5000, LEGACY)?.offset, 0);
    assert_eq!(
        fake.calls(Call::HostAlloc),
        2,
        "no slab: decided off at the first"
    );
    Ok(())
}

#[test]
fn the_background_thread_processes_events_instead_of_allocations() -> TestResult {
    let (fake, a) = setup("pinned_use_background_threads:True", Completion::Manual);
    let s = stream(&fake)?;
    let x = a.allocate(4096, LEGACY)?;
    assert!(a.background_thread_started());
    busy(&fake, s)?;
    a.record_event(x.addr(), s)?;
    a.free(x.addr())?;
    fake.advance(s, None)?;
    let start = Instant::now();
    while stat(&a, "active_requests.current") != 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "never processed");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.allocate(4096, LEGACY)?.addr(), x.addr());
    // The thread holds the allocator weakly: dropping it ends the thread.
    let weak = Arc::downgrade(&a);
    drop(a);
    assert!(weak.upgrade().is_none());
    Ok(())
}

#[test]
fn catch_all_swallows_free_errors_and_the_block_is_retired() -> TestResult {
    for catch_all in [false, true] {
        let (fake, a) = setup(
            &format!(
                "pinned_free_catch_all:{}",
                if catch_all { "True" } else { "False" }
            ),
            Completion::Eager,
        );
        let s = stream(&fake)?;
        let x = a.allocate(4096, LEGACY)?;
        a.record_event(x.addr(), s)?;
        fake.fail_nth(Call::EventRecord, 1, DriverError::LAUNCH_FAILED);
        let freed = a.free(x.addr());
        assert_eq!(freed.is_ok(), catch_all, "{freed:?}");
        assert_eq!(a.suppressed_free_errors(), u64::from(catch_all));
        assert_ne!(a.allocate(4096, LEGACY)?.addr(), x.addr(), "retired");
        a.check_invariants()?;
    }
    Ok(())
}

#[test]
fn bad_pointers_are_typed_errors() -> TestResult {
    let (fake, a) = setup("", Completion::Eager);
    let s = stream(&fake)?;
    let x = a.allocate(64, LEGACY)?;
    assert!(!a.record_event(x.addr() + 8, s)?, "not a block");
    a.free(x.addr())?;
    assert!(matches!(
        a.free(x.addr()),
        Err(AllocError::InvalidHostPointer(_))
    ));
    assert!(matches!(
        a.record_event(x.addr(), s),
        Err(AllocError::HostBlockNotAllocated(_))
    ));
    assert!(matches!(
        a.free(12345),
        Err(AllocError::InvalidHostPointer(12345))
    ));
    Ok(())
}

#[test]
fn pinned_options_are_validated_with_pytorchs_messages() {
    let (_, a) = setup("", Completion::Eager);
    for (bad, message) in [
        (
            "pinned_num_register_threads:3",
            "Number of register threads has to be power of 2, got 3",
        ),
        (
            "pinned_num_register_threads:256",
            "Number of register threads should be less than or equal to 128, got 256",
        ),
        (
            "pinned_reserve_segment_size_mb:0",
            "Pinned reserve segment size has to be greater than 0",
        ),
    ] {
        let err = a.update_config(bad).err().map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains(message)),
            "{err:?}"
        );
    }
}

/// Runs `probe` on another thread when the next `call` starts, and says whether it got
/// through: it takes the allocator's lock, so it would hang if `call` were made under it.
fn lock_is_free_during(fake: &FakeDriver, a: &Arc<HostAllocator>, call: Call) -> impl Fn() -> bool {
    let (tx, rx) = std::sync::mpsc::channel();
    let probe = a.clone();
    fake.before_next(call, move || {
        let probe = probe.clone();
        let tx = tx.clone();
        let worker = std::thread::spawn(move || {
            let _ = probe.stats();
            let _ = tx.send(());
        });
        let _ = worker.join();
    });
    move || rx.recv_timeout(Duration::from_secs(10)).is_ok()
}

#[test]
fn no_driver_call_is_made_under_the_lock() -> TestResult {
    let (fake, a) = setup("pinned_use_cuda_host_register:True", Completion::Manual);
    let s = stream(&fake)?;
    let mut probes = Vec::new();
    for call in [
        Call::HostMalloc,
        Call::HostPrefault,
        Call::HostRegister,
        Call::EventCreate,
        Call::EventRecord,
        Call::EventQuery,
        Call::HostUnregister,
        Call::HostMfree,
    ] {
        probes.push((call, lock_is_free_during(&fake, &a, call)));
    }
    let x = a.allocate(MIB, LEGACY)?;
    busy(&fake, s)?;
    a.record_event(x.addr(), s)?;
    a.free(x.addr())?;
    fake.advance(s, None)?;
    a.empty_cache()?;
    for (call, got_through) in probes {
        assert!(got_through(), "{call:?} was made under the lock");
    }
    Ok(())
}

#[test]
fn dropping_the_allocator_gives_back_what_it_caches_only() -> TestResult {
    let (fake, a) = setup("pinned_reserve_segment_size_mb:1", Completion::Manual);
    let piece = a.allocate(100, LEGACY)?;
    let big = a.allocate(2 * MIB, LEGACY)?;
    a.free(piece.addr())?;
    a.free(big.addr())?;
    drop(a);
    assert_eq!(
        fake.calls(Call::HostFree),
        2,
        "the cached block and the slab"
    );
    // A block still waiting for its stream keeps its memory, and so the slab.
    let (fake, a) = setup("pinned_reserve_segment_size_mb:1", Completion::Manual);
    let s = stream(&fake)?;
    let held = a.allocate(100, LEGACY)?;
    let cached = a.allocate(2 * MIB, LEGACY)?;
    busy(&fake, s)?;
    a.record_event(held.addr(), s)?;
    a.free(held.addr())?;
    a.free(cached.addr())?;
    drop(a);
    assert_eq!(fake.calls(Call::HostFree), 1, "the cached block only");
    // Its own pending event is destroyed (`busy`'s is not the allocator's).
    assert_eq!(fake.calls(Call::EventDestroy), 1, "the pending event");
    Ok(())
}

#[test]
fn threads_allocating_freeing_and_recording_at_once_keep_the_books() -> TestResult {
    let (fake, a) = setup(
        "pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:2",
        Completion::Eager,
    );
    let streams: Vec<StreamHandle> = (0..2).map(|_| stream(&fake)).collect::<Result<_, _>>()?;
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..8u64)
            .map(|t| {
                let (a, streams) = (&a, &streams);
                scope.spawn(move || -> Result<(), AllocError> {
                    let mut seed = 0x9e37_79b9_7f4a_7c15 ^ t;
                    let mut live = Vec::new();
                    for _ in 0..300 {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        if live.len() > 8 || (!live.is_empty() && seed % 3 == 0) {
                            let addr = live.swap_remove((seed >> 8) as usize % live.len());
                            if seed % 5 == 0 {
                                a.record_event(addr, streams[(seed >> 3) as usize % 2])?;
                            }
                            a.free(addr)?;
                        } else if seed % 97 == 0 {
                            a.empty_cache()?;
                        } else {
                            let size = 1 + (seed >> 20) % (5 * MIB / 2);
                            live.push(a.allocate(size, LEGACY)?.addr());
                        }
                    }
                    live.into_iter().try_for_each(|addr| a.free(addr))
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().unwrap_or_else(|_| panic!("a worker panicked")))
    })?;
    a.empty_cache()?;
    a.check_invariants()?;
    assert_eq!(stat(&a, "active_requests.current"), 0);
    assert_eq!(
        stat(&a, "allocations.current"),
        0,
        "eager events: all given back"
    );
    Ok(())
}
