//! What a driver reports of the nodes of a captured graph, and what it sets back.
use crate::{DevicePtr, MemsetValue};

/// One end of a copy node.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CopyEnd {
    /// Device memory at this address (a unified address of device memory included).
    Device(DevicePtr),
    /// Page-locked host memory at this host address (on the fake device, its fake host
    /// address: a [`HostPtr`](crate::HostPtr)'s `raw` plus the offset).
    Host(u64),
}

/// One node of a captured graph, as the driver describes it: the parameters of the kinds
/// that hold device addresses a caller may want to change (kernels, 1-D memsets, 1-D
/// copies), the kind alone for the others.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GraphNode {
    /// A kernel launch: the bytes of each argument, in order.
    Kernel {
        /// One entry per kernel parameter.
        args: Vec<Vec<u8>>,
    },
    /// A 1-D memset of `count` elements at `dst`.
    Memset {
        /// The first element written.
        dst: DevicePtr,
        /// The value written, with its width.
        value: MemsetValue,
        /// Elements written.
        count: u64,
    },
    /// A 1-D copy of `bytes` bytes.
    Memcpy {
        /// Where it writes.
        dst: CopyEnd,
        /// Where it reads.
        src: CopyEnd,
        /// Bytes copied.
        bytes: u64,
    },
    /// A node that only orders others and touches no memory: `what` names it ("empty",
    /// "event record", "event wait", "external semaphore").
    Ordering {
        /// What kind of node.
        what: &'static str,
    },
    /// A node whose parameters the driver does not describe, which may therefore hold any
    /// address: `what` names it ("child graph", "host function", "2-D memset", ...).
    Opaque {
        /// What kind of node.
        what: &'static str,
    },
}

impl GraphNode {
    /// A short name of the node's kind, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            GraphNode::Kernel { .. } => "kernel",
            GraphNode::Memset { .. } => "memset",
            GraphNode::Memcpy { .. } => "memcpy",
            GraphNode::Ordering { what } | GraphNode::Opaque { what } => what,
        }
    }
}
