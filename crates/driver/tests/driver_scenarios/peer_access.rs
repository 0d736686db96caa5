//! Peer access on the fake device with several devices: which pairs can, enabling with the
//! driver's error codes, copies between devices (direct with access, staged without), and
//! virtual-memory mappings opened to a peer by `cuMemSetAccess`.
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver, PeerCopies};
use ferrocuda_types::{DeviceIndex, DevicePtr, MemsetValue, StreamFlags};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);
const D2: DeviceIndex = DeviceIndex(2);

fn three_devices() -> FakeDriver {
    FakeDriver::builder()
        .devices(3)
        .no_peer_access(D0, D2)
        .build()
}

#[test]
fn can_access_peer_answers_per_ordered_pair() -> TestResult {
    let fake = three_devices();
    assert!(fake.device_can_access_peer(D0, D1)?);
    assert!(fake.device_can_access_peer(D1, D0)?);
    assert!(
        !fake.device_can_access_peer(D0, D0)?,
        "a device and itself: no, as CUDA"
    );
    assert!(!fake.device_can_access_peer(D0, D2)?);
    assert!(
        fake.device_can_access_peer(D2, D0)?,
        "the pairs are ordered"
    );
    assert_eq!(
        fake.device_can_access_peer(D0, DeviceIndex(3)),
        Err(DriverError::INVALID_DEVICE)
    );
    assert_eq!(fake.calls(Call::DeviceCanAccessPeer), 6);
    Ok(())
}

#[test]
fn enabling_peer_access_has_the_drivers_error_codes() -> TestResult {
    let fake = three_devices();
    fake.enable_peer_access(D0, D1)?;
    assert!(fake.peer_access_enabled(D0, D1));
    assert!(!fake.peer_access_enabled(D1, D0), "one direction only");
    assert_eq!(
        fake.enable_peer_access(D0, D1),
        Err(DriverError::PEER_ACCESS_ALREADY_ENABLED)
    );
    assert_eq!(
        fake.enable_peer_access(D1, D1),
        Err(DriverError::INVALID_DEVICE)
    );
    assert_eq!(
        fake.enable_peer_access(D0, D2),
        Err(DriverError::PEER_ACCESS_UNSUPPORTED)
    );
    assert_eq!(
        fake.enable_peer_access(D0, DeviceIndex(9)),
        Err(DriverError::INVALID_DEVICE)
    );
    Ok(())
}

fn read(
    fake: &FakeDriver,
    dev: DeviceIndex,
    ptr: DevicePtr,
    n: usize,
) -> Result<Vec<u8>, DriverError> {
    let mut out = vec![0u8; n];
    let s = fake.stream_create(dev, StreamFlags::default())?;
    fake.memcpy_dtoh(&mut out, ptr, s)?;
    Ok(out)
}

#[test]
fn a_peer_copy_is_staged_without_access_and_direct_with_it() -> TestResult {
    let fake = three_devices();
    let s0 = fake.stream_create(D0, StreamFlags::default())?;
    let (src, dst) = (fake.malloc(D0, 256)?, fake.malloc(D1, 256)?);
    fake.memset_async(src, MemsetValue::U8(5), 256, s0)?;
    fake.memcpy_peer_async((D1, dst), (D0, src), 256, s0)?;
    assert_eq!(
        fake.peer_copies(),
        PeerCopies {
            direct: 0,
            staged: 1
        }
    );
    assert_eq!(read(&fake, D1, dst, 256)?, vec![5; 256]);

    fake.enable_peer_access(D0, D1)?;
    fake.memset_async(src, MemsetValue::U8(6), 256, s0)?;
    fake.memcpy_peer_async((D1, dst), (D0, src), 256, s0)?;
    assert_eq!(
        fake.peer_copies(),
        PeerCopies {
            direct: 1,
            staged: 1
        }
    );
    assert_eq!(read(&fake, D1, dst, 256)?, vec![6; 256]);
    Ok(())
}

#[test]
fn a_direct_copy_needs_the_far_mapping_opened_to_the_copying_device() -> TestResult {
    let fake = three_devices();
    let page = fake.vm_granularity(D1)?;
    let va = fake.vm_reserve(D1, page)?;
    let h = fake.vm_create(D1, page)?;
    fake.vm_map(va.base, h)?;
    fake.vm_set_access(D1, va.base, page)?;
    let s0 = fake.stream_create(D0, StreamFlags::default())?;
    let src = fake.malloc(D0, 64)?;
    fake.memset_async(src, MemsetValue::U8(9), 64, s0)?;

    // Staged: each side is reached by its own device.
    fake.memcpy_peer_async((D1, va.base), (D0, src), 64, s0)?;
    fake.enable_peer_access(D0, D1)?;
    assert_eq!(
        fake.memcpy_peer_async((D1, va.base), (D0, src), 64, s0),
        Err(DriverError::ILLEGAL_ADDRESS),
        "device 0 may not touch device 1's mapping yet"
    );
    fake.vm_set_access(D0, va.base, page)?;
    fake.memcpy_peer_async((D1, va.base), (D0, src), 64, s0)?;
    assert_eq!(
        fake.peer_copies(),
        PeerCopies {
            direct: 1,
            staged: 1
        }
    );
    assert_eq!(read(&fake, D1, va.base, 64)?, vec![9; 64]);

    // Unmapped and mapped again, the new mapping is closed to peers.
    fake.vm_unmap(D1, va.base, page)?;
    fake.vm_map(va.base, h)?;
    fake.vm_set_access(D1, va.base, page)?;
    assert_eq!(
        fake.memcpy_peer_async((D1, va.base), (D0, src), 64, s0),
        Err(DriverError::ILLEGAL_ADDRESS)
    );
    Ok(())
}

#[test]
fn set_access_for_a_device_that_cannot_reach_the_memory_is_invalid_device() -> TestResult {
    let fake = three_devices();
    let page = fake.vm_granularity(D2)?;
    let va = fake.vm_reserve(D2, page)?;
    let h = fake.vm_create(D2, page)?;
    fake.vm_map(va.base, h)?;
    assert_eq!(
        fake.vm_set_access(D0, va.base, page),
        Err(DriverError::INVALID_DEVICE)
    );
    fake.vm_set_access(D1, va.base, page)?;
    Ok(())
}
