//! Peer access between devices on the real driver (`cuDeviceCanAccessPeer`,
//! `cuCtxEnablePeerAccess`): what [`Driver::device_can_access_peer`] and
//! [`Driver::enable_peer_access`] do. The policy (PyTorch's cache, "already enabled is
//! fine") lives in the stream layer.
//!
//! [`Driver::device_can_access_peer`]: crate::Driver::device_can_access_peer
//! [`Driver::enable_peer_access`]: crate::Driver::enable_peer_access
use super::{CudaDriver, check};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::DeviceIndex;

impl CudaDriver {
    /// The `CUdevice` of `dev`.
    fn cu_device(&self, dev: DeviceIndex) -> Result<sys::CUdevice, DriverError> {
        let l = self.loaded()?;
        let slot = l.devices.get(dev.as_usize());
        Ok(slot.ok_or(DriverError::INVALID_DEVICE)?.device)
    }

    /// `dev`'s primary context, retained (and made current) if it was not yet.
    pub(super) fn primary_context(&self, dev: DeviceIndex) -> Result<sys::CUcontext, DriverError> {
        let l = self.bind(dev)?;
        let slot = l.devices.get(dev.as_usize());
        match slot.ok_or(DriverError::INVALID_DEVICE)?.context.get() {
            Some(Ok(c)) => Ok(*c as sys::CUcontext),
            _ => Err(DriverError::INVALID_CONTEXT),
        }
    }

    pub(super) fn can_access_peer(
        &self,
        dev: DeviceIndex,
        peer: DeviceIndex,
    ) -> Result<bool, DriverError> {
        let (d, p) = (self.cu_device(dev)?, self.cu_device(peer)?);
        let mut can = 0;
        // SAFETY: both devices came from cuDeviceGet; writes through a valid pointer.
        check(unsafe { sys::cuDeviceCanAccessPeer(&mut can, d, p) })?;
        Ok(can != 0)
    }

    pub(super) fn enable_peer(
        &self,
        dev: DeviceIndex,
        peer: DeviceIndex,
    ) -> Result<(), DriverError> {
        if dev == peer {
            return Err(DriverError::INVALID_DEVICE);
        }
        let peer_ctx = self.primary_context(peer)?;
        self.bind(dev)?;
        // SAFETY: `peer_ctx` is a retained primary context, never released while we live;
        // `dev`'s primary context is current on this thread (bind).
        check(unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) })
    }
}
