//! The seam between process groups and a collectives backend: [`Collective`], implemented
//! by NCCL's communicator ([`NcclComm`]) on the GPU and by the in-process
//! [`FakeGroup`](crate::FakeGroup) on the fake device.
use crate::Result;
use ferrocuda_driver::nccl::{NcclComm, ReduceOp};
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
    /// `count` elements of `send` reduced over all ranks into `recv`.
    fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<()>;
    /// `count` elements of rank `root`'s `send` into every rank's `recv`.
    fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    /// `size * recv_count` elements reduced over ranks; rank `r` keeps block `r`.
    fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<()>;
    /// Every rank's `send_count` elements, by rank, into every rank's `recv`.
    fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DType,
        stream: StreamHandle,
    ) -> Result<()>;
    /// `count` elements to rank `peer`.
    fn send(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<()>;
    /// `count` elements from rank `peer`.
    fn recv(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<()>;
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
    fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<()> {
        Ok(NcclComm::all_reduce(
            self, send, recv, count, dtype, op, stream,
        )?)
    }
    fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        Ok(NcclComm::broadcast(
            self, send, recv, count, dtype, root, stream,
        )?)
    }
    fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<()> {
        Ok(NcclComm::reduce_scatter(
            self, send, recv, recv_count, dtype, op, stream,
        )?)
    }
    fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DType,
        stream: StreamHandle,
    ) -> Result<()> {
        Ok(NcclComm::all_gather(
            self, send, recv, send_count, dtype, stream,
        )?)
    }
    fn send(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        Ok(NcclComm::send(self, buf, count, dtype, peer, stream)?)
    }
    fn recv(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        peer: usize,
        stream: StreamHandle,
    ) -> Result<()> {
        Ok(NcclComm::recv(self, buf, count, dtype, peer, stream)?)
    }
}
