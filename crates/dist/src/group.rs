//! A process group on ferrocuda streams and buffers, as PyTorch's `ProcessGroupNCCL` runs
//! a collective (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp `collective`): the
//! group's communication stream first waits for the device's current stream (`syncStream`),
//! the collective runs there, every buffer it touches is marked used by that stream
//! (`recordStream`, so memory freed while the collective is in flight is not reused before
//! it ends), and the returned [`Work`] holds an event whose `wait` makes the current stream
//! wait for the collective: no host synchronisation anywhere.
use crate::collective::check_ranks;
use crate::{Collective, DistError, Result};
use ferrocuda_driver::nccl::{CollectiveCall, CollectiveOp, ReduceOp};
use ferrocuda_stream::{DeviceBuffer, Event, Runtime, Stream};
use ferrocuda_types::{DeviceIndex, DevicePtr, Element};
use std::sync::Arc;

/// One rank's process group: a collectives backend and a communication stream.
#[derive(Debug)]
pub struct ProcessGroup {
    runtime: Arc<Runtime>,
    comm: Box<dyn Collective>,
    stream: Stream,
}

/// A collective in flight (`c10d::Work`).
#[derive(Debug)]
pub struct Work {
    runtime: Arc<Runtime>,
    device: DeviceIndex,
    done: Event,
}

impl Work {
    /// Makes the device's current stream wait for the collective (`work.wait()` of
    /// `ProcessGroupNCCL`: a stream wait, not a host one).
    pub fn wait(&self) -> Result<()> {
        let current = self.runtime.current_stream(self.device)?;
        Ok(self.done.wait(&current)?)
    }

    /// Whether the collective has completed (`work.is_completed()`).
    pub fn is_completed(&self) -> Result<bool> {
        Ok(self.done.query()?)
    }

    /// Blocks the host until the collective has completed (`work.synchronize()` and a host
    /// wait).
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.done.synchronize()?)
    }
}

impl ProcessGroup {
    /// A group over `comm`, with its communication stream from `comm`'s device's pool
    /// (PyTorch's `getStreamFromPool`, low priority by default).
    pub fn new(runtime: Arc<Runtime>, comm: Box<dyn Collective>) -> Result<ProcessGroup> {
        let stream = runtime.stream_from_pool(comm.device(), false)?;
        Ok(ProcessGroup {
            runtime,
            comm,
            stream,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The device of this rank.
    pub fn device(&self) -> DeviceIndex {
        self.comm.device()
    }

    /// The communication stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    fn check<T: Element>(&self, b: &DeviceBuffer<T>) -> Result<()> {
        if b.device() != self.device() {
            return Err(DistError::DeviceMismatch {
                expected: self.device(),
                found: b.device(),
            });
        }
        Ok(())
    }

    /// Runs `op` (`count` elements of `send` into `recv`, of `T`) on the communication
    /// stream after the current stream, marks `buffers` used by it, and returns the work.
    fn run<T: Element>(
        &self,
        op: CollectiveOp,
        buffers: &[&DeviceBuffer<T>],
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
    ) -> Result<Work> {
        check_ranks(op, self.rank(), self.size())?;
        for b in buffers {
            self.check(b)?;
        }
        let current = self.runtime.current_stream(self.device())?;
        self.stream.wait_stream(&current)?;
        let dtype = T::DTYPE;
        let call = CollectiveCall {
            op,
            send,
            recv,
            count,
            dtype,
        };
        self.comm.collective(&call, self.stream.handle())?;
        for b in buffers {
            b.record_stream(&self.stream)?;
        }
        Ok(Work {
            runtime: self.runtime.clone(),
            device: self.device(),
            done: self.stream.record_event(None)?,
        })
    }

    /// Reduces `buf` over all ranks, in place (`dist.all_reduce`).
    pub fn all_reduce<T: Element>(&self, buf: &DeviceBuffer<T>, op: ReduceOp) -> Result<Work> {
        let op = CollectiveOp::AllReduce(op);
        self.run(op, &[buf], buf.ptr(), buf.ptr(), buf.len())
    }

    /// Copies rank `root`'s `buf` into every rank's `buf` (`dist.broadcast`).
    pub fn broadcast<T: Element>(&self, buf: &DeviceBuffer<T>, root: usize) -> Result<Work> {
        let op = CollectiveOp::Broadcast { root };
        self.run(op, &[buf], buf.ptr(), buf.ptr(), buf.len())
    }

    /// Reduces `input` (`size` blocks of `output.len()`) over ranks; this rank's block lands
    /// in `output` (`dist.reduce_scatter_tensor`).
    pub fn reduce_scatter<T: Element>(
        &self,
        output: &DeviceBuffer<T>,
        input: &DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<Work> {
        let expected = output.len() * self.size();
        self.lengths("reduce_scatter input", expected, input.len())?;
        let op = CollectiveOp::ReduceScatter(op);
        self.run(
            op,
            &[output, input],
            input.ptr(),
            output.ptr(),
            output.len(),
        )
    }

    /// Gathers every rank's `input` into `output`, by rank (`dist.all_gather_into_tensor`).
    pub fn all_gather<T: Element>(
        &self,
        output: &DeviceBuffer<T>,
        input: &DeviceBuffer<T>,
    ) -> Result<Work> {
        self.lengths("all_gather output", input.len() * self.size(), output.len())?;
        let op = CollectiveOp::AllGather;
        self.run(op, &[output, input], input.ptr(), output.ptr(), input.len())
    }

    /// Sends `buf` to rank `peer` (`dist.send`, asynchronous like `isend`: the data moves
    /// in stream order). With NCCL the host returns at once; with the in-process
    /// [`FakeGroup`](crate::FakeGroup) the call is a host rendezvous with the receiver, so
    /// two ranks that each send before they receive wait for each other there (order them,
    /// or pair the calls as NCCL's group calls would).
    pub fn send<T: Element>(&self, buf: &DeviceBuffer<T>, peer: usize) -> Result<Work> {
        let op = CollectiveOp::Send { peer };
        self.run(op, &[buf], buf.ptr(), DevicePtr(0), buf.len())
    }

    /// Receives into `buf` from rank `peer` (`dist.recv`, asynchronous like `irecv`).
    pub fn recv<T: Element>(&self, buf: &DeviceBuffer<T>, peer: usize) -> Result<Work> {
        let op = CollectiveOp::Recv { peer };
        self.run(op, &[buf], DevicePtr(0), buf.ptr(), buf.len())
    }

    fn lengths(&self, what: &'static str, expected: usize, found: usize) -> Result<()> {
        if expected != found {
            return Err(DistError::LengthMismatch {
                what,
                expected,
                found,
            });
        }
        Ok(())
    }
}
