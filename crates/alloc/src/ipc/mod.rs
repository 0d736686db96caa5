//! Sharing allocator blocks with other processes (CUDA IPC), as `torch.multiprocessing`
//! does.
//!
//! - **The handle** ([`CachingAllocator::share_ipc_handle`], PyTorch's `shareIpcHandle` in
//!   `c10/cuda/CUDACachingAllocator.cpp`): for a block of an ordinary segment, the
//!   segment's `cudaIpcMemHandle` and the block's offset in it; for a block of an
//!   expandable segment, the POSIX file descriptors of the pages under it and the
//!   producer's pid, so the consumer fetches them (`ExpandableSegment::share`). Bytes as
//!   PyTorch writes them: version 2, then `'c'` and the 64-byte handle, or `'e'`, the
//!   24-byte header (pid, page size, page count) and one 4-byte descriptor per page.
//! - **The producer keeps a shared block** ([`CachingAllocator::share`], PyTorch's
//!   `GetNewRefCountedSentData` and `CudaIPCSentDataLimbo` in `torch/csrc/CudaIPCTypes.cpp`):
//!   each send takes a counter, set to 1, in a shared-memory file (10 000 counters per
//!   file) and records an interprocess event on the sending stream. A free of a block whose
//!   counters are not all 0 moves it to the limbo instead: still allocated, counted
//!   in every statistic as PyTorch counts it. The limbo is collected at every free of a
//!   shared block, when an allocation finds no cached block (PyTorch's free-memory callback,
//!   before the allocator's own slow path), and on [`CachingAllocator::ipc_collect`].
//! - **The consumer** ([`CachingAllocator::open_shared`], `THPStorage_newSharedCuda` in
//!   `torch/csrc/StorageSharing.cpp`): waits for the send's event on its stream, opens the
//!   handle once per handle however many blocks use it (`getIpcDevPtr`'s cache), and on
//!   close synchronizes its stream, closes the handle with its last user and decrements
//!   the counter, so the producer's next collection frees the block.
//!
//! What travels between the processes is [`SharedMessage`], the eight values of
//! `storage._share_cuda_()`; a PyTorch process and a ferrocuda process exchange blocks
//! both ways with them. Without a share, none of this runs: one relaxed load on `free`.
mod export;
mod opened;
mod sent;

pub use opened::{OpenedHandle, ReceivedBlock};

use serde::{Deserialize, Serialize};

/// Counters per shared-memory file (PyTorch's `CUDA_IPC_REF_COUNTER_FILE_SIZE`).
pub const REF_COUNTER_FILE_SIZE: usize = 10_000;
/// Sends that record an event; past them a send synchronizes its stream instead
/// (PyTorch's `CUDA_IPC_MAXIMUM_EVENTS_TO_USE`).
pub const MAXIMUM_EVENTS_TO_USE: usize = 1_000;

/// Version of the handle bytes (PyTorch's `SHAREABLE_HANDLE_VERSION`).
pub(crate) const HANDLE_VERSION: u8 = 2;
/// A `cudaMalloc` segment's handle follows (`SHAREABLE_CUDA_MALLOC`).
pub(crate) const KIND_CUDA_MALLOC: u8 = b'c';
/// An expandable segment's pages follow (`SHAREABLE_CUDA_EXPANDABLE_SEGMENT`).
pub(crate) const KIND_EXPANDABLE: u8 = b'e';
/// Bytes of an expandable handle's header: pid (4, then 4 of padding), page size (8), page
/// count (8), as PyTorch's `ShareHeader` lies in memory.
pub(crate) const SHARE_HEADER: usize = 24;

/// A block's handle for another process: PyTorch's `ShareableHandle`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareableHandle {
    /// Where the block starts in what the handle opens.
    pub offset: u64,
    /// The handle's bytes (see the [module docs](self)).
    pub handle: Vec<u8>,
}

/// What a producer sends for one block: the eight values of PyTorch's
/// `storage._share_cuda_()`, in its order, and what `UntypedStorage._new_shared_cuda`
/// takes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedMessage {
    /// The producer's device index.
    pub device: u16,
    /// [`ShareableHandle::handle`].
    pub handle: Vec<u8>,
    /// The storage's bytes.
    pub size_bytes: u64,
    /// [`ShareableHandle::offset`].
    pub offset_bytes: u64,
    /// The shared-memory name of the counter file (`/torch_<pid>_<random>_<n>`).
    pub ref_counter_handle: String,
    /// The counter's index in it.
    pub ref_counter_offset: u64,
    /// The send's interprocess event (`cudaIpcEventHandle_t`; zeros without one).
    pub event_handle: Vec<u8>,
    /// Whether the consumer waits for that event.
    pub event_sync_required: bool,
}

/// What this allocator shares and has opened ([`CachingAllocator::ipc_stats`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct IpcStats {
    /// Blocks sent to other processes and still allocated here (the limbo's included).
    pub shared_blocks: u64,
    /// Their bytes.
    pub shared_bytes: u64,
    /// Of those, blocks this process freed that a consumer still holds (the limbo).
    pub limbo_blocks: u64,
    /// Their bytes.
    pub limbo_bytes: u64,
    /// Sends whose counter a consumer has not yet decremented.
    pub open_sends: u64,
    /// Other processes' handles open here (each maps a segment or a range of pages once).
    pub opened_handles: u64,
    /// The bytes they map.
    pub opened_bytes: u64,
}

/// Why a share or an open failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// Handle bytes that are not a handle PyTorch or ferrocuda writes.
    #[error("malformed CUDA IPC handle: {0}")]
    BadHandle(String),
    /// The shared-memory counter file could not be made or opened.
    #[error("CUDA IPC reference counter file {name}: {reason}")]
    CounterFile {
        /// Its shared-memory name.
        name: String,
        /// The system's reason.
        reason: String,
    },
    /// A message for another device than the allocator's.
    #[error("a block of device {message} cannot be opened by the allocator of device {allocator}")]
    WrongDevice {
        /// The message's device.
        message: u16,
        /// The allocator's.
        allocator: u16,
    },
}

#[cfg(doc)]
use crate::CachingAllocator;
pub(crate) use sent::Sharing;
