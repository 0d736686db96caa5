//! How a replay's non-static inputs reach its graph: copied into the recording's static
//! inputs (PyTorch's `reconstructed_inputs`, filled by `_copy_inputs_and_remove_from_src`
//! in `torch/_inductor/cudagraph_trees.py`), or patched: the graph repointed at the
//! caller's buffer with [`CudaGraph::update_input_ptrs`](crate::CudaGraph::update_input_ptrs),
//! where [`InputFeed`] says that is cheaper (beyond PyTorch).
//!
//! Under [`InputFeed::Copy`], an unpadded slot's copy is captured as one of the graph's
//! first nodes (see `run`): a replay points that node at the caller's buffer when it moved
//! (`CudaGraph::retarget_copies`), instead of enqueueing a copy.
//!
//! Each such input slot of a recording remembers where its graph reads it now: its pool
//! copy, or the caller's buffer of an earlier call. Before each replay every slot is made
//! to read either this call's buffer (patched) or its pool copy (then copied into), with
//! one graph update for all the slots that move; a slot that already reads this call's
//! buffer costs nothing.
//!
//! Patching keeps the copy path's results. It is used only for
//! - inputs that are not tree outputs: an output passed back that is not used in place
//!   lives in the tree's pool, where the graph's own outputs and temporaries are, so
//!   reading it in place could race with the graph's writes (a caller's buffer lives
//!   outside the pool);
//! - inputs whose whole shape is used: a bucket's padding needs the copy's zeroed tail;
//! - inputs that overlap no other input of the call: the graph would hold one address for
//!   two inputs, and moving one later would take the other along.
//!
//! Writes are not a difference: a function that writes a non-static input is run eagerly
//! ("mutated inputs") before a replay is considered, whichever way inputs are fed. When
//! the graph cannot be repointed (a node that may hold the input's address but whose
//! parameters cannot be moved: `GraphError::CannotRepoint`), the recording copies from
//! then on, remembered, and the slots already patched are pointed back at their copies.
use super::config::InputFeed;
use super::errors::TreeError;
use super::manager::Trees;
use super::nodes::{InputSlot, RecordedNode};
use super::run::fill;
use super::tensor::Input;
use crate::{GraphError, InputMove, InputUpdate};
use ferrocuda_stream::Stream;
use ferrocuda_types::DevicePtr;

/// What feeding one replay's inputs did.
#[derive(Debug, Default)]
pub(crate) struct Fed {
    /// Inputs copied into the recording's static inputs.
    pub(crate) copies: u64,
    /// Graph updates made (patching, or pointing back at the copies).
    pub(crate) updates: u64,
    /// Moves served by launching another kept instance of the graph.
    pub(crate) kept: u64,
    /// Why the graph cannot be patched, when it was found out on this call.
    pub(crate) refused: Option<String>,
}

impl InputFeed {
    /// Whether the rule wants an input at `at` patched into a slot of `bytes` that reads
    /// `reads` now and saw `seen` at the previous call.
    fn wants_patch(self, at: DevicePtr, bytes: u64, reads: DevicePtr, seen: DevicePtr) -> bool {
        match self {
            InputFeed::Copy => false,
            InputFeed::Patch => true,
            InputFeed::Auto { min_bytes } => bytes >= min_bytes || at == reads || at == seen,
        }
    }
}

/// Whether input `i` of `inputs` may be read in place by a patched graph whose slot holds
/// `bytes` (see the module docs).
fn can_patch(inputs: &[Input<'_>], i: usize, input: &Input<'_>, bytes: u64) -> bool {
    if input.tree.is_some() || bytes == 0 || input.used_bytes() != bytes {
        return false;
    }
    let (start, end) = (input.ptr.0, input.ptr.0.saturating_add(bytes));
    (inputs.iter().enumerate()).all(|(j, other)| {
        j == i || other.ptr.0 >= end || other.ptr.0.saturating_add(other.bytes) <= start
    })
}

impl Trees {
    /// Where slot `i` of `node` is to read this call's input: the caller's buffer when
    /// patched, else its pool copy. Not a copied slot: `None`.
    fn target(&self, node: &RecordedNode, inputs: &[Input<'_>], i: usize) -> Option<InputMove> {
        let (Some(&slot), Some(input)) = (node.inputs.get(i), inputs.get(i)) else {
            return None;
        };
        let InputSlot::Copied {
            ptr,
            bytes,
            reads,
            seen,
            ..
        } = slot
        else {
            return None;
        };
        let patch = node.patchable
            && (self.config.input_feed).wants_patch(input.ptr, bytes, reads, seen)
            && can_patch(inputs, i, input, bytes);
        Some(InputMove {
            old: reads,
            bytes,
            new: if patch { input.ptr } else { ptr },
        })
    }

    /// The moves that bring every copied slot of `node` to where it is to read.
    fn moves(&self, node: &RecordedNode, inputs: &[Input<'_>]) -> Vec<InputMove> {
        (0..node.inputs.len())
            .filter_map(|i| self.target(node, inputs, i))
            .filter(|m| m.old != m.new)
            .collect()
    }

    /// Points the copies `node`'s graph makes of its inputs at this call's buffers: one
    /// graph update, or none when they read there already or a kept instance does.
    fn retarget_copies(
        node: &RecordedNode,
        inputs: &[Input<'_>],
        fed: &mut Fed,
    ) -> Result<(), TreeError> {
        let mut sources = Vec::new();
        for (i, (slot, input)) in node.inputs.iter().zip(inputs).enumerate() {
            let InputSlot::Copied {
                ptr,
                bytes,
                seen,
                in_graph: true,
                ..
            } = *slot
            else {
                continue;
            };
            if input.used_bytes() != bytes {
                return Err(TreeError::Config(format!(
                    "input {i}: {} bytes for a copy of {bytes} bytes captured in the graph",
                    input.used_bytes()
                )));
            }
            if input.ptr != seen {
                sources.push((ptr, input.ptr));
            }
        }
        if !sources.is_empty() {
            match node.graph.retarget_copies(&sources)? {
                InputUpdate::Kept { .. } => fed.kept += 1,
                _ => fed.updates += 1,
            }
        }
        Ok(())
    }

    /// Feeds `inputs` to `node` before its replay on `stream`: one graph update for the
    /// slots that move (falling back to copies for good when the graph cannot be
    /// repointed), one for the copies the graph makes itself, then a copy into each other
    /// slot that reads its pool copy. On an error the slots still say where the graph
    /// reads.
    pub(crate) fn feed(
        &self,
        node: &mut RecordedNode,
        inputs: &[Input<'_>],
        stream: &Stream,
    ) -> Result<Fed, TreeError> {
        let mut fed = Fed::default();
        let moves = self.moves(node, inputs);
        if !moves.is_empty() {
            match node.graph.update_input_ptrs(&moves) {
                Ok(InputUpdate::Kept { .. }) => fed.kept += 1,
                Ok(_) => fed.updates += 1,
                Err(refused @ GraphError::CannotRepoint { .. }) => {
                    node.patchable = false;
                    fed.refused = Some(refused.to_string());
                    let back = self.moves(node, inputs);
                    if !back.is_empty() {
                        match node.graph.update_input_ptrs(&back)? {
                            InputUpdate::Kept { .. } => fed.kept += 1,
                            _ => fed.updates += 1,
                        }
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Trees::retarget_copies(node, inputs, &mut fed)?;
        // Every slot now reads where it was moved to: record that for all of them before
        // any copy can fail, so the books always match the graph.
        for (i, input) in inputs.iter().enumerate() {
            let to = self.target(node, inputs, i);
            if let (Some(to), Some(InputSlot::Copied { reads, seen, .. })) =
                (to, node.inputs.get_mut(i))
            {
                (*reads, *seen) = (to.new, input.ptr);
            }
        }
        let driver = self.runtime.driver();
        for (slot, input) in node.inputs.iter().zip(inputs) {
            if let InputSlot::Copied {
                ptr,
                bytes,
                reads,
                in_graph,
                ..
            } = *slot
                && reads == ptr
                && bytes > 0
            {
                if !in_graph {
                    fill(&**driver, stream, ptr, input.ptr, input.used_bytes(), bytes)?;
                }
                fed.copies += 1;
            }
        }
        Ok(fed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_patches_large_inputs_and_inputs_that_stay_put() {
        let (at, other, pool) = (DevicePtr(0x1000), DevicePtr(0x9000), DevicePtr(0x5000));
        let auto = InputFeed::Auto { min_bytes: 64 };
        assert!(auto.wants_patch(at, 64, pool, other), "large enough");
        assert!(!auto.wants_patch(at, 63, pool, other), "small and moving");
        assert!(auto.wants_patch(at, 8, at, other), "read there already");
        assert!(
            auto.wants_patch(at, 8, pool, at),
            "same address as last call"
        );
        assert!(!InputFeed::Copy.wants_patch(at, 1 << 30, at, at));
        assert!(InputFeed::Patch.wants_patch(at, 1, pool, other));
    }
}
