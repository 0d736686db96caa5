//! A process group on ferrocuda streams and buffers, as PyTorch's `ProcessGroupNCCL` runs
//! a collective (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp `collective`): the
//! group's communication stream first waits for the device's current stream (`syncStream`),
//! the collective runs there, every buffer it touches is marked used by that stream
//! (`recordStream`, so memory freed while the collective is in flight is not reused before
//! it ends), and the returned [`Work`] holds an event whose `wait` makes the current stream
//! wait for the collective: no host synchronisation anywhere.
use crate::collective::check_ranks;
use crate::{Collective, DistError, Result};
use ferrocuda_driver::nccl::{CollectiveOp, ReduceOp};
use ferrocuda_stream::{DeviceBuffer, Event, Runtime, Stream};
use ferrocuda_types::{DeviceIndex, Element};
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

    /// Runs `call` on the communication stream after the current stream, marks `buffers`
    /// used by it, and returns the work.
    fn run<T: Element>(
        &self,
        buffers: &[&DeviceBuffer<T>],
        call: impl FnOnce(&dyn Collective, &Stream) -> Result<()>,
    ) -> Result<Work> {
        for b in buffers {
            self.check(b)?;
        }
        let current = self.runtime.current_stream(self.device())?;
        self.stream.wait_stream(&current)?;
        call(&*self.comm, &self.stream)?;
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
        self.run(&[buf], |c, s| {
            c.all_reduce(buf.ptr(), buf.ptr(), buf.len(), T::DTYPE, op, s.handle())
        })
    }

    /// Copies rank `root`'s `buf` into every rank's `buf` (`dist.broadcast`).
    pub fn broadcast<T: Element>(&self, buf: &DeviceBuffer<T>, root: usize) -> Result<Work> {
        self.ranks(CollectiveOp::Broadcast { root })?;
        self.run(&[buf], |c, s| {
            c.broadcast(buf.ptr(), buf.ptr(), buf.len(), T::DTYPE, root, s.handle())
        })
    }

    /// Reduces `input` (`size` blocks of `output.len()`) over ranks; this rank's block lands
    /// in `output` (`dist.reduce_scatter_tensor`).
    pub fn reduce_scatter<T: Element>(
        &self,
        output: &DeviceBuffer<T>,
        input: &DeviceBuffer<T>,
        op: ReduceOp,
    ) -> Result<Work> {
        self.lengths(
            "reduce_scatter input",
            output.len() * self.size(),
            input.len(),
        )?;
        self.run(&[output, input], |c, s| {
            c.reduce_scatter(
                input.ptr(),
                output.ptr(),
                output.len(),
                T::DTYPE,
                op,
                s.handle(),
            )
        })
    }

    /// Gathers every rank's `input` into `output`, by rank (`dist.all_gather_into_tensor`).
    pub fn all_gather<T: Element>(
        &self,
        output: &DeviceBuffer<T>,
        input: &DeviceBuffer<T>,
    ) -> Result<Work> {
        self.lengths("all_gather output", input.len() * self.size(), output.len())?;
        self.run(&[output, input], |c, s| {
            c.all_gather(input.ptr(), output.ptr(), input.len(), T::DTYPE, s.handle())
        })
    }

    /// Sends `buf` to rank `peer` (`dist.send`, asynchronous like `isend`).
    pub fn send<T: Element>(&self, buf: &DeviceBuffer<T>, peer: usize) -> Result<Work> {
        self.ranks(CollectiveOp::Send { peer })?;
        self.run(&[buf], |c, s| {
            c.send(buf.ptr(), buf.len(), T::DTYPE, peer, s.handle())
        })
    }

    /// Receives into `buf` from rank `peer` (`dist.recv`, asynchronous like `irecv`).
    pub fn recv<T: Element>(&self, buf: &DeviceBuffer<T>, peer: usize) -> Result<Work> {
        self.ranks(CollectiveOp::Recv { peer })?;
        self.run(&[buf], |c, s| {
            c.recv(buf.ptr(), buf.len(), T::DTYPE, peer, s.handle())
        })
    }

    fn ranks(&self, op: CollectiveOp) -> Result<()> {
        check_ranks(op, self.rank(), self.size())
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
