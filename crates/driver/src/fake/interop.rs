//! Streams of "another library" on the fake device, and their adoption
//! ([`Driver::stream_adopt`](crate::Driver::stream_adopt),
//! [`Driver::stream_forget`](crate::Driver::stream_forget)): a foreign stream is a fake
//! stream the driver refuses (`CUDA_ERROR_INVALID_HANDLE`) unless it is adopted, and never
//! destroys, as the real driver treats a cudarc stream.
use super::{FakeDriver, FakeStream, State};
use crate::DriverError;
use crate::interop::{ForeignStream, Origin};
use ferrocuda_types::{DeviceIndex, StreamFlags, StreamHandle};

impl FakeDriver {
    /// A stream made on `dev` by "another library" (the fake's stand-in for a cudarc
    /// stream): non-blocking, unknown to the driver until adopted.
    pub fn foreign_stream(&self, dev: DeviceIndex) -> Result<ForeignStream, DriverError> {
        let mut st = self.state.lock();
        st.check_device(dev)?;
        let raw = st.id();
        let flags = StreamFlags {
            non_blocking: true,
            priority: 0,
        };
        st.streams.insert((dev.0, raw), FakeStream::new(dev, flags));
        st.foreign.insert((dev.0, raw), 0);
        Ok(ForeignStream::fake(dev, raw))
    }

    /// How many times `stream` is adopted now; `None` once it no longer exists (the fake
    /// never destroys one, so `None` means it was never one of its foreign streams).
    pub fn adoptions(&self, stream: &ForeignStream) -> Option<u32> {
        let key = (stream.device().0, stream.raw());
        let st = self.state.lock();
        st.streams.get(&key)?;
        st.foreign.get(&key).copied()
    }
}

pub(super) fn adopt(st: &mut State, foreign: &ForeignStream) -> Result<StreamHandle, DriverError> {
    // A raw handle vouched for is taken as one of the fake's foreign streams, if it is one.
    let (Origin::Fake | Origin::Raw) = foreign.origin() else {
        return Err(DriverError::INVALID_HANDLE);
    };
    let dev = foreign.device();
    st.check_device(dev)?;
    if let (Origin::Raw, 0) = (foreign.origin(), foreign.raw()) {
        return Ok(StreamHandle::legacy(dev));
    }
    let key = (dev.0, foreign.raw());
    let count = st
        .foreign
        .get_mut(&key)
        .ok_or(DriverError::INVALID_HANDLE)?;
    *count += 1;
    Ok(StreamHandle {
        device: dev,
        raw: foreign.raw(),
    })
}

pub(super) fn forget(st: &mut State, stream: StreamHandle) -> Result<(), DriverError> {
    let key = (stream.device.0, stream.raw);
    match st.foreign.get_mut(&key) {
        Some(count) if *count > 0 => {
            *count -= 1;
            Ok(())
        }
        _ => Err(DriverError::INVALID_HANDLE),
    }
}
