//! The seam between process groups and a collectives backend: [`Collective`], implemented
//! by NCCL's communicator ([`NcclComm`]) on the GPU and by the in-process
//! [`FakeGroup`](crate::FakeGroup) on the fake device.
use crate::{DistError, Result};
use ferrocuda_driver::nccl::{CollectiveCall, CollectiveOp, NcclComm, ReduceOp};
use ferrocuda_types::{DType, DeviceIndex, DevicePtr, StreamHandle};

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
    /// Enqueues this rank's part of `call` on `stream`: every collective below comes here.
    fn collective(&self, call: &CollectiveCall, stream: StreamHandle) -> Result<()>;
    /// `count` elements of `send` reduced over all ranks into `recv`.
    fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<()> {
        let op = CollectiveOp::AllReduce(op);
        self.collective(
            &CollectiveCall {
                op,
                send,
                recv,
                count,
                dtype,
            },
            stream,
        )
    }
    /// `count` elements of rank `root`'s `send` into every rank's `recv`.
    fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let op = CollectiveOp::Broadcast { root };
        self.collective(
            &CollectiveCall {
                op,
                send,
                recv,
                count,
                dtype,
            },
            stream,
        )
    }
    /// `size * recv_count` elements reduced over ranks; rank `r` keeps block `r`.
    fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<()> {
        let (op, count) = (CollectiveOp::ReduceScatter(op), recv_count);
        self.collective(
            &CollectiveCall {
                op,
                send,
                recv,
                count,
                dtype,
            },
            stream,
        )
    }
    /// Every rank's `send_count` elements, by rank, into every rank's `recv`.
    fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DType,
        stream: StreamHandle,
    ) -> Result<()> {
        let (op, count) = (CollectiveOp::AllGather, send_count);
        self.collective(
            &CollectiveCall {
                op,
                send,
                recv,
                count,
                dtype,
            },
            stream,
        )
    }
    /// `count` elements to rank `peer`.
    fn send(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let (op, send, recv) = (CollectiveOp::Send { peer }, buf, DevicePtr(0));
        self.collective(
            &CollectiveCall {
                op,
                send,
                recv,
                count,
                dtype,
            },
            stream,
        )
    }
    /// `count` elements from rank `peer`.
    fn recv(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        let (op, send, recv) = (CollectiveOp::Recv { peer }, DevicePtr(0), buf);
        self.collective(
            &CollectiveCall {
                op,
                send,
                recv,
                count,
                dtype,
            },
            stream,
        )
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
}

/// A broadcast's root out of range, or a peer that is not another rank, for rank `rank` of a
/// group of `size`: [`DistError::InvalidRank`].
pub(crate) fn check_ranks(op: CollectiveOp, rank: usize, size: usize) -> Result<()> {
    match op.bad_rank(rank, size) {
        Some(rank) => Err(DistError::InvalidRank { rank, size }),
        None => Ok(()),
    }
}
