//! The caching allocator behind device buffers, on the fake device; and the global
//! `ferrocuda::memory` functions on whatever this machine has.
#![forbid(unsafe_code)]
use ferrocuda::alloc::history::HistoryOptions;
use ferrocuda::alloc::{Caching, DeviceAllocators, OutOfMemory};
use ferrocuda::driver::{Call, FakeDriver, fake::Completion};
use ferrocuda::stream::{DeviceBuffer, KernelCache, MemoryError, Module, Runtime, StreamError};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use ferrocuda_testkit::{KERNELS, register_fake_kernels};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);

fn fake_with_allocators(
    completion: Completion,
) -> (Arc<FakeDriver>, Arc<Runtime>, Arc<DeviceAllocators>) {
    let fake = Arc::new(FakeDriver::builder().completion(completion).build());
    register_fake_kernels(&fake);
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    let allocators = DeviceAllocators::new(fake.clone(), AllocatorConfig::default(), Caching::On);
    allocators.install(&rt);
    (fake, rt, allocators)
}

#[test]
fn buffers_allocate_through_the_caching_allocator() -> TestResult {
    let (fake, rt, allocators) = fake_with_allocators(Completion::Eager);
    let first = DeviceBuffer::<f32>::filled(&rt, D0, 1000, 1.0)?;
    let ptr = first.ptr();
    let stats = allocators.device(D0)?.stats();
    assert_eq!(
        (
            stats.allocation.all.current,
            stats.requested_bytes.all.current
        ),
        (1, 4000)
    );
    drop(first);
    let second = DeviceBuffer::<f32>::filled(&rt, D0, 900, 2.0)?;
    assert_eq!(second.ptr(), ptr, "the cached block is reused");
    assert_eq!(fake.calls(Call::Malloc), 1, "one segment from the driver");
    assert_eq!(second.to_host()?, vec![2.0; 900]);
    Ok(())
}

/// A buffer used on a side stream is not reused before the side stream's work completes.
#[test]
fn buffer_record_stream_protects_side_stream_work() -> TestResult {
    let (fake, rt, allocators) = fake_with_allocators(Completion::Manual);
    let m = Module::from_cuda_source(&rt, D0, "k", KERNELS)?;
    let side = rt.new_stream(D0, 0)?;
    let x = DeviceBuffer::<f32>::filled(&rt, D0, 256, 1.0)?;
    let ptr = x.ptr();
    side.wait_stream(&rt.current_stream(D0)?)?;
    side.launch(
        &m.function("add_one_f32")?,
        &LaunchConfig::for_elements(256, 256),
        &[x.arg(), KernelArg::value(&256u32)],
    )?;
    x.record_stream(&side)?;
    drop(x);
    let y = DeviceBuffer::<f32>::uninit(&rt, D0, 256)?;
    assert_ne!(y.ptr(), ptr, "the side stream may still be writing it");
    fake.advance_all();
    let z = DeviceBuffer::<f32>::uninit(&rt, D0, 256)?;
    assert_eq!(z.ptr(), ptr);
    allocators.device(D0)?.check_invariants()?;
    // No reference cycle: the runtime goes away with its last handle.
    let weak = Arc::downgrade(&rt);
    drop((y, z, m, side, rt));
    assert!(weak.upgrade().is_none(), "the runtime was freed");
    Ok(())
}

/// A buffer's out-of-memory error carries the allocator's figures, and prints PyTorch's text.
#[test]
fn out_of_memory_reaches_buffers_as_a_typed_error() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().capacity(64 << 20).build());
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    DeviceAllocators::new(fake, AllocatorConfig::default(), Caching::On).install(&rt);
    let _kept = DeviceBuffer::<u8>::uninit(&rt, D0, 1000)?;
    let err = match DeviceBuffer::<u8>::uninit(&rt, D0, 100 << 20) {
        Err(e) => e,
        Ok(_) => panic!("100 MiB cannot fit in 64 MiB"),
    };
    let StreamError::Memory {
        source: MemoryError::OutOfMemory(oom),
    } = &err
    else {
        panic!("expected a typed out of memory, got {err:?}");
    };
    let split_rest = (2 << 20) - 1024;
    assert_eq!(
        **oom,
        OutOfMemory {
            device: 0,
            requested: 100 << 20,
            beyond_one_exabyte: false,
            device_total: 64 << 20,
            device_free: 62 << 20,
            processes: Vec::new(),
            allowed: None,
            allocated: 1024,
            reserved: 2 << 20,
            allocated_in_private_pools: 0,
            largest_free_block: split_rest,
            cached_per_stream: vec![(rt.current_stream(D0)?.handle(), split_rest)],
            non_releasable: split_rest,
            expandable_segments: false,
            rejected_by_fraction: false,
            forensics: None,
        }
    );
    let message = err.to_string();
    assert_eq!(
        message,
        oom.to_string(),
        "the report's own text, nothing added"
    );
    assert_eq!(
        message,
        "CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of \
         64.00 MiB of which 62.00 MiB is free. Of the allocated memory 1024 bytes is allocated \
         by PyTorch, and 2.00 MiB is reserved by PyTorch but unallocated. If reserved but \
         unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
         to avoid fragmentation.  See documentation for Memory Management  \
         (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)",
        "PyTorch's message, word for word"
    );
    Ok(())
}

/// With the facade's frame prefixes, a buffer's allocation stack starts at its caller: the
/// stream layer's buffer and memory-resource frames are skipped with the allocator's own.
#[test]
fn history_skips_the_frames_the_facade_names() -> TestResult {
    let (_, rt, allocators) = fake_with_allocators(Completion::Eager);
    let options = HistoryOptions {
        skip_frames: ferrocuda::memory::plumbing_frames(),
        ..HistoryOptions::parse(Some("all"), Some("all"), 100)?
    };
    allocators.device(D0)?.record_memory_history(options);
    let buffer = DeviceBuffer::<f32>::uninit(&rt, D0, 10)?;
    let (segments, _) = allocators.device(D0)?.snapshot();
    let block = segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.address == buffer.ptr().0)
        .ok_or("the buffer's block is in the snapshot")?;
    let first = block.frames.first().map(|f| f.name.as_str());
    assert!(
        first.is_some_and(|n| n.contains("history_skips_the_frames_the_facade_names")),
        "the caller comes first: {:?}",
        block.frames.iter().take(3).collect::<Vec<_>>()
    );
    Ok(())
}

/// The global functions on this machine: without a GPU the statistics are empty and what
/// needs the device returns the reason.
#[test]
fn global_memory_functions() -> TestResult {
    let rt = ferrocuda::runtime();
    if rt.is_available() {
        let before = ferrocuda::memory::memory_allocated(D0)?;
        let p = ferrocuda::memory::caching_allocator_alloc(1, D0, None)?;
        assert_eq!(ferrocuda::memory::memory_allocated(D0)?, before + 512);
        ferrocuda::memory::caching_allocator_delete(p)?;
        assert!(
            ferrocuda::memory::memory_summary(D0, false)?.contains("PyTorch CUDA memory summary")
        );
    } else {
        // As PyTorch: the statistics of an uninitialised CUDA are empty (zero), not an
        // error; what needs the device says why it cannot.
        assert_eq!(ferrocuda::memory::memory_allocated(D0)?, 0);
        assert!(ferrocuda::memory::memory_stats(D0)?.is_empty());
        let err = ferrocuda::memory::caching_allocator_alloc(1, D0, None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("CUDA is not available"), "{err}");
        assert!(ferrocuda::memory::empty_cache().is_ok(), "nothing to empty");
    }
    Ok(())
}

/// Statistics are per device (PyTorch's `test_memory_stats_multigpu`), interleaved.
#[test]
fn stats_are_per_device() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().devices(2).build());
    let allocators = DeviceAllocators::new(fake, AllocatorConfig::default(), Caching::On);
    let (a0, a1) = (allocators.device(D0)?, allocators.device(DeviceIndex(1))?);
    let s1 = ferrocuda::types::StreamHandle::legacy(DeviceIndex(1));
    let mut held = Vec::new();
    for i in 1..=10u64 {
        held.push(
            a0.allocate(i * 1000, ferrocuda::types::StreamHandle::legacy(D0))?
                .ptr,
        );
        let x = a1.allocate((i * 3) << 20, s1)?;
        a1.free(x.ptr)?;
    }
    assert_eq!(a0.stats().allocation.all.current, 10);
    assert_eq!(a1.stats().allocation.all.current, 0);
    assert_eq!(a1.stats().allocation.all.allocated, 10);
    assert_eq!(
        a0.stats().segment.large_pool.current,
        0,
        "device 0 only made small segments"
    );
    assert!(allocators.device(DeviceIndex(2)).is_err());
    for p in held {
        allocators.free_anywhere(p)?;
    }
    assert_eq!(a0.stats().allocation.all.current, 0);
    Ok(())
}
