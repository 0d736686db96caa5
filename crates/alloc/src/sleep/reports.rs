//! What a sleep or wake is asked for and says: the modes, reports, statistics and errors.
use ferrocuda_types::{DevicePtr, PoolId};

/// What happens to a pool's contents while it sleeps.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SleepMode {
    /// The contents are lost; wake maps new, uninitialised pages.
    Discard,
    /// The contents are copied to pinned host memory and restored on wake; with `checksum`,
    /// wake proves the restored device bytes equal the offloaded ones.
    Offload {
        /// Take a checksum of the offloaded bytes and check the restored ones against it.
        checksum: bool,
    },
}

/// What a sleep did.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SleepReport {
    /// Segments whose pages were released.
    pub segments: usize,
    /// Device bytes released.
    pub released_bytes: u64,
    /// Bytes copied to host memory.
    pub offloaded_bytes: u64,
}

/// What a wake did.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct WakeReport {
    /// Segments whose pages were mapped again.
    pub segments: usize,
    /// Device bytes mapped.
    pub mapped_bytes: u64,
    /// Bytes copied back from host memory.
    pub restored_bytes: u64,
    /// Segments whose restored bytes were checked against the offload's checksum.
    pub verified_segments: usize,
}

/// What is asleep in an allocator.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SleepStats {
    /// Sleepable pools asleep (or being put to sleep or woken).
    pub pools: usize,
    /// Segments without their pages.
    pub segments: usize,
    /// Device bytes released (reserved by the allocator, not backed by the device).
    pub bytes: u64,
    /// Of those, bytes kept in host memory.
    pub offloaded_bytes: u64,
    /// Pinned host memory kept by awake segments for their next offload
    /// ([`CachingAllocator::free_host_buffers`](crate::CachingAllocator::free_host_buffers) gives it back).
    pub spare_host_bytes: u64,
}

/// A sleep or wake request that cannot be carried out.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SleepError {
    /// The pool was not made with [`CachingAllocator::create_sleepable_pool`](crate::CachingAllocator::create_sleepable_pool).
    #[error("pool {0} is not sleepable (make it with create_sleepable_pool)")]
    NotSleepable(PoolId),
    /// Sleep of a pool already asleep (its offload would be lost).
    #[error("pool {0} is already asleep")]
    AlreadyAsleep(PoolId),
    /// Sleep or wake of a pool another thread is putting to sleep or waking.
    #[error("pool {0} is being put to sleep or woken by another call")]
    Changing(PoolId),
    /// An allocation routed to a pool that sleeps, or a replay over it.
    #[error("pool {0} is asleep: wake it before using its memory")]
    Asleep(PoolId),
    /// Sleep or wake while a stream capture records into a pool.
    #[error("cannot sleep or wake pool {0} while a stream capture is underway")]
    CaptureUnderway(PoolId),
    /// The allocator does not cache (`PYTORCH_NO_CUDA_MEMORY_CACHING=1`): no pool has
    /// segments of its own.
    #[error("cannot sleep or wake pool {0}: caching is off")]
    CachingOff(PoolId),
    /// The restored bytes of a segment differ from the offloaded ones.
    #[error(
        "pool {pool}: the bytes restored at {segment} differ from those offloaded (checksum {offloaded:#018x}, restored {restored:#018x})"
    )]
    ChecksumMismatch {
        /// The pool.
        pool: PoolId,
        /// The segment's address.
        segment: DevicePtr,
        /// Checksum of the offloaded bytes.
        offloaded: u64,
        /// Checksum of the bytes read back after the restore.
        restored: u64,
    },
}
