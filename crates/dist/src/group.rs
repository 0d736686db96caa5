//! A process group on ferrocuda streams and buffers, as PyTorch's `ProcessGroupNCCL` runs
//! a collective (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp `collective`): the
//! group's communication stream first waits for the device's current stream (`syncStream`),
//! the collective runs there, every buffer it touches is marked used by that stream
//! (`recordStream`, so memory freed while the collective is in flight is not reused before
//! it ends), and the returned [`Work`] holds an event whose `wait` makes the current stream
//! wait for the collective: no host synchronisation anywhere.
use crate::collective::check_ranks;
use crate::watchdog::{Health, InFlight, Watchdog};
use crate::{Collective, DistError, Result};
use ferrocuda_driver::nccl::{CollectiveCall, CollectiveOp, ReduceOp};
use ferrocuda_stream::{DeviceBuffer, Event, Runtime, Stream};
use ferrocuda_types::{CaptureStatus, DeviceIndex, DevicePtr, Element};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One rank's process group: a collectives backend and a communication stream; with
/// [`ProcessGroup::with_timeout`], a watchdog.
pub struct ProcessGroup {
    runtime: Arc<Runtime>,
    comm: Arc<dyn Collective>,
    stream: Stream,
    health: Arc<Health>,
    /// Collectives issued (the watchdog's sequence numbers).
    issued: AtomicU64,
    /// The job's store, kept while the group lives when other ranks may still use it.
    store: Option<Arc<crate::TcpStore>>,
    // Declared last: dropped (stopped) after nothing else needs it.
    watchdog: Option<Watchdog>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("comm", &self.comm)
            .field("stream", &self.stream)
            .field("watchdog", &self.watchdog)
            .finish_non_exhaustive()
    }
}

/// A collective in flight (`c10d::Work`).
pub struct Work {
    runtime: Arc<Runtime>,
    device: DeviceIndex,
    done: Event,
    /// The group's health, when a watchdog watches it.
    health: Option<Arc<Health>>,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("device", &self.device)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
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
    /// wait). Under a watchdog, a collective that never completes ends the wait with the
    /// group's failure ([`DistError::CollectiveTimeout`], [`DistError::Aborted`]) instead:
    /// the event is polled, yielding the thread for the first milliseconds (a collective
    /// of a few hundred microseconds is seen as it ends, as a spinning synchronize sees
    /// it), then sleeping between polls.
    pub fn synchronize(&self) -> Result<()> {
        const SPIN: Duration = Duration::from_millis(20);
        let Some(health) = &self.health else {
            return Ok(self.done.synchronize()?);
        };
        let start = Instant::now();
        loop {
            if self.done.query()? {
                return Ok(());
            }
            if let Some(e) = health.failed() {
                return Err(e);
            }
            if start.elapsed() < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

impl ProcessGroup {
    /// A group over `comm`, with its communication stream from `comm`'s device's pool
    /// (PyTorch's `getStreamFromPool`, low priority by default).
    pub fn new(runtime: Arc<Runtime>, comm: Box<dyn Collective>) -> Result<ProcessGroup> {
        let stream = runtime.stream_from_pool(comm.device(), false)?;
        Ok(ProcessGroup {
            runtime,
            comm: Arc::from(comm),
            stream,
            health: Arc::default(),
            issued: AtomicU64::new(0),
            store: None,
            watchdog: None,
        })
    }

    /// A rank of a job joined through its store: the group keeps `store` for its life, as
    /// PyTorch keeps its default store (rank 0's process may serve it to the others), and
    /// is watched with `timeout` ([`ProcessGroup::with_timeout`]).
    pub(crate) fn for_job(
        runtime: Arc<Runtime>,
        comm: Box<dyn Collective>,
        store: Arc<crate::TcpStore>,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        let mut group = ProcessGroup::new(runtime, comm)?;
        group.store = Some(store);
        group.with_timeout(timeout)
    }

    /// The job's store this group keeps (made by [`ProcessGroup::from_env`] or
    /// [`ProcessGroup::join_pytorch`]; PyTorch's `_get_default_store()`), for keys the ranks
    /// exchange besides the collectives; a process that serves it can keep it past the group
    /// for ranks still using it. `None` for a group made from a communicator
    /// ([`ProcessGroup::new`]).
    pub fn store(&self) -> Option<Arc<crate::TcpStore>> {
        self.store.clone()
    }

    /// Watches this group (PyTorch's watchdog with `TORCH_NCCL_ASYNC_ERROR_HANDLING`): a
    /// collective still running `timeout` after it was issued, or an asynchronous error of
    /// the backend, aborts the communicator and fails the group. From then on every call
    /// is [`DistError::Aborted`] (the first failure in the reason), and
    /// [`Work::synchronize`] returns the failure instead of waiting for ever. Replaces an
    /// earlier watchdog of this group.
    pub fn with_timeout(mut self, timeout: Duration) -> Result<ProcessGroup> {
        self.watchdog = None;
        self.watchdog = Some(Watchdog::start(
            self.runtime.driver().clone(),
            self.comm.clone(),
            self.health.clone(),
            timeout,
        )?);
        Ok(self)
    }

    /// Aborts the group's communicator (`ProcessGroupNCCL::abort`): work in flight stops,
    /// every later call is [`DistError::Aborted`].
    pub fn abort(&self) -> Result<()> {
        self.health.fail(DistError::Aborted {
            reason: "abort() was called".into(),
        });
        self.comm.abort()
    }

    /// Why the group failed, if it did.
    pub fn error(&self) -> Option<DistError> {
        self.health.failed()
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
        if let Some(e) = self.health.failed() {
            return Err(aborted(e));
        }
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
        let seq = self.issued.fetch_add(1, Ordering::Relaxed) + 1;
        // Work captured into a graph is not watched (PyTorch's watchdog skips it too): its
        // event is recorded in the capture, and a query of it would be illegal. Without a
        // watchdog nothing is asked of the driver.
        let watched = self.watchdog.is_some()
            && self
                .runtime
                .driver()
                .stream_capture_status(self.stream.handle())?
                == CaptureStatus::None;
        if watched {
            self.health.watch(InFlight {
                seq,
                what: op.name().to_string(),
                started: Instant::now(),
                done: self.stream.record_event(None)?,
            });
        }
        Ok(Work {
            runtime: self.runtime.clone(),
            device: self.device(),
            done: self.stream.record_event(None)?,
            health: watched.then(|| self.health.clone()),
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

/// The error of a call on a failed group.
fn aborted(e: DistError) -> DistError {
    match e {
        DistError::Aborted { .. } => e,
        other => DistError::Aborted {
            reason: other.to_string(),
        },
    }
}
