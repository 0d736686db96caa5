//! Descriptions of driver acts: kernel launches, memsets, stream/event flags, capture modes.
use crate::{DeviceIndex, DevicePtr};
use serde::{Deserialize, Serialize};

/// Grid, block and dynamic shared memory of one kernel launch.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch covering `n` elements with `threads` threads per block.
    pub fn for_elements(n: usize, threads: u32) -> LaunchConfig {
        let threads = threads.max(1);
        let blocks = n.div_ceil(threads as usize).clamp(1, u32::MAX as usize) as u32;
        LaunchConfig {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Total threads in the launch.
    pub fn total_threads(&self) -> u64 {
        let (gx, gy, gz) = self.grid;
        let (bx, by, bz) = self.block;
        [gx, gy, gz, bx, by, bz]
            .iter()
            .map(|&v| u64::from(v))
            .product()
    }
}

/// One kernel argument. Device pointers carry their device so that the stream layer can
/// refuse a launch that mixes devices; drivers only look at the bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum KernelArg<'a> {
    /// A value passed by copy: the bytes of any `Pod` type.
    Value(&'a [u8]),
    /// A pointer into device memory of `device`.
    Ptr {
        /// The device that owns the memory.
        device: DeviceIndex,
        /// The address.
        ptr: DevicePtr,
    },
}

impl<'a> KernelArg<'a> {
    /// A by-value argument.
    pub fn value<T: bytemuck::Pod>(v: &'a T) -> KernelArg<'a> {
        KernelArg::Value(bytemuck::bytes_of(v))
    }

    /// The argument's bytes, as the kernel receives them.
    pub fn bytes(&self) -> &[u8] {
        match self {
            KernelArg::Value(b) => b,
            KernelArg::Ptr { ptr, .. } => bytemuck::bytes_of(ptr),
        }
    }
}

/// The value a memset writes, with its width (`cuMemsetD8/D16/D32`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemsetValue {
    /// One byte per element.
    U8(u8),
    /// Two bytes per element.
    U16(u16),
    /// Four bytes per element.
    U32(u32),
}

impl MemsetValue {
    /// Bytes per element.
    pub const fn width(self) -> u64 {
        match self {
            MemsetValue::U8(_) => 1,
            MemsetValue::U16(_) => 2,
            MemsetValue::U32(_) => 4,
        }
    }

    /// The little-endian bytes of one element.
    pub fn element_bytes(self) -> Vec<u8> {
        match self {
            MemsetValue::U8(v) => vec![v],
            MemsetValue::U16(v) => v.to_le_bytes().to_vec(),
            MemsetValue::U32(v) => v.to_le_bytes().to_vec(),
        }
    }
}

/// How a stream is created.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StreamFlags {
    /// Does not synchronize with the legacy default stream (`CU_STREAM_NON_BLOCKING`).
    /// PyTorch creates all its streams this way.
    pub non_blocking: bool,
    /// Priority: lower numbers run first, as in CUDA and PyTorch (`-1` is high, `0` normal).
    pub priority: i32,
}

/// How an event is created (`torch.cuda.Event(enable_timing, blocking, interprocess)`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EventFlags {
    /// Records timestamps so that `elapsed_time` works.
    pub timing: bool,
    /// `synchronize` blocks the thread instead of spinning (`CU_EVENT_BLOCKING_SYNC`).
    pub blocking: bool,
    /// Can be shared with another process (`CU_EVENT_INTERPROCESS`; needs timing off).
    pub interprocess: bool,
}

/// The capture mode of `cuStreamBeginCapture` (graphs spec §8.2).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CaptureMode {
    /// Unsafe calls fail on any thread while the capture is open (CUDA's default).
    #[default]
    Global,
    /// Unsafe calls fail only on the capturing thread.
    ThreadLocal,
    /// No call is refused because of the capture.
    Relaxed,
}

/// What `cuStreamIsCapturing` / `cuStreamGetCaptureInfo` report for a stream.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CaptureStatus {
    /// Not capturing.
    None,
    /// Capturing; `id` is unique for the process and never 0.
    Active {
        /// The capture sequence id.
        id: u64,
    },
    /// The capture broke and must be ended.
    Invalidated,
}
