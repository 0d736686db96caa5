//! `torch.cuda`'s device, stream, event and kernel semantics over a [`Driver`].
//!
//! A [`Runtime`] wraps one driver (real or fake) and provides what `torch.cuda` users know:
//! the current device per thread and [`DeviceGuard`] (`with torch.cuda.device(i)`), the
//! legacy default stream, a round-robin pool of 32 streams per priority, the current stream
//! per (thread, device) and [`StreamGuard`] (`with torch.cuda.stream(s)`), events with
//! timing, kernels compiled from CUDA C++ with an on-disk cache, a minimal typed
//! [`DeviceBuffer`], and a pinned host [`PinnedBuffer`] with non-blocking copies.
//!
//! # Design choices
//! - **Lazy initialisation, as PyTorch's.** Making a [`Runtime`] asks the driver nothing;
//!   the first call that needs a device initialises CUDA ([`Runtime::init`],
//!   [`Runtime::is_initialized`]). In a child forked after that, every such call is
//!   [`StreamError::BadFork`], with PyTorch's message. [`Runtime::device_count`] asks NVML
//!   until CUDA is initialised, and [`AvailabilityCheck`] (PyTorch's
//!   `PYTORCH_NVML_BASED_CUDA_CHECK`) decides whether `is_available` does too.
//! - **`Arc<dyn Driver>`, not generics.** The backend is chosen at run time (GPU when
//!   present, the fake device otherwise); one virtual call per driver act costs nothing next
//!   to a launch.
//! - **Thread-local current state, keyed by runtime.** Several runtimes (a fake one in a test
//!   beside a real one) never see each other's current device or stream.
//! - **Lazy events**, as PyTorch: an event is created on the device of its first record;
//!   querying or waiting on an unrecorded event is a no-op.
//! - **Ownership decides destruction**: streams made by [`Runtime::new_stream`] die with
//!   their last clone; pool, default and external streams are never destroyed by us.
//! - **`CUDA_LAUNCH_BLOCKING=1`** is honoured by the drivers themselves (libcuda reads it at
//!   init; the fake driver reads it when built).
//! - Device mismatch is checked here, once, not in the driver: a launch whose buffer argument
//!   lives on another device is [`StreamError::DeviceMismatch`].
//! - **Other libraries' streams and buffers**: a cudarc stream is adopted as a [`Stream`]
//!   ([`Runtime::adopt_stream`], `torch.cuda.ExternalStream`'s role: never destroyed by us),
//!   and a [`DeviceBuffer`] is lent to another stream without a copy ([`DeviceBuffer::lend`],
//!   [`DeviceBuffer::cudarc`] for cudarc's pointer traits), the order between the streams
//!   kept by events both ways.
//!
//! # What the layers above must do
//! - Keep allocations alive until the streams using them are done (the caching allocator's
//!   `record_stream` does this for the buffer in the next layer; a [`PinnedBuffer`]'s
//!   non-blocking copies record their stream with its [`HostMemoryResource`], which must
//!   not reuse the memory before that work completes).
//! - Not use guards across threads (they are `!Send`).
//! - A [`MemoryResource`] reports out of memory as [`MemoryError::OutOfMemory`] with its
//!   figures, so a buffer user can read them ([`StreamError::Memory`] prints the report's
//!   own text); a bad device or a driver failure as the variants this crate has for them.
#![forbid(unsafe_code)]

mod availability;
mod buffer;
mod error;
mod event;
mod interop;
mod memory;
mod module;
mod peer;
mod per_device;
mod pinned_buffer;
mod runtime;
mod stream;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use availability::AvailabilityCheck;
pub use buffer::DeviceBuffer;
pub use error::{MemoryError, Result, StreamError};
pub use event::Event;
pub use ferrocuda_driver::Driver;
pub use interop::Lent;
pub use memory::{DriverHostMemory, DriverMemory, HostMemoryResource, MemoryResource};
pub use module::{CacheOutcome, Function, KernelCache, Module};
pub use per_device::PerDevice;
pub use pinned_buffer::PinnedBuffer;
pub use runtime::{DeviceGuard, Runtime, STREAMS_PER_POOL, StreamGuard};
pub use stream::Stream;
