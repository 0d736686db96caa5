//! The four ways a call is served: a warm-up in the pool, a recording, a replay, an eager
//! run outside the pool; and the input copies they need (`_allocate_and_copy_recording_
//! inputs`, bucket padding). How a replay's inputs are fed is in `feed`.
use super::config::InputFeed;
use super::context::{Call, Ctx, RunKind, Served, TreeFn};
use super::errors::{SkipReason, TreeError, TreeEvent};
use super::liveness::{died_between, live_path_ptrs, path_liveness};
use super::manager::{PathMode, State, Trees};
use super::nodes::{FunctionId, InputSlot, RecordedNode, WarmupNode};
use super::path::PoolRoute;
use super::tensor::{Arg, Input, Out, OutputSlot, Shape, TreeTensor};
use super::warmed::WarmedUp;
use crate::CudaGraph;
use ferrocuda_driver::Driver;
use ferrocuda_stream::{MemoryResource, Stream};
use ferrocuda_types::{CaptureMode, DevicePtr, MemsetValue};
use std::sync::Arc;

/// A recording's inputs: how the node takes each, what the function sees, the copies
/// (freed once recorded), and the copies to capture as the graph's first nodes
/// `(dst, src, bytes)`.
struct Staged {
    slots: Vec<InputSlot>,
    args: Vec<Arg>,
    copies: Vec<Out>,
    captured: Vec<(DevicePtr, DevicePtr, u64)>,
}

/// Calls the wrapped function, naming it in its error.
fn call_fn(
    f: &mut dyn TreeFn,
    ctx: &mut Ctx<'_>,
    args: &[Arg],
    name: &str,
) -> Result<Vec<Out>, TreeError> {
    f(ctx, args).map_err(|e| TreeError::Function {
        function: name.to_string(),
        message: e.to_string(),
    })
}

/// Writes `used` bytes from `src` to `dst`, then zeros up to `bytes`, on `stream`.
pub(super) fn fill(
    driver: &dyn Driver,
    stream: &Stream,
    dst: DevicePtr,
    src: DevicePtr,
    used: u64,
    bytes: u64,
) -> Result<(), TreeError> {
    if used > 0 {
        driver.memcpy_dtod_async(dst, src, used, stream.handle())?;
    }
    if bytes > used {
        driver.memset_async(
            dst.offset(used),
            MemsetValue::U8(0),
            bytes - used,
            stream.handle(),
        )?;
    }
    Ok(())
}

impl Trees {
    pub(crate) fn memory(&self) -> Arc<dyn MemoryResource> {
        self.allocators.clone()
    }

    fn name_of(st: &State, fid: FunctionId) -> Arc<str> {
        st.functions
            .get(fid.0 as usize)
            .map_or_else(|| Arc::from(""), |i| i.name.clone())
    }

    /// A copy of `input` seen as `shape` (padded with zeros), allocated on `stream`, and
    /// filled there unless `fill_later`.
    fn stage(
        &self,
        memory: &Arc<dyn MemoryResource>,
        stream: &Stream,
        input: &Input<'_>,
        shape: Shape,
        fill_later: bool,
    ) -> Result<Out, TreeError> {
        let bytes = shape.bytes(input.dtype);
        let ptr = if bytes == 0 {
            DevicePtr(0)
        } else {
            memory.allocate(self.device, bytes, stream.handle())?
        };
        let arg = Arg {
            ptr,
            device: self.device,
            dtype: input.dtype,
            shape,
        };
        let copy = Out::new(memory.clone(), arg);
        if !fill_later {
            let driver = self.runtime.driver();
            fill(&**driver, stream, ptr, input.ptr, input.used_bytes(), bytes)?;
        }
        Ok(copy)
    }

    /// The arguments of an eager run or a warm-up: the inputs in place, except those a
    /// bucket pads, which are copied.
    fn stage_padded(
        &self,
        memory: &Arc<dyn MemoryResource>,
        stream: &Stream,
        inputs: &[Input<'_>],
        shapes: &[Shape],
    ) -> Result<(Vec<Arg>, Vec<Out>), TreeError> {
        let mut args = Vec::with_capacity(inputs.len());
        let mut copies = Vec::new();
        for (input, &shape) in inputs.iter().zip(shapes) {
            if shape == input.shape {
                args.push(in_place(input));
            } else {
                let copy = self.stage(memory, stream, input, shape, false)?;
                args.push(copy.as_arg());
                copies.push(copy);
            }
        }
        Ok((args, copies))
    }

    /// The inputs of a recording: static inputs and live path outputs in place, the others
    /// copied into the pool (the copies are freed once recorded; replays copy into their
    /// addresses, or patch the graph away from them). Under [`InputFeed::Copy`], the copy
    /// of an input that is never padded (`padded`: the function's inputs may be) is
    /// captured as one of the graph's first nodes, so that a replay with the same buffer
    /// copies without a call of its own.
    fn stage_recording(
        &self,
        memory: &Arc<dyn MemoryResource>,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        managed: &[DevicePtr],
        padded: bool,
    ) -> Result<Staged, TreeError> {
        let mut slots = Vec::with_capacity(inputs.len());
        let mut args = Vec::with_capacity(inputs.len());
        let mut copies = Vec::new();
        let mut captured = Vec::new();
        for (input, &shape) in inputs.iter().zip(shapes) {
            let same = shape == input.shape;
            if same && input.is_static {
                slots.push(InputSlot::Static(input.ptr));
                args.push(in_place(input));
            } else if same && input.tree.is_some() && managed.contains(&input.ptr) {
                slots.push(InputSlot::Managed(input.ptr));
                args.push(in_place(input));
            } else {
                let bytes = shape.bytes(input.dtype);
                let in_graph =
                    self.config.input_feed == InputFeed::Copy && !padded && same && bytes > 0;
                let copy = self.stage(memory, &self.stream, input, shape, in_graph)?;
                let arg = copy.as_arg();
                if in_graph {
                    captured.push((arg.ptr, input.ptr, bytes));
                }
                slots.push(InputSlot::Copied {
                    ptr: arg.ptr,
                    bytes,
                    reads: arg.ptr,
                    seen: input.ptr,
                    in_graph,
                });
                args.push(arg);
                copies.push(copy);
            }
        }
        Ok(Staged {
            slots,
            args,
            copies,
            captured,
        })
    }

    /// The tree takes `outs` over: their blocks are held, their slots made.
    fn adopt(&self, st: &mut State, name: &Arc<str>, outs: Vec<Out>) -> Vec<OutputSlot> {
        (outs.into_iter().enumerate())
            .map(|(i, out)| {
                let arg = out.take();
                if arg.ptr.0 != 0 {
                    st.held.insert(arg.ptr);
                }
                OutputSlot::new(&self.runtime, arg, name.clone(), i)
            })
            .collect()
    }

    /// A warm-up: the function runs eagerly on the tree's stream, allocating in the pool
    /// (`CUDAWarmupNode`).
    pub(crate) fn warmup(
        &self,
        st: &mut State,
        fid: FunctionId,
        generation: u64,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        f: &mut dyn TreeFn,
    ) -> Result<Call, TreeError> {
        self.sync_allocator(st)?;
        let name = Trees::name_of(st, fid);
        let caller = self.runtime.current_stream(self.device)?;
        self.stream.wait_stream(&caller)?;
        let memory = self.memory();
        let allocator = self.allocator()?;
        let (outs, incompatible, requests) = {
            let _route = PoolRoute::begin(allocator, self.pool, &self.stream)?;
            let _current = self.runtime.stream_guard(&self.stream)?;
            let (args, _copies) = self.stage_padded(&memory, &self.stream, inputs, shapes)?;
            let mut ctx = Ctx::new(&self.stream, memory.clone(), RunKind::Warmup);
            // The function's requests (not the padded copies'): a plan of its recording
            // replays them (`Trees::plan`).
            let (outs, requests) = allocator.record_requests(&[self.stream.handle()], || {
                call_fn(f, &mut ctx, &args, &name)
            });
            (outs?, ctx.incompatible(), requests)
        };
        caller.wait_stream(&self.stream)?;
        let mut outputs = self.adopt(st, &name, outs);
        let tensors = outputs.iter_mut().map(OutputSlot::issue).collect();
        st.warmups.push(WarmupNode { outputs });
        st.mode = PathMode::Warmup;
        st.current_gen = Some(generation);
        st.stats.warmups += 1;
        if let Some(info) = st.functions.get_mut(fid.0 as usize) {
            info.warmups += 1;
            info.warmed = Some(WarmedUp::new(requests, inputs, shapes));
            if let Some(op) = incompatible {
                info.skip = Some(SkipReason::IncompatibleOp { op });
            }
        }
        Ok(Call {
            outputs: tensors,
            served: Served::Warmup,
        })
    }

    /// Records a new node under the current one (or as a root), replays it once to compute
    /// its outputs, and checkpoints the pool (`CUDAGraphNode.__init__`, `_record`).
    pub(crate) fn record(
        &self,
        st: &mut State,
        fid: FunctionId,
        generation: u64,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        f: &mut dyn TreeFn,
    ) -> Result<Call, TreeError> {
        self.sync_allocator(st)?;
        let name = Trees::name_of(st, fid);
        let parent = st.path.last().copied();
        let managed = live_path_ptrs(&st.arena, &st.path);
        let liveness = path_liveness(&st.arena, &st.path);
        let expected_dead_before = (parent.and_then(|p| st.arena.get(p)))
            .map_or(Vec::new(), |p| died_between(&p.liveness_after, &liveness));
        let caller = self.runtime.current_stream(self.device)?;
        self.stream.wait_stream(&caller)?;
        let memory = self.memory();
        let padded = st.functions.get(fid.0 as usize).is_some_and(|i| i.padded);
        let staged = {
            let _route = PoolRoute::begin(self.allocator()?, self.pool, &self.stream)?;
            self.stage_recording(&memory, inputs, shapes, &managed, padded)?
        };
        let graph = CudaGraph::new(self.runtime.clone(), self.allocators.clone(), self.device)?;
        graph.keep_instances(self.config.kept_instances);
        let Staged {
            slots,
            args,
            copies,
            captured,
        } = staged;
        let outs = match self.capture(&graph, &memory, &name, &args, &captured, f)? {
            Ok(outs) => outs,
            Err(op) => {
                drop(copies);
                let reason = SkipReason::IncompatibleOp { op };
                if let Some(info) = st.functions.get_mut(fid.0 as usize) {
                    info.skip = Some(reason.clone());
                }
                return self.skip(st, fid, reason, inputs, shapes, f);
            }
        };
        graph.replay(&self.stream)?;
        drop(copies);
        caller.wait_stream(&self.stream)?;
        let checkpoint = self.allocator()?.checkpoint_pool(self.pool)?;
        let mut outputs = self.adopt(st, &name, outs);
        let tensors: Vec<TreeTensor> = outputs.iter_mut().map(OutputSlot::issue).collect();
        let mut liveness_after = liveness;
        liveness_after.push(vec![true; outputs.len()]);
        let id = st.next_graph;
        st.next_graph += 1;
        let node = st.arena.insert(RecordedNode {
            id,
            function: fid,
            parent,
            children: Vec::new(),
            graph,
            inputs: slots,
            patchable: true,
            outputs,
            checkpoint,
            expected_dead_before,
            liveness_after,
        });
        if let Some(p) = parent.and_then(|p| st.arena.get_mut(p)) {
            p.children.push(node);
        }
        st.path.push(node);
        st.mode = PathMode::Recording;
        st.current_gen = Some(generation);
        st.stats.recordings += 1;
        Ok(Call {
            outputs: tensors,
            served: Served::Recorded,
        })
    }

    /// Captures the input copies `(dst, src, bytes)` then the function into `graph` on the
    /// tree's stream and pool: its outputs, or the incompatible operation it declared (the
    /// capture is then discarded).
    fn capture(
        &self,
        graph: &CudaGraph,
        memory: &Arc<dyn MemoryResource>,
        name: &str,
        args: &[Arg],
        copies: &[(DevicePtr, DevicePtr, u64)],
        f: &mut dyn TreeFn,
    ) -> Result<Result<Vec<Out>, String>, TreeError> {
        let capture = graph.capture(
            Some(&self.stream),
            Some(self.pool),
            CaptureMode::ThreadLocal,
        )?;
        let driver = self.runtime.driver();
        for &(dst, src, bytes) in copies {
            driver.memcpy_dtod_async(dst, src, bytes, capture.stream().handle())?;
        }
        let (outs, incompatible) = {
            let mut ctx = Ctx::new(capture.stream(), memory.clone(), RunKind::Record);
            let outs = call_fn(f, &mut ctx, args, name)?;
            (outs, ctx.incompatible())
        };
        if let Some(op) = incompatible {
            drop(capture);
            return Ok(Err(op));
        }
        capture.end()?;
        Ok(Ok(outs))
    }

    /// Replays node `idx` on the caller's current stream after feeding it the non-static
    /// inputs, copied or patched (`execute_node`, `CUDAGraphNode.run`).
    pub(crate) fn execute(
        &self,
        st: &mut State,
        idx: usize,
        generation: u64,
        inputs: &[Input<'_>],
    ) -> Result<Call, TreeError> {
        let stream = self.runtime.current_stream(self.device)?;
        let Some(node) = st.arena.get_mut(idx) else {
            return Err(TreeError::Config(format!("no recorded node {idx}")));
        };
        let fed = self.feed(node, inputs, &stream)?;
        node.graph.replay(&stream)?;
        let outputs = node.outputs.iter_mut().map(OutputSlot::issue).collect();
        let (id, is_root) = (node.id, node.parent.is_none());
        if is_root {
            st.path.clear();
        }
        st.path.push(idx);
        st.mode = PathMode::Execution;
        st.current_gen = Some(generation);
        st.stats.replays += 1;
        st.stats.input_copies += fed.copies;
        st.stats.input_updates += fed.updates;
        st.stats.kept_instance_launches += fed.kept;
        if let Some(reason) = fed.refused {
            st.events
                .push(TreeEvent::CopyingInputs { node: id, reason });
        }
        Ok(Call {
            outputs,
            served: Served::Replayed,
        })
    }

    /// Runs the function eagerly on the caller's stream, outside the pool; its outputs own
    /// their memory and never go stale.
    pub(crate) fn run_eager(
        &self,
        name: &Arc<str>,
        inputs: &[Input<'_>],
        shapes: &[Shape],
        f: &mut dyn TreeFn,
    ) -> Result<Vec<TreeTensor>, TreeError> {
        let stream = self.runtime.current_stream(self.device)?;
        let memory = self.runtime.memory();
        let (args, _copies) = self.stage_padded(&memory, &stream, inputs, shapes)?;
        let mut ctx = Ctx::new(&stream, memory, RunKind::Eager);
        let outs = call_fn(f, &mut ctx, &args, name)?;
        Ok((outs.into_iter().enumerate())
            .map(|(i, out)| TreeTensor::owning(&self.runtime, out, name.clone(), i))
            .collect())
    }
}

/// An input used where it is.
fn in_place(input: &Input<'_>) -> Arg {
    Arg {
        ptr: input.ptr,
        device: input.device,
        dtype: input.dtype,
        shape: input.shape,
    }
}
