//! Streams on the real driver: made with their flags and priority, destroyed, and made to
//! wait for events (`cuStreamCreateWithPriority`, `cuStreamDestroy`, `cuStreamWaitEvent`).
use super::{CudaDriver, check, ready};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, EventHandle, StreamFlags, StreamHandle};

pub(super) fn stream_create(
    driver: &CudaDriver,
    dev: DeviceIndex,
    flags: StreamFlags,
) -> Result<StreamHandle, DriverError> {
    let l = driver.bind(dev)?;
    let mut s = std::ptr::null_mut();
    let f = if flags.non_blocking {
        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32
    } else {
        0
    };
    // SAFETY: a context is current; writes through a valid pointer.
    check(unsafe { sys::cuStreamCreateWithPriority(&mut s, f, flags.priority) })?;
    l.registry.write().streams.insert((dev.0, s as u64));
    Ok(StreamHandle {
        device: dev,
        raw: s as u64,
    })
}

pub(super) fn stream_destroy(driver: &CudaDriver, stream: StreamHandle) -> Result<(), DriverError> {
    let l = driver.bind(stream.device)?;
    if !l
        .registry
        .write()
        .streams
        .remove(&(stream.device.0, stream.raw))
    {
        return Err(DriverError::INVALID_HANDLE);
    }
    // SAFETY: the stream was live (registry) and is destroyed once.
    check(unsafe { sys::cuStreamDestroy_v2(stream.raw as sys::CUstream) })
}

pub(super) fn stream_wait_event(
    driver: &CudaDriver,
    stream: StreamHandle,
    event: EventHandle,
) -> Result<(), DriverError> {
    let (e, _) = driver.event(event)?;
    let s = driver.stream(stream)?;
    // SAFETY: both handles are live.
    check(unsafe { sys::cuStreamWaitEvent(s, e, 0) })
}

pub(super) fn stream_query(driver: &CudaDriver, stream: StreamHandle) -> Result<bool, DriverError> {
    let s = driver.stream(stream)?;
    // SAFETY: `s` is a live stream.
    ready(unsafe { sys::cuStreamQuery(s) })
}

pub(super) fn stream_synchronize(
    driver: &CudaDriver,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    // SAFETY: `s` is a live stream.
    check(unsafe { sys::cuStreamSynchronize(s) })
}
