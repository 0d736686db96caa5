//! How many bytes the tree's pool will reserve once warmed-up functions are recorded, told
//! before recording them: the graph-memory planner ([`ferrocuda_alloc::plan_pool_from`])
//! for trees.
//!
//! A tree warms a function up in its pool and records it at a later call, each new size
//! the root of a step (a decode loop's batch sizes; `torch.compile(mode="reduce-overhead")`
//! records one graph per size). A recording that starts a step finds every block of the
//! pool free (the step's first call ended the previous path, which freed the outputs the
//! tree held), copies its non-static inputs into the pool (`stage_recording`), makes the
//! requests its warm-up made, and frees the copies; its outputs stay until the next step.
//! So a plan starts from the pool's segments as they are, all free, and replays those
//! requests through the allocator's rules with the caller's configuration.
use super::errors::TreeError;
use super::manager::Trees;
use super::nodes::FunctionId;
use crate::GraphError;
use ferrocuda_alloc::{AfterCapture, CaptureRequests, PoolPlan, plan_pool_from};
use std::collections::HashSet;

impl Trees {
    /// What the pool will reserve once `functions` are recorded in this order, each the
    /// first call of a step ([`Trees::mark_step_begin`] before it): a decode loop meeting
    /// its batch sizes, the first recording of each size. Each must have been warmed up
    /// (its first call): the plan replays the requests of its last warm-up, after the
    /// copies of its non-static inputs, from the pool's segments as they are now, all free
    /// (the step's first call frees every output the tree holds); [`PoolPlan::reserved_after`]
    /// has one figure per function. A function recorded already (as a root), named twice,
    /// or that will run eagerly (a skip) records nothing new and adds nothing.
    ///
    /// A function called later in a step (a backward after its forward) records next to
    /// the outputs the step holds and reuses some of its inputs in place: planned as the
    /// first call of a step, it may be planned small. The real recording makes the
    /// requests its warm-up made; a function whose requests change between calls (a
    /// library that allocates a workspace once) is planned from its warm-up's.
    ///
    /// Errors: [`TreeError::NotWarmedUp`]; [`TreeError::Config`] for an id that is not
    /// this tree's, or that a shape cap evicted (its signature's next call warms up under a
    /// new id); the plan's ([`GraphError::Plan`]).
    pub fn plan(&self, functions: &[FunctionId]) -> Result<PoolPlan, TreeError> {
        let allocator = self.allocator()?;
        let st = self.state.lock();
        let stream = self.stream.handle().raw;
        let mut recorded: HashSet<FunctionId> = (st.arena.iter())
            .filter(|(_, n)| n.parent.is_none())
            .map(|(_, n)| n.function)
            .collect();
        let mut captures = Vec::with_capacity(functions.len());
        for &fid in functions {
            let info = (st.functions.get(fid.0 as usize))
                .ok_or_else(|| TreeError::Config(format!("no function {} in this tree", fid.0)))?;
            if info.evicted {
                return Err(TreeError::Config(format!(
                    "function {} was evicted: its signature warms up again under a new id",
                    fid.0
                )));
            }
            if info.skip.is_some() || !recorded.insert(fid) {
                captures.push(CaptureRequests::new());
                continue;
            }
            let warmed = info.warmed.as_ref().ok_or_else(|| TreeError::NotWarmedUp {
                function: fid.0,
                name: info.name.to_string(),
            })?;
            captures.push(warmed.recording(stream));
        }
        let mut start = allocator.pool_layout(self.pool);
        for block in start.iter_mut().flat_map(|s| s.blocks.iter_mut()) {
            block.allocated = false;
        }
        let config = allocator.config();
        plan_pool_from(&config, &start, &captures, AfterCapture::FreeOutputs)
            .map_err(|e| GraphError::Plan(e).into())
    }
}
