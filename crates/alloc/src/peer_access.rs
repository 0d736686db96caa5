//! Opening this device's expandable segments to a peer device (PyTorch's
//! `DeviceCachingAllocator::addPeerAccess` and `ExpandableSegment::addPeer`,
//! c10/cuda/CUDACachingAllocator.cpp): every page mapped now gets `cuMemSetAccess` for the
//! peer, and every page mapped later gets it as it is mapped
//! ([`Engine::map_pages`](crate::engine::Engine)). `cuMemAlloc` segments need nothing: their
//! access follows the peer's context.
use crate::{AllocError, CachingAllocator};
use ferrocuda_types::{DeviceIndex, DevicePtr};

impl CachingAllocator {
    /// Lets `peer` access this device's expandable segments, now and as they grow (the
    /// caller has enabled `peer`'s access to this device in the driver). Idempotent; this
    /// device itself is a no-op. If a `cuMemSetAccess` fails, the peer is not recorded
    /// (a later call tries again) and the error is returned.
    ///
    /// This holds the allocator lock across the `cuMemSetAccess` calls (PyTorch holds its
    /// mutex too): it happens once per pair of devices, and no page may be mapped or
    /// unmapped between listing the mapped pages and opening them.
    pub fn add_peer_access(&self, peer: DeviceIndex) -> Result<(), AllocError> {
        let engine = &self.engine;
        let mut peers = engine.peers.write();
        if peer == engine.device || peers.contains(&peer) {
            return Ok(());
        }
        let st = engine.lock();
        for (addr, bytes) in st.expandable.mapped_runs() {
            engine.driver.vm_set_access(peer, DevicePtr(addr), bytes)?;
        }
        drop(st);
        peers.push(peer);
        Ok(())
    }

    /// The devices given access to this device's expandable segments, in the order added.
    pub fn peers(&self) -> Vec<DeviceIndex> {
        self.engine.peers.read().clone()
    }
}
