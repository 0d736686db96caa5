//! Errors of the collectives layer.
use ferrocuda_driver::DriverError;
use ferrocuda_driver::nccl::NcclError;
use ferrocuda_stream::StreamError;
use ferrocuda_types::{DType, DeviceIndex};

/// What can go wrong with a process group, a collective or the bucketed reducer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DistError {
    /// NCCL failed (or is not installed: [`NcclError::Unavailable`]).
    #[error(transparent)]
    Nccl(#[from] NcclError),
    /// A stream, event or buffer operation failed.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// A buffer on another device than the group's.
    #[error("the buffer is on {found} but the process group on {expected}")]
    DeviceMismatch {
        /// The group's device.
        expected: DeviceIndex,
        /// The buffer's.
        found: DeviceIndex,
    },
    /// Buffer lengths that do not fit the collective (all-gather's output must hold
    /// `size` inputs, reduce-scatter's input `size` outputs).
    #[error("{what}: expected {expected} elements, got {found}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        found: usize,
    },
    /// The ranks of one collective call disagree (kind, count, type, operation or root).
    #[error("the ranks called mismatched collectives: {0}")]
    Mismatched(String),
    /// An element type the fake group does not move (it handles f32, f64, i32, i64).
    #[error("the fake group has no {0:?} arithmetic")]
    UnsupportedType(DType),
    /// A rank, root or peer out of range.
    #[error("invalid rank {rank} for a group of {size}")]
    InvalidRank {
        /// The rank given.
        rank: usize,
        /// Ranks in the group.
        size: usize,
    },
    /// The bucketed reducer was used out of order (DDP's "Expected to mark a variable ready
    /// only once" and "Expected to have finished reduction in the prior iteration").
    #[error("reducer: {0}")]
    Reducer(String),
    /// A torchrun variable is missing or malformed.
    #[error("{message}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong.
        message: String,
    },
    /// Two processes claimed one rank.
    #[error("rank {rank} is taken by another process of this job (RANK given twice)")]
    DuplicateRank {
        /// The rank.
        rank: usize,
    },
    /// Ranks that did not reach the rendezvous in time.
    #[error("ranks {missing:?} of {world_size} did not join within {}s", after.as_secs_f64())]
    RanksMissing {
        /// Who is missing.
        missing: Vec<usize>,
        /// Ranks in the job.
        world_size: usize,
        /// The timeout.
        after: std::time::Duration,
    },
    /// The group failed: its watchdog found a collective past the timeout or an
    /// asynchronous error and aborted the communicator, or [`ProcessGroup::abort`] was
    /// called. Every later call on the group is this error.
    ///
    /// [`ProcessGroup::abort`]: crate::ProcessGroup::abort
    #[error("the process group was aborted: {reason}")]
    Aborted {
        /// Why.
        reason: String,
    },
    /// A collective ran past the group's timeout (PyTorch's watchdog message); the
    /// communicator was aborted.
    #[error(
        "Watchdog caught collective operation timeout: Work(SeqNum={seq}, OpType={what}, Timeout(ms)={}) ran for {} milliseconds before timing out.",
        timeout.as_millis(),
        after.as_millis()
    )]
    CollectiveTimeout {
        /// The collective's number in the group, from 1.
        seq: u64,
        /// Which collective.
        what: String,
        /// How long it had run.
        after: std::time::Duration,
        /// The group's timeout.
        timeout: std::time::Duration,
    },
    /// The rendezvous store failed.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// A rank this call waits for left the group (every handle of it was dropped) before
    /// joining the call: the call can never complete. NCCL would block until its timeout.
    #[error("rank {rank} left the group before joining this call")]
    RankGone {
        /// The rank that left.
        rank: usize,
    },
}

impl From<DriverError> for DistError {
    fn from(e: DriverError) -> DistError {
        DistError::Stream(e.into())
    }
}

/// Result alias of this crate.
pub type Result<T, E = DistError> = std::result::Result<T, E>;
