//! Audit tests: PyTorch's caching-allocator rules (allocator spec §2, §3, §6, §8 and
//! c10/cuda/CUDACachingAllocator.cpp: `DeviceCachingAllocator::malloc`,
//! `garbage_collect_cached_blocks`, `release_available_cached_blocks`,
//! `release_cached_blocks`, `synchronize_and_free_events`, `get_free_block`,
//! `BlockPool::insert_into_blocks`), one group per audited defect (`d1_` … `d10_`).
//!
//! Every expected figure below is worked out from PyTorch's code path, step by step, in the
//! test's comments; none is taken from ferrocuda's implementation. Many of these tests fail
//! on the code they were written against: that is their purpose.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use crate::common::audit;

use audit::{
    D0, GIB, LEGACY, MIB, TestResult, device_used, new_stream, setup, stat, stats, try_setup, want,
};
use ferrocuda_alloc::{AllocError, Allocation, Caching, CachingAllocator, HostAllocator, Route};
use ferrocuda_driver::{Call, DriverError, FakeDriver, fake::Completion};
use ferrocuda_types::{AllocatorConfig, DevicePtr, PoolId, StreamHandle};
use std::sync::Arc;

fn is_oom<T>(r: &Result<T, AllocError>) -> bool {
    matches!(r, Err(AllocError::OutOfMemory(_)))
}

/// The live (allocated or free) blocks of the segment starting at `base`.
fn segment_blocks(a: &CachingAllocator, base: DevicePtr) -> Vec<ferrocuda_alloc::BlockInfo> {
    a.blocks()
        .into_iter()
        .filter(|b| b.segment == base)
        .collect()
}

/// A private pool with one user, holding one free, whole segment of `bytes` (allocated on
/// `stream` while routed to the pool, then freed; routing ended). Returns the pool and the
/// segment's address.
fn retained_pool_with_free_segment(
    a: &CachingAllocator,
    stream: StreamHandle,
    bytes: u64,
) -> Result<(PoolId, DevicePtr), AllocError> {
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Stream(stream))?;
    let x = a.allocate(bytes, stream)?;
    a.free(x.ptr)?;
    a.end_allocate_to_pool(pool)?;
    Ok((pool, x.ptr))
}

/// The pool still holds exactly one free block: `bytes` at `at`.
fn assert_pool_keeps(a: &CachingAllocator, pool: PoolId, at: DevicePtr, bytes: u64) {
    let blocks: Vec<_> = a
        .pool_blocks(pool)
        .into_iter()
        .map(|b| (b.ptr, b.size, b.allocated))
        .collect();
    assert_eq!(
        blocks,
        vec![(at, bytes, false)],
        "the retained pool's free segment must still be there"
    );
    assert_eq!(a.pool_use_count(pool), Some(1));
}

// ---- 1. Private pools are never freed while retained -----------------------------------

/// PyTorch (`garbage_collect_cached_blocks`, spec §3.2): garbage collection only considers
/// unsplit blocks of the DEFAULT large pool; a private pool with users is never touched.
///
/// 1 GiB device, fraction 0.25 (allowed 256 MiB), threshold 0.5 (GC above 128 MiB).
/// Private pool: a free 100 MiB segment (reserved 100). `x` = 50 MiB: miss, GC sees
/// 100 <= 128 and returns, new segment (150). `y` = 50 MiB: miss, GC sees 150 > 128 but the
/// default large pool has no free block, so nothing is freed; new segment (200 <= 256).
#[test]
fn d1_garbage_collection_never_frees_a_retained_private_pool() -> TestResult {
    let (fake, a) = setup(
        GIB,
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.25",
    );
    let s = new_stream(&fake);
    let (pool, seg) = retained_pool_with_free_segment(&a, s, 100 * MIB)?;
    let x = a.allocate(50 * MIB, LEGACY)?;
    let y = a.allocate(50 * MIB, LEGACY)?;
    assert_pool_keeps(&a, pool, seg, 100 * MIB);
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "num_device_alloc",
                "segment.all.current",
                "reserved_bytes.all.current",
                "num_alloc_retries",
                "num_ooms",
            ]
        ),
        want(&[
            ("num_device_free", 0),
            ("num_device_alloc", 3),
            ("segment.all.current", 3),
            ("reserved_bytes.all.current", (200 * MIB) as i64),
            ("num_alloc_retries", 0),
            ("num_ooms", 0),
        ])
    );
    a.free(x.ptr)?;
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// PyTorch (`release_available_cached_blocks`, spec §3.3): the oversize-release step only
/// looks at the request's own pool (the default pool here); then `release_cached_blocks`
/// frees private pools only when they are freeable (`use_count == 0`). So a retained
/// private pool's free segment survives and the request runs out of memory.
///
/// 1 GiB device, fraction 1/16 (allowed 64 MiB), `max_split_size_mb:20`. Private pool: a
/// free 30 MiB segment (reserved 30). A 40 MiB default request: miss; `alloc_block`:
/// 30 + 40 > 64 fails; `release_available_cached_blocks`: the default pool has no block
/// → false; `release_cached_blocks`: `num_sync_all_streams` 1, nothing releasable;
/// `alloc_block(isRetry)`: `num_alloc_retries` 1, fails again → OOM, `num_ooms` 1.
#[test]
fn d1_oversize_release_never_frees_a_retained_private_pool() -> TestResult {
    let (_, a) = setup(
        GIB,
        "max_split_size_mb:20,per_process_memory_fraction:0.0625",
    );
    let (pool, seg) = retained_pool_with_free_segment(&a, LEGACY, 30 * MIB)?;
    let r = a.allocate(40 * MIB, LEGACY);
    assert!(is_oom(&r), "PyTorch runs out of memory here, got {r:?}");
    assert_pool_keeps(&a, pool, seg, 30 * MIB);
    assert_eq!(
        stats(
            &a,
            &[
                "num_ooms",
                "num_alloc_retries",
                "num_sync_all_streams",
                "num_device_free",
                "segment.all.current",
                "reserved_bytes.all.current",
            ]
        ),
        want(&[
            ("num_ooms", 1),
            ("num_alloc_retries", 1),
            ("num_sync_all_streams", 1),
            ("num_device_free", 0),
            ("segment.all.current", 1),
            ("reserved_bytes.all.current", (30 * MIB) as i64),
        ])
    );
    a.check_invariants()?;
    Ok(())
}

/// `cross_stream_reuse` (ferrocuda's own option) may move a whole free segment of the
/// DEFAULT pool between streams, but a default-pool request must never be carved out of a
/// private pool (PyTorch's `get_pool` picks the pool before any search: a request that is
/// not routed only ever sees the default pools).
///
/// Private pool on stream s1: a free 30 MiB segment. A 30 MiB default request on s2 must
/// get a new segment.
#[test]
fn d1_cross_stream_reuse_never_takes_a_retained_private_pool_segment() -> TestResult {
    let (fake, a) = setup(80 * GIB, "cross_stream_reuse:True");
    let (s1, s2) = (new_stream(&fake), new_stream(&fake));
    let (pool, seg) = retained_pool_with_free_segment(&a, s1, 30 * MIB)?;
    let x = a.allocate(30 * MIB, s2)?;
    assert_ne!(x.ptr, seg, "carved out of the private pool's segment");
    assert_pool_keeps(&a, pool, seg, 30 * MIB);
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_alloc",
                "segment.all.current",
                "reserved_bytes.all.current"
            ]
        ),
        want(&[
            ("num_device_alloc", 2),
            ("segment.all.current", 2),
            ("reserved_bytes.all.current", (60 * MIB) as i64),
        ])
    );
    a.free(x.ptr)?;
    a.check_invariants()?;
    Ok(())
}

// ---- 2. The out-of-memory path is PyTorch's ---------------------------------------------

/// PyTorch (`malloc`, spec §3): when `alloc_block` fails and `max_split_size` is unset,
/// `release_cached_blocks` runs: `synchronize_and_free_events` (`num_sync_all_streams`
/// +1), then EVERY unsplit cached block of the default pools is freed (not just enough for
/// the request); then `alloc_block(isRetry=true)` (`num_alloc_retries` +1).
///
/// 1 GiB device. Live 1 KiB (its 2 MiB small segment is split, never released). Cached:
/// 100, 200, 300 MiB on the legacy stream and a whole 2 MiB small segment on s2
/// (reserved 604 MiB, 420 MiB free on the device). A 500 MiB request misses, its
/// cudaMalloc fails, all four cached segments are freed, the retry succeeds.
#[test]
fn d2_out_of_memory_frees_every_cached_segment_then_retries_once() -> TestResult {
    let (fake, a) = setup(GIB, "");
    let s2 = new_stream(&fake);
    let keep = a.allocate(1024, LEGACY)?;
    let cached: Vec<Allocation> = [
        (100 * MIB, LEGACY),
        (200 * MIB, LEGACY),
        (300 * MIB, LEGACY),
        (1024, s2),
    ]
    .into_iter()
    .map(|(n, s)| a.allocate(n, s))
    .collect::<Result<_, _>>()?;
    for c in &cached {
        a.free(c.ptr)?;
    }
    assert_eq!(stat(&a, "reserved_bytes.all.current"), (604 * MIB) as i64);
    let big = a.allocate(500 * MIB, LEGACY)?;
    assert_eq!(
        stats(
            &a,
            &[
                "num_alloc_retries",
                "num_sync_all_streams",
                "num_ooms",
                "num_device_free",
                "num_device_alloc",
                "segment.all.current",
                "segment.small_pool.current",
                "reserved_bytes.all.current",
            ]
        ),
        want(&[
            ("num_alloc_retries", 1),
            ("num_sync_all_streams", 1),
            ("num_ooms", 0),
            ("num_device_free", 4),
            ("num_device_alloc", 6),
            ("segment.all.current", 2),
            ("segment.small_pool.current", 1),
            ("reserved_bytes.all.current", (502 * MIB) as i64),
        ])
    );
    assert_eq!(device_used(&fake), 502 * MIB);
    a.free(big.ptr)?;
    a.free(keep.ptr)?;
    a.check_invariants()?;
    Ok(())
}

// ---- 3. Garbage collection needs a memory fraction --------------------------------------

/// PyTorch (`malloc`, spec §3.2, issue #106660): `garbage_collect_cached_blocks` runs only
/// when `set_fraction && garbage_collection_threshold > 0`. Without a fraction nothing is
/// collected, however full the device.
///
/// 1 GiB device, threshold 0.5, no fraction. Cached: 4 × 120 MiB. Then 200, 200 and 130 MiB
/// requests miss (each larger than 120) and each gets a new segment: 1010 MiB reserved, no
/// segment freed.
#[test]
fn d3_garbage_collection_is_off_without_a_memory_fraction() -> TestResult {
    let (_, a) = setup(GIB, "garbage_collection_threshold:0.5");
    let olds: Vec<Allocation> = (0..4)
        .map(|_| a.allocate(120 * MIB, LEGACY))
        .collect::<Result<_, _>>()?;
    for o in &olds {
        a.free(o.ptr)?;
    }
    let news: Vec<Allocation> = [200 * MIB, 200 * MIB, 130 * MIB]
        .into_iter()
        .map(|n| a.allocate(n, LEGACY))
        .collect::<Result<_, _>>()?;
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "segment.all.current",
                "reserved_bytes.all.current",
                "num_alloc_retries",
            ]
        ),
        want(&[
            ("num_device_free", 0),
            ("segment.all.current", 7),
            ("reserved_bytes.all.current", (1010 * MIB) as i64),
            ("num_alloc_retries", 0),
        ])
    );
    for o in &olds {
        assert_eq!(
            segment_blocks(&a, o.ptr).len(),
            1,
            "cached segment {} was collected",
            o.ptr
        );
    }
    for n in &news {
        a.free(n.ptr)?;
    }
    a.check_invariants()?;
    Ok(())
}

// ---- 4. release_available_cached_blocks --------------------------------------------------

/// PyTorch (`release_available_cached_blocks`, spec §3.3), the case where it succeeds: with
/// `max_split_size` M set and no single block of this stream >= key = max(request, M), it
/// frees this stream's oversize blocks largest first until the total >= key, returns true,
/// and `alloc_block` runs again (no retry counted, no sync).
///
/// 256 MiB device, M = 20 MiB. Live 80 MiB. Cached on the legacy stream 60, 50, 30 MiB; on
/// s2 24 MiB (reserved 244, 12 free). A 100 MiB request: miss; cudaMalloc fails; key = 100:
/// frees 60 (60), 50 (110 >= 100) and stops; 30 and s2's 24 stay; cudaMalloc succeeds.
#[test]
fn d4_oversize_release_frees_largest_first_until_enough() -> TestResult {
    let (fake, a) = setup(256 * MIB, "max_split_size_mb:20");
    let s2 = new_stream(&fake);
    let live = a.allocate(80 * MIB, LEGACY)?;
    let cached: Vec<Allocation> = [
        (60 * MIB, LEGACY),
        (50 * MIB, LEGACY),
        (30 * MIB, LEGACY),
        (24 * MIB, s2),
    ]
    .into_iter()
    .map(|(n, s)| a.allocate(n, s))
    .collect::<Result<_, _>>()?;
    for c in &cached {
        a.free(c.ptr)?;
    }
    let x = a.allocate(100 * MIB, LEGACY)?;
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "num_alloc_retries",
                "num_sync_all_streams",
                "num_ooms",
                "segment.all.current",
                "reserved_bytes.all.current",
            ]
        ),
        want(&[
            ("num_device_free", 2),
            ("num_alloc_retries", 0),
            ("num_sync_all_streams", 0),
            ("num_ooms", 0),
            ("segment.all.current", 4),
            ("reserved_bytes.all.current", (234 * MIB) as i64),
        ])
    );
    for (c, kept) in cached.iter().zip([false, false, true, true]) {
        assert_eq!(
            !segment_blocks(&a, c.ptr).is_empty(),
            kept,
            "cached {} MiB segment",
            c.size / MIB
        );
    }
    a.free(x.ptr)?;
    a.free(live.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// PyTorch (`release_available_cached_blocks`, spec §3.3), the case where it falls short:
/// the walk down this stream's blocks stops at the first block < M; if it freed less than
/// the key it returns false, so `alloc_block` is NOT tried again; `release_cached_blocks`
/// runs (sync +1, every remaining cached segment freed) and `alloc_block(isRetry=true)`
/// counts a retry.
///
/// 256 MiB device, M = 20 MiB. Live 120 MiB. Cached on the legacy stream 40, 30 (oversize)
/// and 12 MiB (reserved 202, 54 free). A 100 MiB request: miss; cudaMalloc fails;
/// key = 100: frees 40, 30 (70), stops at 12 < M → false; `release_cached_blocks` frees
/// 12; retry succeeds.
#[test]
fn d4_oversize_release_that_falls_short_releases_everything_and_counts_a_retry() -> TestResult {
    let (_, a) = setup(256 * MIB, "max_split_size_mb:20");
    let live = a.allocate(120 * MIB, LEGACY)?;
    let cached: Vec<Allocation> = [40 * MIB, 30 * MIB, 12 * MIB]
        .into_iter()
        .map(|n| a.allocate(n, LEGACY))
        .collect::<Result<_, _>>()?;
    for c in &cached {
        a.free(c.ptr)?;
    }
    let x = a.allocate(100 * MIB, LEGACY)?;
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "num_alloc_retries",
                "num_sync_all_streams",
                "num_ooms",
                "segment.all.current",
                "reserved_bytes.all.current",
            ]
        ),
        want(&[
            ("num_device_free", 3),
            ("num_alloc_retries", 1),
            ("num_sync_all_streams", 1),
            ("num_ooms", 0),
            ("segment.all.current", 2),
            ("reserved_bytes.all.current", (220 * MIB) as i64),
        ])
    );
    a.free(x.ptr)?;
    a.free(live.ptr)?;
    a.check_invariants()?;
    Ok(())
}

// ---- 5. empty_cache always counts a sync ------------------------------------------------

/// PyTorch (`release_cached_blocks` → `synchronize_and_free_events`, spec §2.6/§3.4):
/// `num_sync_all_streams` is incremented on every call, with or without pending events.
#[test]
fn d5_empty_cache_counts_a_sync_of_all_streams_on_every_call() -> TestResult {
    let (_, a) = setup(GIB, "");
    for _ in 0..3 {
        a.empty_cache();
    }
    assert_eq!(stat(&a, "num_sync_all_streams"), 3, "an empty allocator");
    let x = a.allocate(4096, LEGACY)?;
    a.free(x.ptr)?;
    a.empty_cache();
    assert_eq!(
        stats(&a, &["num_sync_all_streams", "num_device_free"]),
        want(&[("num_sync_all_streams", 4), ("num_device_free", 1)])
    );
    Ok(())
}

/// Group 6: garbage-collection arithmetic.
mod gc_arithmetic;

/// Groups 7 and 8: options do what they say or are refused; page reclaim keeps exact books.
mod options_and_reclaim;

/// Groups 9 and 10: sizes never overflow; dropping the allocator gives everything back.
mod sizes_and_teardown;

/// Rules beyond the audit list.
mod beyond_the_list;
