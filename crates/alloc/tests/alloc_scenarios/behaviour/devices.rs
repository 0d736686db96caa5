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

/// `pageable_copy_threads` reaches the runtime through the installed host allocator, follows
/// `_set_allocator_settings`, and a staged copy leaves PyTorch's host statistics as they were:
/// its page-locked slots come from the driver, not from the caching host allocator.
#[test]
fn staged_pageable_copies_follow_the_settings_and_leave_host_statistics_alone() -> TestResult {
    use ferrocuda_stream::{CHUNK, DeviceBuffer, Runtime};
    let fake = Arc::new(FakeDriver::default());
    let config = AllocatorConfig::parse("pageable_copy_threads:2")?;
    let allocators = DeviceAllocators::new(fake.clone(), config, Caching::On);
    let rt = Runtime::new(fake.clone());
    allocators.install(&rt);
    assert_eq!(rt.pageable_copy_threads(), 2);
    let values: Vec<u8> = (0..5 * CHUNK).map(|i| (i % 253) as u8).collect();
    let buf = DeviceBuffer::<u8>::uninit(&rt, D0, values.len())?;
    let host_stats = allocators.host().stats();
    buf.copy_from_host(&values)?;
    assert_eq!(buf.to_host()?, values);
    assert_eq!(
        fake.calls(Call::MemcpyHtoDPinned),
        5,
        "staged in five chunks"
    );
    assert_eq!(allocators.host().stats(), host_stats);
    allocators.set_settings("pageable_copy_threads:0")?;
    assert_eq!(rt.pageable_copy_threads(), 0);
    buf.copy_from_host(&values)?;
    assert_eq!(fake.calls(Call::MemcpyHtoDPinned), 5, "the driver's copy");
    Ok(())
}
