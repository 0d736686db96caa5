//! Adopting another library's stream on the fake device: in tests the fake also plays that
//! library, so the stream is one it made; adopting checks that it exists.
use super::{Call, FakeDriver};
use crate::{DriverError, ExternalStream};
use ferrocuda_types::{DeviceIndex, StreamHandle};

impl FakeDriver {
    pub(super) fn adopt_stream(
        &self,
        dev: DeviceIndex,
        stream: ExternalStream,
    ) -> Result<StreamHandle, DriverError> {
        let st = self.enter(Call::StreamAdopt)?;
        let handle = StreamHandle {
            device: dev,
            raw: stream.raw(),
        };
        st.stream_key(handle)?;
        Ok(handle)
    }
}
