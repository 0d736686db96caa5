//! PyTorch's `CUDAPluggableAllocator` (torch/csrc/cuda/CUDAPluggableAllocator.cpp) over the
//! fixture library cargo builds beside this test: the allocation table and its error, the
//! hook each function calls, the texts of what it cannot do; and the library as the segment
//! source of a private pool (`MemPool(allocator=…)`), the caching allocator still caching,
//! splitting and counting.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::common;
use common::{LEGACY, MIB, TestResult, setup, stat};
use ferrocuda_alloc::{AllocError, PluggableAllocator, Route};
use ferrocuda_driver::{Call, Hook, PluggableLibrary, fake::Completion};
use ferrocuda_pluggable_fixture::{Event, HOOK_FUNCTIONS, Probe, path};
use ferrocuda_stream::{MemoryResource, StreamError};
use ferrocuda_types::{DeviceIndex, DevicePtr, PoolId, StreamHandle};
use std::sync::Arc;

const D2: DeviceIndex = DeviceIndex(2);
const S: StreamHandle = StreamHandle {
    device: D2,
    raw: 0xabc,
};

fn host() -> Result<Arc<PluggableAllocator>, AllocError> {
    PluggableAllocator::load(path(), "fixture_host_alloc", "fixture_host_free")
}

fn hooked() -> Result<Arc<PluggableAllocator>, Box<dyn std::error::Error>> {
    let lib = PluggableLibrary::load(path(), "fixture_host_alloc", "fixture_host_free")?;
    let lib = Hook::ALL
        .into_iter()
        .zip(HOOK_FUNCTIONS)
        .try_fold(lib, |lib, (hook, function)| lib.with_hook(hook, function))?;
    Ok(PluggableAllocator::new(lib))
}

#[test]
fn free_gets_the_size_device_and_stream_of_the_allocation() -> TestResult {
    let probe = Probe::open()?;
    let a = host()?;
    let p = a.malloc(1000, D2, S);
    let q = a.malloc(24, DeviceIndex(0), StreamHandle::legacy(DeviceIndex(0)));
    assert_eq!(a.live(), 2);
    probe.clear();
    a.raw_delete(p)?;
    a.raw_delete(q)?;
    assert_eq!(
        probe.events(),
        [
            Event::Free {
                ptr: p.0,
                size: 1000,
                device: 2,
                stream: 0xabc
            },
            Event::Free {
                ptr: q.0,
                size: 24,
                device: 0,
                stream: 0
            }
        ]
    );
    assert_eq!((a.live(), probe.live()), (0, 0));
    Ok(())
}

#[test]
fn a_pointer_not_allocated_here_is_pytorchs_error_and_reaches_no_library() -> TestResult {
    let probe = Probe::open()?;
    let a = host()?;
    let p = a.malloc(64, D2, S);
    let inside = DevicePtr(p.0 + 8);
    for bad in [inside, DevicePtr(0x1234_5000)] {
        let e = a.raw_delete(bad).unwrap_err();
        assert_eq!(e, AllocError::NotAllocatedHere(bad));
        assert_eq!(e.to_string(), "Trying to free a pointer not allocated here");
    }
    a.raw_delete(p)?;
    let again = a.raw_delete(p).unwrap_err();
    assert_eq!(
        again.to_string(),
        "Trying to free a pointer not allocated here"
    );
    let frees = probe
        .events()
        .iter()
        .filter(|e| matches!(e, Event::Free { .. }))
        .count();
    assert_eq!(frees, 1, "only the real free reached the library");
    Ok(())
}

#[test]
fn as_a_memory_resource_a_null_allocation_is_an_error_not_a_buffer() -> TestResult {
    let _probe = Probe::open()?;
    let a = PluggableAllocator::load(path(), "fixture_null_alloc", "fixture_host_free")?;
    let e = a.allocate(D2, 4096, S).unwrap_err();
    assert!(
        e.to_string()
            .contains("the pluggable allocator returned no memory for 4096 bytes on device 2"),
        "{e}"
    );
    assert_eq!(a.live(), 0, "nothing recorded");
    let h = host()?;
    let p = h.allocate(D2, 64, S)?;
    MemoryResource::free(&*h, D2, p)?;
    let e = MemoryResource::free(&*h, D2, p).unwrap_err();
    assert!(matches!(e, StreamError::Memory { .. }), "{e:?}");
    assert_eq!(e.to_string(), "Trying to free a pointer not allocated here");
    Ok(())
}

/// Every function of `a` that has a hook, on `p` and pool (0, 9).
fn call_each_hooked_function(a: &PluggableAllocator, p: DevicePtr) {
    a.init(3);
    a.empty_cache();
    a.set_memory_fraction(0.5, D2);
    a.record_stream(p, S);
    a.begin_allocate_to_pool(D2, PoolId(0, 9));
    a.end_allocate_to_pool(D2, PoolId(0, 9));
    a.release_pool(D2, PoolId(0, 9));
}

#[test]
fn each_function_calls_its_hook_or_nothing() -> TestResult {
    let probe = Probe::open()?;
    let bare = host()?;
    let p = bare.malloc(4096, D2, S);
    probe.clear();
    call_each_hooked_function(&bare, p);
    let inner = DevicePtr(p.0 + 100);
    assert_eq!(
        bare.base_allocation(inner, 7),
        (inner, 7),
        "no hook: as given"
    );
    assert!(probe.events().is_empty());
    bare.raw_delete(p)?;

    let a = hooked()?;
    assert!(
        a.initialized(),
        "initialised when made, as createCustomAllocator leaves it"
    );
    assert_eq!(a.name(), "pluggable");
    let p = a.malloc(4096, D2, S);
    probe.clear();
    call_each_hooked_function(&a, p);
    assert_eq!(a.base_allocation(DevicePtr(p.0 + 100), 7), (p, 4096));
    let pool = (0, 9);
    assert_eq!(
        probe.events(),
        [
            Event::Init(3),
            Event::Reset,
            Event::MemoryFraction {
                fraction: 0.5,
                device: 2
            },
            Event::RecordStream {
                ptr: p.0,
                stream: 0xabc
            },
            Event::BeginAllocateToPool { device: 2, pool },
            Event::EndAllocateToPool { device: 2, pool },
            Event::ReleasePool { device: 2, pool },
            Event::BaseAlloc { ptr: p.0 + 100 },
        ]
    );
    a.raw_delete(p)?;
    Ok(())
}

#[test]
fn unsupported_functions_read_as_pytorchs() {
    assert_eq!(
        PluggableAllocator::unsupported("getDeviceStats").to_string(),
        "CUDAPluggableAllocator does not yet support getDeviceStats. If you need it, please \
         file an issue describing your use case."
    );
}

#[test]
fn a_mem_pool_takes_its_segments_from_the_library_and_gives_them_back() -> TestResult {
    let probe = Probe::open()?;
    let (fake, a) = setup(1 << 34, "", Completion::Eager);
    let lib = host()?;
    let pool = PoolId::handle();
    a.create_pool_with_allocator(pool, lib.clone())?;
    assert_eq!(a.pool_use_count(pool), Some(1));
    // `use_mem_pool(pool)`: routing adds a user, which its end releases.
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let big = a.allocate(MIB + 1, LEGACY)?;
    let small = a.allocate(100, LEGACY)?;
    let small2 = a.allocate(100, LEGACY)?;
    a.end_allocate_to_pool(pool)?;
    a.release_pool(pool)?;
    let outside = a.allocate(100, LEGACY)?;
    assert_eq!(
        fake.calls(Call::Malloc),
        1,
        "only the default pool's segment"
    );
    let segments: Vec<(u64, u64)> = probe
        .events()
        .iter()
        .filter_map(|e| match *e {
            Event::Alloc {
                size, device, ptr, ..
            } => {
                assert_eq!(device, 0);
                Some((ptr, size))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        segments.iter().map(|s| s.1).collect::<Vec<_>>(),
        [20 * MIB, 2 * MIB],
        "a large and a small segment"
    );
    assert_eq!(
        big.ptr.0, segments[0].0,
        "blocks are cut from the library's segments"
    );
    assert_eq!(small.ptr.0, segments[1].0);
    assert_eq!(
        small2.ptr.0,
        segments[1].0 + 512,
        "and split as any segment"
    );
    assert_eq!(stat(&a, "segment.all.current"), 3);
    assert_eq!(
        stat(&a, "reserved_bytes.all.current"),
        (22 * MIB + 2 * MIB) as i64
    );
    assert_eq!(lib.live(), 2);

    for x in [big, small, small2] {
        a.free(x.ptr)?;
    }
    a.empty_cache();
    assert_eq!(lib.live(), 2, "a retained pool keeps its cache");
    a.empty_cache_pool(pool);
    assert_eq!(lib.live(), 2, "also when emptied by itself");
    // The `MemPool` goes: its own user is released, then its cache emptied.
    a.release_pool(pool)?;
    a.empty_cache_pool(pool);
    assert_eq!(lib.live(), 0, "given back to the library, with their sizes");
    let frees: Vec<(u64, u64)> = probe
        .events()
        .iter()
        .filter_map(|e| match *e {
            Event::Free { ptr, size, .. } => Some((ptr, size)),
            _ => None,
        })
        .collect();
    let mut expected = segments.clone();
    expected.sort();
    let mut got = frees.clone();
    got.sort();
    assert_eq!(got, expected);
    assert_eq!(fake.calls(Call::Free), 0, "none went to the driver");
    assert_eq!(
        stat(&a, "segment.all.current"),
        1,
        "the default pool's stays"
    );
    a.free(outside.ptr)?;
    a.check_invariants()?;
    Ok(())
}

#[test]
fn an_existing_pool_takes_no_allocator() -> TestResult {
    let _probe = Probe::open()?;
    let (_, a) = setup(1 << 34, "", Completion::Eager);
    let pool = PoolId::handle();
    a.retain_pool(pool);
    let e = a.create_pool_with_allocator(pool, host()?).unwrap_err();
    assert!(matches!(e, AllocError::Pool(_)), "{e:?}");
    let e = a
        .create_pool_with_allocator(PoolId::DEFAULT, host()?)
        .unwrap_err();
    assert!(matches!(e, AllocError::Pool(_)), "{e:?}");
    Ok(())
}

/// A null segment is the device running out of memory: the slow path releases the cache,
/// retries once, and reports out of memory (PyTorch's `cudaErrorMemoryAllocation`).
#[test]
fn a_null_segment_is_out_of_memory_after_the_retry() -> TestResult {
    let probe = Probe::open()?;
    let (_, a) = setup(1 << 34, "expandable_segments:True", Completion::Eager);
    let lib = PluggableAllocator::load(path(), "fixture_null_alloc", "fixture_host_free")?;
    let pool = PoolId::handle();
    a.create_pool_with_allocator(pool, lib)?;
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let e = a.allocate(3 * MIB, LEGACY).unwrap_err();
    a.end_allocate_to_pool(pool)?;
    assert!(matches!(e, AllocError::OutOfMemory(_)), "{e:?}");
    assert_eq!(
        (stat(&a, "num_alloc_retries"), stat(&a, "num_ooms")),
        (1, 1)
    );
    let asked: Vec<u64> = probe
        .events()
        .iter()
        .filter_map(|e| match *e {
            Event::Alloc { size, .. } => Some(size),
            _ => None,
        })
        .collect();
    assert_eq!(
        asked,
        [20 * MIB, 20 * MIB],
        "plain segments even with expandable segments on, asked twice"
    );
    Ok(())
}

/// Dropping the caching allocator gives the pool's free segments back to the library.
#[test]
fn dropping_the_allocator_gives_the_segments_back() -> TestResult {
    let _probe = Probe::open()?;
    let (_, a) = setup(1 << 34, "", Completion::Eager);
    let lib = host()?;
    let pool = PoolId::handle();
    a.create_pool_with_allocator(pool, lib.clone())?;
    a.begin_allocate_to_pool(pool, Route::Stream(LEGACY))?;
    let x = a.allocate(5 * MIB, LEGACY)?;
    a.end_allocate_to_pool(pool)?;
    a.free(x.ptr)?;
    assert_eq!(lib.live(), 1);
    drop(a);
    assert_eq!(lib.live(), 0);
    Ok(())
}
