//! Which outputs of the current path are alive, and whether a recorded node may serve a
//! call (`check_invariants`, `_get_liveness`, `_get_different_indices` of
//! `torch/_inductor/cudagraph_trees.py`; `log_data_ptr_mismatch` of `cudagraph_utils.py`).
//!
//! An output is alive while a handle of its latest run is held ([`OutputSlot::is_live`]):
//! the `Arc` count stands in for PyTorch's storage weak references.
use super::errors::CheckStatus;
use super::nodes::{Arena, InputSlot, RecordedNode, WarmupNode};
use super::tensor::{Input, OutputSlot};
use ferrocuda_types::DevicePtr;

/// The recorded nodes of the path, root first.
pub(crate) fn path_nodes<'a>(
    arena: &'a Arena,
    path: &'a [usize],
) -> impl Iterator<Item = &'a RecordedNode> + 'a {
    path.iter().filter_map(|&i| arena.get(i))
}

/// Liveness of every output of the path, by depth.
pub(crate) fn path_liveness(arena: &Arena, path: &[usize]) -> Vec<Vec<bool>> {
    path_nodes(arena, path)
        .map(|n| n.outputs.iter().map(OutputSlot::is_live).collect())
        .collect()
}

/// `(depth, index)` of the outputs live in `before` and dead in `now`.
pub(crate) fn died_between(before: &[Vec<bool>], now: &[Vec<bool>]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (depth, (b, n)) in before.iter().zip(now).enumerate() {
        for (index, (&was, &is)) in b.iter().zip(n).enumerate() {
            if was && !is {
                out.push((depth, index));
            }
        }
    }
    out
}

/// Whether every output of the path and of its warm-ups is dead (`all_outputs_are_dead`).
pub(crate) fn all_dead(arena: &Arena, path: &[usize], warmups: &[WarmupNode]) -> bool {
    let recorded = path_nodes(arena, path).flat_map(|n| n.outputs.iter());
    let warm = warmups.iter().flat_map(|w| w.outputs.iter());
    !recorded.chain(warm).any(OutputSlot::is_live)
}

/// Addresses of the live outputs of the path (what an input must equal to be used in
/// place: PyTorch's cudagraph-managed tensors).
pub(crate) fn live_path_ptrs(arena: &Arena, path: &[usize]) -> Vec<DevicePtr> {
    path_nodes(arena, path)
        .flat_map(|n| n.outputs.iter())
        .filter(|s| s.is_live())
        .map(OutputSlot::ptr)
        .collect()
}

/// Addresses of the live outputs of the path and of its warm-ups: the tensors PyTorch's
/// mutation check counts as the tree's (`_is_cuda_graph_recorded_tensor` of the current
/// node, a `CUDAGraphNode` or a `CUDAWarmupNode`), whose writes land in place.
pub(crate) fn live_tree_ptrs(
    arena: &Arena,
    path: &[usize],
    warmups: &[WarmupNode],
) -> Vec<DevicePtr> {
    let recorded = path_nodes(arena, path).flat_map(|n| n.outputs.iter());
    let warm = warmups.iter().flat_map(|w| w.outputs.iter());
    recorded
        .chain(warm)
        .filter(|s| s.is_live())
        .map(OutputSlot::ptr)
        .collect()
}

/// Whether `node` (a child of the path's last node, or a root on an empty path) can serve
/// a call with `inputs`, in PyTorch's order of checks.
pub(crate) fn check_invariants(
    node: &RecordedNode,
    arena: &Arena,
    path: &[usize],
    inputs: &[Input<'_>],
) -> CheckStatus {
    let slots = node.inputs.iter().zip(inputs);
    if slots
        .clone()
        .any(|(s, i)| matches!(s, InputSlot::Managed(p) if *p != i.ptr))
    {
        return CheckStatus::CudagraphManagedIdxMismatch;
    }
    let live = |&(depth, index): &(usize, usize)| {
        let node = path.get(depth).and_then(|&i| arena.get(i));
        node.and_then(|n| n.outputs.get(index))
            .is_some_and(OutputSlot::is_live)
    };
    if node.expected_dead_before.iter().any(live) {
        return CheckStatus::ExpectedDeadIndicesBeforeGraphMismatch;
    }
    if slots
        .clone()
        .any(|(s, i)| matches!(s, InputSlot::Static(p) if *p != i.ptr))
    {
        return CheckStatus::StaticInputIdxMismatch;
    }
    CheckStatus::Success
}

/// PyTorch's detailed mismatch text: the status, then one line per moved input of the
/// kind the status is about.
pub(crate) fn mismatch_detail(
    node: &RecordedNode,
    inputs: &[Input<'_>],
    status: CheckStatus,
) -> String {
    let mut text = format!("{status}.\n");
    for (index, (slot, input)) in node.inputs.iter().zip(inputs).enumerate() {
        let recorded = match (status, slot) {
            (CheckStatus::StaticInputIdxMismatch, InputSlot::Static(p))
            | (CheckStatus::CudagraphManagedIdxMismatch, InputSlot::Managed(p)) => *p,
            _ => continue,
        };
        if recorded != input.ptr {
            text.push_str(&format!(
                "input name: arg{index}. data pointer changed from {} to {}. input stack trace: None\n",
                recorded.0, input.ptr.0
            ));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn died_between_lists_outputs_live_before_and_dead_now() {
        let before = vec![vec![true, true, false], vec![true]];
        let now = vec![vec![true, false, true], vec![false]];
        assert_eq!(died_between(&before, &now), [(0, 1), (1, 0)]);
        assert!(died_between(&now, &now).is_empty());
    }
}
