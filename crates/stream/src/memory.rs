//! Where device buffers get their memory: a resource the layer above can replace (the
//! caching allocator installs itself here), so this layer never depends on the allocator.
use crate::{Result, StreamError};
use ferrocuda_driver::Driver;
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use std::sync::Arc;

/// Device memory for [`DeviceBuffer`](crate::DeviceBuffer)s.
pub trait MemoryResource: Send + Sync + std::fmt::Debug {
    /// `bytes` on `dev`, for use on `stream` (never called with 0 bytes).
    fn allocate(&self, dev: DeviceIndex, bytes: u64, stream: StreamHandle) -> Result<DevicePtr>;
    /// Gives memory back.
    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<()>;
    /// Notes that `stream` uses the memory at `ptr`, so it is not reused before the work
    /// enqueued there so far has completed (`Tensor.record_stream`).
    fn record_stream(&self, dev: DeviceIndex, ptr: DevicePtr, stream: StreamHandle) -> Result<()>;
    /// `dev` has just been given access to `dev_to_access`'s memory
    /// ([`Runtime::get_p2p_access`](crate::Runtime::get_p2p_access)): memory of
    /// `dev_to_access` whose access is set per device (expandable segments) must be opened
    /// to `dev`, now and when mapped later (PyTorch's allocator `enablePeerAccess`, after
    /// the driver's). Nothing to do by default: `cuMemAlloc` memory follows the context.
    fn add_peer_access(&self, dev: DeviceIndex, dev_to_access: DeviceIndex) -> Result<()> {
        let _ = (dev, dev_to_access);
        Ok(())
    }
}

/// Straight `cuMemAlloc`/`cuMemFree`: the default until an allocator is installed.
#[derive(Debug)]
pub struct DriverMemory(pub Arc<dyn Driver>);

impl MemoryResource for DriverMemory {
    fn allocate(&self, dev: DeviceIndex, bytes: u64, _stream: StreamHandle) -> Result<DevicePtr> {
        self.0.malloc(dev, bytes).map_err(StreamError::from)
    }

    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<()> {
        self.0.free(dev, ptr).map_err(StreamError::from)
    }

    fn record_stream(
        &self,
        _dev: DeviceIndex,
        _ptr: DevicePtr,
        _stream: StreamHandle,
    ) -> Result<()> {
        // cuMemFree waits for the device; nothing to track.
        Ok(())
    }
}
