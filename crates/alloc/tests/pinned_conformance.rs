//! Pinned host memory, written once over a backend: the fake device (manual completion) in
//! CI, the real driver in the GPU bundle. The driver's register path (`host_malloc`,
//! pre-fault, `cuMemHostRegister`), [`PinnedBuffer`]s with non-blocking copies through the
//! caching host allocator, PyTorch's `test_caching_pinned_memory` (a block is not reused
//! while a copy from it is pending), `test_pinned_memory_with_cudaregister` (1 and 4
//! threads), `test_pinned_memory_empty_cache`, and a CUDA graph capture that copies from a
//! pinned buffer of the capture's private pool, replayed after the buffer changed.
#![forbid(unsafe_code)]
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_driver::DriverError;
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::{DeviceBuffer, PinnedBuffer};
use ferrocuda_testkit::{Harness, SPIN_CYCLES_PER_MS};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
const MIB: usize = 1 << 20;

/// The harness's runtime served by caching allocators configured with `config`.
fn installed(
    h: &Harness,
    config: &str,
) -> Result<Arc<DeviceAllocators>, Box<dyn std::error::Error>> {
    let allocators = DeviceAllocators::new(
        h.rt.driver().clone(),
        AllocatorConfig::parse(config)?,
        Caching::On,
    );
    allocators.install(&h.rt);
    Ok(allocators)
}

fn host_stat(a: &DeviceAllocators, key: &str) -> i64 {
    a.host().stats().to_map()[key]
}

fn pattern(n: usize, seed: u32) -> Vec<i32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as i32)
        .collect()
}

/// The driver's register path: malloc, pre-fault, register, pinned copies both ways,
/// unregister, free; and its refusals.
fn driver_register_path(h: &Harness) -> TestResult {
    let d = h.rt.driver();
    let bytes = 3 * MIB as u64 + 100;
    let p = d.host_malloc(bytes)?;
    d.host_prefault(p, 0, bytes / 2, 4096)?;
    d.host_prefault(p, bytes / 2, bytes - bytes / 2, 4096)?;
    assert_eq!(
        d.host_prefault(p, 0, bytes + 1, 4096),
        Err(DriverError::INVALID_VALUE)
    );
    d.host_register(p)?;
    assert_eq!(
        d.host_register(p),
        Err(DriverError::HOST_MEMORY_ALREADY_REGISTERED)
    );
    assert_eq!(
        d.host_free(p),
        Err(DriverError::INVALID_VALUE),
        "not cuMemHostAlloc's"
    );
    let data: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    d.host_write(p, 0, &data)?;
    let dev = DeviceBuffer::<u8>::uninit(&h.rt, D0, bytes as usize)?;
    let s = h.rt.default_stream(D0)?;
    d.memcpy_htod_pinned_async(dev.ptr(), (p, 0), bytes, s.handle())?;
    s.synchronize()?;
    d.host_write(p, 0, &vec![0; bytes as usize])?;
    d.memcpy_dtoh_pinned_async((p, 0), dev.ptr(), bytes, s.handle())?;
    s.synchronize()?;
    let mut back = vec![0; bytes as usize];
    d.host_read(p, 0, &mut back)?;
    assert!(back == data, "the round trip through registered memory");
    assert_eq!(
        d.host_mfree(p),
        Err(DriverError::INVALID_VALUE),
        "still registered"
    );
    d.host_unregister(p)?;
    assert_eq!(
        d.host_unregister(p),
        Err(DriverError::HOST_MEMORY_NOT_REGISTERED)
    );
    d.host_mfree(p)?;
    assert_eq!(
        d.host_mfree(p),
        Err(DriverError::INVALID_VALUE),
        "freed once"
    );
    Ok(())
}

/// `pin_memory()` and `copy_(non_blocking=True)` both ways, through the caching host
/// allocator, with its statistics.
fn pinned_buffers_round_trip(h: &Harness) -> TestResult {
    let a = installed(h, "")?;
    let data = pattern(10 * 1024, 7);
    let pinned = PinnedBuffer::from_slice(&h.rt, &data)?;
    assert_eq!(
        pinned.range().map(|r| r.bytes),
        Some(64 * 1024),
        "rounded up"
    );
    let dev = DeviceBuffer::<i32>::uninit(&h.rt, D0, data.len())?;
    pinned.copy_to_device(&dev, true)?;
    assert!(dev.to_host()? == data);
    let back = PinnedBuffer::<i32>::uninit(&h.rt, data.len())?;
    back.copy_from_device(&dev, true)?;
    h.rt.current_stream(D0)?.synchronize()?;
    assert!(back.to_vec()? == data);
    assert_eq!(host_stat(&a, "active_requests.current"), 2);
    drop((pinned, back));
    h.rt.synchronize(D0)?;
    let again = PinnedBuffer::<i32>::uninit(&h.rt, data.len())?;
    assert_eq!(host_stat(&a, "num_host_alloc"), 2, "served from the cache");
    drop(again);
    h.rt.synchronize(D0)?;
    a.host().empty_cache()?;
    assert_eq!(host_stat(&a, "allocations.current"), 0);
    assert_eq!(host_stat(&a, "num_host_free"), 2);
    a.host().check_invariants()?;
    Ok(())
}

/// PyTorch's `test_caching_pinned_memory`: a freed pinned block is reused, but not while
/// a non-blocking copy from it is still pending.
fn pinned_block_waits_for_its_copy(h: &Harness) -> TestResult {
    let a = installed(h, "")?;
    let s = h.rt.new_stream(D0, 0)?;
    let _current = h.rt.stream_guard(&s)?;
    let first = PinnedBuffer::from_slice(&h.rt, &[1i32; 1024])?;
    let addr = first.range().map(|r| r.addr());
    drop(first);
    let second = PinnedBuffer::<i32>::uninit(&h.rt, 1024)?;
    assert_eq!(second.range().map(|r| r.addr()), addr, "cached and reused");
    second.write(&[2; 1024])?;
    let spin = h.module()?.function("spin")?;
    let cycles = 200 * SPIN_CYCLES_PER_MS;
    s.launch(
        &spin,
        &LaunchConfig::for_elements(1, 1),
        &[KernelArg::value(&cycles)],
    )?;
    let dev = DeviceBuffer::<i32>::uninit(&h.rt, D0, 1024)?;
    second.copy_to_device(&dev, true)?;
    drop(second);
    let third = PinnedBuffer::<i32>::uninit(&h.rt, 1024)?;
    assert_ne!(third.range().map(|r| r.addr()), addr, "the copy is pending");
    s.synchronize()?;
    drop(third);
    // The copy's event completed: its block, freed after the third's, is the newest.
    let fourth = PinnedBuffer::<i32>::uninit(&h.rt, 1024)?;
    assert_eq!(
        fourth.range().map(|r| r.addr()),
        addr,
        "reused once the copy is done"
    );
    assert!(
        dev.to_host()? == vec![2; 1024],
        "the copy read the data written before it"
    );
    assert_eq!(host_stat(&a, "allocations.current"), 2);
    a.host().check_invariants()?;
    Ok(())
}

/// PyTorch's `test_pinned_memory_with_cudaregister`: 2 MiB and 16 MiB buffers pinned by
/// `cudaHostRegister` with 8 pre-fault threads hold and copy data.
fn register_path_buffers(h: &Harness) -> TestResult {
    let a = installed(
        h,
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    )?;
    for len in [MIB / 2, 4 * MIB] {
        let data = pattern(len, len as u32);
        let pinned = PinnedBuffer::from_slice(&h.rt, &data)?;
        let dev = DeviceBuffer::<i32>::uninit(&h.rt, D0, len)?;
        pinned.copy_to_device(&dev, false)?;
        assert!(dev.to_host()? == data, "{len}");
    }
    assert_eq!(host_stat(&a, "num_host_alloc"), 2);
    Ok(())
}

/// The same from 4 threads at once (`test_pinned_memory_with_cudaregister_multithread`).
fn register_path_from_threads(h: &Harness) -> TestResult {
    installed(
        h,
        "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    )?;
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4u32)
            .map(|t| {
                scope.spawn(move || -> Result<(), String> {
                    for len in [MIB / 2, 4 * MIB] {
                        let data = pattern(len, t);
                        let pinned =
                            PinnedBuffer::from_slice(&h.rt, &data).map_err(|e| e.to_string())?;
                        if pinned.to_vec().map_err(|e| e.to_string())? != data {
                            return Err(format!("thread {t}: pinned data changed"));
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().unwrap_or(Err("a thread panicked".into())))
    })?;
    Ok(())
}

/// `test_pinned_memory_empty_cache`: both allocation methods give their memory back.
fn empty_cache_for_both_methods(h: &Harness) -> TestResult {
    let a = installed(h, "")?;
    for register in ["True", "False"] {
        a.set_settings(&format!("pinned_use_cuda_host_register:{register}"))?;
        let t = PinnedBuffer::from_slice(&h.rt, &vec![1.0f32; MIB])?;
        drop(t);
        a.host().empty_cache()?;
        assert_eq!(host_stat(&a, "allocations.current"), 0, "{register}");
    }
    assert_eq!(host_stat(&a, "num_host_free"), 2);
    Ok(())
}

/// A pinned buffer made during a capture comes from the capture's private pool; the
/// captured copy reads it at every replay; once dropped after that use it is never handed
/// out again (the graph may still read it). It leaks that 4 KiB block on purpose (a retired
/// block is never freed), which the bundle's compute-sanitizer step (`sanitize.sh`) expects.
fn capture_copies_from_a_private_pinned_pool(h: &Harness) -> TestResult {
    let a = installed(h, "")?;
    let s = h.rt.new_stream(D0, 0)?;
    let dev = DeviceBuffer::<i32>::uninit(&h.rt, D0, 1024)?;
    h.rt.synchronize(D0)?;
    let graph = CudaGraph::new(h.rt.clone(), a.clone(), D0)?;
    let pinned = {
        let _current = h.rt.stream_guard(&s)?;
        graph.capture_begin(&s, None, CaptureMode::ThreadLocal)?;
        let pinned = PinnedBuffer::from_slice(&h.rt, &[5i32; 1024])?;
        pinned.copy_to_device(&dev, true)?;
        graph.capture_end()?;
        pinned
    };
    assert_eq!(a.host().private_pool_count(), 1);
    graph.replay(&s)?;
    s.synchronize()?;
    assert!(dev.to_host()? == vec![5; 1024]);
    pinned.write(&[9; 1024])?;
    graph.replay(&s)?;
    s.synchronize()?;
    assert!(
        dev.to_host()? == vec![9; 1024],
        "the replay read the new bytes"
    );
    let addr = pinned.range().map(|r| r.addr());
    drop(pinned);
    let outside = PinnedBuffer::<i32>::uninit(&h.rt, 1024)?;
    assert_ne!(outside.range().map(|r| r.addr()), addr, "retired");
    drop(graph);
    a.host().empty_cache()?;
    assert_eq!(
        a.host().private_pool_count(),
        1,
        "the retired block keeps it"
    );
    a.host().check_invariants()?;
    Ok(())
}

ferrocuda_testkit::both_backends!(
    driver_register_path,
    pinned_buffers_round_trip,
    pinned_block_waits_for_its_copy,
    register_path_buffers,
    register_path_from_threads,
    empty_cache_for_both_methods,
    capture_copies_from_a_private_pinned_pool
);
