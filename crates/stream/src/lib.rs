//! `torch.cuda`'s device, stream, event and kernel semantics over a [`Driver`].
//!
//! A [`Runtime`] wraps one driver (real or fake) and provides what `torch.cuda` users know:
//! the current device per thread and [`DeviceGuard`] (`with torch.cuda.device(i)`), the
//! legacy default stream, a round-robin pool of 32 streams per priority, the current stream
//! per (thread, device) and [`StreamGuard`] (`with torch.cuda.stream(s)`), events with
//! timing, kernels compiled from CUDA C++ with an on-disk cache, a minimal typed
//! [`DeviceBuffer`], and a pinned host [`PinnedBuffer`] with non-blocking copies.
//!
//! # Example
//! ```
//! use ferrocuda_driver::FakeDriver;
//! use ferrocuda_stream::{DeviceBuffer, Runtime};
//! use ferrocuda_types::DeviceIndex;
//! use std::sync::Arc;
//!
//! let rt = Runtime::new(Arc::new(FakeDriver::default())); // or Arc::new(CudaDriver::new())
//! let dev = DeviceIndex(0);
//! let x = DeviceBuffer::from_slice(&rt, dev, &[1.0f32, 2.0, 3.0])?;
//! // Work on a side stream, after what the current stream has enqueued.
//! let side = rt.stream_from_pool(dev, false)?; // torch.cuda.Stream()
//! side.wait_stream(&rt.current_stream(dev)?)?;
//! x.record_stream(&side)?; // x is used there too: its memory waits for `side`
//! {
//!     let _on_side = rt.stream_guard(&side)?; // with torch.cuda.stream(side):
//!     x.fill(7.0)?; // runs on the current stream, `side`
//! }
//! let done = side.record_event(None)?;
//! rt.current_stream(dev)?.wait_event(&done)?;
//! assert_eq!(x.to_host()?, [7.0; 3]);
//! # Ok::<(), ferrocuda_stream::StreamError>(())
//! ```
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
//! - **Objects know their runtime.** Streams, events and kernels carry the
//!   [`id`](Runtime::id) of the runtime that made them, and every call taking one refuses
//!   another runtime's ([`StreamError::OtherRuntime`]) rather than use its own object of the
//!   same number.
//! - **Large copies between pageable memory and a device may be staged by threads**
//!   ([`DeviceBuffer::copy_from_host`], [`DeviceBuffer::to_host`]): when the host memory
//!   resource says so (`pageable_copy_threads`, off by default), 2 MiB chunks pass through
//!   page-locked slots, copied in or out by several threads, each transferred as soon as
//!   it can be; the bytes, stream order, errors and waits stay the driver's copy's.
//! - **Kernels on the fake device are host functions found by name**
//!   ([`Runtime::register_fake_kernel`]); a kernel with none is
//!   [`StreamError::KernelNotRegistered`], naming it.
//!
//! # What the layers above must do
//! - Check a stream they are given before using its handle with their own runtime
//!   ([`Runtime::check_stream`]).
//! - Provide the host versions of the kernels they ship when loading them on a fake device
//!   ([`Runtime::fake`], `FakeDriver::provide_kernel`), so that no user registers them.
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
mod pageable_copy;
mod peer;
mod per_device;
mod pinned_buffer;
mod runtime;
mod stream;

pub use availability::AvailabilityCheck;
pub use buffer::DeviceBuffer;
pub use error::{MemoryError, Result, StreamError};
pub use event::Event;
pub use ferrocuda_driver::Driver;
pub use interop::Lent;
pub use memory::{DriverHostMemory, DriverMemory, HostMemoryResource, MemoryResource};
pub use module::{CacheOutcome, Function, KernelCache, Module};
pub use pageable_copy::{CHUNK, DEPTH, READ_MIN_THREADS, STAGED_MIN, STAGED_READ_MIN};
pub use per_device::PerDevice;
pub use pinned_buffer::PinnedBuffer;
pub use runtime::{DeviceGuard, Runtime, STREAMS_PER_POOL, StreamGuard};
pub use stream::Stream;
