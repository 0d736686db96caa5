//! Handles checked against the registry before libcuda sees them: streams, events, graphs,
//! instances and host ranges this driver made (a handle of another object, or one made up,
//! is a typed error, never a dangling pointer handed to the driver).
use super::CudaDriver;
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{
    EventFlags, EventHandle, GraphExecHandle, GraphHandle, HostPtr, StreamHandle,
};

impl CudaDriver {
    pub(super) fn stream(&self, s: StreamHandle) -> Result<sys::CUstream, DriverError> {
        let l = self.bind(s.device)?;
        if !l.registry.read().knows_stream(s.device.0, s.raw) {
            return Err(DriverError::INVALID_HANDLE);
        }
        Ok(s.raw as sys::CUstream)
    }

    pub(super) fn event(&self, e: EventHandle) -> Result<(sys::CUevent, EventFlags), DriverError> {
        let l = self.bind(e.device)?;
        let flags = match l.registry.read().events.get(&e.raw) {
            Some(&(d, flags)) if d == e.device.0 => flags,
            _ => return Err(DriverError::INVALID_HANDLE),
        };
        Ok((e.raw as sys::CUevent, flags))
    }

    pub(super) fn graph(&self, g: GraphHandle) -> Result<sys::CUgraph, DriverError> {
        let l = self.bind(g.device)?;
        match l.registry.read().graphs.get(&g.raw) {
            Some(&d) if d == g.device.0 => Ok(g.raw as sys::CUgraph),
            _ => Err(DriverError::INVALID_HANDLE),
        }
    }

    pub(super) fn exec(&self, e: GraphExecHandle) -> Result<sys::CUgraphExec, DriverError> {
        let l = self.bind(e.device)?;
        match l.registry.read().execs.get(&e.raw) {
            Some(&d) if d == e.device.0 => Ok(e.raw as sys::CUgraphExec),
            _ => Err(DriverError::INVALID_HANDLE),
        }
    }

    pub(super) fn host(&self, h: HostPtr, offset: u64, bytes: u64) -> Result<*mut u8, DriverError> {
        let l = self.loaded()?;
        let registry = l.registry.read();
        let len = registry
            .hosts
            .get(&h.raw)
            .or_else(|| registry.mallocs.get(&h.raw).map(|(len, _)| len));
        let ok = len.is_some_and(|&len| offset.checked_add(bytes).is_some_and(|end| end <= len));
        if !ok {
            return Err(DriverError::INVALID_VALUE);
        }
        Ok((h.raw + offset) as *mut u8)
    }
}
