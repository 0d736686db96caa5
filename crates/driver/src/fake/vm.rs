//! Virtual memory on the fake device, for expandable segments: address ranges reserved,
//! physical chunks made, mapped, given access and unmapped (the model is
//! `device_memory`).
use super::addresses::device_of;
use super::device_memory::GRANULARITY;
use super::{Call, FakeDriver};
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr, PhysHandle, VaRange};

pub(super) fn vm_granularity(driver: &FakeDriver, dev: DeviceIndex) -> Result<u64, DriverError> {
    driver.enter(Call::VmGranularity)?.check_device(dev)?;
    Ok(GRANULARITY)
}

pub(super) fn vm_reserve(
    driver: &FakeDriver,
    dev: DeviceIndex,
    bytes: u64,
) -> Result<VaRange, DriverError> {
    let base = driver.enter(Call::VmReserve)?.memory.reserve(dev, bytes)?;
    Ok(VaRange {
        device: dev,
        base,
        bytes,
    })
}

pub(super) fn vm_release(driver: &FakeDriver, range: VaRange) -> Result<(), DriverError> {
    driver
        .enter(Call::VmRelease)?
        .memory
        .unreserve(range.device, range.base, range.bytes)
}

pub(super) fn vm_create(
    driver: &FakeDriver,
    dev: DeviceIndex,
    bytes: u64,
) -> Result<PhysHandle, DriverError> {
    let mut st = driver.enter(Call::VmCreate)?;
    if !bytes.is_multiple_of(GRANULARITY) {
        return Err(DriverError::INVALID_VALUE);
    }
    let raw = st.memory.create_chunk(dev, bytes)?;
    Ok(PhysHandle { device: dev, raw })
}

pub(super) fn vm_destroy(driver: &FakeDriver, handle: PhysHandle) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::VmDestroy)?;
    if st.memory.chunk_device(handle.raw) != Some(handle.device) {
        return Err(DriverError::INVALID_HANDLE);
    }
    super::ipc::forget_export(&mut st.exports, handle.raw);
    st.memory.release_chunk(handle.raw)
}

pub(super) fn vm_unmap(
    driver: &FakeDriver,
    dev: DeviceIndex,
    at: DevicePtr,
    bytes: u64,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::VmUnmap)?;
    if device_of(at) != Some(dev) {
        return Err(DriverError::INVALID_VALUE);
    }
    st.memory.unmap(at, bytes)
}
