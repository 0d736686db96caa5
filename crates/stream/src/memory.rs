//! Where device buffers and pinned host buffers get their memory: resources the layer above
//! can replace (the caching allocators install themselves here), so this layer never
//! depends on the allocators.
use crate::{Result, StreamError};
use ferrocuda_driver::Driver;
use ferrocuda_types::{DeviceIndex, DevicePtr, HostRange, StreamHandle};
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

/// Page-locked host memory for [`PinnedBuffer`](crate::PinnedBuffer)s.
pub trait HostMemoryResource: Send + Sync + std::fmt::Debug {
    /// `bytes` of page-locked host memory (never called with 0), asked for while `stream` is
    /// the current stream (a stream capture routes it to the capture's private pool).
    fn allocate_host(&self, bytes: u64, stream: StreamHandle) -> Result<HostRange>;
    /// Gives memory back; it is not reused before the work its recorded streams had
    /// enqueued completes.
    fn free_host(&self, range: HostRange) -> Result<()>;
    /// Notes that the work enqueued on `stream` so far uses the memory at `range` (PyTorch's
    /// `CachingHostAllocator_recordEvent`, which non-blocking copies call).
    fn record_host_use(&self, range: HostRange, stream: StreamHandle) -> Result<()>;
    /// How many threads stage a large copy from pageable memory to a device
    /// (`pageable_copy_threads`, kept with the pinned host allocator's configuration; see
    /// [`DeviceBuffer::copy_from_host`](crate::DeviceBuffer::copy_from_host)): 0, the default,
    /// leaves the copy to the driver.
    fn pageable_copy_threads(&self) -> usize {
        0
    }
}

/// Straight `cuMemHostAlloc`/`cuMemFreeHost`: the default until a caching host allocator is
/// installed. `cuMemFreeHost` waits for the device, so there is nothing to record.
#[derive(Debug)]
pub struct DriverHostMemory(pub Arc<dyn Driver>);

impl HostMemoryResource for DriverHostMemory {
    fn allocate_host(&self, bytes: u64, _stream: StreamHandle) -> Result<HostRange> {
        Ok(HostRange::whole(self.0.host_alloc(bytes)?))
    }

    fn free_host(&self, range: HostRange) -> Result<()> {
        Ok(self.0.host_free(range.base)?)
    }

    fn record_host_use(&self, _range: HostRange, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }
}
