//! The current path and the allocator's books: ending a path, returning the pool to the
//! current node's checkpoint before warming up or recording after a replay
//! (`apply_checkpoint_execution_state_in_allocator`), checking the pool
//! (`check_memory_pool`), evicting recordings, and tearing the tree down.
//!
//! The tree owns the pool blocks of its outputs and keeps, in `held`, those the allocator
//! has allocated now. Dropping an output handle frees nothing: dead outputs are freed here,
//! lazily, before the next warm-up or recording, so replays (which change no allocator
//! state) and recordings agree on what is free.
use super::errors::{TreeError, TreeEvent};
use super::manager::{PathMode, State, Trees};
use super::nodes::FunctionId;
use super::tensor::OutputSlot;
use ferrocuda_alloc::{CachingAllocator, Route};
use ferrocuda_stream::Stream;
use ferrocuda_types::{DevicePtr, PoolId};
use std::collections::HashSet;

impl Trees {
    /// Every output slot of the path and its warm-ups.
    fn path_slots(st: &mut State) -> impl Iterator<Item = &mut OutputSlot> {
        let State {
            arena,
            path,
            warmups,
            ..
        } = st;
        let mut nodes: Vec<&mut super::nodes::RecordedNode> = Vec::new();
        for (i, node) in arena.iter_mut() {
            if path.contains(&i) {
                nodes.push(node);
            }
        }
        let recorded = nodes.into_iter().flat_map(|n| n.outputs.iter_mut());
        recorded.chain(warmups.iter_mut().flat_map(|w| w.outputs.iter_mut()))
    }

    /// Ends the current path (`current_node = None`): with `invalidate`, the outputs still
    /// held become stale (a new generation may overwrite them: PyTorch's
    /// `dealloc_current_path_weakrefs`, here for replays too); every block the tree holds
    /// goes back to the pool.
    pub(crate) fn end_path(&self, st: &mut State, invalidate: bool) -> Result<(), TreeError> {
        if invalidate {
            for slot in Trees::path_slots(st) {
                if slot.is_live() {
                    slot.invalidate();
                }
            }
        }
        st.path.clear();
        st.warmups.clear();
        st.mode = PathMode::None;
        let allocator = self.allocator()?;
        let mut result = Ok(());
        for ptr in st.held.drain() {
            if let Err(e) = allocator.free(ptr) {
                result = Err(e.into());
            }
        }
        result
    }

    /// Makes the allocator's books match the path before a warm-up or a recording: after a
    /// replay, the pool goes back to the current node's checkpoint; then the blocks of
    /// the path's dead outputs are freed.
    pub(crate) fn sync_allocator(&self, st: &mut State) -> Result<(), TreeError> {
        let allocator = self.allocator()?;
        let current = st.path.last().and_then(|&i| st.arena.get(i));
        if let (PathMode::Execution, Some(node)) = (st.mode, current) {
            allocator.restore_pool(&node.checkpoint)?;
            st.held = node.checkpoint.live().into_iter().collect();
            st.stats.checkpoints += 1;
            st.events.push(TreeEvent::Checkpointed { node: node.id });
        }
        // A dead output's block may have been freed already and taken by a later output
        // of the path, live now: an address is freed only when no live output has it
        // (PyTorch frees the outputs that died since the node ran, by storage).
        let live: HashSet<DevicePtr> = Trees::path_slots(st)
            .filter(|s| s.is_live())
            .map(|s| s.ptr())
            .collect();
        let dead: Vec<DevicePtr> = Trees::path_slots(st)
            .filter(|s| !s.is_live() && !live.contains(&s.ptr()))
            .map(|s| s.ptr())
            .collect();
        for ptr in dead {
            if st.held.remove(&ptr) {
                allocator.free(ptr)?;
            }
        }
        if self.config.slow_path_asserts {
            self.check_pool(st)?;
        }
        Ok(())
    }

    /// The pool's live blocks are exactly the outputs the tree holds (`check_memory_pool`).
    pub(crate) fn check_pool(&self, st: &State) -> Result<(), TreeError> {
        let allocator = self.allocator()?;
        let expected: Vec<DevicePtr> = st.held.iter().copied().collect();
        if allocator.pool_live_allocations_are(self.pool, &expected)? {
            return Ok(());
        }
        let live: HashSet<DevicePtr> = (allocator.pool_blocks(self.pool).iter())
            .filter(|b| b.allocated)
            .map(|b| b.ptr)
            .collect();
        let mut missing: Vec<DevicePtr> = st.held.difference(&live).copied().collect();
        let mut untracked: Vec<DevicePtr> = live.difference(&st.held).copied().collect();
        missing.sort_unstable_by_key(|p| p.0);
        untracked.sort_unstable_by_key(|p| p.0);
        Err(TreeError::PoolMismatch {
            pool: self.pool,
            missing,
            untracked,
        })
    }

    /// Removes every recording of `fid` and their descendants: the current path ends
    /// first if it runs through them (its outputs become stale and every block the tree
    /// holds goes back to the pool, reusable by any recording), their graphs are
    /// destroyed (each gives back its use of the pool) and their outputs become stale.
    /// Nothing else is freed: the tree holds blocks for the current path only, and an
    /// address of a recording off it may be a live output's of the path now (siblings
    /// share memory: PyTorch's trees use max(memory of each path), not the sum).
    pub(crate) fn evict(&self, fid: FunctionId) -> Result<(), TreeError> {
        let mut st = self.state.lock();
        let mut doomed: Vec<usize> = Vec::new();
        let tops: Vec<usize> = (st.arena.iter())
            .filter(|(_, n)| n.function == fid)
            .map(|(i, _)| i)
            .collect();
        for top in tops {
            for i in st.arena.subtree(top) {
                if !doomed.contains(&i) {
                    doomed.push(i);
                }
            }
        }
        if st.path.iter().any(|i| doomed.contains(i)) {
            self.end_path(&mut st, true)?;
        }
        for &i in &doomed {
            let Some(mut node) = st.arena.remove(i) else {
                continue;
            };
            if let Some(parent) = node.parent.and_then(|p| st.arena.get_mut(p)) {
                parent.children.retain(|&c| c != i);
            }
            for slot in &mut node.outputs {
                slot.invalidate();
            }
            st.rerecords.retain(|(n, _), _| *n != Some(node.id));
        }
        if let Some(info) = st.functions.get_mut(fid.0 as usize) {
            info.evicted = true;
        }
        st.stats.evictions += 1;
        st.events.push(TreeEvent::Evicted {
            function: fid.0,
            nodes: doomed.len(),
        });
        Ok(())
    }

    /// Drops every node (each graph gives back its use of the pool) after making every
    /// output stale, frees the blocks the tree holds, and gives back the manager's use of
    /// the pool: nothing of the pool is left in use.
    pub(crate) fn tear_down(&self, mut st: State) {
        for slot in st.warmups.iter_mut().flat_map(|w| w.outputs.iter_mut()) {
            slot.invalidate();
        }
        for (_, node) in st.arena.iter_mut() {
            for slot in &mut node.outputs {
                slot.invalidate();
            }
        }
        let Ok(allocator) = self.allocator() else {
            return;
        };
        for ptr in st.held.drain() {
            // Best effort in a destructor: a block that cannot be freed only stays cached.
            let _ = allocator.free(ptr);
        }
        drop(st);
        let _ = allocator.release_pool(self.pool);
    }
}

/// Routes the allocations made on a stream into the tree's pool while it stands (the
/// warm-ups' and the recording inputs' `_use_cuda_memory_pool_manager`); dropping it ends
/// the route and gives back the use of the pool it took.
pub(crate) struct PoolRoute<'a> {
    allocator: &'a CachingAllocator,
    pool: PoolId,
}

impl<'a> PoolRoute<'a> {
    pub(crate) fn begin(
        allocator: &'a CachingAllocator,
        pool: PoolId,
        stream: &Stream,
    ) -> Result<PoolRoute<'a>, TreeError> {
        allocator.begin_allocate_to_pool(pool, Route::Stream(stream.handle()))?;
        Ok(PoolRoute { allocator, pool })
    }
}

impl Drop for PoolRoute<'_> {
    fn drop(&mut self) {
        let _ = self.allocator.end_allocate_to_pool(self.pool);
        let _ = self.allocator.release_pool(self.pool);
    }
}
