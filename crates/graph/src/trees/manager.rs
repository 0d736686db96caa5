//! The per-device tree manager (`CUDAGraphTreeManager` in
//! `torch/_inductor/cudagraph_trees.py`): its state, generations, and the `run` algorithm
//! that decides, for each call, between warming up, replaying a recorded node, recording a
//! new one, and running eagerly.
use super::config::{FunctionMode, GenerationPolicy, TreeConfig, WrapOptions};
use super::context::{Call, Served, TreeFn};
use super::errors::{CheckStatus, SkipReason, TreeError, TreeEvent};
use super::liveness::{all_dead, check_invariants, live_tree_ptrs, mismatch_detail};
use super::nodes::{Arena, FunctionId, WarmupNode};
use super::tensor::{Input, Shape};
use ferrocuda_alloc::{CachingAllocator, DeviceAllocators};
use ferrocuda_stream::{Runtime, Stream};
use ferrocuda_types::{DeviceIndex, DevicePtr, PoolId};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// What the manager is doing on the current path (`ExecutionState`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum PathMode {
    /// No current node.
    None,
    /// The path ends in warm-up nodes.
    Warmup,
    /// The current node was just recorded: the allocator's books are exact.
    Recording,
    /// The current node was replayed: the allocator's books are those of its last
    /// checkpoint, not of the replays.
    Execution,
}

/// Counters of what the manager did.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Warm-up runs.
    pub warmups: u64,
    /// Graphs recorded.
    pub recordings: u64,
    /// Replays.
    pub replays: u64,
    /// Calls run eagerly without graphs (`counters["inductor"]["cudagraph_skips"]` counts
    /// the first of each function and reason; this counts every call).
    pub eager_calls: u64,
    /// Checkpoints applied to the allocator (`debug_checkpointing_counter`).
    pub checkpoints: u64,
    /// Recordings made because no sibling served (`debug_fail_counter`).
    pub rerecords: u64,
    /// Recordings evicted by a shape cap.
    pub evictions: u64,
    /// Non-static inputs copied into recordings' static inputs before replays.
    pub input_copies: u64,
    /// Graph updates that patched recordings to read callers' buffers (or pointed them
    /// back at their static inputs) before replays; at most one per replay, plus one when
    /// a recording turns out unpatchable. A move to addresses a kept instance holds is
    /// not one ([`TreeStats::kept_instance_launches`]).
    pub input_updates: u64,
    /// Replays whose patched inputs moved to addresses that another kept instance of the
    /// recording's graph held, launched with no graph update
    /// ([`TreeConfig::kept_instances`]).
    pub kept_instance_launches: u64,
}

/// One recorded node, as [`Trees::nodes`] describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    /// Its graph id.
    pub id: u64,
    /// The function it records.
    pub function: FunctionId,
    /// Its parent's graph id; `None` for a root.
    pub parent: Option<u64>,
    /// `(depth, index)` of the path outputs it expects dead.
    pub expected_dead_before: Vec<(usize, usize)>,
}

#[derive(Debug)]
pub(crate) struct FunctionInfo {
    pub(crate) name: Arc<str>,
    pub(crate) mode: FunctionMode,
    pub(crate) mutated: Vec<usize>,
    pub(crate) warmups: u32,
    /// Set once the function can never be graphed (an incompatible op, dynamic shapes).
    pub(crate) skip: Option<SkipReason>,
    /// Skip kinds already reported (PyTorch logs each once per function).
    pub(crate) reported: Vec<std::mem::Discriminant<SkipReason>>,
    pub(crate) warned_path: bool,
    /// Its inputs may be padded to buckets (a recording may see inputs shorter than its
    /// copies).
    pub(crate) padded: bool,
    /// What its last warm-up asked of the pool: what a plan of its recording replays.
    pub(crate) warmed: Option<super::warmed::WarmedUp>,
    /// Evicted by a shape cap: no call has its id any more.
    pub(crate) evicted: bool,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) arena: Arena,
    pub(crate) functions: Vec<FunctionInfo>,
    /// Recorded nodes of the current path, root first.
    pub(crate) path: Vec<usize>,
    /// Warm-up nodes after the path.
    pub(crate) warmups: Vec<WarmupNode>,
    pub(crate) mode: PathMode,
    /// The generation of the current path.
    pub(crate) current_gen: Option<u64>,
    pub(crate) pending_backward: bool,
    /// Pool blocks the tree owns that the allocator has allocated now.
    pub(crate) held: HashSet<DevicePtr>,
    /// Re-recordings per (node graph id, function).
    pub(crate) rerecords: HashMap<(Option<u64>, FunctionId), u32>,
    pub(crate) events: Vec<TreeEvent>,
    pub(crate) stats: TreeStats,
    pub(crate) next_graph: u64,
}

impl State {
    fn new() -> State {
        State {
            arena: Arena::default(),
            functions: Vec::new(),
            path: Vec::new(),
            warmups: Vec::new(),
            mode: PathMode::None,
            current_gen: None,
            pending_backward: false,
            held: HashSet::new(),
            rerecords: HashMap::new(),
            events: Vec::new(),
            stats: TreeStats::default(),
            next_graph: 0,
        }
    }
}

/// The CUDA-graph tree manager of one device: one private pool and one stream shared by
/// every function wrapped through it. See the [module docs](super).
#[derive(Debug)]
pub struct Trees {
    pub(crate) runtime: Arc<Runtime>,
    pub(crate) allocators: Arc<DeviceAllocators>,
    pub(crate) device: DeviceIndex,
    pub(crate) pool: PoolId,
    pub(crate) stream: Stream,
    pub(crate) config: TreeConfig,
    /// Steps begun by `mark_step_begin`.
    steps: AtomicU64,
    /// Calls entered (the generation under the heuristic, until a step is marked).
    calls: AtomicU64,
    pub(crate) state: Mutex<State>,
}

impl Trees {
    /// A manager for `device` whose recordings allocate through `allocators` (installed as
    /// the runtime's memory resource). It holds one private pool for its lifetime (PyTorch
    /// keeps it alive with an empty graph) and records on a stream of its own.
    pub fn new(
        runtime: Arc<Runtime>,
        allocators: Arc<DeviceAllocators>,
        device: DeviceIndex,
        config: TreeConfig,
    ) -> Result<Arc<Trees>, TreeError> {
        runtime.check_device(device)?;
        let stream = runtime.new_stream(device, 0)?;
        let pool = PoolId::handle();
        allocators.device(device)?.retain_pool(pool);
        Ok(Arc::new(Trees {
            runtime,
            allocators,
            device,
            pool,
            stream,
            config,
            steps: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            state: Mutex::new(State::new()),
        }))
    }

    /// Begins a new step (`torch.compiler.cudagraph_mark_step_begin`): the next call may
    /// end the current path, and the outputs of earlier steps still held become stale
    /// when it does.
    pub fn mark_step_begin(&self) {
        self.steps.fetch_add(1, Ordering::AcqRel);
    }

    /// The private pool all recordings share.
    pub fn pool(&self) -> PoolId {
        self.pool
    }

    /// The stream warm-ups and recordings run on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// What the manager did so far.
    pub fn stats(&self) -> TreeStats {
        self.state.lock().stats
    }

    /// The events since the last call (skips, re-recordings, checkpoints, warnings).
    pub fn take_events(&self) -> Vec<TreeEvent> {
        std::mem::take(&mut self.state.lock().events)
    }

    /// The recorded nodes, in arena order.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let st = self.state.lock();
        let id_of = |i: usize| st.arena.get(i).map(|n| n.id);
        st.arena
            .iter()
            .map(|(_, n)| NodeInfo {
                id: n.id,
                function: n.function,
                parent: n.parent.and_then(id_of),
                expected_dead_before: n.expected_dead_before.clone(),
            })
            .collect()
    }

    pub(crate) fn allocator(&self) -> Result<&CachingAllocator, TreeError> {
        Ok(self.allocators.device(self.device)?)
    }

    pub(crate) fn register(&self, options: &WrapOptions, skip: Option<SkipReason>) -> FunctionId {
        let mut st = self.state.lock();
        st.functions.push(FunctionInfo {
            name: options.name.as_str().into(),
            mode: options.mode,
            mutated: options.mutated_inputs.clone(),
            warmups: 0,
            skip,
            reported: Vec::new(),
            warned_path: false,
            padded: options.buckets.is_some(),
            warmed: None,
            evicted: false,
        });
        FunctionId(st.functions.len() as u32 - 1)
    }

    pub(crate) fn report(&self, event: TreeEvent) {
        self.state.lock().events.push(event);
    }

    /// The generation a call entering now belongs to (`get_curr_generation`).
    fn enter_generation(&self) -> u64 {
        let calls = self.calls.fetch_add(1, Ordering::AcqRel) + 1;
        let steps = self.steps.load(Ordering::Acquire);
        match self.config.generations {
            _ if steps > 0 => (1 << 63) | steps,
            GenerationPolicy::Heuristic => calls,
            GenerationPolicy::Explicit => 0,
        }
    }

    /// `can_start_new_generation`.
    fn can_start_new_generation(&self, st: &State, generation: u64) -> bool {
        st.current_gen != Some(generation)
            && (self.config.generations == GenerationPolicy::Explicit
                || self.steps.load(Ordering::Acquire) > 0
                || !st.pending_backward)
    }

    /// Ends the current path if a new generation may start (invalidating its live
    /// outputs) or all its outputs are dead; whether it ended.
    fn try_end_path(&self, st: &mut State, generation: u64) -> Result<bool, TreeError> {
        if st.mode == PathMode::None {
            return Ok(false);
        }
        if self.can_start_new_generation(st, generation) {
            self.end_path(st, true)?;
            return Ok(true);
        }
        if all_dead(&st.arena, &st.path, &st.warmups) {
            self.end_path(st, false)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Runs one call of function `fid` (`run` of the manager). `shapes` are the shapes the
    /// function sees (padded to buckets where that applies).
    pub(crate) fn run(
        &self,
        fid: FunctionId,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        f: &mut dyn TreeFn,
    ) -> Result<Call, TreeError> {
        let generation = self.enter_generation();
        let mut st = self.state.lock();
        let call = self.dispatch(&mut st, fid, generation, inputs, shapes, f);
        if let Some(info) = st.functions.get(fid.0 as usize) {
            match info.mode {
                FunctionMode::Forward => st.pending_backward = true,
                FunctionMode::Backward => st.pending_backward = false,
                FunctionMode::Inference => {}
            }
        }
        call
    }

    fn dispatch(
        &self,
        st: &mut State,
        fid: FunctionId,
        generation: u64,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        f: &mut dyn TreeFn,
    ) -> Result<Call, TreeError> {
        // The wrapped function refused stale inputs before its guards; the signature it
        // picked may have evicted recordings since, making more outputs stale.
        Trees::check_fresh(inputs)?;
        if let Some(reason) = self.static_skip(st, fid, inputs)? {
            return self.skip(st, fid, reason, inputs, shapes, f);
        }
        loop {
            if matches!(st.mode, PathMode::Recording | PathMode::Warmup) {
                self.try_end_path(st, generation)?;
            }
            // Ending the path (here, or at the end of the previous turn) freed its outputs
            // and made them stale before anything reads the inputs.
            Trees::check_fresh(inputs)?;
            if let Some(reason) = self.mutation_skip(st, fid, inputs, shapes) {
                return self.skip(st, fid, reason, inputs, shapes, f);
            }
            let warmups = st.functions.get(fid.0 as usize).map_or(0, |i| i.warmups);
            if warmups < self.config.warmup_runs || st.mode == PathMode::Warmup {
                return self.warmup(st, fid, generation, inputs, shapes, f);
            }
            let (found, mismatch) = self.find_child(st, fid, inputs);
            if let Some(node) = found {
                return self.execute(st, node, generation, inputs);
            }
            let is_root = st
                .arena
                .iter()
                .any(|(_, n)| n.parent.is_none() && n.function == fid);
            if !st.path.is_empty() && is_root && self.try_end_path(st, generation)? {
                continue;
            }
            return self.record_or_skip(st, fid, generation, mismatch, inputs, shapes, f);
        }
    }

    /// [`TreeError::StaleOutput`] when an input is an output made stale: by a later run,
    /// or by this call, which ended the path the output belonged to. PyTorch's order
    /// (`_run` in `torch/_inductor/cudagraph_trees.py`): `try_end_curr_recording` and
    /// `try_end_curr_warmup` free the old path's outputs and mark them stale
    /// (`dealloc_current_path_weakrefs`) before the function reads its inputs, so reading
    /// such an input raises "accessing tensor output of CUDAGraphs that has been
    /// overwritten by a subsequent run". Checked after every place a call may end the
    /// path, so that no warm-up, recording, replay or eager run reads a freed block; here a
    /// replayed path ended by a new step is refused too (PyTorch replays on it silently).
    pub(crate) fn check_fresh(inputs: &[Input<'_>]) -> Result<(), TreeError> {
        for input in inputs {
            if let Some(t) = input.tree {
                t.ptr()?;
            }
        }
        Ok(())
    }

    /// Reasons known before looking at the tree: a sticky skip of the function, an input
    /// on another device, or an uncached allocator. (Inputs past their buffers and stale
    /// ones were refused before the guards: [`Wrapped::call`](super::Wrapped::call).)
    fn static_skip(
        &self,
        st: &State,
        fid: FunctionId,
        inputs: &[Input<'_>],
    ) -> Result<Option<SkipReason>, TreeError> {
        if let Some(reason) = st
            .functions
            .get(fid.0 as usize)
            .and_then(|i| i.skip.clone())
        {
            return Ok(Some(reason));
        }
        let mut devices = vec![self.device];
        for input in inputs {
            if !devices.contains(&input.device) {
                devices.push(input.device);
            }
        }
        if devices.len() > 1 {
            return Ok(Some(SkipReason::MultipleDevices { devices }));
        }
        if !self.allocator()?.is_caching() {
            return Ok(Some(SkipReason::UncachedAllocator));
        }
        Ok(None)
    }

    /// "mutated inputs": the function writes an input that is neither static nor a live
    /// output of the tree used in place (`check_for_mutation`). Outputs of warm-ups count
    /// as recorded ones do: PyTorch asks the current node, a `CUDAGraphNode` or a
    /// `CUDAWarmupNode`, whether the input is one of its path's live outputs
    /// (`_get_cuda_graph_recorded_tensor_checker`, `_is_cuda_graph_recorded_tensor`); a
    /// warm-up reads its inputs in place, so the write lands, and the function goes on to
    /// warm up and record.
    fn mutation_skip(
        &self,
        st: &State,
        fid: FunctionId,
        inputs: &[Input<'_>],
        shapes: &[Shape],
    ) -> Option<SkipReason> {
        let info = st.functions.get(fid.0 as usize)?;
        if info.mutated.is_empty() {
            return None;
        }
        let managed = live_tree_ptrs(&st.arena, &st.path, &st.warmups);
        let lost: Vec<usize> = (info.mutated.iter().copied())
            .filter(|&i| {
                inputs.get(i).is_some_and(|input| {
                    let in_place =
                        input.is_static || (input.tree.is_some() && managed.contains(&input.ptr));
                    !in_place || shapes.get(i) != Some(&input.shape)
                })
            })
            .collect();
        if lost.is_empty() {
            return None;
        }
        let found_from: Vec<String> = lost
            .iter()
            .map(|i| format!("{}: input {i}", info.name))
            .collect();
        Some(SkipReason::MutatedInputs {
            count: lost.len(),
            found_from: found_from.join("\n "),
        })
    }

    /// The first child of the current node (or root) recorded for `fid` that serves the
    /// call; else the mismatch that makes this an unexpected re-recording, if any.
    fn find_child(
        &self,
        st: &State,
        fid: FunctionId,
        inputs: &[Input<'_>],
    ) -> (Option<usize>, Option<(CheckStatus, String)>) {
        let candidates: Vec<usize> = match st.path.last() {
            Some(&cur) => st.arena.get(cur).map_or(Vec::new(), |n| n.children.clone()),
            None => (st.arena.iter())
                .filter(|(_, n)| n.parent.is_none())
                .map(|(i, _)| i)
                .collect(),
        };
        let mut mismatch = None;
        for i in candidates {
            let Some(node) = st.arena.get(i).filter(|n| n.function == fid) else {
                continue;
            };
            match check_invariants(node, &st.arena, &st.path, inputs) {
                CheckStatus::Success => return (Some(i), None),
                status @ (CheckStatus::StaticInputIdxMismatch
                | CheckStatus::CudagraphManagedIdxMismatch) => {
                    mismatch.get_or_insert_with(|| (status, mismatch_detail(node, inputs, status)));
                }
                CheckStatus::ExpectedDeadIndicesBeforeGraphMismatch => {}
            }
        }
        (None, mismatch)
    }

    /// Steps 9 to 11: count an unexpected re-recording against the limit, end or
    /// checkpoint the current execution, and record.
    #[allow(clippy::too_many_arguments)]
    fn record_or_skip(
        &self,
        st: &mut State,
        fid: FunctionId,
        generation: u64,
        mismatch: Option<(CheckStatus, String)>,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        f: &mut dyn TreeFn,
    ) -> Result<Call, TreeError> {
        if let Some((status, detail)) = mismatch {
            let node = st.path.last().and_then(|&i| st.arena.get(i)).map(|n| n.id);
            let count = st.rerecords.entry((node, fid)).or_insert(0);
            *count += 1;
            if *count > self.config.rerecord_limit {
                let reason = SkipReason::RerecordLimit {
                    function: fid.0,
                    limit: self.config.rerecord_limit,
                    node,
                    status,
                };
                return self.skip(st, fid, reason, inputs, shapes, f);
            }
            st.stats.rerecords += 1;
            st.events.push(TreeEvent::Rerecord {
                function: fid.0,
                status,
                detail,
            });
        }
        if st.mode == PathMode::Execution {
            self.try_end_path(st, generation)?;
            Trees::check_fresh(inputs)?;
        }
        self.warn_if_path_grows(st, fid);
        self.record(st, fid, generation, inputs, shapes, f)
    }

    /// Warns once per function when it is recorded again below its own node in one path
    /// (`check_warn_on_unable_to_start_executing`): outputs kept across calls grow the
    /// tree instead of replaying.
    fn warn_if_path_grows(&self, st: &mut State, fid: FunctionId) {
        let repeated = st
            .path
            .iter()
            .any(|&i| st.arena.get(i).is_some_and(|n| n.function == fid));
        let Some(info) = st.functions.get_mut(fid.0 as usize) else {
            return;
        };
        if !repeated || info.warned_path {
            return;
        }
        info.warned_path = true;
        let text = match self.config.generations {
            GenerationPolicy::Heuristic => {
                "Unable to hit fast path of CUDAGraphs because of pending, uninvoked backwards. Consider running with torch.no_grad() or using torch.compiler.cudagraph_mark_step_begin() before each model invocation"
            }
            GenerationPolicy::Explicit => {
                "Unable to hit fast path of CUDAGraphs because outputs of an earlier call in this step are still held: each call records a new graph. Call Trees::mark_step_begin() before each step, or drop the outputs"
            }
        };
        st.events
            .push(TreeEvent::Warning(format!("{}: {text}", info.name)));
    }

    /// Runs the call eagerly (or refuses it under `cudagraph_or_error`), reporting the
    /// reason once per function and kind.
    pub(crate) fn skip(
        &self,
        st: &mut State,
        fid: FunctionId,
        reason: SkipReason,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        f: &mut dyn TreeFn,
    ) -> Result<Call, TreeError> {
        if self.config.cudagraph_or_error {
            return Err(TreeError::Skipped(reason));
        }
        let name = match st.functions.get_mut(fid.0 as usize) {
            Some(info) => {
                let kind = std::mem::discriminant(&reason);
                if !info.reported.contains(&kind) {
                    info.reported.push(kind);
                    st.events.push(TreeEvent::Skipped(reason.clone()));
                }
                info.name.clone()
            }
            None => Arc::from(""),
        };
        st.stats.eager_calls += 1;
        let outputs = self.run_eager(&name, inputs, shapes, f)?;
        Ok(Call {
            outputs,
            served: Served::Eager(reason),
        })
    }
}

impl Drop for Trees {
    fn drop(&mut self) {
        let st = std::mem::replace(self.state.get_mut(), State::new());
        self.tear_down(st);
    }
}
