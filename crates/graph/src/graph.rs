//! `CudaGraph` and its capture guard.
use crate::CaptureMemory;
use crate::PhiloxGenerator;
use crate::instances::Instances;
use crate::repoint;
use ferrocuda_alloc::{AllocError, PlanError};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_stream::{DeviceBuffer, Runtime, Stream, StreamError, StreamGuard};
use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, DevicePtr, Element, GraphExecHandle, GraphHandle,
    PoolId,
};
use parking_lot::Mutex;
use std::path::Path;
use std::sync::Arc;

/// How [`CudaGraph::update_inputs`] applied new input addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputUpdate {
    /// The instantiated graph was patched in place.
    InPlace {
        /// Addresses changed: kernel arguments, memset destinations, copy sources and
        /// destinations.
        pointers: usize,
    },
    /// The driver refused the in-place update; the graph was instantiated again.
    Reinstantiated {
        /// Addresses changed: kernel arguments, memset destinations, copy sources and
        /// destinations.
        pointers: usize,
    },
    /// An instance kept from an earlier update holds these addresses: replays launch it
    /// from now on, and no driver call was made ([`CudaGraph::keep_instances`]).
    Kept {
        /// Addresses changed: kernel arguments, memset destinations, copy sources and
        /// destinations.
        pointers: usize,
    },
    /// Another instance was made for these addresses and is kept
    /// ([`CudaGraph::keep_instances`]).
    Added {
        /// Addresses changed: kernel arguments, memset destinations, copy sources and
        /// destinations.
        pointers: usize,
    },
}

/// One input of [`CudaGraph::update_input_ptrs`], by raw address: the graph holds
/// addresses inside `old..old + bytes`, which are to move to the same offsets inside
/// `new..new + bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputMove {
    /// Where the input the graph reads now starts.
    pub old: DevicePtr,
    /// Its size in bytes (the new input has the same).
    pub bytes: u64,
    /// Where the new input starts.
    pub new: DevicePtr,
}

/// What can go wrong with a graph.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// Capture was asked of the legacy default stream, which cannot capture.
    #[error("CUDA graphs must be captured on a non-default stream")]
    DefaultStream,
    /// The stream is already capturing (captures do not nest).
    #[error("this stream is already capturing: captures cannot be nested")]
    NestedCapture,
    /// `capture_begin` on a graph that already holds a capture (call `reset` first).
    #[error("this graph already holds a capture; reset it before capturing again")]
    AlreadyCaptured,
    /// `capture_end` without `capture_begin`.
    #[error("capture_end without capture_begin")]
    NotCapturing,
    /// `replay` (or `upload`, `debug_dump`) before a successful capture.
    #[error("replay before capture: this graph holds no captured work")]
    NothingCaptured,
    /// The capture recorded no work.
    #[error("the capture recorded no work (an empty graph); its pool was released")]
    EmptyCapture,
    /// A stream forked from the capture was not joined back before its end.
    #[error(
        "a stream forked from the capture was not joined back before capture_end (CUDA_ERROR_STREAM_CAPTURE_UNJOINED); its pool was released"
    )]
    Unjoined,
    /// A forbidden call during the capture (a synchronize, an event query, a host read, or
    /// another thread's allocation in GLOBAL mode) broke it.
    #[error(
        "the capture was invalidated by a call not allowed while capturing (synchronize, event query, host read, or in GLOBAL mode another thread's allocation); its pool was released"
    )]
    Invalidated,
    /// `make_graphed_callables` got a different number of callables and sample inputs.
    #[error("{callables} callables but {samples} sample input lists")]
    SampleCount {
        /// Callables given.
        callables: usize,
        /// Sample input lists given.
        samples: usize,
    },
    /// A graphed callable failed during warm-up or capture.
    #[error("graphed callable {index} failed: {message}")]
    Callable {
        /// Which callable.
        index: usize,
        /// Its error.
        message: String,
    },
    /// A graphed callable was called with a different number of inputs than its samples.
    #[error("a graphed callable takes {expected} inputs, got {found}")]
    InputCount {
        /// Inputs it was captured with.
        expected: usize,
        /// Inputs given.
        found: usize,
    },
    /// No graphed callable has this index.
    #[error("no graphed callable {index}: there are {count}")]
    NoSuchCallable {
        /// The index asked for.
        index: usize,
        /// How many there are.
        count: usize,
    },
    /// Graphed callables sharing a pool were called out of capture order (debug builds).
    #[error(
        "graphed callables share a pool and must replay in capture order: expected callable {expected}, got {found}"
    )]
    ReplayOrder {
        /// The callable due next.
        expected: usize,
        /// The callable called.
        found: usize,
    },
    /// [`CudaGraph::update_inputs`] found a node that may hold an input's address but cannot
    /// be repointed; nothing was changed.
    #[error(
        "update_inputs cannot repoint graph node {node} ({kind}): {reason}; nothing was changed"
    )]
    CannotRepoint {
        /// The node's index, in the driver's order of the graph's nodes.
        node: usize,
        /// What kind of node it is.
        kind: &'static str,
        /// Why it cannot be repointed.
        reason: String,
    },
    /// [`CudaGraph::update_input_ptrs`] got a range that starts at address 0 or runs past
    /// the end of the address space; nothing was changed.
    #[error(
        "update_input_ptrs: the input {old}..+{bytes:#x} or {new}..+{bytes:#x} starts at 0 or runs past the end of the address space; nothing was changed"
    )]
    InputRange {
        /// The old input's address.
        old: DevicePtr,
        /// The new input's address.
        new: DevicePtr,
        /// Their size.
        bytes: u64,
    },
    /// A lazily captured graph's pool, as planned, would take more than the whole budget
    /// of a [`LazyGraphs`](crate::LazyGraphs).
    #[error(
        "capturing this graph would reserve {planned} bytes, more than the budget of {budget} bytes for all graphs"
    )]
    OverBudget {
        /// Bytes its pool would reserve.
        planned: u64,
        /// The budget.
        budget: u64,
    },
    /// The graph-memory planner refused the recorded requests.
    #[error("graph-memory plan: {0}")]
    Plan(#[from] PlanError),
    /// A random-number generator was misused around a capture.
    #[error("graph RNG: {0}")]
    Rng(String),
    /// The driver refused an operation.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    /// A device or stream error.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// The allocator refused a pool operation.
    #[error(transparent)]
    Alloc(#[from] AllocError),
}

#[derive(Debug, Default)]
struct State {
    /// The stream being captured (into `pool`).
    capturing: Option<Stream>,
    graph: Option<GraphHandle>,
    exec: Option<GraphExecHandle>,
    /// The pool this graph holds (a user of it until `reset`).
    pool: Option<PoolId>,
    /// Registered generators, with the offset units one replay consumes from each.
    generators: Vec<(Arc<PhiloxGenerator>, u64)>,
    /// The instances `update_input_ptrs` moves between, with their nodes, read from the
    /// driver at the first update; `None` until then.
    instances: Option<Instances>,
    /// How many instances `update_input_ptrs` may keep (0 and 1: one).
    keep_instances: usize,
}

/// A captured CUDA graph with its private memory pool (`torch.cuda.CUDAGraph`).
#[derive(Debug)]
pub struct CudaGraph {
    runtime: Arc<Runtime>,
    memory: CaptureMemory,
    device: DeviceIndex,
    state: Mutex<State>,
}

impl CudaGraph {
    /// A graph for `device`, whose captures allocate through `memory` (the allocators
    /// installed as the runtime's memory resource: an `Arc<DeviceAllocators>` for
    /// `backend:native`, or [`CaptureMemory::Async`]).
    pub fn new(
        runtime: Arc<Runtime>,
        memory: impl Into<CaptureMemory>,
        device: DeviceIndex,
    ) -> Result<CudaGraph, GraphError> {
        runtime.check_device(device)?;
        Ok(CudaGraph {
            runtime,
            memory: memory.into(),
            device,
            state: Mutex::new(State::default()),
        })
    }

    /// The runtime this graph captures and replays through.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// The device this graph captures on.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    fn driver(&self) -> &Arc<dyn Driver> {
        self.runtime.driver()
    }

    /// The pool this graph's captures allocate from, once a capture began.
    pub fn pool(&self) -> Option<PoolId> {
        self.state.lock().pool
    }

    /// Lets this graph's captures draw from `generator` (`register_generator_state`); each
    /// replay then advances its offset by what the capture drew. Refused while capturing.
    pub fn register_generator(&self, generator: &Arc<PhiloxGenerator>) -> Result<(), GraphError> {
        let mut st = self.state.lock();
        if st.capturing.is_some() {
            return Err(GraphError::Rng(
                "Cannot register the state during capturing stage.".into(),
            ));
        }
        generator.prepare()?;
        if !st.generators.iter().any(|(g, _)| Arc::ptr_eq(g, generator)) {
            st.generators.push((generator.clone(), 0));
        }
        Ok(())
    }

    /// Starts capturing `stream` (`CUDAGraph.capture_begin(pool, capture_error_mode)`).
    /// `pool: Some(id)` shares another graph's pool (or a `PoolId::handle()`); `None` makes
    /// a new one.
    pub fn capture_begin(
        &self,
        stream: &Stream,
        pool: Option<PoolId>,
        mode: CaptureMode,
    ) -> Result<(), GraphError> {
        self.runtime.check_stream(stream)?;
        if stream.is_default() {
            return Err(GraphError::DefaultStream);
        }
        if stream.device() != self.device {
            return Err(StreamError::DeviceMismatch {
                expected: self.device,
                found: stream.device(),
                what: "the capture stream",
            }
            .into());
        }
        let mut st = self.state.lock();
        if st.capturing.is_some() || st.exec.is_some() {
            return Err(GraphError::AlreadyCaptured);
        }
        if !matches!(
            self.driver().stream_capture_status(stream.handle())?,
            CaptureStatus::None
        ) {
            return Err(GraphError::NestedCapture);
        }
        let pool = pool.unwrap_or_else(PoolId::for_capture);
        // The allocator learns that a capture is underway before it begins (PyTorch's
        // `CUDAGraph::capture_begin`: `beginAllocateToPool`, then `cudaStreamBeginCapture`),
        // so a free racing in from another thread is deferred instead of recorded into the
        // capture.
        let announced = self.memory.announce(self.device, stream.handle())?;
        self.driver().stream_begin_capture(stream.handle(), mode)?;
        let id = match self.driver().stream_capture_status(stream.handle()) {
            Ok(CaptureStatus::Active { id }) => id,
            other => {
                self.abort_capture(stream);
                return Err(other
                    .err()
                    .map_or(GraphError::Invalidated, GraphError::from));
            }
        };
        // Pinned host memory asked for during the capture comes from the pool of the same
        // id in the host allocator (PyTorch's `begin_allocate_to_pool` on the host
        // allocator in `CUDAGraph::capture_begin`).
        if let Err(e) = self.memory.route(self.device, pool, id) {
            self.abort_capture(stream);
            return Err(e.into());
        }
        announced.keep();
        let mut started = 0;
        let prologues = st.generators.iter().try_for_each(|(g, _)| {
            g.capture_prologue(id)?;
            started += 1;
            Ok(())
        });
        if let Err(e) = prologues {
            // Only the generators this capture started: the one that refused belongs to
            // another capture.
            for (g, _) in &st.generators[..started] {
                g.capture_epilogue();
            }
            self.abort_capture(stream);
            let _ = self.memory.end(self.device, pool, stream.handle());
            let _ = self.memory.release(self.device, pool);
            return Err(e);
        }
        st.capturing = Some(stream.clone());
        st.pool = Some(pool);
        Ok(())
    }

    /// Ends the capture and instantiates the graph (`capture_end`). On failure the capture
    /// is over, the allocator no longer routes to the pool, and the pool is released.
    pub fn capture_end(&self) -> Result<(), GraphError> {
        self.finish_capture(true)
    }

    /// Ends the capture and throws away what it recorded: the graph is left empty and its
    /// use of the pool is released (what a [`CaptureGuard`] dropped without `end` does).
    fn discard_capture(&self) -> Result<(), GraphError> {
        self.finish_capture(false)
    }

    /// Ends the capture, then stops the allocator's routing and the generators' recording,
    /// then keeps the graph (`keep`) or destroys it; a graph not kept releases the pool.
    fn finish_capture(&self, keep: bool) -> Result<(), GraphError> {
        let mut st = self.state.lock();
        if st.capturing.is_none() {
            return Err(GraphError::NotCapturing);
        }
        let (Some(stream), Some(pool)) = (st.capturing.take(), st.pool) else {
            return Err(GraphError::NotCapturing);
        };
        // The capture ends before the allocator stops routing to the pool (PyTorch's
        // `CUDAGraph::capture_end`: `cudaStreamEndCapture`, then `endAllocateToPool`), so a
        // free racing in from another thread until then is still deferred.
        let ended = if keep {
            Some(self.driver().stream_end_capture(stream.handle()))
        } else {
            self.abort_capture(&stream);
            None
        };
        let unrouted = self.memory.end(self.device, pool, stream.handle());
        for (generator, increment) in &mut st.generators {
            let drawn = generator.capture_epilogue();
            *increment = if keep { drawn } else { 0 };
        }
        let result = ended.map_or(Ok(()), |ended| self.keep_graph(&mut st, ended));
        if !keep || result.is_err() {
            st.pool = None;
            let _ = self.memory.release(self.device, pool);
        }
        unrouted?;
        result
    }

    /// Instantiates the graph a capture ended with, or says why there is none (destroying
    /// what the driver returned).
    fn keep_graph(
        &self,
        st: &mut State,
        ended: Result<GraphHandle, DriverError>,
    ) -> Result<(), GraphError> {
        let graph = match ended {
            Ok(graph) => graph,
            Err(e) if e == DriverError::STREAM_CAPTURE_UNJOINED => {
                return Err(GraphError::Unjoined);
            }
            Err(e) if e == DriverError::STREAM_CAPTURE_INVALIDATED => {
                return Err(GraphError::Invalidated);
            }
            Err(e) => return Err(e.into()),
        };
        let exec = match self.driver().graph_node_count(graph) {
            Ok(0) => Err(GraphError::EmptyCapture),
            Ok(_) => self.driver().graph_instantiate(graph).map_err(Into::into),
            Err(e) => Err(e.into()),
        };
        match exec {
            Ok(exec) => {
                st.graph = Some(graph);
                st.exec = Some(exec);
                Ok(())
            }
            Err(e) => {
                let _ = self.driver().graph_destroy(graph);
                Err(e)
            }
        }
    }

    /// Launches the captured work on `stream` (`replay`; any stream of the device). Each
    /// registered generator the capture drew from first gets its `[seed, offset]` written
    /// to the device (one small copy) and its offset advanced.
    pub fn replay(&self, stream: &Stream) -> Result<(), GraphError> {
        self.runtime.check_stream(stream)?;
        let st = self.state.lock();
        let exec = st.exec.ok_or(GraphError::NothingCaptured)?;
        if let Some(pool) = st.pool
            && self.memory.pool_asleep(self.device, pool)?
        {
            return Err(GraphError::Alloc(
                ferrocuda_alloc::SleepError::Asleep(pool).into(),
            ));
        }
        for (generator, increment) in &st.generators {
            if *increment > 0 {
                generator.replay_prologue(*increment, stream)?;
            }
        }
        Ok(self.driver().graph_launch(exec, stream.handle())?)
    }

    /// Points the captured graph at new buffers instead of copying into the static ones
    /// (beyond PyTorch). For each `(old, new)` pair, every address inside `old` that the
    /// graph holds moves to the same offset inside `new`: kernel arguments, memset
    /// destinations, copy sources and destinations, whether they point at the start of
    /// `old` or into it. The instantiated graph's changed nodes are then set in place
    /// (falling back to `cuGraphExecUpdate`, then to instantiating it again, when the
    /// driver refuses), or another kept instance is launched
    /// ([`CudaGraph::keep_instances`]).
    ///
    /// Refused, with nothing changed: pairs of different lengths
    /// ([`StreamError::LengthMismatch`]), a buffer on another device than the graph's
    /// ([`StreamError::DeviceMismatch`]), and what [`CudaGraph::update_input_ptrs`] (which
    /// does the work) refuses: a graph with a node that may hold an input's address but
    /// cannot be repointed ([`GraphError::CannotRepoint`], naming the node): a memset or
    /// copy that covers part of an input and memory outside it, or a node whose parameters
    /// the driver does not describe (a child graph, a host function, a kernel launched
    /// without a parameter array, a 2-D memset or copy).
    ///
    /// Caveat: a kernel argument's type is not known, so any 8-byte argument whose value
    /// lies inside an old buffer is rewritten, a scalar that happens to equal such an
    /// address included.
    ///
    /// The new buffers must stay alive while the graph may replay.
    pub fn update_inputs<T: Element>(
        &self,
        pairs: &[(&DeviceBuffer<T>, &DeviceBuffer<T>)],
    ) -> Result<InputUpdate, GraphError> {
        let moves = pairs
            .iter()
            .map(|(old, new)| self.input_move(old, new))
            .collect::<Result<Vec<_>, _>>()?;
        self.update_input_ptrs(&moves)
    }

    /// [`CudaGraph::update_inputs`] by raw address, for callers that hold addresses rather
    /// than buffers (the trees): each [`InputMove`] moves the addresses the graph holds
    /// inside `old..old + bytes` to the same offsets inside `new`. The caller vouches that
    /// both ranges are device memory of the graph's device, and that the `old` ranges do not
    /// overlap (where they do, the first move containing an address wins).
    ///
    /// Refused, with nothing changed: a range that starts at address 0 (with `bytes > 0`)
    /// or runs past the end of the address space ([`GraphError::InputRange`]), a graph
    /// that holds no capture ([`GraphError::NothingCaptured`]), a node that may hold an
    /// input's address but cannot be repointed ([`GraphError::CannotRepoint`]), and a
    /// driver failure while setting nodes or updating the instance (that error; the nodes
    /// already set are put back).
    ///
    /// The new ranges must stay valid while the graph may replay.
    pub fn update_input_ptrs(&self, moves: &[InputMove]) -> Result<InputUpdate, GraphError> {
        if let Some(m) = moves.iter().find(|m| !m.is_valid()) {
            return Err(GraphError::InputRange {
                old: m.old,
                new: m.new,
                bytes: m.bytes,
            });
        }
        self.update_instances(|instances| instances.plan(moves))
    }

    /// Points the copies this graph captured into device memory at `dst` (1-D, between
    /// device addresses) at new sources, for each `(dst, src)`: what the trees do for an
    /// input copied inside the recording's graph. As [`CudaGraph::update_input_ptrs`]
    /// otherwise; no such copy is [`GraphError::CannotRepoint`].
    pub(crate) fn retarget_copies(
        &self,
        sources: &[(DevicePtr, DevicePtr)],
    ) -> Result<InputUpdate, GraphError> {
        self.update_instances(|instances| instances.copy_plan(sources))
    }

    /// Makes the changes `plan` says in the instances, reading the captured graph's nodes
    /// at the first update.
    fn update_instances(
        &self,
        plan: impl FnOnce(&Instances) -> Result<repoint::Plan, GraphError>,
    ) -> Result<InputUpdate, GraphError> {
        let mut st = self.state.lock();
        let (graph, mut exec) = st.graph.zip(st.exec).ok_or(GraphError::NothingCaptured)?;
        let driver = &**self.driver();
        let mut instances = match st.instances.take() {
            Some(instances) => instances,
            None => Instances::read(driver, graph)?,
        };
        let result = plan(&instances)
            .and_then(|plan| instances.update(driver, graph, &mut exec, st.keep_instances, plan));
        st.exec = Some(exec);
        st.instances = Some(instances);
        result
    }

    /// Lets [`CudaGraph::update_inputs`] keep up to `n` instances of the captured graph,
    /// each holding the input addresses it was last given (beyond PyTorch; default 1).
    /// Moving back to addresses a kept instance holds then costs no driver call
    /// ([`InputUpdate::Kept`]); moving to new ones makes another instance while fewer than
    /// `n` exist ([`InputUpdate::Added`]), else updates the one replays launch (as with one
    /// instance: the others stay for the addresses they hold).
    /// Each instance costs what `cuGraphInstantiate` costs, in time once and in driver
    /// memory while kept. For a graph fed from a few buffers in turn (double buffering:
    /// `n = 2`). Lowering `n` destroys the least recently launched instances.
    pub fn keep_instances(&self, n: usize) {
        let mut st = self.state.lock();
        st.keep_instances = n;
        if let Some(instances) = &mut st.instances {
            instances.trim(&**self.runtime.driver(), n);
        }
    }

    /// Checks one `(old, new)` pair of [`CudaGraph::update_inputs`].
    fn input_move<T: Element>(
        &self,
        old: &DeviceBuffer<T>,
        new: &DeviceBuffer<T>,
    ) -> Result<InputMove, GraphError> {
        if old.len() != new.len() {
            return Err(StreamError::LengthMismatch {
                expected: old.len(),
                found: new.len(),
            }
            .into());
        }
        for (buffer, what) in [(old, "an old input"), (new, "a new input")] {
            if buffer.device() != self.device {
                return Err(StreamError::DeviceMismatch {
                    expected: self.device,
                    found: buffer.device(),
                    what,
                }
                .into());
            }
        }
        Ok(InputMove {
            old: old.ptr(),
            bytes: old.bytes(),
            new: new.ptr(),
        })
    }

    /// Ends a capture that could not start properly, or is discarded, dropping whatever it
    /// recorded.
    fn abort_capture(&self, stream: &Stream) {
        if let Ok(graph) = self.driver().stream_end_capture(stream.handle()) {
            let _ = self.driver().graph_destroy(graph);
        }
    }

    /// Stages the graph on the device so the first replay does not pay for it (`upload`).
    pub fn upload(&self, stream: &Stream) -> Result<(), GraphError> {
        self.runtime.check_stream(stream)?;
        let exec = self.state.lock().exec.ok_or(GraphError::NothingCaptured)?;
        Ok(self.driver().graph_upload(exec, stream.handle())?)
    }

    /// Number of nodes of the captured graph.
    pub fn node_count(&self) -> Result<usize, GraphError> {
        let graph = self.state.lock().graph.ok_or(GraphError::NothingCaptured)?;
        Ok(self.driver().graph_node_count(graph)?)
    }

    /// Writes the graph as Graphviz DOT (`debug_dump`).
    pub fn debug_dump(&self, path: &Path) -> Result<(), GraphError> {
        let graph = self.state.lock().graph.ok_or(GraphError::NothingCaptured)?;
        Ok(self.driver().graph_debug_dot(graph, path)?)
    }

    /// Drops the captured graph and this graph's use of its pool (`reset`). Buffers
    /// allocated during the capture stay valid until they are dropped.
    pub fn reset(&self) -> Result<(), GraphError> {
        let mut st = self.state.lock();
        if st.capturing.is_some() {
            drop(st);
            let _ = self.discard_capture();
            st = self.state.lock();
        }
        if let Some(mut instances) = st.instances.take() {
            instances.trim(&**self.runtime.driver(), 1);
        }
        if let Some(exec) = st.exec.take() {
            self.driver().graph_exec_destroy(exec)?;
        }
        if let Some(graph) = st.graph.take() {
            self.driver().graph_destroy(graph)?;
        }
        if let Some(pool) = st.pool.take() {
            self.memory.release(self.device, pool)?;
        }
        Ok(())
    }

    /// Captures what is enqueued until the guard ends (`with torch.cuda.graph(g, pool,
    /// stream)`): synchronizes the device, empties the cache, makes `stream` (or the
    /// device's default capture stream) current, and begins the capture.
    ///
    /// As PyTorch's `torch.cuda.graph` (torch/cuda/graphs.py): `__enter__` runs
    /// `torch.cuda.synchronize()` and `torch.cuda.empty_cache()` first, so the capture
    /// starts from a cache holding only live memory (a dropped graph's free pool segments
    /// go back to the driver); `__init__` captures on the class-level
    /// `default_capture_stream` when no stream is given, so that captures sharing a pool
    /// reuse each other's blocks (blocks are tagged by stream). Ferrocuda keeps one default
    /// capture stream per device ([`Runtime::default_capture_stream`]); while another
    /// capture holds it, a pool stream is used instead (PyTorch would fail).
    ///
    /// That first synchronize is why a second capture begun this way while another is
    /// underway on the device (from another thread) fails with the driver's
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and breaks the first capture, whose end then
    /// reports [`GraphError::Invalidated`]: the driver refuses a device synchronize during any
    /// capture and invalidates it, as it does under PyTorch. [`CudaGraph::capture_begin`]
    /// does not synchronize, and refuses the second capture with PyTorch's text instead.
    pub fn capture<'a>(
        &'a self,
        stream: Option<&Stream>,
        pool: Option<PoolId>,
        mode: CaptureMode,
    ) -> Result<CaptureGuard<'a>, GraphError> {
        if let Some(s) = stream {
            self.runtime.check_stream(s)?;
        }
        self.runtime.synchronize(self.device)?;
        self.memory.empty_cache(self.device)?;
        let stream = match stream {
            Some(s) => s.clone(),
            None => self.idle_capture_stream()?,
        };
        let stream_guard = self.runtime.stream_guard(&stream)?;
        self.capture_begin(&stream, pool, mode)?;
        Ok(CaptureGuard {
            graph: self,
            stream,
            _stream_guard: stream_guard,
            ended: false,
        })
    }

    /// The device's default capture stream, or a pool stream while another capture holds it.
    fn idle_capture_stream(&self) -> Result<Stream, GraphError> {
        let stream = self.runtime.default_capture_stream(self.device)?;
        match self.driver().stream_capture_status(stream.handle())? {
            CaptureStatus::None => Ok(stream),
            _ => Ok(self.runtime.stream_from_pool(self.device, false)?),
        }
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let _ = self.reset();
    }
}

/// An open capture (`with torch.cuda.graph(...)`): the capture stream is current until it
/// ends. [`CaptureGuard::end`] ends it, keeps the graph and reports errors. Dropping the
/// guard without `end` (an early return, a `?`, a panic) discards the capture: it is ended,
/// what it recorded is destroyed, the allocator stops routing to the pool and the graph's
/// use of the pool is released, so no half graph is kept and the graph can capture again.
#[derive(Debug)]
#[must_use = "the capture ends when the guard drops"]
pub struct CaptureGuard<'a> {
    graph: &'a CudaGraph,
    stream: Stream,
    _stream_guard: StreamGuard<'a>,
    ended: bool,
}

impl CaptureGuard<'_> {
    /// The capturing stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Ends the capture and instantiates the graph (the only way to keep it).
    pub fn end(mut self) -> Result<(), GraphError> {
        self.ended = true;
        self.graph.capture_end()
    }
}

impl Drop for CaptureGuard<'_> {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.graph.discard_capture();
        }
    }
}
