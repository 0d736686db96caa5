//! Events on the real driver: made with their flags, recorded, timed and destroyed
//! (`cuEventCreate`, `cuEventRecord`, `cuEventElapsedTime`, `cuEventDestroy`), each handle
//! checked against the registry.
use super::{CudaDriver, check, ready};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, EventFlags, EventHandle, StreamHandle};

pub(super) fn event_create(
    driver: &CudaDriver,
    dev: DeviceIndex,
    flags: EventFlags,
) -> Result<EventHandle, DriverError> {
    use sys::CUevent_flags as F;
    let l = driver.bind(dev)?;
    let mut bits = 0;
    if !flags.timing {
        bits |= F::CU_EVENT_DISABLE_TIMING as u32;
    }
    if flags.blocking {
        bits |= F::CU_EVENT_BLOCKING_SYNC as u32;
    }
    if flags.interprocess {
        bits |= F::CU_EVENT_INTERPROCESS as u32;
    }
    let mut e = std::ptr::null_mut();
    // SAFETY: a context is current; writes through a valid pointer.
    check(unsafe { sys::cuEventCreate(&mut e, bits) })?;
    l.registry.write().events.insert(e as u64, (dev.0, flags));
    Ok(EventHandle {
        device: dev,
        raw: e as u64,
    })
}

pub(super) fn event_destroy(driver: &CudaDriver, event: EventHandle) -> Result<(), DriverError> {
    let l = driver.bind(event.device)?;
    l.registry
        .write()
        .events
        .remove(&event.raw)
        .ok_or(DriverError::INVALID_HANDLE)?;
    // SAFETY: the event was live (registry) and is destroyed once.
    check(unsafe { sys::cuEventDestroy_v2(event.raw as sys::CUevent) })
}

pub(super) fn event_record(
    driver: &CudaDriver,
    event: EventHandle,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let (e, _) = driver.event(event)?;
    let s = driver.stream(stream)?;
    // SAFETY: both handles are live.
    check(unsafe { sys::cuEventRecord(e, s) })
}

pub(super) fn event_elapsed_ms(
    driver: &CudaDriver,
    start: EventHandle,
    end: EventHandle,
) -> Result<f32, DriverError> {
    let (a, _) = driver.event(start)?;
    let (b, _) = driver.event(end)?;
    // SAFETY: both events are live.
    unsafe { cudarc::driver::result::event::elapsed(a, b) }
        .map_err(|e| DriverError::from_code(e.0 as i32))
}

pub(super) fn event_query(driver: &CudaDriver, event: EventHandle) -> Result<bool, DriverError> {
    let (e, _) = driver.event(event)?;
    // SAFETY: `e` is live.
    ready(unsafe { sys::cuEventQuery(e) })
}

pub(super) fn event_synchronize(
    driver: &CudaDriver,
    event: EventHandle,
) -> Result<(), DriverError> {
    let (e, _) = driver.event(event)?;
    // SAFETY: `e` is live.
    check(unsafe { sys::cuEventSynchronize(e) })
}
