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
