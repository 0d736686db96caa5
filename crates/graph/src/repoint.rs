//! What [`CudaGraph::update_input_ptrs`](crate::CudaGraph::update_input_ptrs) (and the
//! typed `update_inputs` over it) changes: which node parameters hold an address inside an
//! input, and what they become. Policy only: the driver reads and sets the nodes.
use crate::{GraphError, InputMove};
use ferrocuda_types::{CopyEnd, DevicePtr, GraphNode};

/// Why an opaque node is refused.
const OPAQUE: &str =
    "the driver does not describe its parameters, so it may hold an input's address";

impl InputMove {
    /// Whether both ranges are usable: empty, or starting above 0 and ending inside the
    /// address space.
    pub(crate) fn is_valid(&self) -> bool {
        let fits = |p: DevicePtr| p.0 != 0 && p.0.checked_add(self.bytes).is_some();
        self.bytes == 0 || (fits(self.old) && fits(self.new))
    }

    /// Where `p` goes when it points into the old range.
    fn map(&self, p: DevicePtr) -> Option<DevicePtr> {
        let offset = p.0.checked_sub(self.old.0)?;
        (offset < self.bytes).then(|| self.new.offset(offset))
    }

    /// Whether `[start, start + len)` shares a byte with the old range.
    fn overlaps(&self, start: DevicePtr, len: u64) -> bool {
        start.0 < self.old.0.saturating_add(self.bytes) && self.old.0 < start.0.saturating_add(len)
    }
}

/// The nodes to change, with their new parameters, and how many addresses change.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub(crate) changes: Vec<(usize, GraphNode)>,
    pub(crate) pointers: usize,
}

/// A graph's nodes, read from the driver once (at the graph's first update) and kept equal
/// to what the captured graph and its instance hold, with the nodes that may hold an input's
/// address picked out: kernels with an 8-byte argument, memsets, copies with a device end.
/// An update looks at those only, and builds new parameters only for the nodes it changes.
#[derive(Debug)]
pub(crate) struct NodeMap {
    nodes: Vec<GraphNode>,
    /// Indices of the nodes that may hold an address, in the driver's order.
    holders: Vec<usize>,
    /// The first node whose parameters the driver does not describe, with its kind.
    opaque: Option<(usize, &'static str)>,
}

impl NodeMap {
    /// The map of `nodes`, in the driver's order.
    pub(crate) fn new(nodes: Vec<GraphNode>) -> NodeMap {
        let mut holders = Vec::new();
        let mut opaque = None;
        for (index, node) in nodes.iter().enumerate() {
            let holds = match node {
                GraphNode::Kernel { args } => args.iter().any(|a| a.len() == 8),
                GraphNode::Memset { .. } => true,
                GraphNode::Memcpy { dst, src, .. } => {
                    matches!(dst, CopyEnd::Device(_)) || matches!(src, CopyEnd::Device(_))
                }
                GraphNode::Ordering { .. } => false,
                other => {
                    opaque = opaque.or(Some((index, other.kind())));
                    false
                }
            };
            if holds {
                holders.push(index);
            }
        }
        NodeMap {
            nodes,
            holders,
            opaque,
        }
    }

    /// The nodes as the graph holds them.
    pub(crate) fn nodes(&self) -> &[GraphNode] {
        &self.nodes
    }

    /// The indices of the nodes that may hold an address, in the driver's order.
    pub(crate) fn holders(&self) -> &[usize] {
        &self.holders
    }

    /// Puts `nodes` (the same graph's, with other parameters) in place of the nodes held,
    /// and returns those.
    pub(crate) fn replace_nodes(&mut self, nodes: Vec<GraphNode>) -> Vec<GraphNode> {
        std::mem::replace(&mut self.nodes, nodes)
    }

    /// Records `changes` as made (the graph and its instance hold them now).
    pub(crate) fn apply(&mut self, changes: Vec<(usize, GraphNode)>) {
        for (index, node) in changes {
            if let Some(slot) = self.nodes.get_mut(index) {
                *slot = node;
            }
        }
    }

    /// What pointing the 1-D device-to-device copies into `dst` at `src` does, for each
    /// `(dst, src)`; a `dst` no such copy writes is [`GraphError::CannotRepoint`] (naming
    /// the node count).
    pub(crate) fn copy_plan(&self, sources: &[(DevicePtr, DevicePtr)]) -> Result<Plan, GraphError> {
        let mut plan = Plan::default();
        for &(to, from) in sources {
            let found = self
                .holders
                .iter()
                .find_map(|&index| match self.nodes.get(index) {
                    Some(&GraphNode::Memcpy {
                        dst: CopyEnd::Device(dst),
                        src: CopyEnd::Device(src),
                        bytes,
                    }) if dst == to => Some((index, src, bytes)),
                    _ => None,
                });
            let Some((index, src, bytes)) = found else {
                return Err(GraphError::CannotRepoint {
                    node: self.nodes.len(),
                    kind: "memcpy",
                    reason: format!("the graph holds no device-to-device copy into {to}"),
                });
            };
            if src != from {
                plan.pointers += 1;
                let node = GraphNode::Memcpy {
                    dst: CopyEnd::Device(to),
                    src: CopyEnd::Device(from),
                    bytes,
                };
                plan.changes.push((index, node));
            }
        }
        plan.changes.sort_by_key(|(index, _)| *index);
        Ok(plan)
    }

    /// What repointing `moves` does to the nodes, or the first node (in the driver's order)
    /// that may hold an input's address and cannot be repointed.
    pub(crate) fn plan(&self, moves: &[InputMove]) -> Result<Plan, GraphError> {
        let mut plan = Plan::default();
        for &index in &self.holders {
            if let Some((at, kind)) = self.opaque.filter(|(at, _)| *at < index) {
                return Err(opaque(at, kind));
            }
            let Some(node) = self.nodes.get(index) else {
                continue;
            };
            let mut repoint = Repoint {
                moves,
                index,
                kind: node.kind(),
                pointers: 0,
            };
            let changed = match node {
                GraphNode::Kernel { args } => {
                    if !args.iter().any(|a| repoint.holds(a)) {
                        continue;
                    }
                    GraphNode::Kernel {
                        args: args.iter().map(|a| repoint.argument(a)).collect(),
                    }
                }
                GraphNode::Memset { dst, value, count } => GraphNode::Memset {
                    dst: repoint.range(*dst, value.width().saturating_mul(*count))?,
                    value: *value,
                    count: *count,
                },
                GraphNode::Memcpy { dst, src, bytes } => GraphNode::Memcpy {
                    dst: repoint.end(*dst, *bytes)?,
                    src: repoint.end(*src, *bytes)?,
                    bytes: *bytes,
                },
                _ => continue,
            };
            if repoint.pointers > 0 {
                plan.pointers += repoint.pointers;
                plan.changes.push((index, changed));
            }
        }
        match self.opaque {
            Some((at, kind)) => Err(opaque(at, kind)),
            None => Ok(plan),
        }
    }
}

/// The refusal of an opaque node.
fn opaque(node: usize, kind: &'static str) -> GraphError {
    GraphError::CannotRepoint {
        node,
        kind,
        reason: OPAQUE.into(),
    }
}

/// What repointing `moves` does to `nodes` (in the driver's order), or the first node that
/// may hold an input's address and cannot be repointed.
#[cfg(test)]
pub(crate) fn plan(nodes: &[GraphNode], moves: &[InputMove]) -> Result<Plan, GraphError> {
    NodeMap::new(nodes.to_vec()).plan(moves)
}

/// Repoints the addresses of one node, counting them.
struct Repoint<'a> {
    moves: &'a [InputMove],
    index: usize,
    kind: &'static str,
    pointers: usize,
}

impl Repoint<'_> {
    /// Whether a kernel argument is an 8-byte value inside an old buffer.
    fn holds(&self, bytes: &[u8]) -> bool {
        <[u8; 8]>::try_from(bytes).is_ok_and(|word| {
            let p = DevicePtr(u64::from_le_bytes(word));
            self.moves.iter().any(|m| m.map(p).is_some())
        })
    }

    /// A kernel argument: any 8-byte value inside an old buffer moves with it (a scalar
    /// argument that happens to hold such a value included: its type is not known).
    fn argument(&mut self, bytes: &[u8]) -> Vec<u8> {
        let Ok(word) = <[u8; 8]>::try_from(bytes) else {
            return bytes.to_vec();
        };
        match self.mapped(DevicePtr(u64::from_le_bytes(word))) {
            Some(to) => to.0.to_le_bytes().to_vec(),
            None => bytes.to_vec(),
        }
    }

    /// The range `[start, start + len)` a memset writes or a copy reads or writes: inside
    /// an old buffer it moves; across a buffer's edge it cannot.
    fn range(&mut self, start: DevicePtr, len: u64) -> Result<DevicePtr, GraphError> {
        let Some(m) = self.moves.iter().find(|m| m.overlaps(start, len.max(1))) else {
            return Ok(start);
        };
        match m.map(start) {
            Some(to) if start.0 - m.old.0 + len <= m.bytes => {
                self.pointers += 1;
                Ok(to)
            }
            _ => Err(self.refuse(format!(
                "it covers {start}..{:#x}, part of the input at {}..{:#x} and memory outside it",
                start.0.saturating_add(len),
                m.old,
                m.old.0.saturating_add(m.bytes)
            ))),
        }
    }

    fn end(&mut self, end: CopyEnd, len: u64) -> Result<CopyEnd, GraphError> {
        Ok(match end {
            CopyEnd::Device(p) => CopyEnd::Device(self.range(p, len)?),
            host => host,
        })
    }

    /// Where the first move containing `p` takes it, counted.
    fn mapped(&mut self, p: DevicePtr) -> Option<DevicePtr> {
        let to = self.moves.iter().find_map(|m| m.map(p))?;
        self.pointers += 1;
        Some(to)
    }

    fn refuse(&self, reason: String) -> GraphError {
        GraphError::CannotRepoint {
            node: self.index,
            kind: self.kind,
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrocuda_types::MemsetValue;

    const X: DevicePtr = DevicePtr(0x1000);
    const Y: DevicePtr = DevicePtr(0x2000);

    fn swap() -> [InputMove; 2] {
        [
            InputMove {
                old: X,
                bytes: 0x100,
                new: Y,
            },
            InputMove {
                old: Y,
                bytes: 0x100,
                new: X,
            },
        ]
    }

    fn args(values: &[u64]) -> GraphNode {
        GraphNode::Kernel {
            args: values.iter().map(|v| v.to_le_bytes().to_vec()).collect(),
        }
    }

    #[test]
    fn each_address_moves_once_and_keeps_its_offset() {
        let plan = plan(&[args(&[0x1000, 0x2010, 0x10ff, 0x1100, 7])], &swap()).unwrap();
        assert_eq!(
            plan.pointers, 3,
            "x, y + 0x10, x's last byte; not one past x's end"
        );
        assert_eq!(
            plan.changes,
            vec![(0, args(&[0x2000, 0x1010, 0x20ff, 0x1100, 7]))]
        );
    }

    #[test]
    fn four_byte_arguments_and_untouched_nodes_stay() {
        let small = GraphNode::Kernel {
            args: vec![0x1000u32.to_le_bytes().to_vec()],
        };
        let empty = GraphNode::Ordering { what: "empty" };
        let plan = plan(&[small, empty, args(&[0x3000])], &swap()).unwrap();
        assert_eq!((plan.pointers, plan.changes.len()), (0, 0));
    }

    #[test]
    fn a_range_inside_an_input_moves_and_one_across_its_edge_is_refused() {
        let memset = |dst: u64, count: u64| GraphNode::Memset {
            dst: DevicePtr(dst),
            value: MemsetValue::U32(0),
            count,
        };
        let moved = plan(&[memset(0x1080, 0x20)], &swap()).unwrap();
        assert_eq!(
            moved.changes,
            vec![(0, memset(0x2080, 0x20))],
            "ends at x's end"
        );
        for (dst, count) in [(0x1080, 0x21), (0xff0, 8)] {
            let refused = plan(&[args(&[]), memset(dst, count)], &swap());
            assert!(
                matches!(
                    refused,
                    Err(GraphError::CannotRepoint {
                        node: 1,
                        kind: "memset",
                        ..
                    })
                ),
                "{dst:#x} x {count}: {refused:?}"
            );
        }
        let copy = GraphNode::Memcpy {
            dst: CopyEnd::Host(0x1000),
            src: CopyEnd::Device(Y),
            bytes: 0x100,
        };
        let plan = plan(&[copy], &swap()).unwrap();
        let GraphNode::Memcpy { dst, src, .. } = &plan.changes[0].1 else {
            panic!("{plan:?}")
        };
        assert_eq!(
            (*dst, *src),
            (CopyEnd::Host(0x1000), CopyEnd::Device(X)),
            "host ends stay"
        );
    }

    #[test]
    fn a_range_at_zero_or_past_the_end_of_the_address_space_is_invalid() {
        let m = |old, bytes, new| InputMove {
            old: DevicePtr(old),
            bytes,
            new: DevicePtr(new),
        };
        assert!(m(0x1000, 0x100, 0x2000).is_valid());
        assert!(m(0, 0, 0).is_valid(), "an empty move (an empty buffer)");
        assert!(
            m(u64::MAX - 0x100, 0x100, 0x2000).is_valid(),
            "ends at the top"
        );
        for (old, new) in [
            (0, 0x2000),
            (0x1000, 0),
            (0x1000, u64::MAX - 0x10),
            (u64::MAX, 0x2000),
        ] {
            assert!(!m(old, 0x100, new).is_valid(), "{old:#x} -> {new:#x}");
        }
    }

    #[test]
    fn a_map_follows_its_updates_and_looks_only_at_nodes_that_may_hold_addresses() {
        let empty = GraphNode::Ordering { what: "empty" };
        let four = GraphNode::Kernel {
            args: vec![0x1000u32.to_le_bytes().to_vec()],
        };
        let mut map = NodeMap::new(vec![empty, four.clone(), args(&[0x1000, 7])]);
        assert_eq!(
            map.holders,
            vec![2],
            "4-byte arguments and empty nodes hold none"
        );
        let there = [InputMove {
            old: X,
            bytes: 0x100,
            new: Y,
        }];
        let plan = map.plan(&there).unwrap();
        assert_eq!(plan.changes, vec![(2, args(&[0x2000, 7]))]);
        map.apply(plan.changes);
        assert_eq!(map.nodes()[2], args(&[0x2000, 7]));
        assert_eq!(map.nodes()[1], four);
        assert_eq!(map.plan(&there).unwrap().pointers, 0, "x is no longer held");
        let back = map.plan(&[InputMove {
            old: Y,
            bytes: 0x100,
            new: X,
        }]);
        assert_eq!(back.unwrap().changes, vec![(2, args(&[0x1000, 7]))]);
    }

    #[test]
    fn the_first_refused_node_in_the_drivers_order_is_named() {
        let across = GraphNode::Memset {
            dst: DevicePtr(0xff0),
            value: MemsetValue::U8(0),
            count: 0x20,
        };
        let opaque = GraphNode::Opaque {
            what: "child graph",
        };
        let before = plan(&[across.clone(), opaque.clone()], &swap());
        assert!(
            matches!(
                before,
                Err(GraphError::CannotRepoint {
                    node: 0,
                    kind: "memset",
                    ..
                })
            ),
            "{before:?}"
        );
        let after = plan(&[opaque, across], &swap());
        assert!(
            matches!(
                after,
                Err(GraphError::CannotRepoint {
                    node: 0,
                    kind: "child graph",
                    ..
                })
            ),
            "{after:?}"
        );
    }

    #[test]
    fn an_opaque_node_is_refused() {
        let opaque = GraphNode::Opaque {
            what: "host function",
        };
        assert!(matches!(
            plan(&[opaque], &swap()),
            Err(GraphError::CannotRepoint {
                node: 0,
                kind: "host function",
                ..
            })
        ));
    }
}
