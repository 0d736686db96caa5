//! The `backend:cudaMallocAsync` allocator on the fake device: PyTorch's
//! `CudaMallocAsyncAllocator` (c10/cuda/CUDAMallocAsyncAllocator.cpp) with exact figures of
//! the fake's pool (blocks of 2 MiB multiples).
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use ferrocuda_alloc::{AllocError, AsyncAllocator};
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver, fake::Completion};
use ferrocuda_types::{CaptureMode, DeviceIndex, DevicePtr, MemsetValue};
use std::sync::Arc;

use crate::common;
use common::{D0, GIB, LEGACY, MIB, TestResult, new_stream};

fn setup(capacity: u64, completion: Completion) -> (Arc<FakeDriver>, Arc<AsyncAllocator>) {
    let fake = Arc::new(
        FakeDriver::builder()
            .capacity(capacity)
            .completion(completion)
            .build(),
    );
    let a = AsyncAllocator::new(fake.clone());
    (fake, a)
}

fn stat(a: &AsyncAllocator, key: &str) -> i64 {
    a.stats(D0).unwrap_or_else(|e| panic!("{e}")).to_map()[key]
}

/// Work that stays pending on `s` in manual mode.
fn busy(fake: &FakeDriver, ptr: DevicePtr, s: ferrocuda_types::StreamHandle) {
    fake.memset_async(ptr, MemsetValue::U8(1), 16, s).unwrap();
}

#[test]
fn only_pool_statistics_are_real_and_freed_memory_stays_reserved() -> TestResult {
    let (fake, a) = setup(80 * GIB, Completion::Eager);
    assert_eq!(a.name(), "cudaMallocAsync");
    // A device not used yet reports zeros without asking the driver.
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(fake.calls(Call::MemPoolUsage), 0);
    let x = a.allocate(D0, 3 * MIB, LEGACY)?;
    // lazy_init_device: the pool keeps everything.
    assert_eq!(fake.calls(Call::MemPoolSetReleaseThreshold), 1);
    for (k, v) in [
        ("allocated_bytes.all.current", 4 * MIB as i64),
        ("active_bytes.all.current", 4 * MIB as i64),
        ("reserved_bytes.all.current", 4 * MIB as i64),
        ("allocation.all.current", 0),
        ("segment.all.current", 0),
        ("allocated_bytes.small_pool.current", 0),
        ("requested_bytes.all.current", 0),
        ("num_alloc_retries", 0),
        ("num_device_alloc", 0),
    ] {
        assert_eq!(stat(&a, k), v, "{k}");
    }
    a.free(x)?;
    assert_eq!(stat(&a, "allocated_bytes.all.current"), 0);
    assert_eq!(stat(&a, "allocated_bytes.all.peak"), 4 * MIB as i64);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 4 * MIB as i64);
    a.reset_peak_stats(D0)?;
    assert_eq!(stat(&a, "allocated_bytes.all.peak"), 0);
    assert_eq!(stat(&a, "reserved_bytes.all.peak"), 4 * MIB as i64);
    // emptyCache synchronizes and trims.
    a.empty_cache()?;
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 0);
    assert_eq!(fake.calls(Call::MemPoolTrimTo), 1);
    assert_eq!(fake.mem_get_info(D0)?.0, 80 * GIB);
    Ok(())
}

#[test]
fn a_pool_without_the_threshold_gives_completed_frees_back() -> TestResult {
    // The driver's default threshold (0), which the backend raises to u64::MAX.
    let fake = FakeDriver::default();
    let p = fake.mem_alloc_async(D0, MIB, LEGACY)?;
    fake.mem_free_async(p, LEGACY)?;
    assert_eq!(fake.mem_pool_usage(D0)?.reserved, 0);
    fake.mem_pool_set_release_threshold(D0, u64::MAX)?;
    let p = fake.mem_alloc_async(D0, MIB, LEGACY)?;
    fake.mem_free_async(p, LEGACY)?;
    let u = fake.mem_pool_usage(D0)?;
    assert_eq!((u.reserved, u.used, u.used_high), (2 * MIB, 0, 2 * MIB));
    Ok(())
}

#[test]
fn freed_memory_is_reused_at_once_on_its_stream_and_on_others_once_complete() -> TestResult {
    let (fake, a) = setup(80 * GIB, Completion::Manual);
    let (s1, s2) = (new_stream(&fake)?, new_stream(&fake)?);
    let x = a.allocate(D0, MIB, s1)?;
    busy(&fake, x, s1);
    a.free(x)?;
    assert_eq!(a.allocate(D0, MIB, s1)?, x, "same stream: at once");
    a.free(x)?;
    let y = a.allocate(D0, MIB, s2)?;
    assert_ne!(y, x, "other stream: not before the free completes");
    fake.advance(s1, None)?;
    assert_eq!(a.allocate(D0, MIB, s2)?, x, "other stream: once complete");
    Ok(())
}

#[test]
fn record_stream_frees_on_the_unifying_stream_after_every_usage_stream() -> TestResult {
    let (fake, a) = setup(80 * GIB, Completion::Manual);
    let (s1, s2) = (new_stream(&fake)?, new_stream(&fake)?);
    let x = a.allocate(D0, MIB, s1)?;
    a.record_stream(x, s1)?;
    assert_eq!(
        a.take_warnings(),
        [
            "Called record_stream on tensor whose original creation stream matches the recorded stream. This is unnecessary and has no effect."
        ]
    );
    a.record_stream(x, s2)?;
    a.record_stream(x, s2)?;
    busy(&fake, x, s2);
    let (records, waits) = (
        fake.calls(Call::EventRecord),
        fake.calls(Call::StreamWaitEvent),
    );
    a.free(x)?;
    // sync_raw(creation → unifying), then once per recorded stream (a set).
    assert_eq!(fake.calls(Call::EventRecord) - records, 2);
    assert_eq!(fake.calls(Call::StreamWaitEvent) - waits, 2);
    assert_eq!(fake.calls(Call::MemFreeAsync), 1);
    // Not even the creation stream gets it back while s2 is busy.
    assert_ne!(a.allocate(D0, MIB, s1)?, x);
    fake.advance(s2, None)?;
    fake.advance_all();
    assert_eq!(a.allocate(D0, MIB, s1)?, x);
    Ok(())
}

#[test]
fn memory_fraction_is_enforced_by_the_allocators_own_count_with_pytorchs_text() -> TestResult {
    let (fake, a) = setup(8 * GIB, Completion::Eager);
    a.set_memory_fraction(0.5, D0)?;
    let x = a.allocate(D0, 3 * GIB, LEGACY)?;
    let e = a.allocate(D0, 2 * GIB, LEGACY).unwrap_err();
    assert_eq!(
        e.to_string(),
        "Allocation on device 0 would exceed allowed memory. (out of memory)\n\
         Currently allocated     : 3.00 GiB\n\
         Requested               : 2.00 GiB\n\
         Device limit            : 8.00 GiB\n\
         Free (according to CUDA): 5.00 GiB\n\
         PyTorch limit (set by user-supplied memory fraction)\n\
         \x20                       : 4.00 GiB"
    );
    // Refused by the count: the pool was not asked, nothing was trimmed.
    assert_eq!(fake.calls(Call::MemAllocAsync), 1);
    assert_eq!(fake.calls(Call::MemPoolTrimTo), 0);
    a.free(x)?;
    assert!(a.allocate(D0, 4 * GIB, LEGACY).is_ok());
    assert!(matches!(
        a.set_memory_fraction(1.5, D0),
        Err(AllocError::InvalidFraction(_))
    ));
    Ok(())
}

#[test]
fn pool_out_of_memory_trims_and_retries_once() -> TestResult {
    let (fake, a) = setup(8 * GIB, Completion::Eager);
    let x = a.allocate(D0, 6 * GIB, LEGACY)?;
    a.free(x)?;
    // 6 GiB stay reserved; 7 more do not fit until the pool is trimmed.
    let syncs = fake.calls(Call::StreamSynchronize);
    let y = a.allocate(D0, 7 * GIB, LEGACY)?;
    assert_eq!(fake.calls(Call::StreamSynchronize) - syncs, 1);
    assert_eq!(fake.calls(Call::MemPoolTrimTo), 1);
    assert_eq!(fake.calls(Call::MemAllocAsync), 3);
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 7 * GIB as i64);
    let e = a.allocate(D0, 2 * GIB, LEGACY).unwrap_err();
    assert_eq!(fake.calls(Call::MemAllocAsync), 5, "one retry only");
    assert!(matches!(e, AllocError::PoolOutOfMemory(_)));
    assert_eq!(
        e.to_string().lines().last(),
        Some("                        : 17179869184.00 GiB")
    );
    a.free(y)?;
    Ok(())
}

#[test]
fn capture_rules() -> TestResult {
    let (fake, a) = setup(80 * GIB, Completion::Eager);
    let s = new_stream(&fake)?;
    let before = a.allocate(D0, MIB, s)?;
    assert!(matches!(
        a.end_allocate_to_pool(s),
        Err(AllocError::NoCaptureUnderway)
    ));
    a.begin_allocate_to_pool(D0)?;
    assert_eq!(
        a.begin_allocate_to_pool(D0).unwrap_err().to_string(),
        "Only one capture at a time is allowed in a process."
    );
    let during = a.allocate(D0, MIB, s)?;
    // An uncaptured pointer freed during the capture waits for its end (warning once).
    a.free(before)?;
    assert_eq!(fake.calls(Call::MemFreeAsync), 0);
    // One allocated during the capture is freed at once.
    let other = a.allocate(D0, MIB, LEGACY)?;
    a.free(other)?;
    assert_eq!(fake.calls(Call::MemFreeAsync), 1);
    let w = a.take_warnings();
    assert_eq!(w.len(), 1);
    assert!(w[0].starts_with(
        "freeAsync() was called on an uncaptured allocation during graph capture (address = 0x"
    ));
    a.free(during)?;
    assert_eq!(fake.calls(Call::MemFreeAsync), 2);
    // The capture's free streams are joined into the capture stream at its end.
    let waits = fake.calls(Call::StreamWaitEvent);
    a.end_allocate_to_pool(s)?;
    assert_eq!(fake.calls(Call::StreamWaitEvent) - waits, 2, "LEGACY and s");
    assert!(!a.capture_underway());
    // The deferred frees run at the next allocation.
    let _next = a.allocate(D0, MIB, s)?;
    assert_eq!(fake.calls(Call::MemFreeAsync), 3);
    // A captured pointer freed outside a capture: allowed, with PyTorch's warning.
    a.begin_allocate_to_pool(D0)?;
    let kept = a.allocate(D0, MIB, s)?;
    a.end_allocate_to_pool(s)?;
    a.free(kept)?;
    let w = a.take_warnings();
    assert!(
        w[0].starts_with("Attempting uncaptured free of a captured allocation with address 0x"),
        "{w:?}"
    );
    Ok(())
}

/// A capture that is the allocator's first use of a device sets the device up before it
/// begins: the release threshold cannot be set once the driver is capturing.
#[test]
fn a_capture_sets_up_an_unused_device_before_it_begins() -> TestResult {
    let (fake, a) = setup(80 * GIB, Completion::Eager);
    let s = new_stream(&fake)?;
    assert!(matches!(
        a.begin_allocate_to_pool(DeviceIndex(7)),
        Err(AllocError::AsyncNoSuchDevice { device: 7, .. })
    ));
    assert_eq!(fake.calls(Call::MemPoolSetReleaseThreshold), 0);
    a.begin_allocate_to_pool(D0)?;
    assert_eq!(fake.calls(Call::MemPoolSetReleaseThreshold), 1);
    fake.stream_begin_capture(s, CaptureMode::ThreadLocal)?;
    let during = a.allocate(D0, MIB, s)?;
    assert_eq!(fake.calls(Call::MemPoolSetReleaseThreshold), 1);
    assert!(matches!(
        a.stats(D0),
        Err(AllocError::Driver(e)) if e == DriverError::STREAM_CAPTURE_UNSUPPORTED
    ));
    a.end_allocate_to_pool(s)?;
    assert_eq!(
        fake.stream_end_capture(s).unwrap_err(),
        DriverError::STREAM_CAPTURE_INVALIDATED,
        "a pool call during the capture invalidated it"
    );
    assert!(a.stats(D0).is_ok());
    let _ = during;
    Ok(())
}

#[test]
fn unsupported_functions_and_bad_input_are_pytorchs_errors() -> TestResult {
    let (_fake, a) = setup(80 * GIB, Completion::Eager);
    assert_eq!(
        a.snapshot().unwrap_err().to_string(),
        "Calling snapshot with backend:cudaMallocAsync is not meaningful. (For backend:native, snapshot returns a detailed summary of all blocks tracked by the allocator, but the cudaMallocAsync backend does not track individual blocks.)"
    );
    assert_eq!(
        AsyncAllocator::unsupported("recordHistory").to_string(),
        "cudaMallocAsync does not yet support recordHistory. If you need it, please file an issue describing your use case."
    );
    a.reset_accumulated_stats(D0)?;
    a.reset_accumulated_stats(D0)?;
    assert_eq!(
        a.take_warnings(),
        ["For backend:cudaMallocAsync, resetAccumulatedStats has no effect."]
    );
    assert_eq!(a.allocate(D0, 0, LEGACY)?, DevicePtr(0));
    a.record_stream(DevicePtr(0), LEGACY)?;
    assert_eq!(
        a.allocate(D0, 1 << 60, LEGACY).unwrap_err().to_string(),
        "CUDA out of memory. Tried to allocate more than 1EB memory."
    );
    assert!(matches!(
        a.free(DevicePtr(0x1234)),
        Err(AllocError::InvalidPointer(_))
    ));
    assert!(matches!(
        a.stats(ferrocuda_types::DeviceIndex(3)),
        Err(AllocError::AsyncNoSuchDevice {
            device: 3,
            count: 1
        })
    ));
    let x = a.allocate(D0, 1000, LEGACY)?;
    assert_eq!(a.base_allocation(x)?, (x, 1000));
    Ok(())
}

/// `backend:cudaMallocAsync` parses (it selects this allocator); the caching allocator
/// refuses it, made or re-configured, with PyTorch's assertion text.
#[test]
fn the_backend_key_selects_and_the_native_allocator_refuses_it() -> TestResult {
    let config = ferrocuda_types::AllocatorConfig::parse("backend:cudaMallocAsync")?;
    assert_eq!(
        config.backend,
        ferrocuda_types::AllocatorBackend::CudaMallocAsync
    );
    let fake = Arc::new(FakeDriver::default());
    let e = ferrocuda_alloc::CachingAllocator::new(
        fake.clone(),
        D0,
        config,
        ferrocuda_alloc::Caching::On,
    )
    .unwrap_err();
    let text = "Allocator backend parsed at runtime != allocator backend parsed at load time";
    assert_eq!(e.to_string(), text);
    let native = ferrocuda_alloc::CachingAllocator::new(
        fake,
        D0,
        Default::default(),
        ferrocuda_alloc::Caching::On,
    )?;
    native.update_config("backend:native")?;
    let e = native.update_config("backend:cudaMallocAsync").unwrap_err();
    assert_eq!(e.to_string(), text);
    assert_eq!(
        native.config().backend,
        ferrocuda_types::AllocatorBackend::Native
    );
    Ok(())
}

/// PyTorch's keys of the caching allocator beside `backend:cudaMallocAsync` are accepted
/// and ignored, with PyTorch's warning once per string (CUDAAllocatorConfig::parseArgs);
/// so are the pinned keys PyTorch's CUDA parser warns for, which still go to the host
/// allocator; ferrocuda's own keys are refused.
#[test]
fn pytorchs_keys_beside_the_backend_are_ignored_with_pytorchs_warning() -> TestResult {
    let fake: Arc<dyn Driver> = Arc::new(FakeDriver::builder().build());
    let parse = |s: &str| ferrocuda_types::AllocatorConfig::parse(s);
    let warning = "backend:cudaMallocAsync ignores max_split_size_mb,roundup_power2_divisions, and garbage_collect_threshold.";
    assert_eq!(ferrocuda_alloc::ASYNC_IGNORES_WARNING, warning);
    for s in [
        "backend:cudaMallocAsync,max_split_size_mb:100",
        "backend:cudaMallocAsync,garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,>:4]",
        "release_lock_on_cudamalloc:True,backend:cudaMallocAsync",
        "backend:cudaMallocAsync,expandable_segments:True,max_non_split_rounding_mb:64",
        "backend:cudaMallocAsync,per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True",
        "backend:cudaMallocAsync,graph_capture_record_stream_reuse:True",
        "backend:cudaMallocAsync,pinned_num_register_threads:4,pinned_max_cached_size_mb:8",
        "backend:cudaMallocAsync,pinned_use_cuda_host_register:False",
    ] {
        let a = AsyncAllocator::from_config(fake.clone(), &parse(s)?)
            .unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(a.take_warnings(), [warning], "{s}");
        a.allocate(D0, MIB, LEGACY)?;
    }
    // The backend alone, and the pinned keys PyTorch's generic parser reads: no warning.
    for s in [
        "backend:cudaMallocAsync",
        "backend:cudaMallocAsync,pinned_use_background_threads:True,pinned_max_round_threshold_mb:4",
    ] {
        let a = AsyncAllocator::from_config(fake.clone(), &parse(s)?)?;
        assert!(a.take_warnings().is_empty(), "{s}");
    }
    // At run time too, once per string.
    let a = AsyncAllocator::from_config(fake.clone(), &parse("backend:cudaMallocAsync")?)?;
    a.update_config("max_split_size_mb:100,garbage_collection_threshold:0.5")?;
    a.update_config("backend:cudaMallocAsync")?;
    assert_eq!(a.take_warnings(), [warning]);
    // ferrocuda's own keys: refused, naming the key.
    for (s, key) in [
        ("backend:cudaMallocAsync,thread_cache:False", "thread_cache"),
        (
            "cross_stream_reuse:True,backend:cudaMallocAsync",
            "cross_stream_reuse",
        ),
        (
            "backend:cudaMallocAsync,ferrocuda_recommended:True",
            "ferrocuda_recommended",
        ),
    ] {
        match AsyncAllocator::from_config(fake.clone(), &parse(s)?) {
            Err(e @ AllocError::AsyncFerrocudaOnly { .. }) => assert!(
                e.to_string().starts_with(&format!(
                    "backend:cudaMallocAsync has no use for {key}, an option of ferrocuda's"
                )),
                "{s}: {e}"
            ),
            other => panic!("{s}: {other:?}"),
        }
    }
    assert!(matches!(
        a.update_config("oom_release_partial:True"),
        Err(AllocError::AsyncFerrocudaOnly { .. })
    ));
    Ok(())
}

/// Past the last device, PyTorch's `assertValidDevice` text of this backend.
#[test]
fn an_invalid_device_is_pytorchs_invalid_device_argument() -> TestResult {
    let (_fake, a) = setup(80 * GIB, Completion::Eager);
    let bad = DeviceIndex(3);
    for e in [
        a.stats(bad).err(),
        a.reset_peak_stats(bad).err(),
        a.reset_accumulated_stats(bad).err(),
        a.set_memory_fraction(0.5, bad).err(),
        a.allocate(bad, MIB, LEGACY).err(),
        a.begin_allocate_to_pool(bad).err(),
    ] {
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("Invalid device argument.")
        );
    }
    // Serving buffers, it is the stream layer's invalid device, with its numbers.
    let e = ferrocuda_stream::StreamError::from(AllocError::AsyncNoSuchDevice {
        device: 3,
        count: 1,
    });
    assert_eq!(
        e,
        ferrocuda_stream::StreamError::InvalidDevice { index: 3, count: 1 }
    );
    Ok(())
}

/// During a real stream capture the driver makes graph memory: outside the pool (whose
/// figures, the statistics, do not move), freed by a free node or outside the graph, made
/// again by each launch; a captured free of pool memory is refused by the driver, which is
/// why the allocator defers it.
#[test]
fn captured_allocations_are_graph_memory_outside_the_pool() -> TestResult {
    use ferrocuda_types::GraphNode;
    let (fake, a) = setup(80 * GIB, Completion::Eager);
    let s = new_stream(&fake)?;
    let before = a.allocate(D0, MIB, s)?;
    let allocated = stat(&a, "allocated_bytes.all.current");
    let reserved = stat(&a, "reserved_bytes.all.current");
    a.begin_allocate_to_pool(D0)?;
    fake.stream_begin_capture(s, CaptureMode::ThreadLocal)?;
    let out = a.allocate(D0, 3 * MIB, s)?;
    let scratch = a.allocate(D0, MIB, s)?;
    fake.memset_async(scratch, MemsetValue::U8(7), 16, s)?;
    a.free(scratch)?;
    a.free(before)?;
    assert_eq!(
        fake.mem_free_async(before, s),
        Err(DriverError::INVALID_VALUE),
        "a free node frees graph memory only"
    );
    let graph = fake.stream_end_capture(s)?;
    a.end_allocate_to_pool(s)?;
    // Read after the capture: the driver refuses the pool's attributes during one.
    assert_eq!(
        (
            stat(&a, "allocated_bytes.all.current"),
            stat(&a, "reserved_bytes.all.current")
        ),
        (allocated, reserved),
        "graph memory is not the pool's"
    );
    let memory_nodes = fake
        .graph_nodes(graph)?
        .into_iter()
        .filter(|n| {
            *n == GraphNode::Opaque {
                what: "graph memory allocation or free",
            }
        })
        .count();
    assert_eq!(memory_nodes, 3, "two allocations and one free");
    let exec = fake.graph_instantiate(graph)?;
    fake.graph_launch(exec, s)?;
    fake.graph_launch(exec, s)?;
    // The graph's output freed outside it (PyTorch's warning), then once too often.
    a.free(out)?;
    assert!(a.take_warnings()[1].starts_with("Attempting uncaptured free"));
    assert_eq!(fake.mem_free_async(out, s), Err(DriverError::INVALID_VALUE));
    // A launch allocates it again, at the same address.
    fake.graph_launch(exec, s)?;
    fake.mem_free_async(out, s)?;
    // The deferred free of `before` ran at this allocation, outside the capture.
    let _next = a.allocate(D0, MIB, s)?;
    assert_eq!(stat(&a, "allocated_bytes.all.current"), allocated);
    Ok(())
}
