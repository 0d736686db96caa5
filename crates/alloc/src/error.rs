//! Allocator errors. The out-of-memory report they carry lives in `ferrocuda_types` (so a
//! buffer's error below this layer can carry it too) and is re-exported here.
use ferrocuda_driver::{DriverError, PluggableError};
use ferrocuda_stream::{MemoryError, StreamError};
use ferrocuda_types::{
    ConfigError, ConfigSourceError, DevicePtr, EnvError, PoolId, PoolOutOfMemory,
};

pub use ferrocuda_types::OutOfMemory;

/// What an allocation or free can fail with.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// Out of memory; the message follows PyTorch's (and adds fragmentation figures).
    #[error("{0}")]
    OutOfMemory(Box<OutOfMemory>),
    /// A device index past the last device: PyTorch's `assertValidDevice`
    /// (`c10/cuda/CUDACachingAllocator.cpp`, `NativeCachingAllocator`), which
    /// `torch.cuda.memory_stats` and the other per-device calls reach.
    #[error("Invalid device argument {device}: did you call init?")]
    NoSuchDevice {
        /// The index asked for.
        device: u16,
        /// Devices present.
        count: usize,
    },
    /// A device index past the last device, for the `backend:cudaMallocAsync` allocator:
    /// `CudaMallocAsyncAllocator::assertValidDevice`'s text
    /// (`c10/cuda/CUDAMallocAsyncAllocator.cpp`), which names neither the index nor the
    /// count (both are kept here). PyTorch's `mallocAsync` has an internal assertion of its
    /// own instead, which its allocation on the current device never meets; ferrocuda's
    /// allocation with a device argument gives this error too.
    #[error("Invalid device argument.")]
    AsyncNoSuchDevice {
        /// The index asked for.
        device: u16,
        /// Devices present.
        count: usize,
    },
    /// The driver offers no device at all (no driver, or no GPU).
    #[error("CUDA is not available: {reason}")]
    NotAvailable {
        /// Why, from the driver.
        reason: DriverError,
    },
    /// A pointer this allocator did not hand out (or already took back).
    #[error("invalid device pointer: {0}")]
    InvalidPointer(DevicePtr),
    /// A memory fraction outside [0, 1], refused by the allocator (C++'s
    /// `setMemoryFraction` text; C++ streams NaN as `nan`).
    #[error("invalid fraction:{}. Please set within [0, 1].", cpp_double(*.0))]
    InvalidFraction(f64),
    /// A memory fraction below 0 or above 1, refused by `set_per_process_memory_fraction`
    /// before any allocator (torch/cuda/memory.py's `ValueError`; NaN passes this check).
    #[error("Invalid fraction value: {0:?}. Allowed range: 0~1")]
    FractionOutOfRange(f64),
    /// A bad configuration string.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A configuration variable of the environment is set but cannot be read (not UTF-8).
    #[error(transparent)]
    Env(#[from] EnvError),
    /// A stream-layer call made for an allocator function failed (the facade's
    /// `mem_get_info`, the current stream of `caching_allocator_alloc`).
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// A private-pool request was invalid (PyTorch's messages).
    #[error("{0}")]
    Pool(String),
    /// `getCheckpointState` or `checkPoolLiveAllocations` of a pool that does not exist
    /// (never made, or released with all its segments given back).
    #[error("Could not find pool of id")]
    PoolNotFound(PoolId),
    /// `setCheckpointPoolState` of a pool that does not exist.
    #[error("Could not find private pool id")]
    PrivatePoolNotFound(PoolId),
    /// A checkpoint or restore of a pool that no graph holds any more (freeable).
    #[error("Not expected to checkpoint freeable graph")]
    FreeablePool(PoolId),
    /// A block of the pool to checkpoint waits for events (`BlockState`'s check).
    #[error("Events should have synchronized when checkpointing block")]
    CheckpointEventsPending(DevicePtr),
    /// A block of the pool to restore waits for events, or would on being freed (it was
    /// used on other streams): `freeBlocksAllocatedToPool`'s check.
    #[error("Events should have synchronized when setting checkpointed block")]
    RestoreEventsPending(DevicePtr),
    /// A checkpointed segment starts at no free block of the pool (its segment was given
    /// back, or the checkpoint is another pool's): `setCheckpointPoolState`'s check.
    #[error(" could not find {0}")]
    CheckpointSegmentNotFound(DevicePtr),
    /// The pool cannot take a checkpointed segment's layout: the check of
    /// `setSegmentStateToCheckpoint` that fails (`check`, PyTorch's condition), at the
    /// checkpointed block `block`.
    #[error(
        "Expected {check} to be true, but got false.  (Could this error message be improved?  If so, please report an enhancement request to PyTorch.)"
    )]
    CheckpointMismatch {
        /// The condition PyTorch checks.
        check: &'static str,
        /// The checkpointed block it fails at.
        block: DevicePtr,
    },
    /// A history or snapshot request was invalid, or its file could not be written.
    #[error("{0}")]
    History(String),
    /// A driver call failed (other than out of memory).
    #[error("CUDA driver error: {0}")]
    Driver(DriverError),
    /// Sharing a block with another process, or opening one, failed.
    #[error(transparent)]
    Ipc(crate::ipc::IpcError),
    /// A sleep or wake of a sleepable pool, or a use of one that sleeps (ferrocuda's own).
    #[error(transparent)]
    Sleep(#[from] crate::sleep::reports::SleepError),
    /// A pluggable allocator library could not be loaded (Python's texts).
    #[error(transparent)]
    Pluggable(#[from] PluggableError),
    /// A free of an address the pluggable allocator did not hand out, or already took back:
    /// `CUDAPluggableAllocator::raw_delete`'s check.
    #[error("Trying to free a pointer not allocated here")]
    NotAllocatedHere(DevicePtr),
    /// The pluggable allocator's function gave no memory (null) for a request (PyTorch hands
    /// the null pointer out as the allocation).
    #[error("the pluggable allocator returned no memory for {bytes} bytes on device {device}")]
    PluggableOutOfMemory {
        /// Bytes asked for.
        bytes: u64,
        /// The device.
        device: u16,
    },
    /// What a pluggable allocator cannot do (statistics, snapshots, history, …): PyTorch's
    /// text, naming its function.
    #[error(
        "CUDAPluggableAllocator does not yet support {0}. If you need it, please file an issue describing your use case."
    )]
    PluggableUnsupported(&'static str),
    /// `change_current_allocator` once the current allocator is initialised (PyTorch's
    /// `changeCurrentAllocator` check).
    #[error("Can't swap an already initialized allocator")]
    AlreadyInitialized,
    /// A host address the pinned host allocator did not hand out (or already took back).
    #[error("invalid pinned host pointer: {0:#x}")]
    InvalidHostPointer(u64),
    /// A stream recorded for a pinned host block that was already freed (PyTorch's
    /// internal assert in `record_event`).
    #[error("pinned host block {0:#x} is not allocated: record its use before freeing it")]
    HostBlockNotAllocated(u64),
    /// A pinned host request too large to have a free-list bucket (over 2^63 bytes).
    #[error("cannot allocate {0} bytes of pinned host memory: more than 2^63 bytes")]
    HostRequestTooLarge(u64),
    /// Out of memory in the `backend:cudaMallocAsync` allocator: its own accounting against
    /// the memory fraction, or the pool after a trim and one retry (PyTorch's message).
    #[error("{0}")]
    PoolOutOfMemory(Box<PoolOutOfMemory>),
    /// What the `backend:cudaMallocAsync` allocator has no form of (history, checkpoints,
    /// IPC, …): PyTorch's text, naming its C++ function.
    #[error(
        "cudaMallocAsync does not yet support {0}. If you need it, please file an issue describing your use case."
    )]
    AsyncUnsupported(&'static str),
    /// A snapshot under `backend:cudaMallocAsync` (PyTorch's `snapshot` text).
    #[error(
        "Calling snapshot with backend:cudaMallocAsync is not meaningful. (For backend:native, snapshot returns a detailed summary of all blocks tracked by the allocator, but the cudaMallocAsync backend does not track individual blocks.)"
    )]
    AsyncSnapshot,
    /// A configuration naming another backend than the allocator's own: the caching
    /// allocator made or re-configured with `backend:cudaMallocAsync`, or the other way
    /// round (PyTorch's assertion in `parseAllocatorConfig`).
    #[error("Allocator backend parsed at runtime != allocator backend parsed at load time")]
    WrongBackend,
    /// A key of ferrocuda's own with `backend:cudaMallocAsync`, which has no use for it.
    /// PyTorch's keys are accepted and ignored there with PyTorch's warning (see
    /// [`ferrocuda_types::AsyncBackendKeys`]); ferrocuda's own keys appear in no string
    /// PyTorch accepts, so one there is a mistake worth stopping for.
    #[error(
        "backend:cudaMallocAsync has no use for {key}, an option of ferrocuda's caching \
         allocator (backend:native): remove it, or use backend:native"
    )]
    AsyncFerrocudaOnly {
        /// The first such key.
        key: String,
    },
    /// A capture begun while another is under way (the backend allows one per process).
    #[error("Only one capture at a time is allowed in a process.")]
    CaptureUnderway,
    /// A capture ended that the backend did not see begin.
    #[error(
        "CudaMallocAsync::notifyCaptureAboutToEnd called, but CudaMallocAsync::capture_underway is false."
    )]
    NoCaptureUnderway,
}

/// The environment's configuration: a variable that cannot be read, or the parse error of
/// the one read (the variable's name is dropped, as the parse error names the token).
impl From<ConfigSourceError> for AllocError {
    fn from(e: ConfigSourceError) -> AllocError {
        match e {
            ConfigSourceError::Env(e) => AllocError::Env(e),
            ConfigSourceError::Parse { source, .. } => AllocError::Config(source),
            // A kind added later: its message, as a configuration error.
            other => AllocError::Config(ConfigError {
                position: 0,
                token: String::new(),
                message: other.to_string(),
            }),
        }
    }
}

/// A driver error as the stream layer reads it (its one conversion decides, so a call in a
/// child forked after CUDA was initialised is `Stream(BadFork)`, PyTorch's message alone);
/// anything the stream layer keeps as a plain driver error stays one here.
impl From<DriverError> for AllocError {
    fn from(e: DriverError) -> AllocError {
        match StreamError::from(e) {
            StreamError::Driver(e) => AllocError::Driver(e),
            other => AllocError::Stream(other),
        }
    }
}

/// How an allocator error reaches a buffer user (the allocator serving as the stream
/// layer's memory resource): as the stream layer's own error where it has one, the
/// out-of-memory report intact, anything else by its message.
impl From<AllocError> for StreamError {
    fn from(e: AllocError) -> StreamError {
        match e {
            AllocError::OutOfMemory(report) => StreamError::Memory {
                source: MemoryError::OutOfMemory(report),
            },
            AllocError::PoolOutOfMemory(report) => StreamError::Memory {
                source: MemoryError::PoolOutOfMemory(report),
            },
            AllocError::NoSuchDevice { device, count }
            | AllocError::AsyncNoSuchDevice { device, count } => StreamError::InvalidDevice {
                index: device,
                count,
            },
            AllocError::NotAvailable { reason } => StreamError::NotAvailable { reason },
            AllocError::Driver(e) => StreamError::Driver(e),
            AllocError::Stream(e) => e,
            other => StreamError::Memory {
                source: MemoryError::Other(other.to_string()),
            },
        }
    }
}

/// A double as C++'s `operator<<` writes the common cases (`nan`, `inf`, `1.5`, `2`).
fn cpp_double(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else {
        x.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver call in a bad fork reads as PyTorch's message, without the driver-error
    /// prefix, and reaches buffer users as the stream layer's own bad-fork error.
    #[test]
    fn a_bad_fork_reads_as_pytorchs_message() {
        let e = AllocError::from(DriverError::BAD_FORK);
        assert!(
            e.to_string()
                .starts_with("Cannot re-initialize CUDA in forked subprocess"),
            "{e}"
        );
        assert_eq!(StreamError::from(e), StreamError::BadFork);
        let other = AllocError::from(DriverError::INVALID_VALUE);
        assert!(
            other.to_string().starts_with("CUDA driver error: "),
            "{other}"
        );
    }
}
