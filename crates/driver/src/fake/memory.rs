//! Device and host memory on the fake device and the copies and memsets between them, in
//! stream order: the memory section of [`Driver`](crate::Driver). The memory itself is
//! `device_memory`.
use super::work::Work;
use super::{Call, FakeDriver, host_register};
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr, HostPtr, MemsetValue, StreamHandle};

pub(super) fn malloc(
    driver: &FakeDriver,
    dev: DeviceIndex,
    bytes: u64,
) -> Result<DevicePtr, DriverError> {
    let mut st = driver.enter(Call::Malloc)?;
    st.check_device(dev)?;
    st.check_unsafe_call()?;
    let ptr = st.memory.malloc(dev, bytes)?;
    driver.mallocs.note(dev, ptr);
    Ok(ptr)
}

pub(super) fn free(
    driver: &FakeDriver,
    dev: DeviceIndex,
    ptr: DevicePtr,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::Free)?;
    st.check_device(dev)?;
    st.check_unsafe_call()?;
    // cuMemFree waits for the device's work, as the real driver does in practice.
    let _ = st.drain_device(dev);
    st.memory.free(dev, ptr)
}

pub(super) fn host_alloc(driver: &FakeDriver, bytes: u64) -> Result<HostPtr, DriverError> {
    let mut st = driver.enter(Call::HostAlloc)?;
    st.check_unsafe_call()?;
    let data = host_register::host_bytes(bytes)?;
    let raw = st.next_host;
    st.next_host += bytes.max(1).div_ceil(4096) * 4096;
    st.hosts.insert(raw, data);
    Ok(HostPtr { raw, bytes })
}

pub(super) fn host_free(driver: &FakeDriver, ptr: HostPtr) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::HostFree)?;
    st.check_unsafe_call()?;
    if st.mallocs.contains(ptr) {
        return Err(DriverError::INVALID_VALUE);
    }
    st.hosts
        .remove(&ptr.raw)
        .map(|_| ())
        .ok_or(DriverError::INVALID_VALUE)
}

pub(super) fn host_read(
    driver: &FakeDriver,
    src: HostPtr,
    offset: u64,
    dst: &mut [u8],
) -> Result<(), DriverError> {
    let st = driver.enter(Call::HostRead)?;
    st.host_range(src, offset, dst.len() as u64)?;
    let buf = st.hosts.get(&src.raw).ok_or(DriverError::INVALID_VALUE)?;
    dst.copy_from_slice(&buf[offset as usize..offset as usize + dst.len()]);
    Ok(())
}

pub(super) fn host_write(
    driver: &FakeDriver,
    dst: HostPtr,
    offset: u64,
    src: &[u8],
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::HostWrite)?;
    st.host_range(dst, offset, src.len() as u64)?;
    let buf = st
        .hosts
        .get_mut(&dst.raw)
        .ok_or(DriverError::INVALID_VALUE)?;
    buf[offset as usize..offset as usize + src.len()].copy_from_slice(src);
    Ok(())
}

pub(super) fn memset_async(
    driver: &FakeDriver,
    dst: DevicePtr,
    value: MemsetValue,
    count: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::Memset)?;
    let key = st.stream_key(stream)?;
    st.dev_ptr_check(dst, value.width() * count)?;
    st.enqueue(key, Work::Memset { dst, value, count })
}

pub(super) fn memcpy_htod_async(
    driver: &FakeDriver,
    dst: DevicePtr,
    src: &[u8],
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::MemcpyHtoD)?;
    let key = st.stream_key(stream)?;
    st.dev_ptr_check(dst, src.len() as u64)?;
    // A captured copy would read `src` at every replay, long after the borrow ends.
    if st.streams.get(&key).is_some_and(|s| s.capture.is_some()) {
        return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
    }
    st.enqueue(
        key,
        Work::HostToDevice {
            dst,
            bytes: src.into(),
        },
    )
}

pub(super) fn memcpy_dtoh(
    driver: &FakeDriver,
    dst: &mut [u8],
    src: DevicePtr,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::MemcpyDtoH)?;
    let key = st.stream_key(stream)?;
    st.dev_ptr_check(src, dst.len() as u64)?;
    st.refuse_if_capturing(key)?;
    // As CUDA's: the copy is enqueued (with the legacy stream's implicit waits, or its
    // refusal while a blocking stream captures), then waited for (an unsafe call).
    st.wait_implicitly(key)?;
    st.check_unsafe_call()?;
    st.drain(key)?;
    st.memory.read(src, dst)
}

pub(super) fn memcpy_dtod_async(
    driver: &FakeDriver,
    dst: DevicePtr,
    src: DevicePtr,
    bytes: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::MemcpyDtoD)?;
    let key = st.stream_key(stream)?;
    st.dev_ptr_check(dst, bytes)?;
    st.dev_ptr_check(src, bytes)?;
    st.enqueue(key, Work::DeviceToDevice { dst, src, bytes })
}

pub(super) fn memcpy_peer_async(
    driver: &FakeDriver,
    dst: (DeviceIndex, DevicePtr),
    src: (DeviceIndex, DevicePtr),
    bytes: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::MemcpyPeer)?;
    let key = st.stream_key(stream)?;
    if st.dev_ptr_check(dst.1, bytes)? != dst.0 || st.dev_ptr_check(src.1, bytes)? != src.0 {
        return Err(DriverError::INVALID_VALUE);
    }
    st.route_peer_copy(DeviceIndex(key.0), dst, src, bytes)?;
    st.enqueue(
        key,
        Work::DeviceToDevice {
            dst: dst.1,
            src: src.1,
            bytes,
        },
    )
}

pub(super) fn memcpy_htod_pinned_async(
    driver: &FakeDriver,
    dst: DevicePtr,
    src: (HostPtr, u64),
    bytes: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::MemcpyHtoDPinned)?;
    let key = st.stream_key(stream)?;
    st.dev_ptr_check(dst, bytes)?;
    st.host_range(src.0, src.1, bytes)?;
    st.enqueue(
        key,
        Work::PinnedToDevice {
            dst,
            host: src.0.raw,
            offset: src.1,
            bytes,
        },
    )
}

pub(super) fn memcpy_dtoh_pinned_async(
    driver: &FakeDriver,
    dst: (HostPtr, u64),
    src: DevicePtr,
    bytes: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::MemcpyDtoHPinned)?;
    let key = st.stream_key(stream)?;
    st.dev_ptr_check(src, bytes)?;
    st.host_range(dst.0, dst.1, bytes)?;
    st.enqueue(
        key,
        Work::DeviceToPinned {
            host: dst.0.raw,
            offset: dst.1,
            src,
            bytes,
        },
    )
}
