//! Peer access between the fake's devices: which pairs can (every pair of distinct devices,
//! unless [`FakeDriverBuilder::no_peer_access`] says otherwise), which are enabled
//! (`cuCtxEnablePeerAccess`, with the driver's error codes), and how cross-device copies ran:
//! directly when the copying stream's device has access to the other device (which then
//! needs the far side's virtual-memory mappings opened to it by `cuMemSetAccess`, or the copy
//! is `CUDA_ERROR_ILLEGAL_ADDRESS` at once), staged through the host otherwise.
use super::Call;
use super::{FakeDriver, FakeDriverBuilder, State};
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr};
use std::collections::HashSet;

/// How many cross-device copies the fake ran each way ([`FakeDriver::peer_copies`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerCopies {
    /// Over peer access (the stream's device had it enabled to the other device).
    pub direct: u64,
    /// Staged through the host by the driver (no peer access enabled).
    pub staged: u64,
}

/// The peer-access state of a fake driver.
#[derive(Debug, Default)]
pub(super) struct Peers {
    /// `(dev, peer)` pairs where `dev` cannot access `peer`.
    unsupported: HashSet<(u16, u16)>,
    /// `(dev, peer)` pairs where `dev`'s context has access to `peer` enabled.
    enabled: HashSet<(u16, u16)>,
    copies: PeerCopies,
}

impl Peers {
    pub(super) fn new(unsupported: &[(u16, u16)]) -> Peers {
        Peers {
            unsupported: unsupported.iter().copied().collect(),
            ..Peers::default()
        }
    }

    fn can(&self, dev: DeviceIndex, peer: DeviceIndex) -> bool {
        dev != peer && !self.unsupported.contains(&(dev.0, peer.0))
    }
}

impl FakeDriverBuilder {
    /// Device `dev` cannot access `peer`'s memory (`cuDeviceCanAccessPeer` answers 0; by
    /// default every pair of distinct devices can, as on an NVLink machine).
    pub fn no_peer_access(mut self, dev: DeviceIndex, peer: DeviceIndex) -> Self {
        self.no_peer.push((dev.0, peer.0));
        self
    }
}

impl FakeDriver {
    /// How many cross-device copies ran directly and how many were staged.
    pub fn peer_copies(&self) -> PeerCopies {
        self.state.lock().peers.copies
    }

    /// Whether `dev`'s context has access to `peer` enabled.
    pub fn peer_access_enabled(&self, dev: DeviceIndex, peer: DeviceIndex) -> bool {
        self.state.lock().peers.enabled.contains(&(dev.0, peer.0))
    }
}

impl State {
    pub(super) fn can_access_peer(
        &self,
        dev: DeviceIndex,
        peer: DeviceIndex,
    ) -> Result<bool, DriverError> {
        self.check_device(dev)?;
        self.check_device(peer)?;
        Ok(self.peers.can(dev, peer))
    }

    pub(super) fn enable_peer(
        &mut self,
        dev: DeviceIndex,
        peer: DeviceIndex,
    ) -> Result<(), DriverError> {
        self.check_device(dev)?;
        self.check_device(peer)?;
        if dev == peer {
            return Err(DriverError::INVALID_DEVICE);
        }
        if !self.peers.can(dev, peer) {
            return Err(DriverError::PEER_ACCESS_UNSUPPORTED);
        }
        if !self.peers.enabled.insert((dev.0, peer.0)) {
            return Err(DriverError::PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    }

    /// `cuMemSetAccess` of `[at, at + bytes)` for `dev`, the memory's device or a peer.
    pub(super) fn set_access(
        &mut self,
        dev: DeviceIndex,
        at: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.check_device(dev)?;
        let owner = super::device_of(at).ok_or(DriverError::INVALID_VALUE)?;
        if owner == dev {
            return self.memory.set_access(at, bytes);
        }
        self.check_device(owner)?;
        if !self.peers.can(dev, owner) {
            return Err(DriverError::INVALID_DEVICE);
        }
        self.memory.set_peer_access(at, bytes, dev)
    }

    /// Decides how a copy between `dst` and `src` on a stream of `on` runs, counts it, and
    /// checks a direct copy's access to the far side.
    pub(super) fn route_peer_copy(
        &mut self,
        on: DeviceIndex,
        dst: (DeviceIndex, DevicePtr),
        src: (DeviceIndex, DevicePtr),
        bytes: u64,
    ) -> Result<(), DriverError> {
        let far = [dst, src].into_iter().find(|(d, _)| *d != on);
        match far {
            Some((d, ptr)) if self.peers.enabled.contains(&(on.0, d.0)) => {
                if !self.memory.peer_accessible(ptr, bytes, on) {
                    return Err(DriverError::ILLEGAL_ADDRESS);
                }
                self.peers.copies.direct += 1;
            }
            _ => self.peers.copies.staged += 1,
        }
        Ok(())
    }
}

pub(super) fn device_can_access_peer(
    driver: &FakeDriver,
    dev: DeviceIndex,
    peer: DeviceIndex,
) -> Result<bool, DriverError> {
    driver
        .enter(Call::DeviceCanAccessPeer)?
        .can_access_peer(dev, peer)
}
