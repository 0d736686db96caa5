//! The seam between process groups and a collectives backend: [`Collective`], implemented
//! by NCCL's communicator ([`NcclComm`]) on the GPU and by the in-process
//! [`FakeGroup`](crate::FakeGroup) on the fake device.
use crate::{DistError, Result};
use ferrocuda_driver::nccl::{CollectiveCall, CollectiveOp, NcclComm};
use ferrocuda_types::{DType, DeviceIndex, StreamHandle};

/// One rank's collectives, enqueued on a stream of its device. Buffers are device addresses
/// the caller keeps alive until the stream has run the call (the process group does that
/// with `record_stream`).
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// The device of this rank.
    fn device(&self) -> DeviceIndex;
    /// Enqueues this rank's part of `call` on `stream` (every collective: [`CollectiveOp`]).
    fn collective(&self, call: &CollectiveCall, stream: StreamHandle) -> Result<()>;
    /// Aborts the communicator (the watchdog does, on a timeout or an asynchronous error),
    /// from any thread, while a call is in progress too. Nothing to abort by default.
    fn abort(&self) -> Result<()> {
        Ok(())
    }
    /// An error the backend reports outside any call (NCCL's asynchronous error). None by
    /// default.
    fn async_error(&self) -> Result<()> {
        Ok(())
    }
}

impl Collective for NcclComm {
    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }
    fn size(&self) -> usize {
        NcclComm::size(self)
    }
    fn device(&self) -> DeviceIndex {
        NcclComm::device(self)
    }
    fn collective(&self, call: &CollectiveCall, stream: StreamHandle) -> Result<()> {
        Ok(NcclComm::collective(self, call, stream)?)
    }
    fn abort(&self) -> Result<()> {
        Ok(NcclComm::abort(self)?)
    }
    fn async_error(&self) -> Result<()> {
        Ok(NcclComm::async_error(self)?)
    }
}

/// A broadcast's root out of range, or a peer that is not another rank, for rank `rank` of a
/// group of `size`: [`DistError::InvalidRank`].
pub(crate) fn check_ranks(op: CollectiveOp, rank: usize, size: usize) -> Result<()> {
    match op.bad_rank(rank, size) {
        Some(rank) => Err(DistError::InvalidRank { rank, size }),
        None => Ok(()),
    }
}

/// The checks of a backend that moves data on the host (the fake group, the store group):
/// the stream on the rank's device, and an element type it reduces (f32, f64, i32, i64).
pub(crate) fn check_host_call(
    device: DeviceIndex,
    call: &CollectiveCall,
    stream: StreamHandle,
) -> Result<()> {
    if stream.device != device {
        return Err(DistError::DeviceMismatch {
            expected: device,
            found: stream.device,
        });
    }
    if !matches!(
        call.dtype,
        DType::F32 | DType::F64 | DType::I32 | DType::I64
    ) {
        return Err(DistError::UnsupportedType(call.dtype));
    }
    Ok(())
}
