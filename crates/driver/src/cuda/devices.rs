//! Devices on the real driver: which processes use them (NVML), their properties, free
//! memory and stream priorities (`cuDeviceGetAttribute`, `cuMemGetInfo`,
//! `cuCtxGetStreamPriorityRange`): the devices section of [`Driver`](crate::Driver).
use super::{CudaDriver, check};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, DeviceProperties};

pub(super) fn gpu_processes(driver: &CudaDriver, dev: DeviceIndex) -> Vec<crate::nvml::GpuProcess> {
    use sys::CUdevice_attribute as A;
    let pci = (|| {
        Ok::<_, DriverError>(format!(
            "{:08X}:{:02X}:{:02X}.0",
            driver.attribute(dev, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            driver.attribute(dev, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            driver.attribute(dev, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        ))
    })();
    pci.ok()
        .and_then(|id| crate::nvml::compute_processes(&id).ok())
        .unwrap_or_default()
}

pub(super) fn device_properties(
    driver: &CudaDriver,
    dev: DeviceIndex,
) -> Result<DeviceProperties, DriverError> {
    use sys::CUdevice_attribute as A;
    let l = driver.loaded()?;
    let slot = l
        .devices
        .get(dev.as_usize())
        .ok_or(DriverError::INVALID_DEVICE)?;
    let mut name = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer holds 256 bytes and we pass that length.
    check(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, slot.device) })?;
    // SAFETY: the driver wrote a NUL-terminated string into the buffer.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut total = 0usize;
    // SAFETY: writes through a valid pointer.
    check(unsafe { sys::cuDeviceTotalMem_v2(&mut total, slot.device) })?;
    let attr = |a| driver.attribute(dev, a).map(|v| v.max(0) as u32);
    Ok(DeviceProperties {
        name,
        major: attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        minor: attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        total_memory: total as u64,
        multi_processor_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        max_threads_per_multi_processor: attr(
            A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
        )?,
        warp_size: attr(A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
        l2_cache_size: u64::from(attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?),
    })
}

pub(super) fn mem_get_info(
    driver: &CudaDriver,
    dev: DeviceIndex,
) -> Result<(u64, u64), DriverError> {
    driver.bind(dev)?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: a context is current; writes through valid pointers.
    check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
    Ok((free as u64, total as u64))
}

pub(super) fn stream_priority_range(
    driver: &CudaDriver,
    dev: DeviceIndex,
) -> Result<(i32, i32), DriverError> {
    driver.bind(dev)?;
    let (mut least, mut greatest) = (0, 0);
    // SAFETY: a context is current; writes through valid pointers.
    check(unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) })?;
    Ok((least, greatest))
}

pub(super) fn device_synchronize(driver: &CudaDriver, dev: DeviceIndex) -> Result<(), DriverError> {
    driver.bind(dev)?;
    // SAFETY: a context is current.
    check(unsafe { sys::cuCtxSynchronize() })
}
