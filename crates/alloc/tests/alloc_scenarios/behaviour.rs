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

mod expandable {
    use super::*;

    #[test]
    fn stats_count_mapped_pages_not_segments() -> TestResult {
        let (fake, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
        let x = a.allocate(1, LEGACY)?;
        assert_eq!(
            (
                stat(&a, "reserved_bytes.small_pool.current"),
                stat(&a, "segment.all.current")
            ),
            (2 * MIB as i64, 0)
        );
        assert_eq!(
            (
                stat(&a, "num_device_alloc"),
                stat(&a, "inactive_split.all.current")
            ),
            (1, 0)
        );
        let y = a.allocate(3 * MIB, LEGACY)?;
        let z = a.allocate(3 * MIB, LEGACY)?;
        assert_eq!(z.ptr, y.ptr.offset(y.size), "large blocks grow one range");
        assert_eq!(
            stat(&a, "reserved_bytes.large_pool.current"),
            20 * MIB as i64,
            "one 20 MiB page holds both"
        );
        assert_eq!(stat(&a, "num_device_alloc"), 2);
        assert_eq!(
            fake.calls(Call::VmReserve),
            2,
            "one range per (stream, pool)"
        );
        for p in [x.ptr, y.ptr, z.ptr] {
            a.free(p)?;
        }
        a.check_invariants()?;
        a.empty_cache();
        assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
        assert_eq!(stat(&a, "num_device_free"), 2);
        assert_eq!(
            (fake.calls(Call::VmRelease), fake.mem_get_info(D0)?.0),
            (2, 80 * GIB),
            "ranges and pages all given back"
        );
        a.check_invariants()?;
        Ok(())
    }

    #[test]
    fn freed_interior_pages_are_unmapped_and_refilled_lowest_first() -> TestResult {
        let (fake, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
        let xs: Vec<_> = (0..4)
            .map(|_| a.allocate(40 * MIB, LEGACY))
            .collect::<Result<_, _>>()?;
        assert_eq!(stat(&a, "reserved_bytes.all.current"), 160 * MIB as i64);
        a.free(xs[1].ptr)?;
        a.empty_cache();
        assert_eq!(
            stat(&a, "reserved_bytes.all.current"),
            120 * MIB as i64,
            "the hole's whole pages were unmapped"
        );
        assert!(fake.calls(Call::VmUnmap) >= 1);
        let again = a.allocate(40 * MIB, LEGACY)?;
        assert_eq!(again.ptr, xs[1].ptr, "the hole is refilled first");
        a.check_invariants()?;
        Ok(())
    }

    /// A mapping that fails part-way leaves the segment usable (PyTorch #188008).
    #[test]
    fn mapping_is_transactional() -> TestResult {
        let (fake, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
        fake.fail_nth(Call::VmMap, 2, ferrocuda_driver::DriverError::OUT_OF_MEMORY);
        let x = a.allocate(50 * MIB, LEGACY)?; // three 20 MiB pages; the second map fails once
        assert_eq!(
            stat(&a, "num_ooms"),
            0,
            "the slow path grew again after the rollback"
        );
        assert_eq!(stat(&a, "reserved_bytes.all.current"), 60 * MIB as i64);
        let (free, total) = fake.mem_get_info(D0)?;
        assert_eq!(
            total - free,
            60 * MIB,
            "no physical page leaked by the rollback"
        );
        fake.fail_nth(Call::VmSetAccess, 1, ferrocuda_driver::DriverError::UNKNOWN);
        let err = a.allocate(100 * MIB, LEGACY).err();
        assert!(matches!(err, Some(AllocError::Driver(_))), "{err:?}");
        let y = a.allocate(100 * MIB, LEGACY)?;
        assert_eq!(y.ptr, x.ptr.offset(x.size), "the segment is still usable");
        let (free, total) = fake.mem_get_info(D0)?;
        assert_eq!(total - free, stat(&a, "reserved_bytes.all.current") as u64);
        a.check_invariants()?;
        Ok(())
    }

    #[test]
    fn switching_off_at_run_time_stops_using_expandable_blocks() -> TestResult {
        let (_, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
        let x = a.allocate(30 * MIB, LEGACY)?;
        a.free(x.ptr)?;
        a.update_config("expandable_segments:False")?;
        let y = a.allocate(30 * MIB, LEGACY)?;
        assert_ne!(y.ptr, x.ptr, "cached expandable blocks are not used");
        assert_eq!(
            stat(&a, "segment.all.current"),
            1,
            "a plain segment instead"
        );
        a.update_config("expandable_segments:True")?;
        let z = a.allocate(30 * MIB, LEGACY)?;
        assert_eq!(z.ptr, x.ptr);
        a.check_invariants()?;
        Ok(())
    }

    #[test]
    fn memory_fraction_bounds_mapped_bytes() -> TestResult {
        let (_, a) = setup(
            GIB,
            "expandable_segments:True,per_process_memory_fraction:0.5",
            Completion::Eager,
        );
        let x = a.allocate(400 * MIB, LEGACY)?;
        assert!(matches!(
            a.allocate(200 * MIB, LEGACY),
            Err(AllocError::OutOfMemory(_))
        ));
        a.free(x.ptr)?;
        // PyTorch's `alloc_block` checks 400 + 500 MiB against the 512 MiB allowed and
        // refuses; the cache is released (x's pages unmapped, its range given back) and
        // the retry maps 500 MiB.
        let _y = a.allocate(500 * MIB, LEGACY)?;
        // (One retry for the refused 200 MiB, one for this.)
        assert_eq!(stat(&a, "num_alloc_retries"), 2);
        assert_eq!(stat(&a, "reserved_bytes.all.current"), 500 * MIB as i64);
        a.check_invariants()?;
        Ok(())
    }
}

mod snapshots {
    use super::*;
    use ferrocuda_alloc::history::HistoryOptions;

    #[test]
    fn history_and_snapshot_follow_pytorch() -> TestResult {
        let (fake, a) = setup(80 * GIB, "", Completion::Manual);
        let opts =
            HistoryOptions::parse(Some("all"), Some("all"), 100).map_err(|e| e.to_string())?;
        a.record_memory_history(opts);
        let s1 = new_stream(&fake)?;
        let x = a.allocate(1000, LEGACY)?;
        let y = a.allocate(3 * MIB, LEGACY)?;
        fake.memset_async(y.ptr, MemsetValue::U8(1), 16, s1)?;
        a.record_stream(y.ptr, s1)?;
        a.free(y.ptr)?;
        let (segments, trace) = a.snapshot();
        assert_eq!(segments.len(), 2);
        let small = &segments[0];
        assert_eq!(
            (
                small.segment_type.as_str(),
                small.total_size,
                small.allocated_size,
                small.requested_size
            ),
            ("small", 2 * MIB, 1024, 1000)
        );
        assert_eq!(small.blocks[0].state, "active_allocated");
        let first = small.blocks[0]
            .frames
            .first()
            .map(|f| f.name.as_str())
            .unwrap_or_default();
        assert!(
            first.contains("history_and_snapshot_follow_pytorch"),
            "the caller comes first: {first}"
        );
        let large = &segments[1];
        assert_eq!(
            large.blocks[0].state, "active_pending_free",
            "waiting for s1"
        );
        assert_eq!(
            large.blocks.iter().map(|b| b.size).sum::<u64>(),
            large.total_size
        );
        let actions: Vec<&str> = trace.iter().map(|e| e.action.as_str()).collect();
        assert_eq!(
            actions,
            [
                "segment_alloc",
                "alloc",
                "segment_alloc",
                "alloc",
                "free_requested"
            ],
            "a snapshot's own entry shows in the next one only"
        );
        assert_eq!(
            (trace[1].size, trace[1].addr),
            (1000, x.ptr.0),
            "alloc entries carry the requested size"
        );
        assert!(
            trace[4].frames.as_ref().is_some_and(|f| !f.is_empty()),
            "context=all records free stacks"
        );
        fake.advance(s1, None)?;
        a.free(x.ptr)?;
        a.empty_cache();
        let (segments, trace) = a.snapshot();
        assert!(segments.is_empty());
        let tail: Vec<&str> = trace
            .iter()
            .rev()
            .take(5)
            .map(|e| e.action.as_str())
            .collect();
        assert!(
            tail.contains(&"free_completed") && tail.contains(&"segment_free"),
            "{tail:?}"
        );
        assert_eq!(trace[5].action, "snapshot", "the first snapshot's entry");
        // The ring buffer keeps the newest entries; state mode keeps one; off clears.
        a.record_memory_history(
            HistoryOptions::parse(Some("all"), None, 3).map_err(|e| e.to_string())?,
        );
        assert_eq!(a.snapshot().1.len(), 3);
        a.record_memory_history(HistoryOptions::parse(None, None, 3).map_err(|e| e.to_string())?);
        assert!(a.snapshot().1.is_empty());
        assert!(HistoryOptions::parse(Some("everything"), None, 1).is_err());
        assert!(
            HistoryOptions::parse(Some("all"), Some("some"), 1)
                .is_err_and(|e| e.contains("'state', 'alloc', 'all', or None"))
        );
        Ok(())
    }

    /// Alone, the allocator skips only its own frames (and the backtrace crate's): which
    /// frames of the layers above are plumbing is theirs to say (the facade passes them).
    /// No test in this file passes `skip_frames`: lists given are merged process-wide.
    #[test]
    fn alone_the_allocator_skips_only_its_own_frames() -> TestResult {
        use ferrocuda_alloc::DeviceAllocators;
        use ferrocuda_stream::{DeviceBuffer, KernelCache, Runtime};
        let fake = Arc::new(FakeDriver::default());
        let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
        let allocators = DeviceAllocators::new(fake, AllocatorConfig::default(), Caching::On);
        allocators.install(&rt);
        allocators
            .device(D0)?
            .record_memory_history(HistoryOptions::parse(Some("all"), Some("all"), 100)?);
        let buffer = DeviceBuffer::<f32>::uninit(&rt, D0, 10)?;
        let (segments, _) = allocators.device(D0)?.snapshot();
        let frames = &segments[0].blocks[0].frames;
        assert_eq!(segments[0].blocks[0].address, buffer.ptr().0);
        let names: Vec<&str> = frames.iter().map(|f| f.name.as_str()).collect();
        // The stream layer's frame, by its name, or (inlined in an optimized build, where
        // the debug info names it without its path, `uninit<f32>`) by its file.
        let stream_layers = |f: &ferrocuda_types::Frame| {
            f.name.starts_with("ferrocuda_stream::buffer::DeviceBuffer")
                || f.filename
                    .replace('\\', "/")
                    .ends_with("crates/stream/src/buffer.rs")
        };
        assert!(
            frames.first().is_some_and(stream_layers),
            "the stream layer's frame is not the allocator's to skip: {frames:?}"
        );
        assert!(
            names
                .iter()
                .any(|n| n.contains("alone_the_allocator_skips_only_its_own_frames")),
            "{names:?}"
        );
        Ok(())
    }

    #[test]
    fn expandable_snapshot_has_one_segment_per_mapped_run_and_map_events() -> TestResult {
        let (_, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
        a.record_memory_history(
            HistoryOptions::parse(Some("all"), None, 1000).map_err(|e| e.to_string())?,
        );
        let xs: Vec<_> = (0..3)
            .map(|_| a.allocate(40 * MIB, LEGACY))
            .collect::<Result<_, _>>()?;
        a.free(xs[1].ptr)?;
        a.empty_cache();
        let (segments, trace) = a.snapshot();
        assert_eq!(
            segments.len(),
            2,
            "the unmapped hole splits the range in two"
        );
        assert!(segments.iter().all(|s| s.is_expandable));
        let actions: Vec<&str> = trace.iter().map(|e| e.action.as_str()).collect();
        assert!(
            actions.contains(&"segment_map") && actions.contains(&"segment_unmap"),
            "{actions:?}"
        );
        Ok(())
    }
}

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

mod private_pools {
    use super::*;
    use ferrocuda_alloc::Route;
    use ferrocuda_types::{CaptureMode, CaptureStatus, PoolId};

    fn capture_id(fake: &FakeDriver, s: StreamHandle) -> Result<u64, Box<dyn std::error::Error>> {
        match fake.stream_capture_status(s)? {
            CaptureStatus::Active { id } => Ok(id),
            other => Err(format!("not capturing: {other:?}").into()),
        }
    }

    /// `empty_cache` after a capture records and waits for the events of blocks freed
    /// during it (PyTorch's `synchronize_and_free_events` calls
    /// `insert_events_deferred_until_no_capture` first): the block is free afterwards.
    #[test]
    fn empty_cache_after_a_capture_frees_its_deferred_blocks() -> TestResult {
        let (fake, a) = setup(80 * GIB, "", Completion::Manual);
        let (s, side) = (new_stream(&fake)?, new_stream(&fake)?);
        let pool = PoolId::for_capture();
        fake.stream_begin_capture(s, CaptureMode::Global)?;
        a.begin_allocate_to_pool(pool, Route::Capture(capture_id(&fake, s)?))?;
        let x = a.allocate(MIB, s)?;
        a.record_stream(x.ptr, side)?;
        a.free(x.ptr)?; // deferred: no event work during a capture
        a.end_allocate_to_pool(pool)?;
        let graph = fake.stream_end_capture(s)?;
        let pending = |a: &CachingAllocator| {
            a.pool_blocks(pool)
                .iter()
                .any(|b| b.ptr == x.ptr && b.pending_events)
        };
        assert!(pending(&a));
        a.empty_cache();
        assert!(!pending(&a), "the deferred free was processed");
        fake.graph_destroy(graph)?;
        a.check_invariants()?;
        Ok(())
    }

    /// `cudaMallocMaybeCapturing` relaxes only the capturing thread's allocations: another
    /// thread that needs a new segment during a GLOBAL capture invalidates it, as in
    /// PyTorch (and as CUDA's rules for a potentially unsafe call say).
    #[test]
    fn another_threads_new_segment_invalidates_a_global_capture() -> TestResult {
        let (fake, a) = setup(80 * GIB, "", Completion::Manual);
        let s = new_stream(&fake)?;
        let pool = PoolId::for_capture();
        fake.stream_begin_capture(s, CaptureMode::Global)?;
        a.begin_allocate_to_pool(pool, Route::Capture(capture_id(&fake, s)?))?;
        let _x = a.allocate(MIB, s)?; // the capturing thread: relaxed, fine
        assert!(matches!(
            fake.stream_capture_status(s)?,
            CaptureStatus::Active { .. }
        ));
        let other = std::thread::scope(|t| t.spawn(|| a.allocate(MIB, LEGACY)).join());
        let other = other.map_err(|_| "the other thread panicked")?;
        assert!(matches!(other, Err(AllocError::Driver(_))), "{other:?}");
        assert_eq!(fake.stream_capture_status(s)?, CaptureStatus::Invalidated);
        Ok(())
    }

    #[test]
    fn a_capture_allocates_from_its_pool_and_side_streams_follow() -> TestResult {
        let (fake, a) = setup(80 * GIB, "", Completion::Manual);
        let (s, side, other) = (new_stream(&fake)?, new_stream(&fake)?, new_stream(&fake)?);
        let pool = PoolId::for_capture();
        fake.stream_begin_capture(s, CaptureMode::Global)?;
        a.begin_allocate_to_pool(pool, Route::Capture(capture_id(&fake, s)?))?;
        let x = a.allocate(MIB, s)?;
        assert!(
            matches!(fake.stream_capture_status(s)?, CaptureStatus::Active { .. }),
            "the segment's cudaMalloc ran in relaxed mode"
        );
        assert!(
            a.pool_blocks(pool)
                .iter()
                .any(|b| b.ptr == x.ptr && b.allocated)
        );
        // A stream forked into the capture allocates from the pool too.
        let ev = fake.event_create(D0, Default::default())?;
        fake.event_record(ev, s)?;
        fake.stream_wait_event(side, ev)?;
        let y = a.allocate(3 * MIB, side)?;
        assert!(a.pool_blocks(pool).iter().any(|b| b.ptr == y.ptr));
        // An unrelated stream does not.
        let z = a.allocate(MIB, other)?;
        assert!(
            a.pool_blocks(PoolId::DEFAULT)
                .iter()
                .any(|b| b.ptr == z.ptr)
        );
        // Frees inside the capture are reused in capture order.
        a.free(x.ptr)?;
        assert_eq!(a.allocate(MIB, s)?.ptr, x.ptr);
        // A free with another stream's use is deferred: no event work during capture.
        let w = a.allocate(2048, s)?;
        a.record_stream(w.ptr, side)?;
        let (records, queries) = (fake.calls(Call::EventRecord), fake.calls(Call::EventQuery));
        a.free(w.ptr)?;
        assert_eq!(
            (fake.calls(Call::EventRecord), fake.calls(Call::EventQuery)),
            (records, queries)
        );
        a.empty_cache();
        assert_eq!(
            fake.calls(Call::Free),
            0,
            "nothing is freed while capturing"
        );
        fake.event_record(ev, side)?;
        fake.stream_wait_event(s, ev)?;
        let graph = fake.stream_end_capture(s)?;
        a.end_allocate_to_pool(pool)?;
        let _ = a.allocate(512, other)?;
        assert!(
            fake.calls(Call::EventRecord) > records + 1,
            "the deferred free recorded its event after the capture"
        );
        assert_eq!(a.pool_use_count(pool), Some(1));
        a.check_invariants()?;
        fake.graph_destroy(graph)?;
        Ok(())
    }

    #[test]
    fn a_released_pool_is_returned_at_the_next_empty_cache() -> TestResult {
        let (fake, a) = setup(80 * GIB, "", Completion::Eager);
        let pool = PoolId::handle();
        a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
        let x = a.allocate(5 * MIB, LEGACY)?;
        let other_thread = std::thread::scope(|sc| {
            sc.spawn(|| a.allocate(5 * MIB, LEGACY).map(|x| x.ptr))
                .join()
                .expect("thread")
        })?;
        assert!(
            a.pool_blocks(PoolId::DEFAULT)
                .iter()
                .any(|b| b.ptr == other_thread),
            "other threads are not routed"
        );
        a.end_allocate_to_pool(pool)?;
        a.free(other_thread)?;
        a.release_pool(pool)?;
        assert_eq!(a.pool_use_count(pool), Some(0));
        assert!(
            a.pool_blocks(pool)
                .iter()
                .any(|b| b.ptr == x.ptr && b.allocated),
            "outputs outlive their graph"
        );
        a.free(x.ptr)?;
        let frees = fake.calls(Call::Free);
        a.empty_cache();
        assert_eq!(
            fake.calls(Call::Free),
            frees + 2,
            "the pool's segment and the default one"
        );
        assert_eq!(
            (a.pool_use_count(pool), a.pool_blocks(pool).len()),
            (None, 0),
            "the pool is gone"
        );
        a.check_invariants()?;
        Ok(())
    }

    #[test]
    fn pool_requests_are_checked() -> TestResult {
        let (_, a) = setup(80 * GIB, "", Completion::Eager);
        let pool = PoolId::handle();
        assert!(
            a.begin_allocate_to_pool(PoolId::DEFAULT, Route::Stream(LEGACY))
                .is_err()
        );
        a.begin_allocate_to_pool(pool, Route::Stream(LEGACY))?;
        let twice = a
            .begin_allocate_to_pool(pool, Route::Stream(LEGACY))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            twice.starts_with("beginAllocateToPool: already recording to mempool_id"),
            "{twice}"
        );
        a.end_allocate_to_pool(pool)?;
        let again = a
            .end_allocate_to_pool(pool)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            again.starts_with("endAllocatePool: not currently recording to mempool_id"),
            "{again}"
        );
        a.release_pool(pool)?;
        assert!(a.release_pool(pool).is_err());
        assert!(PoolId::handle().0 == 0 && PoolId::for_capture().1 == 0);
        Ok(())
    }
}

/// The per-thread front end (`thread_cache`): what other threads and readers see.
mod thread_cache {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_freed_block_comes_back_and_every_reuse_is_counted() -> TestResult {
        let (_, a) = setup(80 * GIB, "", Completion::Eager);
        let first = a.allocate(MIB, LEGACY)?;
        a.free(first.ptr)?;
        for _ in 0..999 {
            let x = a.allocate(MIB, LEGACY)?;
            assert_eq!(
                x, first,
                "the same block, as PyTorch's free and best fit give"
            );
            a.free(x.ptr)?;
        }
        assert_eq!(stat(&a, "allocation.all.allocated"), 1000);
        assert_eq!(stat(&a, "allocation.small_pool.freed"), 1000);
        assert_eq!(stat(&a, "allocated_bytes.all.allocated"), 1000 * MIB as i64);
        // The remainder of the segment merged and split again every time.
        assert_eq!(stat(&a, "inactive_split.all.allocated"), 1000);
        assert_eq!(stat(&a, "inactive_split.all.current"), 0);
        for _ in 0..500 {
            let x = a.allocate(MIB, LEGACY)?;
            a.free(x.ptr)?;
        }
        assert_eq!(stat(&a, "allocation.all.allocated"), 1500);
        assert_eq!(stat(&a, "allocation.all.current"), 0);
        a.check_invariants()?;
        Ok(())
    }

    /// Runs `f` on a new thread and waits for it: everything before happens-before it, and
    /// it happens-before everything after.
    fn on_another_thread<T: Send>(
        f: impl FnOnce() -> Result<T, AllocError> + Send,
    ) -> Result<T, Box<dyn std::error::Error>> {
        let result =
            std::thread::scope(|s| s.spawn(f).join()).map_err(|_| "the other thread panicked")?;
        Ok(result?)
    }

    /// Thread A frees, then hands over to thread B: B's request sees A's free, as under
    /// PyTorch's one mutex (A's block comes back, not a new piece of the segment).
    #[test]
    fn a_block_freed_before_a_hand_over_serves_the_other_thread() -> TestResult {
        let (_, a) = setup(80 * GIB, "", Completion::Eager);
        let x = a.allocate(MIB, LEGACY)?;
        a.free(x.ptr)?;
        let y = on_another_thread(|| a.allocate(MIB, LEGACY))?;
        assert_eq!(y.ptr, x.ptr);
        assert_eq!(stat(&a, "allocated_bytes.all.peak"), MIB as i64);
        assert_eq!(stat(&a, "active_bytes.all.peak"), MIB as i64);
        assert_eq!(stat(&a, "requested_bytes.all.peak"), MIB as i64);
        a.check_invariants()?;
        Ok(())
    }

    /// Another thread's request after a hand-over processes events first: a block freed
    /// behind `record_stream`, whose stream has since finished, is found by the owner of
    /// the last credit too.
    #[test]
    fn a_request_after_another_threads_record_stream_free_processes_events() -> TestResult {
        let (fake, a) = setup(80 * GIB, "", Completion::Manual);
        let s1 = new_stream(&fake)?;
        let x = a.allocate(MIB, LEGACY)?;
        a.free(x.ptr)?; // parked in this thread's slot
        let y = a.allocate(MIB, LEGACY)?;
        assert_eq!(y.ptr, x.ptr);
        on_another_thread(|| {
            a.record_stream(y.ptr, s1)?;
            a.free(y.ptr)
        })?;
        fake.advance(s1, None)?;
        let z = a.allocate(MIB, LEGACY)?;
        assert_eq!(z.ptr, x.ptr, "the event completed: the block is free again");
        assert_eq!(stat(&a, "active.all.current"), 1);
        a.check_invariants()?;
        Ok(())
    }

    /// A layout change by another thread around a block this thread keeps reusing: the
    /// statistics stay those of the single-lock path.
    #[test]
    fn another_threads_split_around_a_reused_block_keeps_the_books() -> TestResult {
        let run = |config: &str| -> Result<Vec<i64>, Box<dyn std::error::Error>> {
            let (_, a) = setup(80 * GIB, config, Completion::Eager);
            let x = a.allocate(3 * MIB, LEGACY)?;
            a.free(x.ptr)?;
            let x = a.allocate(3 * MIB, LEGACY)?;
            let tail = on_another_thread(|| a.allocate(4 * MIB, LEGACY))?;
            a.free(x.ptr)?;
            let x = a.allocate(3 * MIB, LEGACY)?;
            on_another_thread(|| a.free(tail.ptr))?;
            a.free(x.ptr)?;
            let x = a.allocate(3 * MIB, LEGACY)?;
            let stats = a.stats().to_map();
            a.free(x.ptr)?;
            a.check_invariants()?;
            let mut values: Vec<_> = stats.into_iter().collect();
            values.sort();
            Ok(values.into_iter().map(|(_, v)| v).collect())
        };
        assert_eq!(run("")?, run("thread_cache:False")?);
        Ok(())
    }

    #[test]
    fn a_credited_block_freed_by_another_thread_is_freed_once() -> TestResult {
        let (_, a) = setup(80 * GIB, "", Completion::Eager);
        let x = a.allocate(MIB, LEGACY)?;
        std::thread::scope(|s| s.spawn(|| a.free(x.ptr)).join())
            .map_err(|_| "the freeing thread panicked")??;
        assert!(
            matches!(a.free(x.ptr), Err(AllocError::InvalidPointer(_))),
            "a second free is an error, not a park"
        );
        assert_eq!(stat(&a, "allocation.all.current"), 0);
        let y = a.allocate(MIB, LEGACY)?;
        assert_eq!(y.ptr, x.ptr, "free in the pool again");
        a.check_invariants()?;
        Ok(())
    }

    #[test]
    fn a_parked_block_freed_again_is_an_invalid_pointer() -> TestResult {
        let (_, a) = setup(80 * GIB, "", Completion::Eager);
        let x = a.allocate(4096, LEGACY)?;
        a.free(x.ptr)?;
        assert!(matches!(a.free(x.ptr), Err(AllocError::InvalidPointer(_))));
        // Another thread freeing the parked block is refused the same way.
        let y = a.allocate(4096, LEGACY)?;
        a.free(y.ptr)?;
        let other = std::thread::scope(|s| s.spawn(|| a.free(y.ptr)).join())
            .map_err(|_| "the freeing thread panicked")?;
        assert!(matches!(other, Err(AllocError::InvalidPointer(_))));
        assert_eq!(stat(&a, "allocation.all.current"), 0);
        a.check_invariants()?;
        Ok(())
    }

    #[test]
    fn a_block_parked_by_an_exited_thread_is_freed() -> TestResult {
        let (_, a) = setup(80 * GIB, "", Completion::Eager);
        let x = std::thread::scope(|s| {
            s.spawn(|| -> Result<Allocation, AllocError> {
                let x = a.allocate(12 * MIB, LEGACY)?;
                a.free(x.ptr)?;
                Ok(x)
            })
            .join()
        })
        .map_err(|_| "the thread panicked")??;
        // The reader settles it...
        assert_eq!(stat(&a, "allocation.all.current"), 0);
        assert_eq!(stat(&a, "active_bytes.all.current"), 0);
        // ... and the next request finds it.
        let y = a.allocate(12 * MIB, LEGACY)?;
        assert_eq!(y.ptr, x.ptr);
        assert_eq!(stat(&a, "segment.all.current"), 1);
        a.check_invariants()?;
        Ok(())
    }

    #[test]
    fn a_request_that_would_grow_takes_blocks_other_threads_parked() -> TestResult {
        let (_, a) = setup(80 * GIB, "", Completion::Eager);
        let (parked_tx, parked_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let found = std::thread::scope(|s| -> Result<DevicePtr, AllocError> {
            let a = &a;
            s.spawn(move || -> Result<(), AllocError> {
                let x = a.allocate(12 * MIB, LEGACY)?;
                a.free(x.ptr)?; // parked: this thread is still alive
                parked_tx.send(x.ptr).ok();
                done_rx.recv().ok();
                Ok(())
            });
            let parked = parked_rx.recv().unwrap_or(DevicePtr(0));
            let y = a.allocate(12 * MIB, LEGACY)?;
            done_tx.send(()).ok();
            assert_eq!(y.ptr, parked, "no new segment while a parked block fits");
            Ok(y.ptr)
        })?;
        assert_ne!(found, DevicePtr(0));
        assert_eq!(stat(&a, "num_device_alloc"), 1);
        a.check_invariants()?;
        Ok(())
    }

    /// The other thread of [`freed_during_next`], to join once the call has returned.
    type Freeing = std::thread::JoinHandle<Result<(), AllocError>>;

    /// Has another thread allocate a block with `prepare` and free it while this thread is
    /// inside its next driver call of kind `call` (the allocator's lock released). Returns
    /// the block's address and the other thread, to join once that call has returned.
    fn freed_during_next(
        fake: &FakeDriver,
        a: &Arc<CachingAllocator>,
        call: Call,
        prepare: impl FnOnce(&CachingAllocator) -> Result<DevicePtr, AllocError> + Send + 'static,
    ) -> Result<(DevicePtr, Freeing), Box<dyn std::error::Error>> {
        let (ptr_tx, ptr_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let other = {
            let a = a.clone();
            std::thread::spawn(move || -> Result<(), AllocError> {
                let ptr = prepare(&a)?;
                a.allocate(512, LEGACY)?; // the slot's credit moves on: the free takes the lock
                ptr_tx.send(ptr).ok();
                go_rx.recv().ok();
                a.free(ptr)?;
                done_tx.send(()).ok();
                Ok(())
            })
        };
        let ptr = ptr_rx
            .recv()
            .map_err(|_| "the other thread stopped before its free")?;
        fake.before_next(call, move || {
            go_tx.send(()).ok();
            done_rx.recv().ok();
        });
        Ok((ptr, other))
    }

    /// While a request waits for the driver (the allocator's lock released), another
    /// thread frees a block that fits it better. PyTorch's free of the new block followed by
    /// the same request would find that block, so the new one is not credited: the
    /// request's next round gets the better block, not its own freed one.
    #[test]
    fn a_block_freed_during_a_driver_call_wins_the_next_round() -> TestResult {
        let (fake, a) = setup(80 * GIB, "", Completion::Eager);
        let a = Arc::new(a);
        let (better, other) = freed_during_next(&fake, &a, Call::Malloc, |a| {
            Ok(a.allocate(12 * MIB, LEGACY)?.ptr)
        })?;
        let x = a.allocate(12 * MIB, LEGACY)?; // a new segment; `better` is freed meanwhile
        other.join().map_err(|_| "the other thread panicked")??;
        assert_ne!(x.ptr, better);
        next_round_gets(
            &a,
            x,
            better,
            "best fit: the lower of two equal free blocks",
        )
    }

    /// With expandable segments, a block at the mapped frontier loses to a free interior
    /// block that fits, even a larger one (spec §4.5): when another thread frees such a block
    /// while this one maps pages (lock released), the block just mapped gets no credit, and
    /// its next round goes to the interior block as in PyTorch.
    #[test]
    fn an_interior_block_freed_while_mapping_wins_over_the_frontier() -> TestResult {
        let (fake, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
        let a = Arc::new(a);
        let (interior, other) = freed_during_next(&fake, &a, Call::VmMap, |a| {
            let interior = a.allocate(50 * MIB, LEGACY)?; // three 20 MiB pages...
            a.allocate(10 * MIB, LEGACY)?; // ... filled up to the frontier
            Ok(interior.ptr)
        })?;
        // Two more pages: the block ends 15 MiB short of the new frontier.
        let x = a.allocate(25 * MIB, LEGACY)?;
        other.join().map_err(|_| "the other thread panicked")??;
        assert_eq!(x.ptr, interior.offset(60 * MIB));
        next_round_gets(
            &a,
            x,
            interior,
            "the interior block, which cannot grow, before the frontier, which can",
        )
    }

    /// Frees `x` and asks for its bytes again: the block at `want` must come back.
    fn next_round_gets(
        a: &CachingAllocator,
        x: Allocation,
        want: DevicePtr,
        why: &str,
    ) -> TestResult {
        a.free(x.ptr)?;
        let again = a.allocate(x.requested, LEGACY)?;
        assert_eq!(again.ptr, want, "{why}");
        a.check_invariants()?;
        Ok(())
    }

    #[test]
    fn many_threads_keep_exact_books() -> TestResult {
        let (_, a) = setup(80 * GIB, "", Completion::Eager);
        let a = Arc::new(a);
        let done = std::sync::atomic::AtomicBool::new(false);
        let ops: i64 = std::thread::scope(|s| {
            // A reader settling every slot again and again while the workers run.
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let live = a.stats().allocation.all.current;
                    assert!((0..=8 * 10).contains(&live), "{live} live blocks");
                    a.reset_peak_stats();
                    std::thread::yield_now();
                }
            });
            let workers: Vec<_> = (0..8u64)
                .map(|t| {
                    let a = a.clone();
                    s.spawn(move || -> Result<i64, AllocError> {
                        let mut held = Vec::new();
                        let mut count = 0;
                        for i in 0..20_000u64 {
                            // Mostly pairs (the thread cache), some blocks kept a while.
                            let x = a.allocate(512 << ((i * 7 + t) % 13), LEGACY)?;
                            count += 1;
                            if i % 5 == 0 {
                                held.push(x.ptr);
                            } else {
                                a.free(x.ptr)?;
                            }
                            if held.len() > 8 {
                                a.free(held.remove(0))?;
                            }
                        }
                        held.into_iter().try_for_each(|p| a.free(p))?;
                        Ok(count)
                    })
                })
                .collect();
            let total = workers
                .into_iter()
                .map(|w| w.join().unwrap_or_else(|_| panic!("a worker panicked")))
                .sum::<Result<i64, AllocError>>();
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            total
        })?;
        assert_eq!(stat(&a, "allocation.all.allocated"), ops);
        assert_eq!(stat(&a, "allocation.all.freed"), ops);
        assert_eq!(stat(&a, "allocation.all.current"), 0);
        assert_eq!(stat(&a, "active_bytes.all.current"), 0);
        a.check_invariants()?;
        Ok(())
    }
}

mod devices {
    use super::*;
    use ferrocuda_alloc::DeviceAllocators;
    use ferrocuda_driver::DriverError;
    use ferrocuda_stream::{MemoryResource, StreamError};
    use ferrocuda_types::DeviceIndex;

    /// PyTorch's `NativeCachingAllocator::assertValidDevice`, typed; the memory resource
    /// hands the stream layer its own invalid-device error.
    #[test]
    fn a_device_past_the_last_is_no_such_device() -> TestResult {
        let fake = Arc::new(FakeDriver::builder().devices(2).build());
        let allocators = DeviceAllocators::new(fake, AllocatorConfig::default(), Caching::On);
        let err = allocators.device(DeviceIndex(2)).err();
        assert_eq!(
            err,
            Some(AllocError::NoSuchDevice {
                device: 2,
                count: 2
            })
        );
        assert_eq!(
            err.map(|e| e.to_string()).as_deref(),
            Some("Invalid device argument 2: did you call init?")
        );
        let d2 = DeviceIndex(2);
        assert_eq!(
            allocators.allocate(d2, 1, StreamHandle::legacy(d2)),
            Err(StreamError::InvalidDevice { index: 2, count: 2 })
        );
        Ok(())
    }

    #[test]
    fn without_devices_the_driver_says_why() -> TestResult {
        let fake = Arc::new(FakeDriver::builder().devices(0).build());
        let allocators = DeviceAllocators::new(fake, AllocatorConfig::default(), Caching::On);
        let reason = DriverError::NO_DEVICE;
        assert_eq!(
            allocators.device(D0).err(),
            Some(AllocError::NotAvailable { reason })
        );
        assert_eq!(
            allocators.free(D0, DevicePtr(0x1000)),
            Err(StreamError::NotAvailable { reason })
        );
        Ok(())
    }
}
