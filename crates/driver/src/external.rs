//! Streams made by someone else (PyTorch's `cudaStream_t`), and the proof that one is live.
use ferrocuda_types::StreamHandle;
use std::ffi::c_void;

/// A stream this process's other CUDA user made (PyTorch's `cudaStream_t`), to be adopted
/// by [`Driver::stream_adopt`](crate::Driver::stream_adopt): registered so the driver's
/// handle checks accept it, never destroyed by ferrocuda.
///
/// A raw pointer can only become one through the `unsafe` [`ExternalStream::from_raw`],
/// whose caller vouches that it names a live stream: that is what lets the real driver hand
/// it to libcuda. [`ExternalStream::of_fake`] makes one safely for tests on the fake device;
/// the real driver refuses those.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ExternalStream {
    raw: u64,
    vouched: bool,
}

impl ExternalStream {
    /// The legacy default stream (a null `cudaStream_t`), which every context has.
    pub const LEGACY: ExternalStream = ExternalStream {
        raw: 0,
        vouched: true,
    };

    /// A stream from its raw `cudaStream_t` / `CUstream`.
    ///
    /// # Safety
    /// `raw` is null (the legacy default stream) or a stream handle of the CUDA driver
    /// loaded in this process (a `cudaStream_t` or `CUstream`, `cudaStreamPerThread`
    /// included) that is live now and stays live while ferrocuda may use it: until every
    /// allocation made or recorded on it has been freed and the work it was used by has
    /// completed (what PyTorch's native allocator assumes of the streams it is given).
    pub unsafe fn from_raw(raw: *mut c_void) -> ExternalStream {
        ExternalStream {
            raw: raw.addr() as u64,
            vouched: true,
        }
    }

    /// A stream of the fake device standing in for another library's stream. The fake
    /// driver adopts it if it exists; the real driver refuses it (nobody vouched that the
    /// value is a live CUDA stream).
    pub fn of_fake(stream: StreamHandle) -> ExternalStream {
        ExternalStream {
            raw: stream.raw,
            vouched: stream.raw == 0,
        }
    }

    /// The raw handle.
    pub fn raw(self) -> u64 {
        self.raw
    }

    /// Whether the raw value was vouched for as a live CUDA stream ([`ExternalStream::from_raw`]).
    pub fn is_vouched(self) -> bool {
        self.vouched
    }
}
