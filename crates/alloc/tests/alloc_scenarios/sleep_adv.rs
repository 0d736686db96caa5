//! Adversarial scenarios of sleep and wake of a sleepable pool: injected driver failures at
//! every call of a sleep and of a wake (then recovery, with every byte checked), pools
//! without segments, frees while asleep, the default pool serving while a pool sleeps, out
//! of memory on wake, two pools, expandable segments alongside, concurrent callers, the
//! statistics and the snapshot.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::common;
use common::{LEGACY, MIB, TestResult};
use ferrocuda_alloc::{
    AllocError, Allocation, Caching, CachingAllocator, Route, SleepError, SleepMode, SleepReport,
    SleepStats, WakeReport,
};
use ferrocuda_driver::fake::Call;
use ferrocuda_driver::{Driver, DriverError, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DevicePtr, PoolId};
use std::sync::Arc;

use crate::sleep::{
    CAPACITY, D0, OFFLOAD, Served, fill_pool, free_bytes, me, new_allocator, pattern, read, serve,
    serve_with,
};

fn check_blocks(fake: &FakeDriver, blocks: &[(Allocation, Vec<u8>)], label: &str) {
    for (i, (block, bytes)) in blocks.iter().enumerate() {
        match read(fake, block.ptr, bytes.len()) {
            Ok(got) => assert!(
                got == *bytes,
                "{label}: block {i} at {:#x} does not hold its bytes",
                block.ptr.0
            ),
            Err(e) => panic!(
                "{label}: block {i} at {:#x} cannot be read: {e:?}",
                block.ptr.0
            ),
        }
    }
}

fn sleep_error(result: Result<impl std::fmt::Debug, AllocError>) -> SleepError {
    match result {
        Err(AllocError::Sleep(e)) => e,
        other => panic!("expected a sleep error, got {other:?}"),
    }
}

/// Successful `host_alloc`s (the fake counts failed calls too: `failed` were injected)
/// and `host_free`s.
fn host_balance_with(fake: &FakeDriver, failed: u64) -> (u64, u64) {
    (
        fake.calls(Call::HostAlloc) - failed,
        fake.calls(Call::HostFree),
    )
}

/// What sleeps, leaving out the pinned buffers a wake keeps for the next sleep.
fn awake_stats(a: &CachingAllocator) -> SleepStats {
    SleepStats {
        spare_host_bytes: 0,
        ..a.sleep_stats()
    }
}

fn host_balance(fake: &FakeDriver) -> (u64, u64) {
    host_balance_with(fake, 0)
}

/// After a failed sleep or wake: the pool is either awake with its bytes, or asleep and
/// wakes with them; then it sleeps and wakes again; no host memory, physical memory or
/// address range is left over.
fn recover_and_check(s: &Served, free_awake: u64, label: &str, failed_host_allocs: u64) {
    if s.a.pool_asleep(s.pool)
        && let Err(e) = s.a.wake(s.pool)
    {
        panic!("{label}: the pool was left asleep and does not wake: {e:?}");
    }
    assert!(!s.a.pool_asleep(s.pool), "{label}: awake after wake");
    assert_eq!(
        awake_stats(&s.a),
        Default::default(),
        "{label}: nothing asleep"
    );
    check_blocks(&s.fake, &s.blocks, &format!("{label} (after recovery)"));
    assert_eq!(
        free_bytes(&s.fake),
        free_awake,
        "{label}: device memory back to what the awake pool holds"
    );
    // (A wake keeps its pinned buffers for the next sleep: give them back first.)
    s.a.free_host_buffers(s.pool).expect("spares");
    let (allocs, frees) = host_balance_with(&s.fake, failed_host_allocs);
    assert_eq!(allocs, frees, "{label}: every pinned host buffer freed");
    // And it can sleep and wake again.
    s.a.sleep(s.pool, OFFLOAD)
        .unwrap_or_else(|e| panic!("{label}: second sleep: {e:?}"));
    s.a.wake(s.pool)
        .unwrap_or_else(|e| panic!("{label}: second wake: {e:?}"));
    check_blocks(&s.fake, &s.blocks, &format!("{label} (second cycle)"));
    assert_eq!(free_bytes(&s.fake), free_awake, "{label}: second cycle");
    // (A wake keeps its pinned buffers for the next sleep: give them back first.)
    s.a.free_host_buffers(s.pool).expect("spares");
    let (allocs, frees) = host_balance_with(&s.fake, failed_host_allocs);
    assert_eq!(allocs, frees, "{label}: host buffers after second cycle");
}

/// A sleep whose `nth` call of `call` fails must fail and leave the pool whole.
fn sleep_fails_at(call: Call, nth: u64) {
    let s = serve();
    let free_awake = free_bytes(&s.fake);
    let stats0 = s.a.stats();
    s.fake.fail_nth(call, nth, DriverError::OUT_OF_MEMORY);
    let label = format!("sleep failing at {call:?} #{nth}");
    let result = s.a.sleep(s.pool, OFFLOAD);
    assert!(result.is_err(), "{label}: the sleep reports the failure");
    assert_eq!(s.a.stats(), stats0, "{label}: statistics unchanged");
    if !s.a.pool_asleep(s.pool) {
        // Awake: every byte must be there now, before any wake.
        check_blocks(&s.fake, &s.blocks, &format!("{label} (left awake)"));
    }
    let failed = u64::from(call == Call::HostAlloc);
    recover_and_check(&s, free_awake, &label, failed);
}

/// A wake whose `nth` call of `call` fails must fail and leave the pool whole: awake with
/// its bytes, or asleep and wakeable with them.
fn wake_fails_at(call: Call, nth: u64) {
    let s = serve();
    let free_awake = free_bytes(&s.fake);
    let stats0 = s.a.stats();
    s.a.sleep(s.pool, OFFLOAD).unwrap();
    s.fake.fail_nth(call, nth, DriverError::OUT_OF_MEMORY);
    let label = format!("wake failing at {call:?} #{nth}");
    let result = s.a.wake(s.pool);
    assert!(result.is_err(), "{label}: the wake reports the failure");
    assert_eq!(s.a.stats(), stats0, "{label}: statistics unchanged");
    if !s.a.pool_asleep(s.pool) {
        check_blocks(&s.fake, &s.blocks, &format!("{label} (left awake)"));
    }
    let failed = u64::from(call == Call::HostAlloc);
    recover_and_check(&s, free_awake, &label, failed);
}

macro_rules! failure_tests {
    ($driver:ident: $($name:ident => ($call:ident, $nth:expr)),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $driver(Call::$call, $nth);
            }
        )*
    };
}

failure_tests! { sleep_fails_at:
    a_failed_sleep_at_device_synchronize_leaves_the_pool_whole => (DeviceSynchronize, 1),
    a_failed_sleep_at_stream_create_leaves_the_pool_whole => (StreamCreate, 1),
    a_failed_sleep_at_first_host_alloc_leaves_the_pool_whole => (HostAlloc, 1),
    a_failed_sleep_at_second_host_alloc_leaves_the_pool_whole => (HostAlloc, 2),
    a_failed_sleep_at_first_offload_copy_leaves_the_pool_whole => (MemcpyDtoHPinned, 1),
    a_failed_sleep_at_second_offload_copy_leaves_the_pool_whole => (MemcpyDtoHPinned, 2),
    a_failed_sleep_at_stream_synchronize_leaves_the_pool_whole => (StreamSynchronize, 1),
    a_failed_sleep_at_host_checksum_read_leaves_the_pool_whole => (HostRead, 2),
    a_failed_sleep_at_first_unmap_leaves_the_pool_whole => (VmUnmap, 1),
    a_failed_sleep_at_second_unmap_leaves_the_pool_whole => (VmUnmap, 2),
    a_failed_sleep_at_first_destroy_leaves_the_pool_whole => (VmDestroy, 1),
    a_failed_sleep_at_second_destroy_leaves_the_pool_whole => (VmDestroy, 2),
}

failure_tests! { wake_fails_at:
    a_failed_wake_at_first_create_leaves_the_pool_whole => (VmCreate, 1),
    a_failed_wake_at_second_create_leaves_the_pool_whole => (VmCreate, 2),
    a_failed_wake_at_first_map_leaves_the_pool_whole => (VmMap, 1),
    a_failed_wake_at_second_map_leaves_the_pool_whole => (VmMap, 2),
    a_failed_wake_at_first_set_access_leaves_the_pool_whole => (VmSetAccess, 1),
    a_failed_wake_at_second_set_access_leaves_the_pool_whole => (VmSetAccess, 2),
    a_failed_wake_at_stream_create_keeps_the_offloaded_bytes => (StreamCreate, 1),
    a_failed_wake_at_first_restore_copy_keeps_the_offloaded_bytes => (MemcpyHtoDPinned, 1),
    a_failed_wake_at_second_restore_copy_keeps_the_offloaded_bytes => (MemcpyHtoDPinned, 2),
    a_failed_wake_at_stream_synchronize_keeps_the_offloaded_bytes => (StreamSynchronize, 1),
    a_failed_wake_at_checksum_read_back_keeps_the_bytes => (MemcpyDtoH, 1),
}

/// A failed sleep or wake with a discarding sleep still leaves no physical memory or host
/// memory behind, and the pool wakes after (first map failing).
#[test]
fn a_failed_wake_after_discard_leaves_the_pool_wakeable() -> TestResult {
    let s = serve();
    let free_awake = free_bytes(&s.fake);
    s.a.sleep(s.pool, SleepMode::Discard)?;
    s.fake.fail_nth(Call::VmMap, 2, DriverError::OUT_OF_MEMORY);
    assert!(s.a.wake(s.pool).is_err());
    assert!(s.a.pool_asleep(s.pool), "one segment still has no pages");
    assert_eq!(s.a.sleep_stats().segments, 1);
    let woken = s.a.wake(s.pool)?;
    assert_eq!(woken.segments, 1, "only the missing segment is mapped");
    assert_eq!(free_bytes(&s.fake), free_awake);
    assert_eq!(host_balance(&s.fake), (0, 0));
    Ok(())
}

/// A pool without segments sleeps and wakes with empty reports; while asleep it refuses
/// allocations; after wake it serves.
#[test]
fn a_pool_without_segments_sleeps_and_wakes_cleanly() -> TestResult {
    let (fake, a) = new_allocator(CAPACITY, "");
    let pool = PoolId::handle();
    a.create_sleepable_pool(pool)?;
    let free0 = free_bytes(&fake);
    let stats0 = a.stats();
    assert_eq!(a.sleep(pool, OFFLOAD)?, SleepReport::default());
    assert!(a.pool_asleep(pool));
    assert_eq!(
        sleep_error(a.sleep(pool, OFFLOAD)),
        SleepError::AlreadyAsleep(pool)
    );
    a.begin_allocate_to_pool(pool, me())?;
    assert_eq!(
        sleep_error(a.allocate(MIB, LEGACY)),
        SleepError::Asleep(pool)
    );
    a.end_allocate_to_pool(pool)?;
    assert_eq!(a.stats(), stats0);
    assert_eq!(a.wake(pool)?, WakeReport::default());
    assert!(!a.pool_asleep(pool));
    assert_eq!(awake_stats(&a), Default::default());
    let blocks = fill_pool(&fake, &a, pool, &[(3 * MIB, 7)]);
    check_blocks(&fake, &blocks, "after wake");
    assert!(free_bytes(&fake) < free0, "the pool took a new segment");
    assert_eq!(host_balance(&fake), (0, 0));
    Ok(())
}

/// Blocks freed while the pool sleeps merge with their free neighbours; after wake the
/// merged space serves again at the same address and the block kept keeps its bytes.
#[test]
fn frees_and_merges_while_asleep_keep_the_other_bytes() -> TestResult {
    let s = serve();
    s.a.sleep(s.pool, OFFLOAD)?;
    let (small, _) = s.blocks[0];
    let (nine, _) = s.blocks[2];
    s.a.free(nine.ptr)?;
    s.a.free(small.ptr)?;
    // Snapshot: the pool's segments still asleep, with the freed space free.
    let (segments, _) = s.a.snapshot();
    let pool_segments: Vec<_> = segments
        .iter()
        .filter(|g| g.segment_pool_id == (s.pool.0, s.pool.1))
        .collect();
    assert_eq!(pool_segments.len(), 2);
    assert!(pool_segments.iter().all(|g| g.asleep));
    let woken = s.a.wake(s.pool)?;
    assert_eq!(woken.verified_segments, 2);
    check_blocks(&s.fake, &s.blocks[1..2], "the kept block");
    s.a.begin_allocate_to_pool(s.pool, me())?;
    let merged = s.a.allocate(14 * MIB, LEGACY)?;
    s.a.end_allocate_to_pool(s.pool)?;
    assert_eq!(
        merged.ptr, nine.ptr,
        "the freed 9 MiB and the 5 MiB tail merged while asleep"
    );
    let fresh = pattern(11, 14 * MIB);
    s.fake.memcpy_htod_async(merged.ptr, &fresh, LEGACY)?;
    assert_eq!(read(&s.fake, merged.ptr, fresh.len())?, fresh);
    check_blocks(&s.fake, &s.blocks[1..2], "the kept block after reuse");
    Ok(())
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// While the pool sleeps, the default pool takes the device memory it gave back, but
/// never its addresses; the sleeping pool then wakes with every byte once that memory is
/// freed.
#[test]
fn the_default_pool_never_gets_a_sleeping_pools_addresses() -> TestResult {
    let s = serve();
    let (segments, _) = s.a.snapshot();
    let ranges: Vec<(u64, u64)> = segments
        .iter()
        .filter(|g| g.segment_pool_id == (s.pool.0, s.pool.1))
        .map(|g| (g.address, g.total_size))
        .collect();
    assert_eq!(ranges.len(), 2);
    s.a.sleep(s.pool, OFFLOAD)?;
    let mut taken = Vec::new();
    for size in [64 << 10, 512 << 10, 3 * MIB, 12 * MIB, 20 * MIB, 22 * MIB] {
        let block = s.a.allocate(size, LEGACY)?;
        for r in &ranges {
            assert!(
                !overlaps((block.ptr.0, size), *r),
                "default block {:#x}+{size} inside the sleeping pool's range {r:x?}",
                block.ptr.0
            );
        }
        s.fake
            .memcpy_htod_async(block.ptr, &pattern(5, size), LEGACY)?;
        taken.push(block);
    }
    for block in &taken {
        s.a.free(block.ptr)?;
    }
    s.a.empty_cache();
    s.a.wake(s.pool)?;
    check_blocks(&s.fake, &s.blocks, "after wake");
    Ok(())
}

/// Fills the device from the default pool until it refuses; returns the blocks.
fn fill_device(a: &CachingAllocator, fake: &FakeDriver) -> Vec<Allocation> {
    let mut held = Vec::new();
    let big = (free_bytes(fake) / (2 * MIB)) * 2 * MIB;
    if big >= 12 * MIB {
        held.push(a.allocate(big - 2 * MIB, LEGACY).unwrap());
    }
    for _ in 0..10_000 {
        match a.allocate(512 << 10, LEGACY) {
            Ok(b) => held.push(b),
            Err(_) => break,
        }
    }
    held
}

/// Out of memory on wake: the device's memory went to the default pool while the pool
/// slept. The wake fails with an error, the pool stays asleep (allocations still refused,
/// its bytes safe), and it wakes with every byte once the memory is freed.
#[test]
fn wake_out_of_memory_keeps_the_pool_asleep_until_memory_is_freed() -> TestResult {
    let s = serve();
    let free_awake = free_bytes(&s.fake);
    s.a.sleep(s.pool, OFFLOAD)?;
    let held = fill_device(&s.a, &s.fake);
    assert!(free_bytes(&s.fake) < 2 * MIB, "the device is full");
    assert!(s.a.wake(s.pool).is_err(), "no pages for the wake");
    assert!(s.a.pool_asleep(s.pool));
    assert_eq!(s.a.sleep_stats().segments, 2);
    assert_eq!(s.a.sleep_stats().offloaded_bytes, 22 * MIB);
    s.a.begin_allocate_to_pool(s.pool, me())?;
    assert_eq!(
        sleep_error(s.a.allocate(MIB, LEGACY)),
        SleepError::Asleep(s.pool)
    );
    s.a.end_allocate_to_pool(s.pool)?;
    for b in &held {
        s.a.free(b.ptr)?;
    }
    s.a.empty_cache();
    let woken = s.a.wake(s.pool)?;
    assert_eq!((woken.segments, woken.verified_segments), (2, 2));
    check_blocks(&s.fake, &s.blocks, "after the second wake");
    assert_eq!(free_bytes(&s.fake), free_awake);
    s.a.free_host_buffers(s.pool).expect("spares");
    assert_eq!(
        host_balance(&s.fake).0,
        host_balance(&s.fake).1,
        "host copies freed"
    );
    Ok(())
}

/// Room for the small segment only: the wake maps it, fails on the large one, and the
/// pool stays asleep (partly); a later wake finishes, every byte in place.
#[test]
fn a_partial_wake_out_of_memory_finishes_later_with_every_byte() -> TestResult {
    let s = serve();
    let free_awake = free_bytes(&s.fake);
    s.a.sleep(s.pool, OFFLOAD)?;
    let free = free_bytes(&s.fake);
    // Leave 6 MiB: room for the 2 MiB segment, not for the 20 MiB one.
    let hog = s.a.allocate(free - 6 * MIB, LEGACY)?;
    assert_eq!(free_bytes(&s.fake), 6 * MIB);
    assert!(s.a.wake(s.pool).is_err());
    assert!(s.a.pool_asleep(s.pool), "the large segment is still asleep");
    let asleep = s.a.sleep_stats();
    assert!(asleep.segments >= 1);
    assert_eq!(
        asleep.bytes, asleep.offloaded_bytes,
        "what sleeps still has its host copy"
    );
    s.a.free(hog.ptr)?;
    s.a.empty_cache();
    s.a.wake(s.pool)?;
    check_blocks(&s.fake, &s.blocks, "after the finishing wake");
    assert_eq!(free_bytes(&s.fake), free_awake);
    // (A wake keeps its pinned buffers for the next sleep: give them back first.)
    s.a.free_host_buffers(s.pool).expect("spares");
    let (allocs, frees) = host_balance(&s.fake);
    assert_eq!(allocs, frees);
    Ok(())
}

/// Two sleepable pools sleep and wake independently: one sleeping does not stop the other
/// serving, and each keeps its own bytes.
#[test]
fn two_sleepable_pools_sleep_independently() -> TestResult {
    let s = serve();
    let other = PoolId::handle();
    s.a.create_sleepable_pool(other)?;
    let theirs = fill_pool(&s.fake, &s.a, other, &[(4 * MIB, 21), (100 << 10, 22)]);
    s.a.sleep(s.pool, OFFLOAD)?;
    assert!(!s.a.pool_asleep(other));
    check_blocks(&s.fake, &theirs, "the other pool while the first sleeps");
    let more = fill_pool(&s.fake, &s.a, other, &[(2 * MIB, 23)]);
    let stats = s.a.sleep_stats();
    assert_eq!((stats.pools, stats.segments), (1, 2));
    s.a.sleep(other, SleepMode::Offload { checksum: false })?;
    let stats = s.a.sleep_stats();
    assert_eq!(stats.pools, 2);
    assert_eq!(stats.segments, 4);
    s.a.wake(s.pool)?;
    assert!(s.a.pool_asleep(other));
    assert!(!s.a.pool_asleep(s.pool));
    check_blocks(&s.fake, &s.blocks, "first pool woken");
    assert_eq!(s.a.sleep_stats().pools, 1);
    s.a.wake(other)?;
    check_blocks(&s.fake, &theirs, "second pool woken");
    check_blocks(&s.fake, &more, "second pool's later block");
    assert_eq!(awake_stats(&s.a), Default::default());
    Ok(())
}

/// With `expandable_segments:True` the default pool maps expandable ranges while the
/// sleepable pool still takes whole segments; sleeping does not touch the default pool's
/// memory and waking restores the pool's.
#[test]
fn expandable_segments_alongside_a_sleeping_pool() -> TestResult {
    let s = serve_with("expandable_segments:True");
    let default_block = s.a.allocate(5 * MIB, LEGACY)?;
    let default_bytes = pattern(40, 5 * MIB);
    s.fake
        .memcpy_htod_async(default_block.ptr, &default_bytes, LEGACY)?;
    let free_awake = free_bytes(&s.fake);
    let stats0 = s.a.stats();
    let report = s.a.sleep(s.pool, OFFLOAD)?;
    assert_eq!(report.segments, 2);
    assert_eq!(report.released_bytes, 22 * MIB);
    assert_eq!(free_bytes(&s.fake), free_awake + 22 * MIB);
    assert_eq!(s.a.stats(), stats0, "after sleep");
    assert_eq!(
        read(&s.fake, default_block.ptr, default_bytes.len())?,
        default_bytes
    );
    // The expandable range grows while the pool sleeps, and shrinks again.
    let grown = s.a.allocate(30 * MIB, LEGACY)?;
    s.fake
        .memcpy_htod_async(grown.ptr, &pattern(41, 30 * MIB), LEGACY)?;
    s.a.free(grown.ptr)?;
    s.a.empty_cache();
    let (segments, _) = s.a.snapshot();
    assert!(
        segments
            .iter()
            .filter(|g| g.asleep)
            .all(|g| !g.is_expandable && g.segment_pool_id == (s.pool.0, s.pool.1))
    );
    assert_eq!(segments.iter().filter(|g| g.asleep).count(), 2);
    let before_wake = s.a.stats();
    s.a.wake(s.pool)?;
    check_blocks(&s.fake, &s.blocks, "after wake with expandable segments");
    assert_eq!(
        read(&s.fake, default_block.ptr, default_bytes.len())?,
        default_bytes
    );
    assert_eq!(s.a.stats(), before_wake, "after wake");
    assert_eq!(free_bytes(&s.fake), free_awake);
    Ok(())
}

/// A sleep or wake asked for while another is inside the driver (here from the device
/// synchronization of the first) is refused as `Changing`; the first completes and the
/// bytes survive.
#[test]
fn a_second_caller_during_a_sleep_gets_changing() -> TestResult {
    let s = serve();
    let (a, pool) = (s.a.clone(), s.pool);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    s.fake.before_next(Call::DeviceSynchronize, move || {
        let mut seen = seen2.lock().unwrap();
        seen.push(format!("{:?}", a.sleep(pool, SleepMode::Discard)));
        seen.push(format!("{:?}", a.wake(pool)));
        seen.push(format!("{}", a.pool_asleep(pool)));
    });
    s.a.sleep(s.pool, OFFLOAD)?;
    let seen = seen.lock().unwrap().clone();
    let changing = format!(
        "{:?}",
        Err::<(), _>(AllocError::from(SleepError::Changing(pool)))
    );
    assert_eq!(seen[0], changing, "a second sleep: {seen:?}");
    assert_eq!(seen[1], changing, "a wake during the sleep: {seen:?}");
    assert_eq!(seen[2], "true", "a changing pool counts as asleep");
    // And a sleep during a wake.
    let (a, seen3) = (s.a.clone(), Arc::new(std::sync::Mutex::new(None)));
    let seen4 = seen3.clone();
    s.fake.before_next(Call::VmCreate, move || {
        *seen4.lock().unwrap() = Some(format!("{:?}", a.sleep(pool, OFFLOAD)));
    });
    s.a.wake(s.pool)?;
    assert_eq!(seen3.lock().unwrap().clone(), Some(changing));
    check_blocks(&s.fake, &s.blocks, "after the contested sleep and wake");
    Ok(())
}

/// The pool's last user leaves while it is being put to sleep (all blocks freed, released,
/// `empty_cache_pool` and `empty_cache` called from inside the sleep): nothing is given
/// back under the sleep; after it, emptying the pool gives back everything, host copies
/// included.
#[test]
fn a_pool_released_while_changing_is_given_back_after() -> TestResult {
    let s = serve();
    let free_start = free_bytes(&s.fake) + 22 * MIB;
    let (a, pool) = (s.a.clone(), s.pool);
    let ptrs: Vec<DevicePtr> = s.blocks.iter().map(|(b, _)| b.ptr).collect();
    s.fake.before_next(Call::StreamCreate, move || {
        for p in ptrs {
            a.free(p).unwrap();
        }
        a.release_pool(pool).unwrap();
        a.release_pool(pool).unwrap();
        a.empty_cache_pool(pool);
        a.empty_cache();
    });
    let report = s.a.sleep(s.pool, OFFLOAD)?;
    assert_eq!(report.segments, 2);
    assert_eq!(
        s.fake.calls(Call::VmRelease),
        0,
        "nothing given back under the sleep"
    );
    s.a.empty_cache_pool(s.pool);
    assert_eq!(awake_stats(&s.a), Default::default());
    assert_eq!(common::stat(&s.a, "reserved_bytes.all.current"), 0);
    assert_eq!(s.fake.calls(Call::VmRelease), 2);
    // (A wake keeps its pinned buffers for the next sleep: give them back first.)
    s.a.free_host_buffers(s.pool).expect("spares");
    let (allocs, frees) = host_balance(&s.fake);
    assert_eq!(allocs, frees, "host copies freed");
    assert_eq!(free_bytes(&s.fake), free_start);
    Ok(())
}

/// Threads race sleep and wake of one pool: each call either succeeds or is refused with
/// `Changing` / `AlreadyAsleep`; the pool ends consistent and, once awake, holds its bytes.
#[test]
fn racing_sleeps_and_wakes_never_corrupt_the_pool() -> TestResult {
    let s = serve();
    let free_awake = free_bytes(&s.fake);
    let stats0 = s.a.stats();
    let barrier = Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (a, pool, barrier) = (s.a.clone(), s.pool, barrier.clone());
            std::thread::spawn(move || {
                let mut unexpected = Vec::new();
                barrier.wait();
                for i in 0..40 {
                    let result = if (i + t) % 2 == 0 {
                        a.sleep(pool, OFFLOAD).map(|_| ())
                    } else {
                        a.wake(pool).map(|_| ())
                    };
                    match result {
                        Ok(())
                        | Err(AllocError::Sleep(
                            SleepError::Changing(_) | SleepError::AlreadyAsleep(_),
                        )) => {}
                        Err(e) => unexpected.push(format!("{e:?}")),
                    }
                }
                unexpected
            })
        })
        .collect();
    let unexpected: Vec<String> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert!(unexpected.is_empty(), "unexpected errors: {unexpected:?}");
    s.a.wake(s.pool)?;
    assert!(!s.a.pool_asleep(s.pool));
    assert_eq!(awake_stats(&s.a), Default::default());
    check_blocks(&s.fake, &s.blocks, "after the race");
    assert_eq!(free_bytes(&s.fake), free_awake);
    assert_eq!(s.a.stats(), stats0);
    // (A wake keeps its pinned buffers for the next sleep: give them back first.)
    s.a.free_host_buffers(s.pool).expect("spares");
    let (allocs, frees) = host_balance(&s.fake);
    assert_eq!(allocs, frees);
    Ok(())
}

/// Allocations from one thread into the pool race sleeps and wakes from another: every
/// allocation either succeeds (and then its block holds what was written, once awake) or
/// is refused with `Asleep`.
#[test]
fn allocations_racing_sleep_are_served_or_refused_as_asleep() -> TestResult {
    let s = serve();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sleeper = {
        let (a, pool, stop) = (s.a.clone(), s.pool, stop.clone());
        std::thread::spawn(move || {
            let mut errors = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                if let Err(e) = a.sleep(pool, OFFLOAD) {
                    errors.push(format!("sleep: {e:?}"));
                }
                if let Err(e) = a.wake(pool) {
                    errors.push(format!("wake: {e:?}"));
                }
            }
            errors
        })
    };
    s.a.begin_allocate_to_pool(s.pool, me())?;
    let mut got = Vec::new();
    let mut unexpected = Vec::new();
    for i in 0..200u64 {
        let size = (1 + i % 5) * (300 << 10);
        match s.a.allocate(size, LEGACY) {
            Ok(b) => got.push(b),
            Err(AllocError::Sleep(SleepError::Asleep(_))) => {}
            Err(e) => unexpected.push(format!("{e:?}")),
        }
    }
    s.a.end_allocate_to_pool(s.pool)?;
    stop.store(true, std::sync::atomic::Ordering::Release);
    let errors = sleeper.join().unwrap();
    assert!(errors.is_empty(), "sleep/wake errors: {errors:?}");
    assert!(unexpected.is_empty(), "allocation errors: {unexpected:?}");
    s.a.wake(s.pool)?;
    // Every block handed out is distinct and usable.
    let mut spans: Vec<(u64, u64)> = got.iter().map(|b| (b.ptr.0, b.size)).collect();
    spans.extend(s.blocks.iter().map(|(b, _)| (b.ptr.0, b.size)));
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "blocks overlap: {w:x?}");
    }
    check_blocks(&s.fake, &s.blocks, "after the race");
    // (A wake keeps its pinned buffers for the next sleep: give them back first.)
    s.a.free_host_buffers(s.pool).expect("spares");
    let (allocs, frees) = host_balance(&s.fake);
    assert_eq!(allocs, frees);
    Ok(())
}

/// An allocation into the pool whose new segment is being mapped when a sleep begins (the
/// allocator's lock is released around the driver calls): once the sleep has returned,
/// the pool holds no device memory (the late segment is asleep too), or the allocation was
/// refused.
#[test]
fn a_segment_mapped_during_a_sleep_does_not_stay_awake() -> TestResult {
    let s = serve();
    let (a, pool) = (s.a.clone(), s.pool);
    let slept = Arc::new(std::sync::Mutex::new(None));
    let slept2 = slept.clone();
    s.fake.before_next(Call::VmCreate, move || {
        *slept2.lock().unwrap() = Some(a.sleep(pool, SleepMode::Discard));
    });
    s.a.begin_allocate_to_pool(s.pool, me())?;
    let late = s.a.allocate(30 * MIB, LEGACY);
    s.a.end_allocate_to_pool(s.pool)?;
    let slept = slept.lock().unwrap().take().expect("the hook ran");
    assert!(slept.is_ok(), "the sleep: {slept:?}");
    assert!(s.a.pool_asleep(s.pool));
    if let Ok(block) = late {
        let (segments, _) = s.a.snapshot();
        let awake: Vec<_> = segments
            .iter()
            .filter(|g| g.segment_pool_id == (s.pool.0, s.pool.1) && !g.asleep)
            .map(|g| (g.address, g.total_size))
            .collect();
        assert!(
            awake.is_empty(),
            "the pool sleeps but its segment(s) {awake:x?} keep device memory (late block {:#x})",
            block.ptr.0
        );
    }
    Ok(())
}

/// PyTorch's statistics see neither a sleep nor a wake, nor an allocation refused because
/// the pool sleeps; frees while asleep move them as frees do.
#[test]
fn statistics_do_not_see_sleep_wake_or_refusals() -> TestResult {
    let s = serve();
    let stats0 = s.a.stats();
    s.a.sleep(s.pool, SleepMode::Discard)?;
    assert_eq!(s.a.stats(), stats0, "after sleep");
    s.a.begin_allocate_to_pool(s.pool, me())?;
    for size in [1 << 10, 3 * MIB, 40 * MIB] {
        assert_eq!(
            sleep_error(s.a.allocate(size, LEGACY)),
            SleepError::Asleep(s.pool)
        );
    }
    s.a.end_allocate_to_pool(s.pool)?;
    assert_eq!(s.a.stats(), stats0, "after refused allocations");
    s.a.free(s.blocks[1].0.ptr)?;
    let after_free = s.a.stats();
    assert_eq!(
        common::stat(&s.a, "allocated_bytes.all.current"),
        stats0.to_map()["allocated_bytes.all.current"] - s.blocks[1].0.size as i64
    );
    s.a.wake(s.pool)?;
    assert_eq!(s.a.stats(), after_free, "after wake");
    Ok(())
}

/// Without a checksum the wake restores every byte and reads nothing back: a byte changed
/// before the wake's copy completes is not reported, and `verified_segments` is 0.
#[test]
fn checksum_off_restores_without_reading_back() -> TestResult {
    let s = serve();
    let report = s.a.sleep(s.pool, SleepMode::Offload { checksum: false })?;
    assert_eq!(report.offloaded_bytes, 22 * MIB);
    assert_eq!(s.fake.calls(Call::HostRead), 0, "no host checksum taken");
    let reads = s.fake.calls(Call::MemcpyDtoH);
    let woken = s.a.wake(s.pool)?;
    assert_eq!(woken.restored_bytes, 22 * MIB);
    assert_eq!(woken.verified_segments, 0);
    assert_eq!(s.fake.calls(Call::MemcpyDtoH), reads, "nothing read back");
    check_blocks(&s.fake, &s.blocks, "after an unchecked restore");
    Ok(())
}

/// With a checksum, every segment is verified, and the reports of sleep and wake agree
/// with `sleep_stats` and with each other.
#[test]
fn reports_agree_with_sleep_stats() -> TestResult {
    let s = serve();
    let report = s.a.sleep(s.pool, OFFLOAD)?;
    let stats = s.a.sleep_stats();
    assert_eq!(stats.segments, report.segments);
    assert_eq!(stats.bytes, report.released_bytes);
    assert_eq!(stats.offloaded_bytes, report.offloaded_bytes);
    let woken = s.a.wake(s.pool)?;
    assert_eq!(woken.segments, report.segments);
    assert_eq!(woken.mapped_bytes, report.released_bytes);
    assert_eq!(woken.restored_bytes, report.offloaded_bytes);
    assert_eq!(woken.verified_segments, report.segments);
    assert_eq!(
        s.a.wake(s.pool)?,
        WakeReport::default(),
        "a second wake is free"
    );
    Ok(())
}

/// Sleep and wake are refused while a stream capture records into a pool (an unbound
/// `NextCapture` route counts), and work again after it ends.
#[test]
fn sleep_and_wake_are_refused_while_a_capture_is_underway() -> TestResult {
    let s = serve();
    let graph_pool = PoolId::handle();
    s.a.begin_allocate_to_pool(graph_pool, Route::NextCapture)?;
    assert_eq!(
        sleep_error(s.a.sleep(s.pool, OFFLOAD)),
        SleepError::CaptureUnderway(s.pool)
    );
    assert!(!s.a.pool_asleep(s.pool));
    s.a.end_allocate_to_pool(graph_pool)?;
    s.a.sleep(s.pool, OFFLOAD)?;
    s.a.begin_allocate_to_pool(graph_pool, Route::NextCapture)?;
    assert_eq!(
        sleep_error(s.a.wake(s.pool)),
        SleepError::CaptureUnderway(s.pool)
    );
    assert!(s.a.pool_asleep(s.pool));
    s.a.end_allocate_to_pool(graph_pool)?;
    s.a.wake(s.pool)?;
    check_blocks(&s.fake, &s.blocks, "after the capture");
    Ok(())
}

/// Without caching, sleep and wake are refused as `CachingOff`.
#[test]
fn caching_off_refuses_sleep_and_wake() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().capacity(CAPACITY).build());
    let a = CachingAllocator::new(fake, D0, AllocatorConfig::parse("")?, Caching::Off)?;
    let pool = PoolId::handle();
    let _ = a.create_sleepable_pool(pool);
    assert_eq!(
        sleep_error(a.sleep(pool, OFFLOAD)),
        SleepError::CachingOff(pool)
    );
    assert_eq!(sleep_error(a.wake(pool)), SleepError::CachingOff(pool));
    assert!(!a.pool_asleep(pool));
    Ok(())
}

/// A pool id that was never created, and a plain private pool, are not sleepable for
/// wake either.
#[test]
fn wake_of_an_unknown_or_plain_pool_is_not_sleepable() -> TestResult {
    let s = serve();
    let unknown = PoolId::handle();
    assert_eq!(
        sleep_error(s.a.wake(unknown)),
        SleepError::NotSleepable(unknown)
    );
    assert_eq!(
        sleep_error(s.a.sleep(unknown, SleepMode::Discard)),
        SleepError::NotSleepable(unknown)
    );
    let plain = PoolId::handle();
    s.a.retain_pool(plain);
    assert_eq!(
        sleep_error(s.a.wake(plain)),
        SleepError::NotSleepable(plain)
    );
    assert_eq!(
        sleep_error(s.a.wake(PoolId::DEFAULT)),
        SleepError::NotSleepable(PoolId::DEFAULT)
    );
    Ok(())
}

/// Dropping the allocator while a pool sleeps (its blocks freed) gives back every host
/// copy and address range, and the device's memory.
#[test]
fn dropping_the_allocator_while_asleep_gives_everything_back() -> TestResult {
    let s = serve();
    s.a.sleep(s.pool, OFFLOAD)?;
    for (b, _) in &s.blocks {
        s.a.free(b.ptr)?;
    }
    let Served { fake, a, .. } = s;
    assert_eq!(Arc::strong_count(&a), 1, "the only handle");
    drop(a);
    let (allocs, frees) = host_balance(&fake);
    assert_eq!(allocs, frees, "host copies freed");
    assert_eq!(
        fake.calls(Call::VmReserve),
        fake.calls(Call::VmRelease),
        "address ranges released"
    );
    assert_eq!(free_bytes(&fake), CAPACITY);
    Ok(())
}

/// A pool released while asleep, emptied, and a new sleepable pool created: the new one
/// sleeps and wakes with its own bytes; nothing of the old one is left asleep.
#[test]
fn a_released_asleep_pool_leaves_nothing_for_the_next() -> TestResult {
    let s = serve();
    s.a.sleep(s.pool, OFFLOAD)?;
    for (b, _) in &s.blocks {
        s.a.free(b.ptr)?;
    }
    s.a.release_pool(s.pool)?;
    s.a.release_pool(s.pool)?;
    s.a.empty_cache_pool(s.pool);
    assert!(!s.a.pool_asleep(s.pool));
    assert_eq!(awake_stats(&s.a), Default::default());
    // The same id can be made sleepable again, awake.
    s.a.create_sleepable_pool(s.pool)?;
    assert!(!s.a.pool_asleep(s.pool));
    let blocks = fill_pool(&s.fake, &s.a, s.pool, &[(7 * MIB, 50)]);
    s.a.sleep(s.pool, OFFLOAD)?;
    assert_eq!(s.a.sleep_stats().segments, 1);
    s.a.wake(s.pool)?;
    check_blocks(&s.fake, &blocks, "the new pool");
    Ok(())
}
