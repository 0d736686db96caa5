//! The stream-ordered allocator on the real driver: `cuMemAllocAsync` and `cuMemFreeAsync`
//! on the device's default pool (`cuDeviceGetDefaultMemPool`), its attributes and
//! `cuMemPoolTrimTo`. The pool of the primary context's device is the one PyTorch's
//! cudaMallocAsync backend uses.
use super::{CudaDriver, check};
use crate::{DriverError, MemPoolUsage};
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use sys::CUmemPool_attribute as Attr;

/// `dev`'s default pool, with `dev`'s context current.
fn default_pool(driver: &CudaDriver, dev: DeviceIndex) -> Result<sys::CUmemoryPool, DriverError> {
    let l = driver.bind(dev)?;
    let slot = l
        .devices
        .get(dev.as_usize())
        .ok_or(DriverError::INVALID_DEVICE)?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: `slot.device` came from cuDeviceGet; writes through a valid pointer.
    check(unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, slot.device) })?;
    Ok(pool)
}

fn get(pool: sys::CUmemoryPool, attr: Attr) -> Result<u64, DriverError> {
    let mut value = 0u64;
    // SAFETY: the four memory attributes read here are cuuint64_t; `value` is one.
    check(unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&raw mut value).cast()) })?;
    Ok(value)
}

fn set(pool: sys::CUmemoryPool, attr: Attr, mut value: u64) -> Result<(), DriverError> {
    // SAFETY: the attributes set here (release threshold, the two highs) are cuuint64_t.
    check(unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&raw mut value).cast()) })
}

pub(super) fn alloc_async(
    driver: &CudaDriver,
    dev: DeviceIndex,
    bytes: u64,
    stream: StreamHandle,
) -> Result<DevicePtr, DriverError> {
    if stream.device != dev {
        return Err(DriverError::INVALID_VALUE);
    }
    let s = driver.stream(stream)?;
    let mut ptr = 0;
    // SAFETY: `s` is a live stream of `dev`, whose context `stream()` made current; writes
    // through a valid pointer.
    check(unsafe { sys::cuMemAllocAsync(&mut ptr, bytes as usize, s) })?;
    Ok(DevicePtr(ptr))
}

pub(super) fn free_async(
    driver: &CudaDriver,
    ptr: DevicePtr,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    // SAFETY: `s` is a live stream; the driver checks that `ptr` is a live stream-ordered
    // allocation and fails otherwise.
    check(unsafe { sys::cuMemFreeAsync(ptr.0, s) })
}

pub(super) fn set_release_threshold(
    driver: &CudaDriver,
    dev: DeviceIndex,
    bytes: u64,
) -> Result<(), DriverError> {
    set(
        default_pool(driver, dev)?,
        Attr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        bytes,
    )
}

pub(super) fn usage(driver: &CudaDriver, dev: DeviceIndex) -> Result<MemPoolUsage, DriverError> {
    let pool = default_pool(driver, dev)?;
    Ok(MemPoolUsage {
        reserved: get(pool, Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        reserved_high: get(pool, Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        used: get(pool, Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        used_high: get(pool, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
    })
}

pub(super) fn reset_peaks(driver: &CudaDriver, dev: DeviceIndex) -> Result<(), DriverError> {
    let pool = default_pool(driver, dev)?;
    // Zero is the only value these take: it resets each high to its current value.
    set(pool, Attr::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)?;
    set(pool, Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
}

pub(super) fn trim_to(driver: &CudaDriver, dev: DeviceIndex, keep: u64) -> Result<(), DriverError> {
    let pool = default_pool(driver, dev)?;
    // SAFETY: `pool` is the device's default pool, which lives as long as the context.
    check(unsafe { sys::cuMemPoolTrimTo(pool, keep as usize) })
}
