//! The fake's state asked about the handles a call was given: fresh ids, devices, streams,
//! events, device and host ranges, graphs (a handle of another object, or one made up, is
//! the driver's typed error).
use super::addresses::device_of;
use super::{FakeEvent, FakeGraph, State, StreamKey};
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr, EventHandle, GraphHandle, HostPtr, StreamHandle};

impl State {
    pub(super) fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub(super) fn check_device(&self, dev: DeviceIndex) -> Result<(), DriverError> {
        if dev.as_usize() < self.devices {
            Ok(())
        } else {
            Err(DriverError::INVALID_DEVICE)
        }
    }

    pub(super) fn stream_key(&self, s: StreamHandle) -> Result<StreamKey, DriverError> {
        let key = (s.device.0, s.raw);
        match self.streams.get(&key) {
            Some(_) if self.foreign.get(&key) == Some(&0) => Err(DriverError::INVALID_HANDLE),
            Some(_) => Ok(key),
            None if s.device.as_usize() >= self.devices => Err(DriverError::INVALID_DEVICE),
            None => Err(DriverError::INVALID_HANDLE),
        }
    }

    pub(super) fn event(&self, e: EventHandle) -> Result<&FakeEvent, DriverError> {
        self.events
            .get(&e.raw)
            .filter(|ev| ev.device == e.device)
            .ok_or(DriverError::INVALID_HANDLE)
    }

    pub(super) fn dev_ptr_check(
        &self,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<DeviceIndex, DriverError> {
        self.memory
            .check(ptr, bytes)
            .map_err(|_| DriverError::INVALID_VALUE)?;
        device_of(ptr).ok_or(DriverError::INVALID_VALUE)
    }

    pub(super) fn host_range(
        &self,
        h: HostPtr,
        offset: u64,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let buf = self.hosts.get(&h.raw).ok_or(DriverError::INVALID_VALUE)?;
        if offset
            .checked_add(bytes)
            .is_some_and(|end| end <= buf.len() as u64)
        {
            Ok(())
        } else {
            Err(DriverError::INVALID_VALUE)
        }
    }

    pub(super) fn graph(&self, g: GraphHandle) -> Result<&FakeGraph, DriverError> {
        self.graphs
            .get(&g.raw)
            .filter(|x| x.device == g.device)
            .ok_or(DriverError::INVALID_HANDLE)
    }
}
