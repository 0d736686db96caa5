//! The allocator's behaviour on the fake device: PyTorch's tests "in spirit" (allocator
//! spec §12 items 1–19) with exact figures.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use ferrocuda_alloc::{AllocError, Allocation, Caching, CachingAllocator};
use ferrocuda_driver::{Call, Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{AllocatorConfig, DevicePtr, MemsetValue, StreamHandle};
use std::sync::Arc;

use crate::common;
use common::{D0, GIB, LEGACY, MIB, TestResult, new_stream, setup, stat};

#[test]
fn small_allocation_exact_stats() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let x = a.allocate(1, LEGACY)?;
    assert_eq!((x.size, x.requested), (512, 1));
    for (k, v) in [
        ("allocation.all.current", 1),
        ("allocation.small_pool.current", 1),
        ("allocated_bytes.all.current", 512),
        ("requested_bytes.all.current", 1),
        ("segment.small_pool.current", 1),
        ("reserved_bytes.all.current", 2 * MIB as i64),
        ("inactive_split.all.current", 1),
        ("inactive_split_bytes.all.current", 2 * MIB as i64 - 512),
        ("active.all.current", 1),
        ("num_device_alloc", 1),
        ("max_split_size", -1),
    ] {
        assert_eq!(stat(&a, k), v, "{k}");
    }
    a.check_invariants()?;
    a.free(x.ptr)?;
    for (k, v) in [
        ("allocation.all.current", 0),
        ("active.all.current", 0),
        ("inactive_split.all.current", 0),
        ("reserved_bytes.all.current", 2 * MIB as i64),
        ("allocated_bytes.all.peak", 512),
    ] {
        assert_eq!(stat(&a, k), v, "{k}");
    }
    let y = a.allocate(1000, LEGACY)?;
    assert_eq!(y.ptr, x.ptr, "the cached block is reused");
    a.free(y.ptr)?;
    a.empty_cache();
    assert_eq!(
        (
            stat(&a, "reserved_bytes.all.current"),
            stat(&a, "num_device_free")
        ),
        (0, 1)
    );
    assert_eq!(fake.calls(Call::Malloc), 1);
    a.reset_peak_stats();
    assert_eq!(stat(&a, "allocated_bytes.all.peak"), 0);
    a.reset_accumulated_stats();
    assert_eq!(
        (
            stat(&a, "allocated_bytes.all.allocated"),
            stat(&a, "num_device_alloc")
        ),
        (0, 0)
    );
    a.check_invariants()?;
    Ok(())
}

#[test]
fn large_pool_segments_and_splits() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let x = a.allocate(MIB + 1, LEGACY)?;
    assert_eq!(x.size, MIB + 512);
    assert_eq!(
        stat(&a, "reserved_bytes.large_pool.current"),
        20 * MIB as i64
    );
    assert_eq!(
        stat(&a, "inactive_split_bytes.large_pool.current"),
        (20 * MIB - MIB - 512) as i64
    );
    let y = a.allocate(10 * MIB, LEGACY)?;
    assert_eq!(y.ptr, x.ptr.offset(x.size), "carved from the same segment");
    let z = a.allocate(10 * MIB, LEGACY)?;
    assert_eq!(
        stat(&a, "segment.large_pool.current"),
        2,
        "no room left: a 10 MiB segment"
    );
    assert_eq!(
        stat(&a, "reserved_bytes.large_pool.current"),
        30 * MIB as i64
    );
    // 20 MiB - 1 MiB - 512 - 10 MiB = 9 MiB - 512 remains: bigger than 1 MiB, stays split off.
    assert_eq!(stat(&a, "inactive_split.large_pool.current"), 1);
    for p in [x.ptr, y.ptr, z.ptr] {
        a.free(p)?;
        a.check_invariants()?;
    }
    assert_eq!(
        stat(&a, "inactive_split.all.current"),
        0,
        "everything merged back"
    );
    // A remainder of at most 1 MiB stays attached to a large allocation.
    let w = a.allocate(19 * MIB + 512, LEGACY)?;
    assert_eq!(
        (w.size, w.requested),
        (20 * MIB, 19 * MIB + 512),
        "the whole block, unsplit"
    );
    assert_eq!(stat(&a, "inactive_split.all.current"), 0);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn out_of_memory_message_and_one_exabyte() -> TestResult {
    let (_, a) = setup(GIB, "", Completion::Eager);
    let err = a
        .allocate(800_000_000 * GIB, LEGACY)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.starts_with("CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of 1024.00 MiB of which 1024.00 MiB is free. "), "{err}");
    assert!(err.contains("Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."));
    assert!(
        !err.contains("Largest free block")
            && err.ends_with("unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"),
        "{err}"
    );
    let err = a.allocate(1 << 60, LEGACY).err().map(|e| e.to_string());
    assert_eq!(
        err.as_deref(),
        Some("CUDA out of memory. Tried to allocate more than 1EB memory.")
    );
    assert_eq!(
        stat(&a, "num_ooms"),
        1,
        "the 1 EB refusal is not counted, as in PyTorch"
    );
    let small = a.allocate(1024, LEGACY)?;
    a.free(small.ptr)?;
    Ok(())
}

/// PyTorch's `release_cached_blocks` under out of memory: every cached segment goes, one
/// retry and one sync of all streams are counted.
/// The parts of PyTorch's message that depend on the machine and the pools
/// (`DeviceCachingAllocator::malloc`): NVML's processes on the device (this one named as
/// such), and the cached blocks of private pools, counted as allocated and named; the
/// history's `oom` entry records the rounded request, not the segment size.
#[test]
fn out_of_memory_message_processes_private_pools_and_trace() -> TestResult {
    use ferrocuda_alloc::Route;
    use ferrocuda_alloc::history::HistoryOptions;
    use ferrocuda_driver::GpuProcess;
    use ferrocuda_types::PoolId;
    let fake = Arc::new(
        FakeDriver::builder()
            .capacity(48 * MIB)
            .gpu_processes(vec![
                GpuProcess {
                    pid: std::process::id(),
                    used: 40 * MIB,
                },
                GpuProcess {
                    pid: 4242,
                    used: 3 * MIB,
                },
            ])
            .build(),
    );
    let a = CachingAllocator::new(fake.clone(), D0, AllocatorConfig::default(), Caching::On)?;
    a.record_memory_history(HistoryOptions::parse(Some("all"), None, 100)?);
    let pool = PoolId(0, 7);
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let cached = a.allocate(30 * MIB, LEGACY)?;
    a.end_allocate_to_pool(pool)?;
    a.free(cached.ptr)?;
    let live = a.allocate(10 * MIB, LEGACY)?;
    let err = a
        .allocate(5 * MIB + 1, LEGACY)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_eq!(
        err,
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of \
         48.00 MiB of which 8.00 MiB is free. Including non-PyTorch memory, this process has \
         40.00 MiB memory in use. Process 4242 has 3.00 MiB memory in use. Of the allocated \
         memory 40.00 MiB is allocated by PyTorch, with 30.00 MiB allocated in private pools \
         (e.g., CUDA Graphs), and 0 bytes is reserved by PyTorch but unallocated. If reserved \
         but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
         to avoid fragmentation.  See documentation for Memory Management  \
         (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    );
    let (_, trace) = a.snapshot();
    let oom = trace
        .iter()
        .find(|e| e.action == "oom")
        .ok_or("an oom entry")?;
    assert_eq!(
        (oom.size, oom.device_free),
        (5 * MIB + 512, Some(8 * MIB)),
        "the rounded request and the free memory"
    );
    a.free(live.ptr)?;
    Ok(())
}

#[test]
fn out_of_memory_frees_every_cached_segment_and_counts_a_retry() -> TestResult {
    let (fake, a) = setup(GIB, "", Completion::Eager);
    let keep = a.allocate(100 * MIB, LEGACY)?;
    let cached = [
        a.allocate(300 * MIB, LEGACY)?,
        a.allocate(200 * MIB, LEGACY)?,
    ];
    cached.iter().try_for_each(|c| a.free(c.ptr))?;
    let frees_before = fake.calls(Call::Free);
    let big = a.allocate(600 * MIB, LEGACY)?;
    assert_eq!(
        fake.calls(Call::Free),
        frees_before + 2,
        "both cached segments"
    );
    for (key, value) in [
        ("num_alloc_retries", 1),
        ("num_sync_all_streams", 1),
        ("num_device_free", 2),
        ("reserved_bytes.all.current", 700 * MIB as i64),
    ] {
        assert_eq!(stat(&a, key), value, "{key}");
    }
    a.free(big.ptr)?;
    a.free(keep.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// `oom_release_partial`: the largest cached segments go only until the request fits.
#[test]
fn out_of_memory_retry_frees_only_what_it_needs() -> TestResult {
    let (fake, a) = setup(GIB, "oom_release_partial:True", Completion::Eager);
    let keep = a.allocate(100 * MIB, LEGACY)?;
    let first = a.allocate(500 * MIB, LEGACY)?;
    a.free(first.ptr)?;
    let frees_before = fake.calls(Call::Free);
    let second = a.allocate(600 * MIB, LEGACY)?;
    assert_eq!(
        fake.calls(Call::Free),
        frees_before + 1,
        "the cached 500 MiB segment was released"
    );
    assert_eq!(
        stat(&a, "num_alloc_retries"),
        0,
        "no full-cache flush was needed"
    );
    a.free(second.ptr)?;
    a.free(keep.ptr)?;
    a.check_invariants()?;
    Ok(())
}

#[test]
fn memory_fraction_bounds_reserved_bytes() -> TestResult {
    let (_, a) = setup(GIB, "", Completion::Eager);
    assert!(matches!(
        a.set_memory_fraction(1.5),
        Err(AllocError::InvalidFraction(_))
    ));
    assert!(a.set_memory_fraction(-0.1).is_err());
    a.set_memory_fraction(0.5)?;
    assert_eq!(a.memory_fraction(), 0.5);
    let fits = a.allocate((0.499 * GIB as f64) as u64, LEGACY)?;
    a.free(fits.ptr)?;
    a.empty_cache();
    let err = a
        .allocate(GIB / 2 + 1, LEGACY)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("512.00 MiB allowed; "), "{err}");
    a.set_memory_fraction(1.0)?;
    let now = a.allocate(GIB / 2 + 1, LEGACY)?;
    a.free(now.ptr)?;
    let from_config = setup(GIB, "per_process_memory_fraction:0.25", Completion::Eager).1;
    assert_eq!(from_config.memory_fraction(), 0.25);
    Ok(())
}

#[test]
fn record_stream_delays_reuse_until_the_stream_catches_up() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let s0 = new_stream(&fake)?;
    let s1 = new_stream(&fake)?;
    let x = a.allocate(4096, s0)?;
    fake.memset_async(x.ptr, MemsetValue::U8(1), 4096, s1)?; // s1 still uses x
    a.record_stream(x.ptr, s1)?;
    a.free(x.ptr)?;
    assert_eq!(
        stat(&a, "active.all.current"),
        1,
        "freed but waiting for s1"
    );
    let y = a.allocate(4096, s0)?;
    assert_ne!(y.ptr, x.ptr, "not reused while s1 may still use it");
    fake.advance(s1, None)?;
    let z = a.allocate(4096, s0)?;
    assert_eq!(z.ptr, x.ptr, "reused once s1's work completed");
    // A block is never reused on another stream.
    a.free(z.ptr)?;
    let w = a.allocate(4096, s1)?;
    assert_ne!(w.ptr, x.ptr);
    assert!(matches!(
        a.record_stream(DevicePtr(12345), s1),
        Err(AllocError::InvalidPointer(_))
    ));
    assert!(matches!(
        a.free(DevicePtr(12345)),
        Err(AllocError::InvalidPointer(_))
    ));
    a.check_invariants()?;
    Ok(())
}

/// PyTorch waits for every stream's events under out of memory, then frees every cached
/// segment and retries: the block held back by the event is given back, not reused.
#[test]
fn record_stream_blocks_are_released_when_memory_runs_out() -> TestResult {
    let (fake, a) = setup(64 * MIB, "", Completion::Manual);
    let s0 = new_stream(&fake)?;
    let s1 = new_stream(&fake)?;
    let x = a.allocate(40 * MIB, s0)?;
    fake.memset_async(x.ptr, MemsetValue::U8(1), 16, s1)?;
    a.record_stream(x.ptr, s1)?;
    a.free(x.ptr)?;
    let y = a.allocate(40 * MIB, s0)?;
    for (key, value) in [
        ("num_sync_all_streams", 1),
        ("num_alloc_retries", 1),
        ("num_device_free", 1),
        ("segment.all.current", 1),
    ] {
        assert_eq!(stat(&a, key), value, "{key}");
    }
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// `oom_search_after_sync`: the cache is searched again once the events are waited for.
#[test]
fn record_stream_blocks_are_reclaimed_when_memory_runs_out() -> TestResult {
    let (fake, a) = setup(64 * MIB, "oom_search_after_sync:True", Completion::Manual);
    let s0 = new_stream(&fake)?;
    let s1 = new_stream(&fake)?;
    let x = a.allocate(40 * MIB, s0)?;
    fake.memset_async(x.ptr, MemsetValue::U8(1), 16, s1)?;
    a.record_stream(x.ptr, s1)?;
    a.free(x.ptr)?;
    let y = a.allocate(40 * MIB, s0)?;
    assert_eq!(
        y.ptr, x.ptr,
        "the slow path waited for s1 and found the block again"
    );
    assert_eq!(stat(&a, "num_sync_all_streams"), 1);
    Ok(())
}

#[test]
fn max_split_size_oversize_rules() -> TestResult {
    let (_, a) = setup(80 * GIB, "max_split_size_mb:20", Completion::Eager);
    assert_eq!(stat(&a, "max_split_size"), 20 * MIB as i64);
    let big = a.allocate(30 * MIB, LEGACY)?;
    assert_eq!(
        (
            stat(&a, "oversize_allocations.current"),
            stat(&a, "oversize_segments.current")
        ),
        (1, 1)
    );
    a.free(big.ptr)?;
    let normal = a.allocate(10 * MIB, LEGACY)?;
    assert_ne!(
        normal.ptr, big.ptr,
        "an oversize block never serves a normal request"
    );
    let near = a.allocate(25 * MIB, LEGACY)?;
    assert_eq!(
        (near.ptr, near.size),
        (big.ptr, 30 * MIB),
        "an oversize request may take up to 20 MiB more, unsplit"
    );
    a.free(near.ptr)?;
    let far = a.allocate(21 * MIB, LEGACY)?;
    assert_eq!(far.ptr, big.ptr, "30 < 21 + 20");
    a.check_invariants()?;
    Ok(())
}

#[test]
fn config_update_takes_effect() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    a.update_config("roundup_power2_divisions:4")?;
    assert_eq!(a.allocate(9000, LEGACY)?.size, 10240);
    assert!(a.update_config("roundup_power2_divisions:3").is_err());
    assert_eq!(
        a.config().sizes.roundup_power2_divisions,
        [4; 16],
        "a bad update changes nothing"
    );
    a.update_config("")?;
    assert_eq!(a.allocate(9000, LEGACY)?.size, 9216);
    Ok(())
}

#[test]
fn without_caching_every_request_goes_to_the_driver() -> TestResult {
    let fake = Arc::new(FakeDriver::default());
    let a = CachingAllocator::new(fake.clone(), D0, AllocatorConfig::default(), Caching::Off)?;
    let x = a.allocate(1000, LEGACY)?;
    assert_eq!(x.size, 1000);
    a.free(x.ptr)?;
    assert_eq!((fake.calls(Call::Malloc), fake.calls(Call::Free)), (1, 1));
    assert_eq!(
        stat(&a, "allocated_bytes.all.allocated"),
        0,
        "no statistics without caching"
    );
    assert!(a.free(x.ptr).is_err());
    Ok(())
}

/// PyTorch collects garbage only under a memory fraction (`garbage_collect_cached_blocks`
/// is called only with `set_fraction`).
#[test]
fn garbage_collection_needs_a_fraction() -> TestResult {
    let (_, a) = setup(GIB, "garbage_collection_threshold:0.5", Completion::Eager);
    let olds: Vec<_> = (0..4)
        .map(|_| a.allocate(120 * MIB, LEGACY))
        .collect::<Result<_, _>>()?;
    olds.iter().try_for_each(|o| a.free(o.ptr))?;
    let x = a.allocate(200 * MIB, LEGACY)?;
    let y = a.allocate(200 * MIB, LEGACY)?;
    assert_eq!(stat(&a, "num_device_free"), 0);
    a.free(x.ptr)?;
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// `garbage_collection_without_fraction`: the device's memory is the limit.
#[test]
fn garbage_collection_frees_old_segments_without_a_fraction() -> TestResult {
    let (_, a) = setup(
        GIB,
        "garbage_collection_threshold:0.5,garbage_collection_without_fraction:True",
        Completion::Eager,
    );
    let olds: Vec<_> = (0..4)
        .map(|_| a.allocate(120 * MIB, LEGACY))
        .collect::<Result<_, _>>()?;
    for o in &olds {
        a.free(o.ptr)?;
    }
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 480 * MIB as i64);
    // A 200 MiB request misses the cache; 480 MiB reserved is under half of 1 GiB, so
    // nothing is collected yet...
    let x = a.allocate(200 * MIB, LEGACY)?;
    assert_eq!(stat(&a, "num_device_free"), 0);
    // ...but a second one pushes reserved past the threshold, and old segments go.
    let y = a.allocate(200 * MIB, LEGACY)?;
    assert!(stat(&a, "num_device_free") >= 1);
    a.free(x.ptr)?;
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// 10 000 random operations (2–20 MiB, some small) with data integrity (spec §12 item 14).
#[test]
fn frees_from_other_threads_and_concurrent_use() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let a = Arc::new(a);
    let handed: Vec<DevicePtr> = (0..64)
        .map(|i| a.allocate(4096 * (i + 1), LEGACY).map(|x| x.ptr))
        .collect::<Result<_, _>>()?;
    std::thread::scope(|s| {
        for chunk in handed.chunks(16) {
            let a = a.clone();
            s.spawn(move || {
                chunk
                    .iter()
                    .for_each(|p| a.free(*p).unwrap_or_else(|e| panic!("{e}")))
            });
        }
        for t in 0..4u64 {
            let a = a.clone();
            s.spawn(move || {
                for i in 0..2000u64 {
                    let x = a
                        .allocate(512 * (1 + (i * 7 + t) % 5000), LEGACY)
                        .unwrap_or_else(|e| panic!("{e}"));
                    a.free(x.ptr).unwrap_or_else(|e| panic!("{e}"));
                }
            });
        }
    });
    a.check_invariants()?;
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    Ok(())
}

/// `cross_stream_reuse`: a segment stranded on one stream serves another without a driver
/// call, and the new stream's work is ordered after the old stream's.
#[test]
fn cross_stream_reuse_moves_whole_segments_with_an_event_wait() -> TestResult {
    for enabled in [false, true] {
        let config = if enabled {
            "cross_stream_reuse:True"
        } else {
            ""
        };
        let (fake, a) = setup(80 * GIB, config, Completion::Manual);
        let s0 = new_stream(&fake)?;
        let s1 = new_stream(&fake)?;
        let x = a.allocate(30 * MIB, s0)?;
        fake.memset_async(x.ptr, MemsetValue::U8(1), 16, s0)?; // s0 still writing
        a.free(x.ptr)?;
        let mallocs = fake.calls(Call::Malloc);
        let y = a.allocate(30 * MIB, s1)?;
        if !enabled {
            assert_ne!(
                y.ptr, x.ptr,
                "PyTorch never shares cached blocks across streams"
            );
            continue;
        }
        assert_eq!(
            (y.ptr, fake.calls(Call::Malloc)),
            (x.ptr, mallocs),
            "reused, no driver call"
        );
        fake.memset_async(y.ptr, MemsetValue::U8(2), 16, s1)?;
        assert_eq!(fake.advance(s1, None)?, 0, "s1 waits for s0's write");
        fake.advance(s0, None)?;
        fake.advance(s1, None)?;
        let mut back = [0u8; 16];
        fake.memcpy_dtoh(&mut back, y.ptr, s1)?;
        assert_eq!(back, [2; 16], "s1's write came last");
        a.free(y.ptr)?;
        let z = a.allocate(30 * MIB, s1)?;
        assert_eq!(z.ptr, x.ptr, "the segment now belongs to s1");
        a.check_invariants()?;
    }
    Ok(())
}

#[test]
fn out_of_memory_observers_are_notified() -> TestResult {
    let (_, a) = setup(GIB, "", Completion::Eager);
    let seen = Arc::new(call_counter::Counter::default());
    let counter = seen.clone();
    a.add_oom_observer(Arc::new(move |report| counter.add(report.requested)));
    assert!(a.allocate(2 * GIB, LEGACY).is_err());
    assert_eq!(seen.get(), (1, 2 * GIB));
    Ok(())
}

#[test]
fn record_stream_on_a_pointer_inside_the_allocation() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let s0 = new_stream(&fake)?;
    let s1 = new_stream(&fake)?;
    let x = a.allocate(8192, s0)?;
    fake.memset_async(x.ptr.offset(4096), MemsetValue::U8(1), 16, s1)?;
    a.record_stream(x.ptr.offset(4096), s1)?; // a "shifted view"
    a.free(x.ptr)?;
    assert_ne!(
        a.allocate(8192, s0)?.ptr,
        x.ptr,
        "the base allocation is protected"
    );
    Ok(())
}

mod call_counter {
    use std::sync::atomic::{AtomicU64, Ordering};
    /// Counts calls and sums a value, from any thread.
    #[derive(Default)]
    pub(super) struct Counter(AtomicU64, AtomicU64);
    impl Counter {
        pub(super) fn add(&self, v: u64) {
            self.0.fetch_add(1, Ordering::SeqCst);
            self.1.fetch_add(v, Ordering::SeqCst);
        }
        pub(super) fn get(&self) -> (u64, u64) {
            (self.0.load(Ordering::SeqCst), self.1.load(Ordering::SeqCst))
        }
    }
}

/// A driver failure while recording the protecting event neither loses the block nor lets
/// it be reused early: the allocator waits for the stream instead.
#[test]
fn a_failed_event_record_falls_back_to_waiting() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let s0 = new_stream(&fake)?;
    let s1 = new_stream(&fake)?;
    let x = a.allocate(4096, s0)?;
    fake.memset_async(x.ptr, MemsetValue::U8(1), 16, s1)?;
    a.record_stream(x.ptr, s1)?;
    fake.fail_nth(Call::EventRecord, 1, ferrocuda_driver::DriverError::UNKNOWN);
    a.free(x.ptr)?;
    assert_eq!(fake.pending(s1)?, 0, "the allocator waited for s1");
    assert_eq!(
        a.allocate(4096, s0)?.ptr,
        x.ptr,
        "and the block is back in the cache"
    );
    a.check_invariants()?;
    Ok(())
}

mod expandable;

mod snapshots;

/// `expandable_segments_reclaim`: growth reuses the physical pages of a free hole.
#[test]
fn reclaim_moves_free_pages_to_the_frontier() -> TestResult {
    for reclaim in [false, true] {
        let conf = if reclaim {
            "expandable_segments:True,expandable_segments_reclaim:True"
        } else {
            "expandable_segments:True"
        };
        let (fake, a) = setup(80 * GIB, conf, Completion::Eager);
        let xs: Vec<_> = (0..3)
            .map(|_| a.allocate(40 * MIB, LEGACY))
            .collect::<Result<_, _>>()?;
        fake.memset_async(xs[0].ptr, MemsetValue::U8(3), 64, LEGACY)?;
        fake.memset_async(xs[2].ptr, MemsetValue::U8(4), 64, LEGACY)?;
        a.free(xs[1].ptr)?;
        let syncs = fake.calls(Call::StreamSynchronize);
        let big = a.allocate(60 * MIB, LEGACY)?;
        let reserved = stat(&a, "reserved_bytes.all.current") as u64;
        if reclaim {
            assert_eq!(
                reserved,
                140 * MIB,
                "40 MiB of the hole moved: only 20 MiB are new"
            );
            assert_eq!(
                fake.calls(Call::StreamSynchronize),
                syncs,
                "the hole's last use was known complete by an event: no synchronization"
            );
            let (free, total) = fake.mem_get_info(D0)?;
            assert_eq!(
                total - free,
                reserved,
                "no physical page leaked or double-counted"
            );
        } else {
            assert_eq!(
                reserved,
                180 * MIB,
                "PyTorch's behaviour: new pages at the frontier"
            );
        }
        fake.memset_async(big.ptr, MemsetValue::U8(5), big.size, LEGACY)?;
        let mut back = [0u8; 64];
        fake.memcpy_dtoh(&mut back, xs[0].ptr, LEGACY)?;
        assert_eq!(back, [3; 64]);
        fake.memcpy_dtoh(&mut back, xs[2].ptr, LEGACY)?;
        assert_eq!(back, [4; 64], "live data untouched by the remap");
        a.check_invariants()?;
        for p in [xs[0].ptr, xs[2].ptr, big.ptr] {
            a.free(p)?;
        }
        a.empty_cache();
        assert_eq!(
            (
                stat(&a, "reserved_bytes.all.current"),
                fake.mem_get_info(D0)?.0
            ),
            (0, 80 * GIB)
        );
        a.check_invariants()?;
    }
    Ok(())
}

mod private_pools;

/// The per-thread front end (`thread_cache`): what other threads and readers see.
mod thread_cache;

mod devices;
