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

// ---- 6. Garbage-collection arithmetic ---------------------------------------------------

/// PyTorch (`garbage_collect_cached_blocks`): the age threshold is a double,
/// `total_age / count`; blocks with age >= threshold are freed, and a round that reaches
/// the target ends the loop. Ages: `pool.get_free_blocks_call_count - gc_count_base`, the
/// count bumped once per `get_free_block` on that pool, the base set by
/// `insert_into_blocks`.
///
/// 1 GiB device, fraction 0.5 (allowed 512 MiB), threshold 0.5 (GC above 256 MiB). Large
/// pool clock c: C 12 on s2 (c=1), A 80 (c=2), B 80 (c=3), D 100 on s2 (c=4; GC sees
/// 172 <= 256; reserved 272), free A (base 4), free C (base 4), 12 on s2 (c=5, a hit: C
/// again), free B (base 5), T 50 on s2 (c=6, miss): GC sees 272 > 256, target 16; ages
/// A 2, B 1, average 1.5 → only A is freed (80 >= 16, done). An integer average (1) would
/// free B too.
#[test]
fn d6_gc_average_age_is_a_double() -> TestResult {
    let (fake, a) = setup(
        GIB,
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
    );
    let s2 = new_stream(&fake);
    let c = a.allocate(12 * MIB, s2)?;
    let blk_a = a.allocate(80 * MIB, LEGACY)?;
    let blk_b = a.allocate(80 * MIB, LEGACY)?;
    let d = a.allocate(100 * MIB, s2)?;
    a.free(blk_a.ptr)?;
    a.free(c.ptr)?;
    let c2 = a.allocate(12 * MIB, s2)?;
    assert_eq!(c2.ptr, c.ptr, "a hit in the cache");
    a.free(blk_b.ptr)?;
    let t = a.allocate(50 * MIB, s2)?;
    assert!(segment_blocks(&a, blk_a.ptr).is_empty(), "A (age 2) freed");
    assert_eq!(
        segment_blocks(&a, blk_b.ptr).len(),
        1,
        "B (age 1 < 1.5) must stay cached"
    );
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "segment.all.current",
                "reserved_bytes.all.current"
            ]
        ),
        want(&[
            ("num_device_free", 1),
            ("segment.all.current", 4),
            ("reserved_bytes.all.current", (242 * MIB) as i64),
        ])
    );
    for p in [c2.ptr, d.ptr, t.ptr] {
        a.free(p)?;
    }
    a.check_invariants()?;
    Ok(())
}

/// PyTorch: each pool has its own clock (`get_free_blocks_call_count`); small-pool
/// searches do not age large-pool blocks.
///
/// Same device and settings as above. Live 512 B first (small segment, reserved 2). Large
/// clock c: A 100 (c=1), B 100 (c=2), D 100 on s2 (c=3; 202 <= 256), free A (base 3),
/// three 512 B requests (small-pool hits: no large tick, no GC), free B (base 3), T 50 on
/// s2 (c=4): 302 > 256, target 46; ages A 1, B 1, average 1 → both freed.
#[test]
fn d6_gc_ages_are_counted_per_pool() -> TestResult {
    let (fake, a) = setup(
        GIB,
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
    );
    let s2 = new_stream(&fake);
    let mut small = vec![a.allocate(512, LEGACY)?];
    let blk_a = a.allocate(100 * MIB, LEGACY)?;
    let blk_b = a.allocate(100 * MIB, LEGACY)?;
    let d = a.allocate(100 * MIB, s2)?;
    a.free(blk_a.ptr)?;
    for _ in 0..3 {
        small.push(a.allocate(512, LEGACY)?);
    }
    a.free(blk_b.ptr)?;
    let t = a.allocate(50 * MIB, s2)?;
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "segment.all.current",
                "reserved_bytes.all.current"
            ]
        ),
        want(&[
            ("num_device_free", 2),
            ("segment.all.current", 3),
            ("reserved_bytes.all.current", (152 * MIB) as i64),
        ])
    );
    for p in small.iter().map(|x| x.ptr).chain([d.ptr, t.ptr]) {
        a.free(p)?;
    }
    a.check_invariants()?;
    Ok(())
}

/// PyTorch: the clock only runs while a fraction is set and the threshold is > 0, so
/// searches made before the fraction was set age nothing.
///
/// 1 GiB device, threshold 0.5, no fraction yet. A 100, B 100, free A (base 0), two 20 MiB
/// requests on s2 (no tick, no GC: no fraction). Fraction 0.5 (GC above 256 MiB). Free B
/// (base 0). D 100 on s2 (c=1; 240 <= 256), T 50 on s2 (c=2): 340 > 256, target 84; ages
/// A 2, B 2 → both freed: reserved 140 + 50.
#[test]
fn d6_gc_clock_runs_only_with_a_fraction() -> TestResult {
    let (fake, a) = setup(GIB, "garbage_collection_threshold:0.5");
    let s2 = new_stream(&fake);
    let blk_a = a.allocate(100 * MIB, LEGACY)?;
    let blk_b = a.allocate(100 * MIB, LEGACY)?;
    a.free(blk_a.ptr)?;
    let e1 = a.allocate(20 * MIB, s2)?;
    let e2 = a.allocate(20 * MIB, s2)?;
    a.set_memory_fraction(0.5)?;
    a.free(blk_b.ptr)?;
    let d = a.allocate(100 * MIB, s2)?;
    let t = a.allocate(50 * MIB, s2)?;
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "segment.all.current",
                "reserved_bytes.all.current"
            ]
        ),
        want(&[
            ("num_device_free", 2),
            ("segment.all.current", 4),
            ("reserved_bytes.all.current", (190 * MIB) as i64),
        ])
    );
    for p in [e1.ptr, e2.ptr, d.ptr, t.ptr] {
        a.free(p)?;
    }
    a.check_invariants()?;
    Ok(())
}

// ---- 7. Options must do what they say, or be refused ------------------------------------

/// Whether `e` says clearly that `key` is not supported yet.
fn says_unsupported(e: &str, key: &str) -> bool {
    let lower = e.to_lowercase();
    e.contains(key)
        && ["not supported", "unsupported", "not implemented", "not yet"]
            .iter()
            .any(|w| lower.contains(w))
}

/// Builds an allocator with `config`: `Ok(None)` when parsing or construction refuses it
/// saying it is not supported (acceptable), `Ok(Some(..))` when it is accepted.
fn accepted(
    capacity: u64,
    config: &str,
    key: &str,
) -> Result<Option<(Arc<FakeDriver>, CachingAllocator)>, String> {
    match try_setup(capacity, config, Completion::Eager) {
        Ok(pair) => Ok(Some(pair)),
        Err(e) if says_unsupported(&e.to_string(), key) => Ok(None),
        Err(e) => Err(format!(
            "{config:?} refused without saying it is unsupported: {e}"
        )),
    }
}

/// PyTorch 2.15 (spec §3.1): with `throw_on_cudamalloc_oom:True` and a fraction, a segment
/// request over the fraction is rejected at once — no release, no retry, no sync — with
/// "Allocation was preemptively rejected" and `num_oom_rejections` +1. Either that, or the
/// option is refused as not supported yet.
///
/// 1 GiB device, fraction 0.25 (256 MiB). Cached 200 MiB on s2; 100 MiB on the legacy
/// stream: 200 + 100 > 256 → rejected (without the option PyTorch would free the cached
/// segment and succeed).
#[test]
fn d7_throw_on_cudamalloc_oom_rejects_up_front_or_is_refused() -> TestResult {
    let key = "throw_on_cudamalloc_oom";
    let Some((fake, a)) = accepted(
        GIB,
        "throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.25",
        key,
    )?
    else {
        return Ok(());
    };
    let s2 = new_stream(&fake);
    let c = a.allocate(200 * MIB, s2)?;
    a.free(c.ptr)?;
    let r = a.allocate(100 * MIB, LEGACY);
    let msg = r.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        is_oom(&r) && msg.contains("preemptively rejected"),
        "accepted but without effect: {r:?}"
    );
    assert_eq!(
        stats(
            &a,
            &[
                "num_oom_rejections",
                "num_alloc_retries",
                "num_sync_all_streams",
                "num_device_free"
            ]
        ),
        want(&[
            ("num_oom_rejections", 1),
            ("num_alloc_retries", 0),
            ("num_sync_all_streams", 0),
            ("num_device_free", 0),
        ])
    );
    Ok(())
}

/// Options with no observable effect in ferrocuda yet (no stream reserve classes, no
/// in-capture record_stream reuse; the `pinned_*` keys have theirs, tested in `host.rs`, and
/// `backend:cudaMallocAsync` selects its allocator, tested in `async_backend.rs`):
/// accepting them silently would make a user believe they work. Each must be refused by
/// `AllocatorConfig::parse`/`CachingAllocator::new` — and by `update_config` at run time —
/// with an error that says it is not supported.
#[test]
fn d7_options_without_effect_are_refused() {
    let cases = [
        ("graph_capture_record_stream_reuse", "True"),
        ("expandable_segments_reserve_by_class", "[inference:0.5]"),
    ];
    let mut silent = Vec::new();
    for (key, value) in cases {
        let config = format!("{key}:{value}");
        match accepted(GIB, &config, key) {
            Ok(None) => {}
            Ok(Some(_)) => silent.push(format!("{config}: accepted by CachingAllocator::new")),
            Err(e) => silent.push(e),
        }
        let (_, a) = setup(GIB, "");
        match a.update_config(&config) {
            Err(e) if says_unsupported(&e.to_string(), key) => {}
            Err(e) => silent.push(format!("{config}: update_config error is unclear: {e}")),
            Ok(()) => silent.push(format!("{config}: accepted by update_config")),
        }
    }
    assert!(
        silent.is_empty(),
        "options accepted with no effect:\n{}",
        silent.join("\n")
    );
}

/// `release_lock_on_cudamalloc:True` (spec §3.1): the device lock is released around
/// cudaMalloc. Either that is observable — another thread takes the allocator's lock
/// (reads the statistics) while this one is inside the driver's malloc — or the option is
/// refused.
#[test]
fn d7_release_lock_on_cudamalloc_releases_the_lock_or_is_refused() -> TestResult {
    let key = "release_lock_on_cudamalloc";
    let Some((fake, a)) = accepted(GIB, "release_lock_on_cudamalloc:True", key)? else {
        return Ok(());
    };
    let a = Arc::new(a);
    let (tx, rx) = std::sync::mpsc::channel();
    let other = a.clone();
    fake.before_next(Call::Malloc, move || {
        // Inside the driver's malloc: another thread must get the lock.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = other.stats();
            done_tx.send(()).ok();
        });
        let got = done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .is_ok();
        tx.send(got).ok();
    });
    let x = a.allocate(30 * MIB, LEGACY)?;
    assert_eq!(
        rx.recv().ok(),
        Some(true),
        "the lock was held across cudaMalloc"
    );
    a.free(x.ptr)?;
    Ok(())
}

/// `expandable_segments_reserve:0.5` (spec §4.8): each expandable segment reserves half the
/// device's memory of address space (instead of 9/8). Either that, or refused.
#[test]
fn d7_expandable_segments_reserve_sets_the_reservation_or_is_refused() -> TestResult {
    let key = "expandable_segments_reserve";
    let Some((_, a)) = accepted(
        80 * GIB,
        "expandable_segments:True,expandable_segments_reserve:0.5",
        key,
    )?
    else {
        return Ok(());
    };
    let x = a.allocate(512, LEGACY)?;
    let seg = a
        .blocks()
        .into_iter()
        .find(|b| b.ptr == x.ptr)
        .map(|b| b.segment);
    let reserved: u64 = seg.map_or(0, |s| segment_blocks(&a, s).iter().map(|b| b.size).sum());
    assert_eq!(reserved, 40 * GIB, "address space reserved for the segment");
    a.free(x.ptr)?;
    Ok(())
}

// ---- 8. Expandable page reclaim keeps exact books ---------------------------------------

/// After an out-of-memory error with `expandable_segments_reclaim`, the books still hold:
/// `check_invariants` passes, reserved bytes equal the mapped bytes of `blocks()` and of the
/// snapshot and the device's used bytes; and as PyTorch's OOM path releases every fully
/// free page (`release_cached_blocks`), only the page holding the live 2 MiB block stays.
///
/// 80 GiB device. 40 MiB (pages 0–1 of 20 MiB), 2 MiB (page 2), free the 40 MiB, then
/// 81 GiB → OOM; pages 0–1 are unmapped on the way: 20 MiB reserved.
#[test]
fn d8_reclaim_books_hold_after_an_out_of_memory_error() -> TestResult {
    let (fake, a) = setup(
        80 * GIB,
        "expandable_segments:True,expandable_segments_reclaim:True",
    );
    let x = a.allocate(40 * MIB, LEGACY)?;
    let y = a.allocate(2 * MIB, LEGACY)?;
    a.free(x.ptr)?;
    let r = a.allocate(81 * GIB, LEGACY);
    assert!(is_oom(&r), "{r:?}");
    a.check_invariants()?;
    let reserved = stat(&a, "reserved_bytes.all.current") as u64;
    let mapped: u64 = a.blocks().iter().filter(|b| b.mapped).map(|b| b.size).sum();
    let (segments, _) = a.snapshot();
    let in_snapshot: u64 = segments.iter().map(|s| s.total_size).sum();
    assert_eq!(
        (reserved, reserved, reserved),
        (mapped, in_snapshot, device_used(&fake)),
        "reserved vs (mapped blocks, snapshot, device used)"
    );
    assert_eq!(reserved, 20 * MIB, "only the live block's page stays");
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// Many streams, each with its own expandable segment (and its own address reservation):
/// every request must succeed or fail with a plain out-of-memory error, never a driver
/// error such as `CUDA_ERROR_INVALID_HANDLE`. The audit used 45 000 streams; the default
/// here is 45 000 too (set `FERROCUDA_AUDIT_STREAMS` to change it).
#[test]
fn d8_many_streams_with_expandable_segments_never_hit_a_driver_error() -> TestResult {
    let streams: usize = std::env::var("FERROCUDA_AUDIT_STREAMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(45_000);
    let (fake, a) = setup(
        80 * GIB,
        "expandable_segments:True,expandable_segments_reclaim:True",
    );
    let (mut ok, mut ooms) = (0usize, 0usize);
    for i in 0..streams {
        let s = new_stream(&fake);
        match a.allocate(512, s) {
            Ok(x) => {
                ok += 1;
                a.free(x.ptr)?;
            }
            Err(AllocError::OutOfMemory(_)) => ooms += 1,
            Err(e) => panic!("stream {i} (after {ok} successes, {ooms} OOMs): {e}"),
        }
    }
    eprintln!("{streams} streams: {ok} allocations, {ooms} out-of-memory errors");
    a.check_invariants()?;
    Ok(())
}

// ---- 9. Sizes never overflow ---------------------------------------------------------------

/// Allocations that must each succeed or fail with an out-of-memory error; afterwards no
/// two of the live ones overlap and the books hold. `Err` describes what went wrong.
fn size_workload(a: &CachingAllocator) -> Result<(), String> {
    let sizes = [
        512,
        MIB + 1,
        5 * MIB,
        12 * MIB,
        30 * MIB,
        100 * MIB,
        3 * GIB,
    ];
    let mut live: Vec<Allocation> = Vec::new();
    for n in sizes {
        match a.allocate(n, LEGACY) {
            Ok(x) => live.push(x),
            Err(AllocError::OutOfMemory(_)) => {}
            Err(e) => return Err(format!("allocate({n}): {e}")),
        }
    }
    for (i, x) in live.iter().enumerate() {
        for y in &live[i + 1..] {
            let overlap =
                x.ptr.0 < y.ptr.0.wrapping_add(y.size) && y.ptr.0 < x.ptr.0.wrapping_add(x.size);
            if overlap || x.ptr.0.checked_add(x.size).is_none() {
                return Err(format!("live blocks overlap: {x:?} and {y:?}"));
            }
        }
    }
    a.check_invariants()?;
    for x in &live {
        a.free(x.ptr).map_err(|e| format!("free {}: {e}", x.ptr))?;
    }
    a.check_invariants()
}

/// Runs `f`, turning a panic into an `Err`.
/// Pinned requests from small to absurd: each succeeds, runs out of memory, or (past 2^63
/// bytes) is refused, and what succeeded can be freed and given back.
fn host_size_workload(a: &HostAllocator) -> Result<(), String> {
    let mut live = Vec::new();
    for n in [512, MIB + 1, 64 * MIB, 1 << 62, (1 << 63) + 1, u64::MAX] {
        match a.allocate(n, LEGACY) {
            Ok(r) if r.bytes >= n => live.push(r.addr()),
            Ok(r) => return Err(format!("allocate({n}) gave {} bytes", r.bytes)),
            Err(AllocError::Driver(e)) if e == DriverError::OUT_OF_MEMORY => {}
            Err(AllocError::HostRequestTooLarge(_)) if n > 1 << 63 => {}
            Err(e) => return Err(format!("allocate({n}): {e}")),
        }
    }
    for addr in live {
        a.free(addr).map_err(|e| e.to_string())?;
    }
    a.empty_cache().map_err(|e| e.to_string())?;
    a.check_invariants()
}

fn no_panic(what: &str, f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| format!("{what}: {e}")),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("{what}: panicked: {msg}"))
        }
    }
}

/// Every size key is range-checked: a value whose byte count does not fit (or is absurd)
/// is refused at parse time — or, for the keys the device allocator uses, the allocator
/// still works (no panic, typed errors, no overlapping blocks); for the pinned keys, the
/// host allocator likewise (no panic, and a failure is a typed error). The audit's case:
/// `large_segment_size_mb:17592186044416` (2^44 MiB = 2^64 bytes).
#[test]
fn d9_huge_size_keys_are_refused_or_harmless() {
    let values = [
        "17592186044416",       // 2^44 MiB = 2^64 bytes
        "18446744073709551615", // u64::MAX MiB
        "17592186044415",       // the largest that fits in bytes
        "9007199254740992",     // 2^53 MiB
    ];
    let device_keys = [
        "large_segment_size_mb",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
    ];
    let pinned_keys = [
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
        "pinned_reserve_segment_size_mb",
    ];
    let mut failures = Vec::new();
    for value in values {
        for key in device_keys {
            for extra in ["", ",expandable_segments:True"] {
                let config = format!("{key}:{value}{extra}");
                let Ok(parsed) = AllocatorConfig::parse(&config) else {
                    continue;
                };
                let r = no_panic(&config, || {
                    let fake = Arc::new(FakeDriver::builder().capacity(80 * GIB).build());
                    let a = CachingAllocator::new(fake, D0, parsed, Caching::On)
                        .map_err(|e| e.to_string())?;
                    size_workload(&a)
                });
                failures.extend(r.err());
            }
        }
        for key in pinned_keys {
            let config = format!("{key}:{value}");
            let Ok(parsed) = AllocatorConfig::parse(&config) else {
                continue;
            };
            let r = no_panic(&config, || {
                let fake = Arc::new(FakeDriver::builder().build());
                host_size_workload(&HostAllocator::new(fake, parsed.pinned))
            });
            failures.extend(r.err());
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// PyTorch (spec §3 step 1): a request of 1 EB or more fails at once with an out-of-memory
/// error; smaller huge requests go through the allocator and fail with one too. Sizes near
/// `u64::MAX` must never overflow (this runs in debug, where overflow panics), whatever
/// the configuration.
#[test]
fn d9_sizes_near_u64_max_fail_with_a_typed_error() {
    let configs = [
        "",
        "expandable_segments:True",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[>:16]",
        "max_split_size_mb:20",
        "max_split_size_mb:20,expandable_segments:True",
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
        "cross_stream_reuse:True",
        "expandable_segments:True,expandable_segments_reclaim:True",
    ];
    let sizes = [
        u64::MAX,
        u64::MAX - 1,
        u64::MAX - 511,
        1 << 63,
        (1 << 60) + 1,
        1 << 60,
        (1 << 60) - 1,
        (1 << 60) - 512,
        (1 << 59) + 1,
        80 * GIB + 1,
    ];
    let mut failures = Vec::new();
    for config in configs {
        let r = no_panic(config, || {
            let (_, a) = setup(80 * GIB, config);
            let keep = a.allocate(4096, LEGACY).map_err(|e| e.to_string())?;
            for n in sizes {
                match a.allocate(n, LEGACY) {
                    Err(AllocError::OutOfMemory(_)) => {}
                    other => return Err(format!("allocate({n:#x}): {other:?}")),
                }
                a.check_invariants()?;
            }
            for p in [DevicePtr(u64::MAX), DevicePtr(u64::MAX - 4095)] {
                if !matches!(a.free(p), Err(AllocError::InvalidPointer(_))) {
                    return Err(format!("free({p}) was not an invalid pointer"));
                }
                if !matches!(
                    a.record_stream(p, StreamHandle::legacy(D0)),
                    Err(AllocError::InvalidPointer(_))
                ) {
                    return Err(format!("record_stream({p}) was not an invalid pointer"));
                }
            }
            a.free(keep.ptr).map_err(|e| e.to_string())?;
            a.check_invariants()
        });
        failures.extend(r.err());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- 10. Dropping the allocator gives everything back -----------------------------------

/// Allocates a mix on two streams (one block used on the other stream too), frees it all
/// and drops the allocator: every byte, physical handle and address reservation taken
/// from the driver must have been given back.
fn drop_gives_everything_back(config: &str) {
    let (fake, a) = setup(80 * GIB, config);
    let s2 = new_stream(&fake);
    let xs: Vec<Allocation> = [
        (512, LEGACY),
        (3 * MIB, LEGACY),
        (30 * MIB, LEGACY),
        (4096, s2),
        (25 * MIB, s2),
    ]
    .into_iter()
    .map(|(n, s)| a.allocate(n, s).unwrap_or_else(|e| panic!("{e}")))
    .collect();
    a.record_stream(xs[2].ptr, s2)
        .unwrap_or_else(|e| panic!("{e}"));
    for x in &xs {
        a.free(x.ptr).unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(device_used(&fake) > 0);
    drop(a);
    let counts = |c: Call| fake.calls(c);
    assert_eq!(
        (
            device_used(&fake),
            counts(Call::Malloc) - counts(Call::Free),
            counts(Call::VmCreate) - counts(Call::VmDestroy),
            counts(Call::VmReserve) - counts(Call::VmRelease),
        ),
        (0, 0, 0, 0),
        "{config:?}: (bytes used, segments, physical handles, address reservations) \
         still held after the allocator was dropped"
    );
}

/// Dropping a `CachingAllocator` frees its cached segments (PyTorch's allocator lives for
/// the process, but a Rust value that owns device memory must give it back on drop).
#[test]
fn d10_drop_frees_cached_segments() {
    drop_gives_everything_back("");
}

/// The same with expandable segments: mapped pages released, address ranges freed.
#[test]
fn d10_drop_frees_expandable_pages_and_address_space() {
    drop_gives_everything_back("expandable_segments:True");
}

/// The same with page reclaim: spare physical pages are released too.
#[test]
fn d10_drop_frees_reclaimed_spare_pages() {
    drop_gives_everything_back("expandable_segments:True,expandable_segments_reclaim:True");
}

/// A live allocation outlives the allocator (its memory is the user's); everything else
/// goes back: a live 512 B block keeps exactly its 2 MiB segment.
#[test]
fn d10_drop_keeps_only_segments_with_live_blocks() -> TestResult {
    let (fake, a) = setup(80 * GIB, "");
    let live = a.allocate(512, LEGACY)?;
    let x = a.allocate(30 * MIB, LEGACY)?;
    a.free(x.ptr)?;
    drop(a);
    assert_ne!(live.ptr, DevicePtr(0));
    assert_eq!(device_used(&fake), 2 * MIB);
    Ok(())
}

// ---- Beyond the audit list -----------------------------------------------------------------

/// PyTorch: the 1 EB guard is a `TORCH_CHECK_WITH(OutOfMemoryError, …)` in
/// `NativeCachingAllocator::malloc`/`allocate`, before the device allocator: it raises but
/// counts nothing (`num_ooms` stays 0) and calls no OOM observer.
#[test]
fn extra_one_exabyte_guard_counts_no_oom() -> TestResult {
    let (_, a) = setup(GIB, "");
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = seen.clone();
    a.add_oom_observer(Arc::new(move |_| {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }));
    let r = a.allocate(1 << 60, LEGACY);
    assert_eq!(
        r.err().map(|e| e.to_string()).as_deref(),
        Some("CUDA out of memory. Tried to allocate more than 1EB memory.")
    );
    assert_eq!(
        (
            stat(&a, "num_ooms"),
            seen.load(std::sync::atomic::Ordering::Relaxed)
        ),
        (0, 0),
        "(num_ooms, observer calls)"
    );
    Ok(())
}

/// Oracle class A: `free_block` applies the net change of `inactive_split` once (its merges
/// subtract, a result still split adds, then one `increase` or `decrease`), so a free that
/// merges one split neighbour and stays split moves no block count at all.
#[test]
fn oracle_a_free_block_applies_the_net_inactive_split_change() -> TestResult {
    let (_, a) = setup(GIB, "");
    let k = 512 * 1024;
    // One 2 MiB small segment: a | b | c | free tail. The first split counts 1.
    let x = a.allocate(k, LEGACY)?;
    let y = a.allocate(k, LEGACY)?;
    let _z = a.allocate(k, LEGACY)?;
    // Freeing x: no merge, still split: +1 (increase).
    a.free(x.ptr)?;
    // Freeing y: merges x (-1, -512 KiB), still split (+1, +1 MiB): net 0 blocks, +512 KiB.
    a.free(y.ptr)?;
    for (key, value) in [
        ("inactive_split.all.current", 2),
        ("inactive_split.all.allocated", 2),
        ("inactive_split.all.freed", 0),
        ("inactive_split_bytes.all.current", (k + 2 * k) as i64),
        // 1.5 MiB (first split) + 512 KiB (x) + 512 KiB (y's net)
        ("inactive_split_bytes.all.allocated", (3 * k + k + k) as i64),
        // the tail shrank twice by 512 KiB
        ("inactive_split_bytes.all.freed", (2 * k) as i64),
    ] {
        assert_eq!(stat(&a, key), value, "{key}");
    }
    Ok(())
}

/// Oracle class B: PyTorch's `map_block` merges the range it mapped with both free
/// neighbours, so a free block right after a hole that gets mapped joins the new block.
/// Segment (20 MiB pages): [free a][unmapped][free c][d]; a 30 MiB request takes a, maps
/// the hole and merges c: one 60 MiB block, 30 MiB handed out, 30 MiB left free in one
/// piece, which a second 30 MiB request takes without mapping anything.
#[test]
fn oracle_b_a_mapped_hole_merges_the_free_block_after_it() -> TestResult {
    let (_, al) = setup(GIB, "expandable_segments:True");
    let page = 20 * MIB;
    let a = al.allocate(page, LEGACY)?;
    let b = al.allocate(page, LEGACY)?;
    let c = al.allocate(page, LEGACY)?;
    let _d = al.allocate(page, LEGACY)?;
    assert_eq!(c.ptr.0, a.ptr.0 + 2 * page);
    al.free(b.ptr)?;
    al.empty_cache(); // b's page is unmapped: a hole
    al.free(a.ptr)?;
    al.free(c.ptr)?;
    let maps = stat(&al, "num_device_alloc");
    let x = al.allocate(30 * MIB, LEGACY)?;
    assert_eq!(x.ptr, a.ptr);
    assert_eq!(stat(&al, "num_device_alloc"), maps + 1);
    let y = al.allocate(30 * MIB, LEGACY)?;
    assert_eq!(
        y.ptr.0,
        a.ptr.0 + 30 * MIB,
        "the rest of a, the hole and c is one block"
    );
    assert_eq!(
        stat(&al, "num_device_alloc"),
        maps + 1,
        "nothing more mapped"
    );
    al.check_invariants()?;
    Ok(())
}

/// Oracle class C: `alloc_block` checks the memory fraction against the allocation size
/// (`get_allocation_size`) before trying expandable segments, not against the pages the
/// request would map. With 100 MiB allowed, 80 MiB mapped and a 10 MiB free tail, a 25 MiB
/// request (26 MiB allocation size: 106 MiB > 100) runs out of memory in PyTorch although
/// one more 20 MiB page would fit.
#[test]
fn oracle_c_expandable_growth_is_checked_against_the_allocation_size() -> TestResult {
    let (_, al) = setup(GIB, "expandable_segments:True");
    al.set_memory_fraction(100.0 / 1024.0)?;
    let _x = al.allocate(70 * MIB, LEGACY)?;
    assert_eq!(stat(&al, "reserved_bytes.all.current"), 80 * MIB as i64);
    let r = al.allocate(25 * MIB, LEGACY);
    assert!(is_oom(&r), "{r:?}");
    assert_eq!(stat(&al, "reserved_bytes.all.current"), 80 * MIB as i64);
    // 11 MiB (12 MiB allocation size: 92 MiB) passes the check and maps a whole page.
    let _y = al.allocate(11 * MIB, LEGACY)?;
    assert_eq!(stat(&al, "reserved_bytes.all.current"), 100 * MIB as i64);
    al.check_invariants()?;
    Ok(())
}
