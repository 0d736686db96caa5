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
