//! Streams other libraries made (cudarc's), adopted into the registry without being owned:
//! what [`Driver::stream_adopt`](crate::Driver::stream_adopt) and
//! [`Driver::stream_forget`](crate::Driver::stream_forget) do on the real driver.
use super::{CudaDriver, check};
use crate::DriverError;
use crate::interop::{ForeignStream, Origin};
use cudarc::driver::sys;
use ferrocuda_types::StreamHandle;

/// Registers a cudarc stream, or a raw stream vouched for (PyTorch's), of `dev`'s primary
/// context (the one this driver binds).
pub(super) fn adopt(
    driver: &CudaDriver,
    foreign: &ForeignStream,
) -> Result<StreamHandle, DriverError> {
    let dev = foreign.device();
    let l = driver.bind(dev)?;
    let ours = l.devices.get(dev.as_usize());
    let ours = ours.and_then(|slot| slot.context.get()?.as_ref().ok());
    let theirs = match foreign.origin() {
        Origin::Cudarc(stream) => stream.context().cu_ctx() as usize,
        Origin::Raw if foreign.raw() == 0 => return Ok(StreamHandle::legacy(dev)),
        Origin::Raw => {
            let mut ctx = std::ptr::null_mut();
            // SAFETY: a `Raw` foreign stream names a live stream of this process's driver
            // (the contract of `ForeignStream::from_raw`); writes through a valid pointer.
            check(unsafe { sys::cuStreamGetCtx(foreign.raw() as sys::CUstream, &mut ctx) })?;
            ctx as usize
        }
        Origin::Fake => return Err(DriverError::INVALID_HANDLE),
    };
    if ours != Some(&theirs) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CudaDriver, Driver};
    use ferrocuda_types::DeviceIndex;

    const GPU: DeviceIndex = DeviceIndex(0);

    #[cfg(feature = "c-export")]
    fn current_context() -> Result<usize, DriverError> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: writes through a valid pointer; the driver is loaded.
        check(unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
        Ok(ctx as usize)
    }

    /// A raw stream made behind the driver's back (as PyTorch makes its own) is unknown
    /// until adopted, usable after, never destroyed by the driver. With the C functions
    /// built in, a driver act inside a `ContextScope` on a thread with no current context
    /// leaves it with none.
    #[test]
    #[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
    fn a_raw_stream_is_adopted_checked_and_never_destroyed() -> Result<(), DriverError> {
        let d = CudaDriver::new();
        d.bind(GPU)?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: writes through a valid pointer, in the bound primary context.
        check(unsafe { sys::cuStreamCreate(&mut raw, flags) })?;
        let handle = StreamHandle {
            device: GPU,
            raw: raw as u64,
        };
        assert_eq!(d.stream_query(handle), Err(DriverError::INVALID_HANDLE));
        // SAFETY: `raw` is a live stream of this process's driver until destroyed below.
        let foreign = unsafe { ForeignStream::from_raw(GPU, raw.cast()) };
        assert_eq!(d.stream_adopt(&foreign)?, handle);
        let ev = d.event_create(GPU, Default::default())?;
        d.event_record(ev, handle)?;
        d.event_synchronize(ev)?;
        d.event_destroy(ev)?;
        assert_eq!(d.stream_destroy(handle), Err(DriverError::INVALID_HANDLE));
        assert!(d.stream_query(handle)?, "still alive, still adopted");
        // SAFETY: null is the legacy default stream.
        let legacy = unsafe { ForeignStream::from_raw(GPU, std::ptr::null_mut()) };
        assert_eq!(d.stream_adopt(&legacy)?, StreamHandle::legacy(GPU));
        #[cfg(feature = "c-export")]
        std::thread::scope(|t| {
            t.spawn(|| -> Result<(), DriverError> {
                assert_eq!(current_context()?, 0, "a new thread has no context");
                let scope = crate::cuda::context_scope::ContextScope::enter();
                d.stream_query(handle)?; // binds the primary context
                assert_ne!(current_context()?, 0);
                drop(scope);
                assert_eq!(current_context()?, 0, "put back");
                Ok(())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })?;
        d.stream_forget(handle)?;
        assert_eq!(d.stream_query(handle), Err(DriverError::INVALID_HANDLE));
        // SAFETY: the stream is ours (made above) and destroyed once.
        check(unsafe { sys::cuStreamDestroy_v2(raw) })
    }
}
