//! Virtual memory on the real driver, for expandable segments: address ranges reserved,
//! physical chunks made, mapped and given access (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`, `cuMemSetAccess`).
use super::{CudaDriver, check};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, DevicePtr, PhysHandle, VaRange};

pub(super) fn vm_granularity(driver: &CudaDriver, dev: DeviceIndex) -> Result<u64, DriverError> {
    let prop = driver.alloc_prop(dev)?;
    driver.bind(dev)?;
    let mut g = 0usize;
    let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: `prop` is fully initialized; writes through a valid pointer.
    check(unsafe { sys::cuMemGetAllocationGranularity(&mut g, &prop, flag) })?;
    Ok(g as u64)
}

pub(super) fn vm_reserve(
    driver: &CudaDriver,
    dev: DeviceIndex,
    bytes: u64,
) -> Result<VaRange, DriverError> {
    driver.bind(dev)?;
    let mut base = 0;
    // SAFETY: a context is current; writes through a valid pointer.
    check(unsafe { sys::cuMemAddressReserve(&mut base, bytes as usize, 0, 0, 0) })?;
    Ok(VaRange {
        device: dev,
        base: DevicePtr(base),
        bytes,
    })
}

pub(super) fn vm_create(
    driver: &CudaDriver,
    dev: DeviceIndex,
    bytes: u64,
) -> Result<PhysHandle, DriverError> {
    let prop = driver.alloc_prop(dev)?;
    let l = driver.bind(dev)?;
    let mut h = 0;
    // SAFETY: `prop` is fully initialized; writes through a valid pointer.
    check(unsafe { sys::cuMemCreate(&mut h, bytes as usize, &prop, 0) })?;
    l.registry.write().phys.insert(h, (dev.0, bytes));
    Ok(PhysHandle {
        device: dev,
        raw: h,
    })
}

pub(super) fn vm_destroy(driver: &CudaDriver, handle: PhysHandle) -> Result<(), DriverError> {
    let l = driver.bind(handle.device)?;
    let mut registry = l.registry.write();
    registry
        .phys
        .remove(&handle.raw)
        .ok_or(DriverError::INVALID_HANDLE)?;
    // Its exported descriptor, if any, closes with it (PyTorch closes it on unmap).
    registry.exports.remove(&handle.raw);
    drop(registry);
    // SAFETY: the handle was live (registry) and is released once.
    check(unsafe { sys::cuMemRelease(handle.raw) })
}

pub(super) fn vm_map(
    driver: &CudaDriver,
    at: DevicePtr,
    handle: PhysHandle,
) -> Result<(), DriverError> {
    let l = driver.bind(handle.device)?;
    let bytes = match l.registry.read().phys.get(&handle.raw) {
        Some(&(d, b)) if d == handle.device.0 => b,
        _ => return Err(DriverError::INVALID_HANDLE),
    };
    // SAFETY: the handle is live; the driver checks the address range.
    check(unsafe { sys::cuMemMap(at.0, bytes as usize, 0, handle.raw, 0) })
}

pub(super) fn vm_set_access(
    driver: &CudaDriver,
    dev: DeviceIndex,
    at: DevicePtr,
    bytes: u64,
) -> Result<(), DriverError> {
    let prop = driver.alloc_prop(dev)?;
    driver.bind(dev)?;
    let desc = sys::CUmemAccessDesc {
        location: prop.location,
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one valid descriptor; the driver checks the range.
    check(unsafe { sys::cuMemSetAccess(at.0, bytes as usize, &desc, 1) })
}

pub(super) fn vm_release(driver: &CudaDriver, range: VaRange) -> Result<(), DriverError> {
    driver.bind(range.device)?;
    // SAFETY: the driver checks that the range was reserved.
    check(unsafe { sys::cuMemAddressFree(range.base.0, range.bytes as usize) })
}

pub(super) fn vm_unmap(
    driver: &CudaDriver,
    dev: DeviceIndex,
    at: DevicePtr,
    bytes: u64,
) -> Result<(), DriverError> {
    driver.bind(dev)?;
    // SAFETY: the driver checks the range.
    check(unsafe { sys::cuMemUnmap(at.0, bytes as usize) })
}
