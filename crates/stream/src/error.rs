//! Errors of the stream layer.
use ferrocuda_driver::{CompileError, DriverError};
use ferrocuda_types::{DeviceIndex, DeviceParseError, OutOfMemory, PoolOutOfMemory};

/// What can go wrong with devices, streams, events, kernels and buffers.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[source] DriverError),
    /// A CUDA call in a child forked after CUDA was initialised in its parent; the message
    /// is PyTorch's ("Cannot re-initialize CUDA in forked subprocess. ...").
    #[error("{}", DriverError::BAD_FORK)]
    BadFork,
    /// No CUDA device can be used (no driver, no device).
    #[error("CUDA is not available: {reason}")]
    NotAvailable {
        /// Why, from the driver.
        reason: DriverError,
    },
    /// A device index past the last device.
    #[error("invalid device ordinal {index}: {count} CUDA device(s) available")]
    InvalidDevice {
        /// The index asked for.
        index: u16,
        /// Devices present.
        count: usize,
    },
    /// A device string did not parse.
    #[error(transparent)]
    Parse(#[from] DeviceParseError),
    /// A CUDA device was needed and the CPU was named.
    #[error("expected a CUDA device, got cpu")]
    NotCuda,
    /// An operation mixed objects of two devices.
    #[error("{what} is on {found} but the operation runs on {expected}")]
    DeviceMismatch {
        /// The device the operation runs on.
        expected: DeviceIndex,
        /// The device of the offending object.
        found: DeviceIndex,
        /// What the offending object is.
        what: &'static str,
    },
    /// `elapsed_time` on an event that was never recorded (c10/cuda/CUDAEvent.h's text).
    #[error("Both events must be recorded before calculating elapsed time.")]
    EventNotRecorded,
    /// `elapsed_time` on an event whose work has not completed (c10/cuda/CUDAEvent.h).
    #[error("Both events must be completed before calculating elapsed time.")]
    EventNotCompleted,
    /// `elapsed_time` on an event created without timing (c10/cuda/CUDAEvent.h).
    #[error("Both events must be created with argument 'enable_timing=True'.")]
    TimingDisabled,
    /// `record` on a stream of another device than the event's (c10/cuda/CUDAEvent.h).
    #[error("Event device {event} does not match recording stream's device {stream}.")]
    EventDeviceMismatch {
        /// The event's device index.
        event: u16,
        /// The stream's device index.
        stream: u16,
    },
    /// An interprocess event must have timing disabled (a CUDA rule).
    #[error("an interprocess event cannot have timing enabled")]
    InterprocessTiming,
    /// Compiling a kernel failed.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// The memory resource failed (other than with a device or driver error, which keep
    /// their own variants); prints the resource's message.
    #[error(transparent)]
    Memory {
        /// What failed: out of memory with the allocator's figures, or another failure.
        source: MemoryError,
    },
    /// A stream, event, kernel or buffer made by another [`Runtime`](crate::Runtime) (another
    /// instance, even over the same driver) was given to this one: refused, so that work
    /// never lands on this runtime's object that happens to have the same number.
    #[error(
        "{what} belongs to another runtime (runtime {found}) than the one it is used with \
         (runtime {expected})"
    )]
    OtherRuntime {
        /// What the offending object is.
        what: &'static str,
        /// [`Runtime::id`](crate::Runtime::id) of the runtime it was used with.
        expected: u64,
        /// [`Runtime::id`](crate::Runtime::id) of the runtime that made it.
        found: u64,
    },
    /// The fake device has no host function for the kernel `name` (the driver's
    /// `FERROCUDA_KERNEL_NOT_REGISTERED`, named). The library's own kernels are provided by
    /// the crates that own them; a program's own kernel needs
    /// [`Runtime::register_fake_kernel`](crate::Runtime::register_fake_kernel).
    #[error(
        "the fake device has no host function for kernel `{name}`: register one with \
         `Runtime::register_fake_kernel` (or `FakeDriver::register_kernel`)"
    )]
    KernelNotRegistered {
        /// The kernel's name.
        name: String,
    },
    /// Host and device lengths differ.
    #[error("length mismatch: expected {expected} elements, got {found}")]
    LengthMismatch {
        /// The buffer's length.
        expected: usize,
        /// The other side's length.
        found: usize,
    },
}

impl From<DriverError> for StreamError {
    /// [`DriverError::BAD_FORK`] becomes [`StreamError::BadFork`], so that it reads as
    /// PyTorch's message alone; every other error is [`StreamError::Driver`].
    fn from(e: DriverError) -> StreamError {
        if e == DriverError::BAD_FORK {
            StreamError::BadFork
        } else {
            StreamError::Driver(e)
        }
    }
}

/// How a [`MemoryResource`](crate::MemoryResource) failed to serve a buffer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// Out of memory, with the figures of the report (PyTorch's message).
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
    /// Out of memory in the `backend:cudaMallocAsync` allocator (PyTorch's message).
    #[error("{0}")]
    PoolOutOfMemory(Box<PoolOutOfMemory>),
    /// Any other failure, as the resource describes it (an invalid pointer, a
    /// misconfigured allocator, ...).
    #[error("{0}")]
    Other(String),
}

/// Result alias of this crate.
pub type Result<T, E = StreamError> = std::result::Result<T, E>;

/// [`StreamError::OtherRuntime`] for `what`, made by runtime `found`, used with runtime
/// `expected`, unless they are one.
pub(crate) fn same_runtime(
    expected: u64,
    found: u64,
    what: &'static str,
) -> Result<(), StreamError> {
    if expected == found {
        Ok(())
    } else {
        Err(StreamError::OtherRuntime {
            what,
            expected,
            found,
        })
    }
}
