//! Devices on the fake device: NVML's processes, the properties of an H100-like device, free
//! memory, stream priorities: the devices section of [`Driver`](crate::Driver).
use super::{Call, FakeDriver};
use crate::nvml::GpuProcess;
use crate::{DriverError, NvmlError};
use ferrocuda_types::{DeviceIndex, DeviceProperties};

pub(super) fn nvml_device_count(driver: &FakeDriver) -> Result<usize, NvmlError> {
    driver.count(Call::NvmlDeviceCount);
    driver.nvml.clone()
}

pub(super) fn gpu_processes(driver: &FakeDriver, _dev: DeviceIndex) -> Vec<GpuProcess> {
    driver.count(Call::GpuProcesses);
    driver.processes.clone()
}

pub(super) fn device_properties(
    driver: &FakeDriver,
    dev: DeviceIndex,
) -> Result<DeviceProperties, DriverError> {
    let st = driver.enter(Call::DeviceProperties)?;
    st.check_device(dev)?;
    Ok(fake_properties(st.memory.capacity(dev)))
}

pub(super) fn device_synchronize(driver: &FakeDriver, dev: DeviceIndex) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::DeviceSynchronize)?;
    st.check_device(dev)?;
    st.refuse_device_sync_during_captures(dev)?;
    st.drain_device(dev)
}

pub(super) fn stream_priority_range(
    driver: &FakeDriver,
    dev: DeviceIndex,
) -> Result<(i32, i32), DriverError> {
    driver.enter(Call::StreamPriorityRange)?.check_device(dev)?;
    Ok((0, -5))
}

fn fake_properties(capacity: u64) -> DeviceProperties {
    DeviceProperties {
        name: "ferrocuda fake device".into(),
        major: 9,
        minor: 0,
        total_memory: capacity,
        multi_processor_count: 132,
        max_threads_per_multi_processor: 2048,
        warp_size: 32,
        l2_cache_size: 50 << 20,
    }
}
