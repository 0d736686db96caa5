//! Expandable segments opened to peer devices (PyTorch's `addPeerAccess` /
//! `ExpandableSegment::addPeer`) on the fake device with several devices: pages mapped
//! before and after a peer is added are accessible to it, a direct copy from the peer's
//! stream works through the whole stack (runtime, allocators, buffers), and without telling
//! the allocator the same copy is an illegal address.
use ferrocuda_alloc::{Caching, CachingAllocator, DeviceAllocators};
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver, PeerCopies};
use ferrocuda_stream::{DeviceBuffer, KernelCache, Runtime, StreamError};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, MemsetValue, StreamFlags, StreamHandle};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);
const D2: DeviceIndex = DeviceIndex(2);
const MIB: u64 = 1 << 20;

fn expandable() -> Result<AllocatorConfig, Box<dyn std::error::Error>> {
    Ok(AllocatorConfig::parse("expandable_segments:True")?)
}

type Stack = (Arc<FakeDriver>, Arc<Runtime>, Arc<DeviceAllocators>);

fn stack(devices: usize) -> Result<Stack, Box<dyn std::error::Error>> {
    let fake = Arc::new(FakeDriver::builder().devices(devices).build());
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    let allocators = DeviceAllocators::new(fake.clone(), expandable()?, Caching::On);
    allocators.install(&rt);
    Ok((fake, rt, allocators))
}

/// Writes `bytes` of 0xAB from a stream of `from` into `dst` on another device, directly.
fn direct_write(
    fake: &FakeDriver,
    from: DeviceIndex,
    dst: (DeviceIndex, ferrocuda_types::DevicePtr),
    bytes: u64,
) -> Result<(), DriverError> {
    let s = fake.stream_create(from, StreamFlags::default())?;
    let src = fake.malloc(from, bytes)?;
    fake.memset_async(src, MemsetValue::U8(0xAB), bytes, s)?;
    fake.memcpy_peer_async(dst, (from, src), bytes, s)?;
    fake.stream_synchronize(s)
}

#[test]
fn pages_mapped_before_and_after_a_peer_is_added_are_open_to_it() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().devices(3).build());
    let a = CachingAllocator::new(fake.clone(), D1, expandable()?, Caching::On)?;
    let s1 = StreamHandle { device: D1, raw: 0 };
    let before = a.allocate(3 * MIB, s1)?;
    fake.enable_peer_access(D0, D1)?;
    assert_eq!(
        direct_write(&fake, D0, (D1, before.ptr), 3 * MIB),
        Err(DriverError::ILLEGAL_ADDRESS),
        "peer access enabled in the driver alone does not open expandable pages"
    );
    let set_access = fake.calls(Call::VmSetAccess);
    a.add_peer_access(D0)?;
    assert!(fake.calls(Call::VmSetAccess) > set_access);
    direct_write(&fake, D0, (D1, before.ptr), 3 * MIB)?;

    let again = fake.calls(Call::VmSetAccess);
    a.add_peer_access(D0)?;
    a.add_peer_access(D1)?;
    assert_eq!(
        fake.calls(Call::VmSetAccess),
        again,
        "idempotent; itself a no-op"
    );
    assert_eq!(a.peers(), vec![D0]);

    let after = a.allocate(40 * MIB, s1)?;
    direct_write(&fake, D0, (D1, after.ptr), 40 * MIB)?;
    fake.enable_peer_access(D2, D1)?;
    assert_eq!(
        direct_write(&fake, D2, (D1, after.ptr), MIB),
        Err(DriverError::ILLEGAL_ADDRESS),
        "only the peers added"
    );
    Ok(())
}

#[test]
fn pages_unmapped_and_mapped_again_are_opened_again() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().devices(2).build());
    let a = CachingAllocator::new(fake.clone(), D1, expandable()?, Caching::On)?;
    let s1 = StreamHandle { device: D1, raw: 0 };
    fake.enable_peer_access(D0, D1)?;
    a.add_peer_access(D0)?;
    let x = a.allocate(20 * MIB, s1)?;
    a.free(x.ptr)?;
    a.empty_cache();
    let y = a.allocate(20 * MIB, s1)?;
    direct_write(&fake, D0, (D1, y.ptr), 20 * MIB)?;
    Ok(())
}

#[test]
fn a_failed_set_access_leaves_the_peer_unrecorded_for_a_retry() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().devices(2).build());
    let a = CachingAllocator::new(fake.clone(), D1, expandable()?, Caching::On)?;
    let x = a.allocate(MIB, StreamHandle { device: D1, raw: 0 })?;
    fake.fail_nth(Call::VmSetAccess, 1, DriverError::OUT_OF_MEMORY);
    assert!(a.add_peer_access(D0).is_err());
    assert!(a.peers().is_empty());
    a.add_peer_access(D0)?;
    fake.enable_peer_access(D0, D1)?;
    direct_write(&fake, D0, (D1, x.ptr), MIB)?;
    Ok(())
}

#[test]
fn copies_between_devices_through_the_stack_open_expandable_segments() -> TestResult {
    let (fake, rt, allocators) = stack(2)?;
    let on0 = DeviceBuffer::from_slice(&rt, D0, &[1.5f32; 1000])?;
    let on1 = DeviceBuffer::<f32>::filled(&rt, D1, 1000, 0.0)?;
    on1.copy_from(&on0)?;
    assert_eq!(on1.to_host()?, vec![1.5; 1000]);
    on1.fill(2.5)?;
    on0.copy_from(&on1)?;
    assert_eq!(on0.to_host()?, vec![2.5; 1000]);
    assert_eq!(
        fake.peer_copies(),
        PeerCopies {
            direct: 2,
            staged: 0
        }
    );
    assert_eq!(allocators.device(D1)?.peers(), vec![D0]);
    assert_eq!(allocators.device(D0)?.peers(), vec![D1]);

    // Memory mapped afterwards is open too.
    let big1 = DeviceBuffer::<u8>::filled(&rt, D1, 4 << 20, 0)?;
    let big0 = DeviceBuffer::<u8>::filled(&rt, D0, 4 << 20, 7)?;
    big1.copy_from(&big0)?;
    assert_eq!(big1.to_host()?.iter().filter(|&&b| b == 7).count(), 4 << 20);
    Ok(())
}

#[test]
fn a_device_past_the_last_is_a_typed_error() -> TestResult {
    let (_, rt, _) = stack(2)?;
    assert!(matches!(
        rt.get_p2p_access(D0, D2),
        Err(StreamError::InvalidDevice { index: 2, count: 2 })
    ));
    Ok(())
}
