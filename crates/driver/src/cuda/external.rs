//! Adopting another library's stream (PyTorch's `cudaStream_t`) on the real driver: checked
//! against the device's primary context, registered so every handle check accepts it, and
//! marked so that `stream_destroy` never destroys it.
use super::{CudaDriver, check};
use crate::{DriverError, ExternalStream};
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, StreamHandle};

impl CudaDriver {
    pub(super) fn adopt_stream(
        &self,
        dev: DeviceIndex,
        stream: ExternalStream,
    ) -> Result<StreamHandle, DriverError> {
        let l = self.bind(dev)?;
        let handle = StreamHandle {
            device: dev,
            raw: stream.raw(),
        };
        if stream.raw() == 0 || l.registry.read().streams.contains(&(dev.0, stream.raw())) {
            return Ok(handle);
        }
        if !stream.is_vouched() {
            return Err(DriverError::INVALID_HANDLE);
        }
        let mut ctx = std::ptr::null_mut();
        // SAFETY: a vouched `ExternalStream` names a live stream of this process's driver
        // (the contract of `ExternalStream::from_raw`); writes through a valid pointer.
        check(unsafe { sys::cuStreamGetCtx(stream.raw() as sys::CUstream, &mut ctx) })?;
        if Some(ctx as usize) != self.primary_context(dev) {
            return Err(DriverError::INVALID_CONTEXT);
        }
        let mut registry = l.registry.write();
        registry.streams.insert((dev.0, stream.raw()));
        registry.adopted.insert((dev.0, stream.raw()));
        Ok(handle)
    }

    /// Whether `stream` was adopted (so is not ours to destroy).
    pub(super) fn is_adopted(&self, stream: StreamHandle) -> bool {
        self.loaded().is_ok_and(|l| {
            l.registry
                .read()
                .adopted
                .contains(&(stream.device.0, stream.raw))
        })
    }
}

impl CudaDriver {
    /// `dev`'s primary context (its address), once bound.
    fn primary_context(&self, dev: DeviceIndex) -> Option<usize> {
        let l = self.loaded().ok()?;
        l.devices
            .get(dev.as_usize())?
            .context
            .get()?
            .as_ref()
            .ok()
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Driver;

    const GPU: DeviceIndex = DeviceIndex(0);

    #[cfg(feature = "c-export")]
    fn current_context() -> Result<usize, DriverError> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: writes through a valid pointer; the driver is loaded.
        check(unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
        Ok(ctx as usize)
    }

    /// A stream made behind the driver's back (as PyTorch makes its own) is unknown until
    /// adopted, usable after, never destroyed by the driver; a value nobody vouched for is
    /// refused. With the C functions built in, a driver act inside a `ContextScope` on a
    /// thread with no current context leaves it with none.
    #[test]
    #[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
    fn a_foreign_stream_is_adopted_checked_and_never_destroyed() -> Result<(), DriverError> {
        let d = CudaDriver::new();
        d.bind(GPU)?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: writes through a valid pointer, in the bound primary context.
        check(unsafe { sys::cuStreamCreate(&mut raw, flags) })?;
        let foreign = StreamHandle {
            device: GPU,
            raw: raw as u64,
        };
        assert_eq!(d.stream_query(foreign), Err(DriverError::INVALID_HANDLE));
        // SAFETY: `raw` is a live stream of this process's driver until destroyed below.
        let external = unsafe { ExternalStream::from_raw(raw.cast()) };
        let adopted = d.stream_adopt(GPU, external)?;
        assert_eq!(adopted, foreign);
        assert_eq!(d.stream_adopt(GPU, external)?, adopted, "adopting again");
        let ev = d.event_create(GPU, Default::default())?;
        d.event_record(ev, adopted)?;
        d.event_synchronize(ev)?;
        d.event_destroy(ev)?;
        assert_eq!(d.stream_destroy(adopted), Err(DriverError::NOT_PERMITTED));
        assert!(d.stream_query(adopted)?, "still alive");
        let made_up = ExternalStream::of_fake(StreamHandle {
            device: GPU,
            raw: 0x1234,
        });
        assert_eq!(
            d.stream_adopt(GPU, made_up),
            Err(DriverError::INVALID_HANDLE)
        );
        #[cfg(feature = "c-export")]
        std::thread::scope(|t| {
            t.spawn(|| -> Result<(), DriverError> {
                assert_eq!(current_context()?, 0, "a new thread has no context");
                let scope = crate::cuda::context_scope::ContextScope::enter();
                d.stream_query(adopted)?; // binds the primary context
                assert_ne!(current_context()?, 0);
                drop(scope);
                assert_eq!(current_context()?, 0, "put back");
                Ok(())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })?;
        // SAFETY: the stream is ours (made above) and destroyed once.
        check(unsafe { sys::cuStreamDestroy_v2(raw) })?;
        Ok(())
    }
}
