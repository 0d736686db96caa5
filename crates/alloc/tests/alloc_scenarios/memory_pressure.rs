//! What the allocator does when the device or the memory fraction is full, against
//! PyTorch's `DeviceCachingAllocator::malloc` (c10/cuda/CUDACachingAllocator.cpp): garbage
//! collection, the oversize release, `release_cached_blocks`, and which pools each may
//! touch; and the options that decide it.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::common;
use common::{GIB, LEGACY, MIB, TestResult, new_stream, setup, stat};
use ferrocuda_alloc::{AllocError, CachingAllocator, Route};
use ferrocuda_driver::{Call, fake::Completion};
use ferrocuda_types::{AllocatorConfig, PoolId, StreamHandle};

/// A retained private pool holding one free segment of `bytes`, allocated on `stream`.
fn pool_with_a_free_segment(
    a: &CachingAllocator,
    bytes: u64,
    stream: StreamHandle,
) -> Result<PoolId, AllocError> {
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let x = a.allocate(bytes, stream)?;
    a.end_allocate_to_pool(pool)?;
    a.free(x.ptr)?;
    assert_eq!(a.pool_use_count(pool), Some(1));
    Ok(pool)
}

fn pool_bytes(a: &CachingAllocator, pool: PoolId) -> u64 {
    a.pool_blocks(pool).iter().map(|b| b.size).sum()
}

/// Garbage collection frees only the default large pool's blocks.
#[test]
fn garbage_collection_keeps_a_retained_private_pool() -> TestResult {
    let (_, a) = setup(GIB, "garbage_collection_threshold:0.5", Completion::Eager);
    a.set_memory_fraction(0.25)?;
    let pool = pool_with_a_free_segment(&a, 100 * MIB, LEGACY)?;
    let x = a.allocate(30 * MIB, LEGACY)?;
    let y = a.allocate(30 * MIB, LEGACY)?; // 130 MiB reserved > 0.5 * 256 MiB: collects
    assert_eq!(pool_bytes(&a, pool), 100 * MIB);
    assert_eq!(stat(&a, "num_device_free"), 0);
    a.free(x.ptr)?;
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// The oversize release and the final release of everything leave a retained pool alone:
/// the request runs out of memory, as in PyTorch.
#[test]
fn oversize_release_keeps_a_retained_private_pool() -> TestResult {
    let (_, a) = setup(GIB, "max_split_size_mb:20", Completion::Eager);
    a.set_memory_fraction(0.0625)?; // 64 MiB
    let pool = pool_with_a_free_segment(&a, 30 * MIB, LEGACY)?;
    let err = a.allocate(40 * MIB, LEGACY).err();
    assert!(matches!(err, Some(AllocError::OutOfMemory(_))), "{err:?}");
    assert_eq!(pool_bytes(&a, pool), 30 * MIB);
    assert_eq!(
        (stat(&a, "num_ooms"), stat(&a, "num_alloc_retries")),
        (1, 1)
    );
    // Once the pool has no user, the same request frees its segment and succeeds.
    a.release_pool(pool)?;
    let x = a.allocate(40 * MIB, LEGACY)?;
    assert_eq!(pool_bytes(&a, pool), 0);
    a.free(x.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// `cross_stream_reuse` moves only the request's own pool's segments.
#[test]
fn cross_stream_reuse_keeps_a_retained_private_pool() -> TestResult {
    let (fake, a) = setup(64 * MIB, "cross_stream_reuse:True", Completion::Eager);
    let side = new_stream(&fake)?;
    let pool = pool_with_a_free_segment(&a, 40 * MIB, side)?;
    let err = a.allocate(30 * MIB, LEGACY).err();
    assert!(matches!(err, Some(AllocError::OutOfMemory(_))), "{err:?}");
    assert_eq!(pool_bytes(&a, pool), 40 * MIB);
    a.check_invariants()?;
    Ok(())
}

/// `release_available_cached_blocks`: with no single oversize block big enough, oversize
/// blocks go largest first; too little freed means everything is released and the retry
/// counted.
#[test]
fn oversize_release_that_frees_too_little_releases_everything() -> TestResult {
    let (fake, a) = setup(200 * MIB, "max_split_size_mb:20", Completion::Eager);
    let keep = a.allocate(60 * MIB, LEGACY)?;
    let oversize = a.allocate(30 * MIB, LEGACY)?;
    let smalls: Vec<_> = (0..4)
        .map(|_| a.allocate(12 * MIB, LEGACY))
        .collect::<Result<_, _>>()?;
    a.free(oversize.ptr)?;
    smalls.iter().try_for_each(|s| a.free(s.ptr))?;
    // Reserved: 60 + 30 + 48 = 138 MiB; 100 MiB more does not fit in 200. The oversize step
    // frees the 30 MiB block (< 100 wanted) and gives up; then every cached segment goes.
    let frees = fake.calls(Call::Free);
    let big = a.allocate(100 * MIB, LEGACY)?;
    assert_eq!(fake.calls(Call::Free), frees + 5);
    assert_eq!(stat(&a, "num_alloc_retries"), 1);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 160 * MIB as i64);
    a.free(big.ptr)?;
    a.free(keep.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// Garbage collection's average age is a double: ages 2, 1 and 1 give 1.33, and only the
/// oldest block goes (an integer average of 1 would free all three). Ages count searches
/// of the default large pool, whatever the stream.
#[test]
fn garbage_collection_averages_ages_as_a_double() -> TestResult {
    let (fake, a) = setup(GIB, "garbage_collection_threshold:0.4", Completion::Eager);
    a.set_memory_fraction(0.5)?; // 512 MiB allowed, collection above 204.8 MiB
    let side = new_stream(&fake)?;
    let old = a.allocate(100 * MIB, LEGACY)?; // search 1
    let young = [a.allocate(60 * MIB, LEGACY)?, a.allocate(40 * MIB, LEGACY)?]; // 2, 3
    a.free(old.ptr)?; // freed at 3
    let probe = a.allocate(2 * MIB, side)?; // search 4 misses: a 20 MiB segment on `side`
    young.iter().try_for_each(|y| a.free(y.ptr))?; // freed at 4
    // Search 5 misses (ages 2, 1, 1); 220 MiB reserved is over the threshold: collect.
    let x = a.allocate(120 * MIB, LEGACY)?;
    assert_eq!(stat(&a, "num_device_free"), 1);
    let again = [a.allocate(60 * MIB, LEGACY)?, a.allocate(40 * MIB, LEGACY)?];
    assert_eq!(
        [again[0].ptr, again[1].ptr],
        [young[0].ptr, young[1].ptr],
        "the younger segments stayed cached"
    );
    for p in [probe.ptr, x.ptr, again[0].ptr, again[1].ptr] {
        a.free(p)?;
    }
    a.check_invariants()?;
    Ok(())
}

/// `empty_cache` counts a sync of all streams on every call, as PyTorch's
/// `synchronize_and_free_events` does.
#[test]
fn empty_cache_counts_a_sync_every_time() -> TestResult {
    let (_, a) = setup(GIB, "", Completion::Eager);
    a.empty_cache();
    a.empty_cache();
    assert_eq!(stat(&a, "num_sync_all_streams"), 2);
    Ok(())
}

/// `throw_on_cudamalloc_oom`: a growth past the fraction fails at once, counted in
/// `num_oom_rejections`, with no retry; without it, the usual path runs.
#[test]
fn throw_on_cudamalloc_oom_rejects_up_front() -> TestResult {
    let (fake, a) = setup(GIB, "throw_on_cudamalloc_oom:True", Completion::Eager);
    a.set_memory_fraction(0.5)?;
    let cached = a.allocate(100 * MIB, LEGACY)?;
    a.free(cached.ptr)?;
    let frees = fake.calls(Call::Free);
    let err = a.allocate(450 * MIB, LEGACY).err().map(|e| e.to_string());
    let err = err.unwrap_or_default();
    assert!(
        err.contains("preemptively rejected because it would exceed per_process_memory_fraction"),
        "{err}"
    );
    assert_eq!(fake.calls(Call::Free), frees, "nothing released first");
    for (key, value) in [
        ("num_oom_rejections", 1),
        ("num_ooms", 0),
        ("num_alloc_retries", 0),
    ] {
        assert_eq!(stat(&a, key), value, "{key}");
    }
    let (_, plain) = setup(GIB, "", Completion::Eager);
    plain.set_memory_fraction(0.5)?;
    let cached = plain.allocate(100 * MIB, LEGACY)?;
    plain.free(cached.ptr)?;
    let x = plain.allocate(450 * MIB, LEGACY)?;
    assert_eq!(stat(&plain, "num_alloc_retries"), 1);
    plain.free(x.ptr)?;
    Ok(())
}

/// Options that are not built yet are refused, never silently ignored.
#[test]
fn options_not_built_yet_are_errors() {
    for config in [
        "graph_capture_record_stream_reuse:True",
        "expandable_segments_reserve_by_class:[weights:0.5]",
    ] {
        let err = AllocatorConfig::parse(config).err().map(|e| e.message);
        assert!(
            err.as_deref()
                .is_some_and(|m| m.contains("not supported by ferrocuda yet")),
            "{config}: {err:?}"
        );
    }
    // The pinned host allocator reads these (its behaviour is tested in host.rs).
    for config in [
        "backend:native",
        "graph_capture_record_stream_reuse:False",
        "throw_on_cudamalloc_oom:True",
        "release_lock_on_cudamalloc:True",
        "pinned_use_cuda_host_register:True",
        "pinned_num_register_threads:4",
        "pinned_use_background_threads:False",
        "pinned_reserve_segment_size_mb:64",
        "pinned_max_round_threshold_mb:8",
        "pinned_max_cached_size_mb:8",
        "pinned_free_catch_all:True",
    ] {
        assert!(AllocatorConfig::parse(config).is_ok(), "{config}");
    }
}

/// Sizes are range-checked where they are parsed; sizes near the limits fail as typed
/// errors, never with an overflow.
#[test]
fn huge_sizes_are_refused_or_fail_cleanly() -> TestResult {
    let err = AllocatorConfig::parse("large_segment_size_mb:17592186044416").err();
    assert!(
        err.as_ref()
            .is_some_and(|e| e.message.contains("at most 1099511627776")),
        "{err:?}"
    );
    for config in [
        "large_segment_size_mb:1099511627776",
        "max_split_size_mb:18446744073709551615",
        "max_non_split_rounding_mb:18446744073709551615",
    ] {
        let (_, a) = setup(80 * GIB, config, Completion::Eager);
        let live: Vec<_> = [3 * MIB, 5 * MIB, 500]
            .into_iter()
            .filter_map(|n| a.allocate(n, LEGACY).ok())
            .collect();
        for n in [(1 << 60) - 1, (1 << 60) - (1 << 21), u64::MAX] {
            let err = a.allocate(n, LEGACY).err();
            assert!(
                matches!(err, Some(AllocError::OutOfMemory(_))),
                "{config}: {n}: {err:?}"
            );
        }
        a.check_invariants()?;
        live.iter().try_for_each(|x| a.free(x.ptr))?;
    }
    Ok(())
}

/// Page reclaim under an out-of-memory request keeps the books: reserved bytes equal a
/// recount of the segments afterwards.
#[test]
fn page_reclaim_keeps_the_books_when_memory_runs_out() -> TestResult {
    let (_, a) = setup(
        80 * GIB,
        "expandable_segments:True,expandable_segments_reclaim:True",
        Completion::Eager,
    );
    let x = a.allocate(40 * MIB, LEGACY)?;
    let y = a.allocate(2 * MIB, LEGACY)?;
    a.free(x.ptr)?;
    let err = a.allocate(81 * GIB, LEGACY).err();
    assert!(matches!(err, Some(AllocError::OutOfMemory(_))), "{err:?}");
    a.check_invariants()?;
    let z = a.allocate(40 * MIB, LEGACY)?;
    a.check_invariants()?;
    a.free(y.ptr)?;
    a.free(z.ptr)?;
    a.empty_cache();
    a.check_invariants()?;
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    Ok(())
}

/// Many streams that each hold a little: no driver error, and requests do not slow down
/// with the number of streams (20 000 streams in well under the test's time).
#[test]
fn many_streams_with_page_reclaim() -> TestResult {
    let (fake, a) = setup(
        80 * GIB,
        "expandable_segments:True,expandable_segments_reclaim:True",
        Completion::Eager,
    );
    let started = std::time::Instant::now();
    let mut live = Vec::new();
    for _ in 0..20_000 {
        let s = new_stream(&fake)?;
        match a.allocate(512, s) {
            Ok(x) => live.push(x),
            Err(AllocError::OutOfMemory(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    a.check_invariants()?;
    live.iter().try_for_each(|x| a.free(x.ptr))?;
    a.empty_cache();
    a.check_invariants()?;
    assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
    Ok(())
}

/// Dropping an allocator gives every segment and page that is not handed out back to the
/// driver.
#[test]
fn dropping_an_allocator_gives_its_memory_back() -> TestResult {
    for config in ["", "expandable_segments:True"] {
        let (fake, a) = setup(GIB, config, Completion::Eager);
        let s = new_stream(&fake)?;
        let (total, free_at_start) =
            ferrocuda_driver::Driver::mem_get_info(&*fake, common::D0).map(|(f, t)| (t, f))?;
        let xs: Vec<_> = [MIB, 30 * MIB, 500, 3 * MIB]
            .into_iter()
            .map(|n| a.allocate(n, s))
            .collect::<Result<_, _>>()?;
        a.free(xs[0].ptr)?;
        a.free(xs[2].ptr)?;
        a.free(xs[1].ptr)?;
        a.free(xs[3].ptr)?;
        drop(a);
        let (free, _) = ferrocuda_driver::Driver::mem_get_info(&*fake, common::D0)?;
        assert_eq!((free, total), (free_at_start, total), "{config}");
    }
    Ok(())
}

/// Dropping an allocator also gives back the free segments of private pools that still
/// have users (nobody can use them once the allocator is gone).
#[test]
fn dropping_an_allocator_gives_back_retained_private_pools() -> TestResult {
    let (fake, a) = setup(GIB, "", Completion::Eager);
    let pool = pool_with_a_free_segment(&a, 30 * MIB, LEGACY)?;
    assert_eq!(pool_bytes(&a, pool), 30 * MIB);
    drop(a);
    let (free, total) = ferrocuda_driver::Driver::mem_get_info(&*fake, common::D0)?;
    assert_eq!(free, total);
    Ok(())
}

/// A free piece over a `max_split_size_mb` lowered at run time is still a piece of a split
/// segment: the oversize release must not free the segment under its live neighbour
/// (PyTorch's `release_block` would hand the whole segment back to `cudaFree`).
#[test]
fn oversize_release_skips_a_piece_of_a_split_segment() -> TestResult {
    let (_, a) = setup(64 * MIB, "max_split_size_mb:64", Completion::Eager);
    let whole = a.allocate(60 * MIB, LEGACY)?;
    a.free(whole.ptr)?;
    let live = a.allocate(30 * MIB, LEGACY)?; // splits the 60 MiB segment
    a.update_config("max_split_size_mb:20")?; // the free 30 MiB piece is now oversize
    let err = a.allocate(10 * MIB, LEGACY).err();
    assert!(matches!(err, Some(AllocError::OutOfMemory(_))), "{err:?}");
    assert_eq!(stat(&a, "num_device_free"), 0);
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 30 * MIB as i64);
    a.check_invariants()?;
    a.free(live.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// An expandable segment keeps the page size it was made with when `large_segment_size_mb`
/// changes at run time: growing it maps its own pages, and dropping the allocator gives
/// every page back.
#[test]
fn expandable_segments_keep_their_page_size_across_a_config_change() -> TestResult {
    let (fake, a) = setup(
        GIB,
        "expandable_segments:True,large_segment_size_mb:32",
        Completion::Eager,
    );
    let first = a.allocate(8 * MIB, LEGACY)?;
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 32 * MIB as i64);
    a.update_config("expandable_segments:True,large_segment_size_mb:12")?;
    let second = a.allocate(30 * MIB, LEGACY)?; // grows the 32 MiB-page segment
    assert_eq!(second.ptr.0, first.ptr.0 + 8 * MIB);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 64 * MIB as i64);
    a.check_invariants()?;
    a.free(first.ptr)?;
    a.free(second.ptr)?;
    drop(a);
    let (free, total) = ferrocuda_driver::Driver::mem_get_info(&*fake, common::D0)?;
    assert_eq!(free, total);
    Ok(())
}

/// `expandable_segments_page_mb` sets the large pool's expandable page: growth maps 2 MiB
/// at a time instead of 20 MiB, and page reclaim moves 2 MiB pages.
#[test]
fn expandable_page_size_key_sets_the_large_pages() -> TestResult {
    let (_, a) = setup(GIB, "expandable_segments:True", Completion::Eager);
    let x = a.allocate(3 * MIB, LEGACY)?;
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 20 * MIB as i64);
    a.free(x.ptr)?;
    let (_, a) = setup(
        GIB,
        "expandable_segments:True,expandable_segments_page_mb:2",
        Completion::Eager,
    );
    let x = a.allocate(3 * MIB, LEGACY)?;
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 4 * MIB as i64);
    let y = a.allocate(5 * MIB, LEGACY)?;
    // The free MiB after `x` and two more pages.
    assert_eq!(y.ptr.0, x.ptr.0 + 3 * MIB);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 8 * MIB as i64);
    a.free(x.ptr)?;
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}
