//! Peer access between devices, with PyTorch's rules (aten/src/ATen/cuda/PeerToPeerAccess.cpp
//! `get_p2p_access`, c10/cuda/CUDACachingAllocator.cpp `NativeCachingAllocator::
//! enablePeerAccess`, torch/cuda/__init__.py `can_device_access_peer`), and copies between
//! devices with the stream order of aten/src/ATen/native/cuda/Copy.cu
//! `copy_device_to_device`.
use crate::{Result, Runtime, Stream};
use ferrocuda_driver::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr};

impl Runtime {
    /// Whether `dev` can access `peer`'s memory directly
    /// (`torch.cuda.can_device_access_peer`): both must be devices
    /// ([`StreamError::InvalidDevice`](crate::StreamError::InvalidDevice) otherwise); a
    /// device and itself is `false`, as CUDA answers. Enables nothing.
    pub fn can_device_access_peer(&self, dev: DeviceIndex, peer: DeviceIndex) -> Result<bool> {
        self.check_device(dev)?;
        self.check_device(peer)?;
        Ok(self.driver().device_can_access_peer(dev, peer)?)
    }

    /// PyTorch's `at::cuda::get_p2p_access(dev, dev_to_access)`: whether `dev` may access
    /// `dev_to_access`'s memory, enabling that the first time it is asked for a pair that
    /// can. Answers are cached per ordered pair (a device and itself: `true`). Enabling is
    /// idempotent: "already enabled" (access enabled behind our back) is not an error. Once
    /// enabled, the memory resource is told ([`MemoryResource::add_peer_access`]), so the
    /// caching allocator of `dev_to_access` opens its expandable segments to `dev`.
    ///
    /// One difference: PyTorch caches the answer before enabling, so after a failed enable
    /// it answers `true` without access; here a failure is returned and nothing is cached,
    /// so the next call tries again.
    ///
    /// [`MemoryResource::add_peer_access`]: crate::MemoryResource::add_peer_access
    pub fn get_p2p_access(&self, dev: DeviceIndex, dev_to_access: DeviceIndex) -> Result<bool> {
        self.check_device(dev)?;
        self.check_device(dev_to_access)?;
        if dev == dev_to_access {
            return Ok(true);
        }
        let key = (dev.0, dev_to_access.0);
        // Held across the driver calls so that two threads asking for one pair enable it
        // once; it is taken only here, and nothing else is locked inside it but the memory
        // resource's own lock.
        let mut cache = self.peer_access.lock();
        if let Some(&known) = cache.get(&key) {
            return Ok(known);
        }
        let can = self.driver().device_can_access_peer(dev, dev_to_access)?;
        if can {
            match self.driver().enable_peer_access(dev, dev_to_access) {
                Ok(()) => {}
                Err(e) if e == DriverError::PEER_ACCESS_ALREADY_ENABLED => {}
                Err(e) => return Err(e.into()),
            }
            self.memory().add_peer_access(dev, dev_to_access)?;
        }
        cache.insert(key, can);
        Ok(can)
    }

    /// Copies `bytes` from `src` on `src_dev` to `dst` on `dst_dev` as PyTorch's `copy_`
    /// between devices does (Copy.cu `copy_kernel_cuda` then `copy_device_to_device`): peer
    /// access from the source to the destination device is asked for (and enabled when
    /// possible, [`Runtime::get_p2p_access`]); the copy runs on the source device's current
    /// stream after the destination device's current stream (a two-way barrier), and the
    /// destination device's current stream waits for the copy. The driver copies directly
    /// when access is enabled and stages through the host otherwise. On one device it is a
    /// plain copy on that device's current stream. Returns the stream the copy ran on.
    pub fn copy_between_devices(
        &self,
        dst: (DeviceIndex, DevicePtr),
        src: (DeviceIndex, DevicePtr),
        bytes: u64,
    ) -> Result<Stream> {
        let (dst_dev, src_dev) = (dst.0, src.0);
        let copy_stream = self.current_stream(src_dev)?;
        if dst_dev == src_dev {
            if bytes > 0 && dst.1 != src.1 {
                self.driver()
                    .memcpy_dtod_async(dst.1, src.1, bytes, copy_stream.handle())?;
            }
            return Ok(copy_stream);
        }
        self.get_p2p_access(src_dev, dst_dev)?;
        let dst_stream = self.current_stream(dst_dev)?;
        // src waits on dst: nobody is still using the destination when the copy writes it.
        copy_stream.wait_stream(&dst_stream)?;
        if bytes > 0 {
            self.driver()
                .memcpy_peer_async(dst, src, bytes, copy_stream.handle())?;
        }
        // dst waits on src: the destination's users see the copy done.
        dst_stream.wait_stream(&copy_stream)?;
        Ok(copy_stream)
    }
}
