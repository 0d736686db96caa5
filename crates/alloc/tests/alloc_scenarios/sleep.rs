//! Sleep and wake of a sleepable pool on the fake device, whose virtual memory model backs
//! mapped pages with bytes and refuses copies to unmapped ones: the device's free memory
//! grows by what sleeps, the same pointers read the same bytes after an offloaded sleep,
//! PyTorch's statistics do not move, what sleeps is refused with typed errors, and failures
//! part way leave the pool whole.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::common;
use common::{LEGACY, MIB, TestResult, setup};
use ferrocuda_alloc::{
    AllocError, Allocation, CachingAllocator, Route, SleepError, SleepMode, SleepReport,
};
use ferrocuda_driver::fake::{Call, Completion};
use ferrocuda_driver::{Driver, DriverError, FakeDriver};
use ferrocuda_types::{DeviceIndex, DevicePtr, PoolId};
use std::sync::Arc;

// The helpers below serve `sleep_adv` too.
pub(crate) const D0: DeviceIndex = DeviceIndex(0);
pub(crate) const OFFLOAD: SleepMode = SleepMode::Offload { checksum: true };
pub(crate) const CAPACITY: u64 = 256 * MIB;

/// A sleepable pool with a small block (2 MiB small segment) and two large ones (one 20 MiB
/// segment split), each filled with its own pattern.
pub(crate) struct Served {
    pub(crate) fake: Arc<FakeDriver>,
    pub(crate) a: Arc<CachingAllocator>,
    pub(crate) pool: PoolId,
    pub(crate) blocks: Vec<(Allocation, Vec<u8>)>,
}

pub(crate) fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i % 253) as u8))
        .collect()
}

pub(crate) fn new_allocator(
    capacity: u64,
    config: &str,
) -> (Arc<FakeDriver>, Arc<CachingAllocator>) {
    let (fake, a) = common::setup(capacity, config, Completion::Eager);
    (fake, Arc::new(a))
}

pub(crate) fn me() -> Route {
    Route::Thread(std::thread::current().id())
}

/// Allocates `sizes` (with seeds) into `pool`, writing each block's pattern.
pub(crate) fn fill_pool(
    fake: &FakeDriver,
    a: &CachingAllocator,
    pool: PoolId,
    sizes: &[(u64, u8)],
) -> Vec<(Allocation, Vec<u8>)> {
    a.begin_allocate_to_pool(pool, me()).unwrap();
    let blocks = sizes
        .iter()
        .map(|&(bytes, seed)| {
            let block = a.allocate(bytes, LEGACY).unwrap();
            let data = pattern(seed, bytes);
            fake.memcpy_htod_async(block.ptr, &data, LEGACY).unwrap();
            (block, data)
        })
        .collect();
    a.end_allocate_to_pool(pool).unwrap();
    blocks
}

pub(crate) const SIZES: [(u64, u8); 3] = [(64 << 10, 1), (6 * MIB, 2), (9 * MIB, 3)];

pub(crate) fn serve_with(config: &str) -> Served {
    let (fake, a) = new_allocator(CAPACITY, config);
    let pool = PoolId::handle();
    a.create_sleepable_pool(pool).unwrap();
    let blocks = fill_pool(&fake, &a, pool, &SIZES);
    Served {
        fake,
        a,
        pool,
        blocks,
    }
}

pub(crate) fn serve() -> Served {
    serve_with("")
}

pub(crate) fn read(fake: &FakeDriver, ptr: DevicePtr, len: usize) -> Result<Vec<u8>, DriverError> {
    let mut out = vec![0; len];
    fake.memcpy_dtoh(&mut out, ptr, LEGACY)?;
    Ok(out)
}

pub(crate) fn free_bytes(fake: &FakeDriver) -> u64 {
    fake.mem_get_info(D0).unwrap().0
}

fn assert_contents(s: &Served) {
    for (block, bytes) in &s.blocks {
        assert_eq!(&read(&s.fake, block.ptr, bytes.len()).unwrap(), bytes);
    }
}

fn asleep_error(result: Result<impl std::fmt::Debug, AllocError>) -> SleepError {
    match result {
        Err(AllocError::Sleep(e)) => e,
        other => panic!("expected a sleep error, got {other:?}"),
    }
}

/// An offloaded sleep gives the pool's two segments (2 + 20 MiB) back to the device and the
/// same pointers read the same bytes after wake, checked by the checksum; PyTorch's
/// statistics are the same throughout.
#[test]
fn offload_returns_the_pages_and_restores_every_byte() -> TestResult {
    let s = serve();
    let (free0, stats0) = (free_bytes(&s.fake), s.a.stats());
    let report = s.a.sleep(s.pool, OFFLOAD)?;
    assert_eq!(
        report,
        SleepReport {
            segments: 2,
            released_bytes: 22 * MIB,
            offloaded_bytes: 22 * MIB,
        }
    );
    assert_eq!(free_bytes(&s.fake), free0 + 22 * MIB);
    assert_eq!(
        s.a.stats(),
        stats0,
        "PyTorch's statistics do not see a sleep"
    );
    let asleep = s.a.sleep_stats();
    assert_eq!((asleep.pools, asleep.segments), (1, 2));
    assert_eq!((asleep.bytes, asleep.offloaded_bytes), (22 * MIB, 22 * MIB));
    assert!(s.a.pool_asleep(s.pool));
    // The pages are gone: the device refuses to read them.
    let (block, bytes) = &s.blocks[1];
    assert!(read(&s.fake, block.ptr, bytes.len()).is_err());

    let woken = s.a.wake(s.pool)?;
    assert_eq!(
        (woken.segments, woken.mapped_bytes, woken.restored_bytes),
        (2, 22 * MIB, 22 * MIB)
    );
    assert_eq!(woken.verified_segments, 2);
    assert_eq!(free_bytes(&s.fake), free0);
    assert_contents(&s);
    assert_eq!(s.a.stats(), stats0);
    // The pinned buffers stay for the next sleep, until given back.
    let kept = s.a.sleep_stats();
    assert_eq!((kept.segments, kept.spare_host_bytes), (0, 22 * MIB));
    let allocs = s.fake.calls(Call::HostAlloc);
    s.a.sleep(s.pool, OFFLOAD)?;
    assert_eq!(
        s.fake.calls(Call::HostAlloc),
        allocs,
        "the next offload reuses them"
    );
    s.a.wake(s.pool)?;
    assert_contents(&s);
    assert_eq!(s.a.free_host_buffers(s.pool)?, 22 * MIB);
    assert_eq!(s.a.sleep_stats(), Default::default());
    assert_eq!(s.fake.calls(Call::HostFree), 2);
    assert!(!s.a.pool_asleep(s.pool));
    Ok(())
}

/// A discarding sleep keeps the addresses: after wake the same pointers are usable again,
/// with new pages (what they hold is not kept).
#[test]
fn discard_keeps_addresses_usable() -> TestResult {
    let s = serve();
    let free0 = free_bytes(&s.fake);
    let report = s.a.sleep(s.pool, SleepMode::Discard)?;
    assert_eq!(
        (report.released_bytes, report.offloaded_bytes),
        (22 * MIB, 0)
    );
    assert_eq!(s.a.sleep_stats().offloaded_bytes, 0);
    let woken = s.a.wake(s.pool)?;
    assert_eq!((woken.restored_bytes, woken.verified_segments), (0, 0));
    assert_eq!(free_bytes(&s.fake), free0);
    for (block, bytes) in &s.blocks {
        let fresh = pattern(9, bytes.len() as u64);
        s.fake.memcpy_htod_async(block.ptr, &fresh, LEGACY)?;
        assert_eq!(read(&s.fake, block.ptr, bytes.len())?, fresh);
    }
    Ok(())
}

/// While the pool sleeps, allocations routed to it are refused (the default pool still
/// serves), its blocks may be freed, and a second sleep is refused; after wake it serves
/// again from the same cache.
#[test]
fn an_asleep_pool_refuses_allocations_and_a_second_sleep() -> TestResult {
    let s = serve();
    s.a.sleep(s.pool, OFFLOAD)?;
    let me = Route::Thread(std::thread::current().id());
    s.a.begin_allocate_to_pool(s.pool, me)?;
    assert_eq!(
        asleep_error(s.a.allocate(MIB, LEGACY)),
        SleepError::Asleep(s.pool)
    );
    s.a.end_allocate_to_pool(s.pool)?;
    let elsewhere = s.a.allocate(MIB, LEGACY)?;
    s.a.free(elsewhere.ptr)?;
    assert_eq!(
        asleep_error(s.a.sleep(s.pool, SleepMode::Discard)),
        SleepError::AlreadyAsleep(s.pool)
    );
    // A free while asleep is bookkeeping only.
    let (freed, _) = &s.blocks[2];
    s.a.free(freed.ptr)?;
    s.a.wake(s.pool)?;
    s.a.begin_allocate_to_pool(s.pool, me)?;
    let again = s.a.allocate(freed.size, LEGACY)?;
    s.a.end_allocate_to_pool(s.pool)?;
    assert_eq!(
        again.ptr, freed.ptr,
        "the pool's cache serves the freed block again"
    );
    // The other blocks kept their bytes.
    let (block, bytes) = &s.blocks[1];
    assert_eq!(&read(&s.fake, block.ptr, bytes.len())?, bytes);
    Ok(())
}

/// Pools that cannot sleep say so; waking an awake pool does nothing.
#[test]
fn only_sleepable_pools_sleep() -> TestResult {
    let s = serve();
    assert_eq!(
        asleep_error(s.a.sleep(PoolId::DEFAULT, OFFLOAD)),
        SleepError::NotSleepable(PoolId::DEFAULT)
    );
    let plain = PoolId::handle();
    s.a.retain_pool(plain);
    assert_eq!(
        asleep_error(s.a.sleep(plain, OFFLOAD)),
        SleepError::NotSleepable(plain)
    );
    assert_eq!(s.a.wake(s.pool)?, Default::default());
    assert!(matches!(
        s.a.create_sleepable_pool(s.pool),
        Err(AllocError::Pool(_))
    ));
    Ok(())
}

/// A pool released while it sleeps gives its address ranges and host copies back with its
/// segments: the device and the statistics end where they began.
#[test]
fn a_pool_released_asleep_gives_everything_back() -> TestResult {
    let s = serve();
    let free_at_start = free_bytes(&s.fake) + 22 * MIB;
    s.a.sleep(s.pool, OFFLOAD)?;
    for (block, _) in &s.blocks {
        s.a.free(block.ptr)?;
    }
    // Its two users: the creation and the routing (`begin_allocate_to_pool` adds one).
    s.a.release_pool(s.pool)?;
    s.a.release_pool(s.pool)?;
    s.a.empty_cache_pool(s.pool);
    assert_eq!(common::stat(&s.a, "reserved_bytes.all.current"), 0);
    assert_eq!(s.a.sleep_stats(), Default::default());
    assert_eq!(free_bytes(&s.fake), free_at_start);
    assert_eq!(
        s.fake.calls(Call::VmRelease),
        2,
        "both address ranges released"
    );
    assert_eq!(s.fake.calls(Call::HostFree), 2, "both host copies freed");
    Ok(())
}

/// A failure while offloading (the second pinned buffer cannot be had) leaves the pool
/// awake with every byte in place and no host memory held.
#[test]
fn a_failed_offload_leaves_the_pool_awake() -> TestResult {
    let s = serve();
    s.fake
        .fail_nth(Call::HostAlloc, 2, DriverError::OUT_OF_MEMORY);
    assert!(s.a.sleep(s.pool, OFFLOAD).is_err());
    assert!(!s.a.pool_asleep(s.pool));
    assert_eq!(s.a.sleep_stats(), Default::default());
    assert_eq!(
        s.fake.calls(Call::HostFree),
        1,
        "the first buffer went back"
    );
    assert_contents(&s);
    // And it can sleep and wake after.
    s.a.sleep(s.pool, OFFLOAD)?;
    s.a.wake(s.pool)?;
    assert_contents(&s);
    Ok(())
}

/// A restore whose device bytes differ from the offloaded ones (a byte changed after the
/// copy back, before the check reads it) is a checksum error naming the segment; the pool
/// is awake.
#[test]
fn the_checksum_catches_a_corrupted_restore() -> TestResult {
    let s = serve();
    s.a.sleep(s.pool, OFFLOAD)?;
    let (victim, _) = s.blocks[0];
    let fake = s.fake.clone();
    s.fake.before_next(Call::MemcpyDtoH, move || {
        fake.memcpy_htod_async(victim.ptr, &[0xff], LEGACY)
            .expect("corrupt a byte");
    });
    match asleep_error(s.a.wake(s.pool)) {
        SleepError::ChecksumMismatch { pool, segment, .. } => {
            assert_eq!(pool, s.pool);
            assert!(segment.0 <= victim.ptr.0);
        }
        other => panic!("expected a checksum mismatch, got {other:?}"),
    }
    assert!(!s.a.pool_asleep(s.pool));
    Ok(())
}

/// The snapshot marks the sleeping pool's segments (and writes the key for them only).
#[test]
fn the_snapshot_says_what_sleeps() -> TestResult {
    let s = serve();
    let other = s.a.allocate(MIB, LEGACY)?;
    s.a.sleep(s.pool, SleepMode::Discard)?;
    let pickled = |a: &CachingAllocator| a.device_snapshot().to_pickle();
    let (segments, _) = s.a.snapshot();
    let (asleep, awake): (Vec<_>, Vec<_>) = segments.iter().partition(|g| g.asleep);
    assert_eq!(asleep.len(), 2);
    assert!(
        asleep
            .iter()
            .all(|g| g.segment_pool_id == (s.pool.0, s.pool.1))
    );
    assert_eq!(awake.len(), 1);
    let pickle = pickled(&s.a)?;
    let key = b"asleep";
    let count = pickle.windows(key.len()).filter(|w| w == key).count();
    assert!(count >= 1, "the key is written for the sleeping segments");
    s.a.wake(s.pool)?;
    let pickle = pickled(&s.a)?;
    assert!(!pickle.windows(key.len()).any(|w| w == key));
    s.a.free(other.ptr)?;
    Ok(())
}

/// A segment larger than a restore's piece (64 MiB) wakes in pieces, each copied back as
/// soon as it is mapped: every byte comes back; a piece that cannot be made undoes the
/// pieces before it, leaves the pool asleep with its host copy, and the next wake restores
/// it all.
#[test]
fn a_large_segment_wakes_in_pieces() -> TestResult {
    let (fake, a) = setup(512 * MIB, "", Completion::Eager);
    let pool = PoolId::handle();
    a.create_sleepable_pool(pool)?;
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let block = a.allocate(150 * MIB, LEGACY)?;
    a.end_allocate_to_pool(pool)?;
    let bytes = pattern(5, block.size);
    fake.memcpy_htod_async(block.ptr, &bytes, LEGACY)?;
    let free_awake = free_bytes(&fake);
    a.sleep(pool, OFFLOAD)?;
    let creates = fake.calls(Call::VmCreate);
    fake.fail_nth(Call::VmCreate, 2, DriverError::OUT_OF_MEMORY);
    assert!(a.wake(pool).is_err());
    assert!(a.pool_asleep(pool));
    assert_eq!(
        fake.calls(Call::VmDestroy),
        2,
        "the sleep's and the first piece's"
    );
    assert_eq!(free_bytes(&fake), free_awake + block.size);
    let woken = a.wake(pool)?;
    assert_eq!(woken.verified_segments, 1);
    assert_eq!(
        fake.calls(Call::VmCreate) - creates,
        2 + 3,
        "a piece and the failed one, then three pieces of 64 MiB at most"
    );
    assert_eq!(read(&fake, block.ptr, bytes.len())?, bytes);
    assert_eq!(free_bytes(&fake), free_awake);
    // It sleeps again from its pieces, and the pool gives everything back when released.
    a.sleep(pool, OFFLOAD)?;
    a.wake(pool)?;
    assert_eq!(read(&fake, block.ptr, bytes.len())?, bytes);
    a.free(block.ptr)?;
    a.release_pool(pool)?;
    a.release_pool(pool)?;
    a.empty_cache_pool(pool);
    // (The fake counts the failed create too.)
    assert_eq!(fake.calls(Call::VmCreate) - 1, fake.calls(Call::VmDestroy));
    assert_eq!(fake.calls(Call::HostAlloc), fake.calls(Call::HostFree));
    Ok(())
}

/// Several pools (a server's tags) sleep and wake together: a list naming a pool that is
/// not sleepable, or one pool twice, is refused before anything sleeps; two sleepable pools
/// give both their pages back and come back with every byte.
#[test]
fn several_pools_sleep_and_wake_together() -> TestResult {
    let s = serve();
    let kv = PoolId::handle();
    s.a.create_sleepable_pool(kv)?;
    let kv_blocks = fill_pool(&s.fake, &s.a, kv, &[(3 * MIB, 7)]);
    let plain = PoolId::handle();
    s.a.retain_pool(plain);
    let free0 = free_bytes(&s.fake);
    assert_eq!(
        asleep_error(s.a.sleep_pools(&[s.pool, plain], SleepMode::Discard)),
        SleepError::NotSleepable(plain)
    );
    assert_eq!(
        asleep_error(s.a.sleep_pools(&[kv, s.pool, kv], SleepMode::Discard)),
        SleepError::AlreadyAsleep(kv)
    );
    assert!(
        !s.a.pool_asleep(s.pool) && !s.a.pool_asleep(kv),
        "nothing slept"
    );
    assert_eq!(free_bytes(&s.fake), free0);
    let reports = s.a.sleep_pools(&[s.pool, kv], OFFLOAD)?;
    assert_eq!(
        reports.iter().map(|r| r.released_bytes).collect::<Vec<_>>(),
        [22 * MIB, 20 * MIB]
    );
    assert!(s.a.pool_asleep(s.pool) && s.a.pool_asleep(kv));
    assert_eq!(free_bytes(&s.fake), free0 + 42 * MIB);
    let woken = s.a.wake_pools(&[s.pool, kv])?;
    assert_eq!(woken.iter().map(|w| w.segments).sum::<usize>(), 3);
    assert_contents(&s);
    for (block, bytes) in &kv_blocks {
        assert_eq!(&read(&s.fake, block.ptr, bytes.len())?, bytes);
    }
    assert_eq!(
        s.a.wake_pools(&[s.pool, kv])?.len(),
        2,
        "awake pools wake at no cost"
    );
    Ok(())
}
