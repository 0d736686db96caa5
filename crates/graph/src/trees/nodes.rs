//! The nodes of a tree (`CUDAGraphNode`, `CUDAWarmupNode` in
//! `torch/_inductor/cudagraph_trees.py`) and the arena that holds them.
//!
//! A recorded node owns its graph, the classification of its inputs at recording (static,
//! tree-managed, or copied into the pool), its outputs, the pool's checkpoint taken right
//! after it was recorded, and the liveness of the path's outputs around its recording. A
//! warm-up node owns only its outputs: its addresses came from the allocator's state and
//! cannot be replayed.
use super::tensor::OutputSlot;
use crate::CudaGraph;
use ferrocuda_types::{DevicePtr, PoolCheckpoint};

/// A wrapped function at one input signature: the unit PyTorch calls a `FunctionID`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FunctionId(pub u32);

/// How a recorded node takes one input.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum InputSlot {
    /// Used in place; the address the recording holds (a new one records anew).
    Static(DevicePtr),
    /// A live output of the path, used in place at this address.
    Managed(DevicePtr),
    /// Fed on each replay: copied into the pool at `ptr`, whose copy is `bytes` long (the
    /// padded size; the tail past the input is zeroed), or patched: the graph repointed at
    /// the caller's buffer.
    Copied {
        ptr: DevicePtr,
        bytes: u64,
        /// Where the graph reads it now: `ptr`, or a caller's buffer it was patched to.
        reads: DevicePtr,
        /// The caller's address at the previous call (for [`InputFeed::Auto`]).
        ///
        /// [`InputFeed::Auto`]: super::InputFeed::Auto
        seen: DevicePtr,
        /// The copy is the graph's first node, reading `seen` (under [`InputFeed::Copy`],
        /// unpadded): a replay points it at the caller's buffer instead of copying first.
        ///
        /// [`InputFeed::Copy`]: super::InputFeed::Copy
        in_graph: bool,
    },
}

/// One recording.
#[derive(Debug)]
pub(crate) struct RecordedNode {
    /// Its graph id (`GraphID`), unique in the manager.
    pub(crate) id: u64,
    pub(crate) function: FunctionId,
    /// Arena index of its parent; `None` for a root.
    pub(crate) parent: Option<usize>,
    /// Arena indices of its children, in recording order.
    pub(crate) children: Vec<usize>,
    pub(crate) graph: CudaGraph,
    pub(crate) inputs: Vec<InputSlot>,
    /// Whether its graph may be patched to read callers' buffers: false once
    /// `update_input_ptrs` refused it (a node it cannot repoint).
    pub(crate) patchable: bool,
    pub(crate) outputs: Vec<OutputSlot>,
    /// The pool right after its recording (`checkpointed_caching_state`).
    pub(crate) checkpoint: PoolCheckpoint,
    /// Path outputs `(depth, index)` live when the parent finished and dead when this node
    /// was recorded: it may have reused their memory (`expected_dead_indices_before_graph`).
    pub(crate) expected_dead_before: Vec<(usize, usize)>,
    /// Liveness of every output of the path, this node's included, right after recording
    /// (`recorded_liveness_after_graph`).
    pub(crate) liveness_after: Vec<Vec<bool>>,
}

/// One eager run inside the pool.
#[derive(Debug)]
pub(crate) struct WarmupNode {
    pub(crate) outputs: Vec<OutputSlot>,
}

/// Recorded nodes by index; removed nodes leave a hole reused later.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    slots: Vec<Option<RecordedNode>>,
    holes: Vec<usize>,
}

impl Arena {
    pub(crate) fn insert(&mut self, node: RecordedNode) -> usize {
        match self.holes.pop() {
            Some(i) => {
                self.slots[i] = Some(node);
                i
            }
            None => {
                self.slots.push(Some(node));
                self.slots.len() - 1
            }
        }
    }

    pub(crate) fn get(&self, i: usize) -> Option<&RecordedNode> {
        self.slots.get(i).and_then(Option::as_ref)
    }

    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut RecordedNode> {
        self.slots.get_mut(i).and_then(Option::as_mut)
    }

    pub(crate) fn remove(&mut self, i: usize) -> Option<RecordedNode> {
        let node = self.slots.get_mut(i)?.take()?;
        self.holes.push(i);
        Some(node)
    }

    /// Every node, with its index.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &RecordedNode)> {
        (self.slots.iter().enumerate()).filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
    }

    /// Every node, mutably, with its index.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut RecordedNode)> {
        (self.slots.iter_mut().enumerate()).filter_map(|(i, n)| n.as_mut().map(|n| (i, n)))
    }

    /// `root` and all its descendants.
    pub(crate) fn subtree(&self, root: usize) -> Vec<usize> {
        let mut out = vec![root];
        let mut next = 0;
        while let Some(&i) = out.get(next) {
            if let Some(n) = self.get(i) {
                out.extend(&n.children);
            }
            next += 1;
        }
        out
    }
}
