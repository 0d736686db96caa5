//! Streams other libraries made (cudarc's), adopted into the registry without being owned:
//! what [`Driver::stream_adopt`](crate::Driver::stream_adopt) and
//! [`Driver::stream_forget`](crate::Driver::stream_forget) do on the real driver.
use super::CudaDriver;
use crate::DriverError;
use crate::interop::{ForeignStream, Origin};
use ferrocuda_types::StreamHandle;

/// Registers a cudarc stream of `dev`'s primary context (the one this driver binds).
pub(super) fn adopt(
    driver: &CudaDriver,
    foreign: &ForeignStream,
) -> Result<StreamHandle, DriverError> {
    let Origin::Cudarc(stream) = foreign.origin() else {
        return Err(DriverError::INVALID_HANDLE);
    };
    let dev = foreign.device();
    let l = driver.bind(dev)?;
    let ours = l.devices.get(dev.as_usize());
    let ours = ours.and_then(|slot| slot.context.get()?.as_ref().ok());
    if ours != Some(&(stream.context().cu_ctx() as usize)) {
        return Err(DriverError::INVALID_CONTEXT);
    }
    let handle = StreamHandle {
        device: dev,
        raw: foreign.raw(),
    };
    if handle.raw != 0 {
        *l.registry
            .write()
            .adopted
            .entry((dev.0, handle.raw))
            .or_insert(0) += 1;
    }
    Ok(handle)
}

/// Ends one adoption; the stream is its maker's to destroy.
pub(super) fn forget(driver: &CudaDriver, stream: StreamHandle) -> Result<(), DriverError> {
    let l = driver.bind(stream.device)?;
    if stream.raw == 0 {
        return Ok(());
    }
    let mut reg = l.registry.write();
    let key = (stream.device.0, stream.raw);
    let count = reg
        .adopted
        .get_mut(&key)
        .ok_or(DriverError::INVALID_HANDLE)?;
    *count -= 1;
    if *count == 0 {
        reg.adopted.remove(&key);
    }
    Ok(())
}
