//! Graph nodes of the fake device as the [`Driver`](crate::Driver) describes them
//! ([`GraphNode`]), and new parameters applied to them.
use crate::DriverError;
use crate::fake::work::Work;
use ferrocuda_types::{CopyEnd, DevicePtr, GraphNode};

/// What `work`, a node of a captured graph, looks like to the layers above.
pub(super) fn describe(work: &Work) -> GraphNode {
    match work {
        Work::Kernel { args, .. } => GraphNode::Kernel {
            args: args.to_vec(),
        },
        Work::Memset { dst, value, count } => GraphNode::Memset {
            dst: *dst,
            value: *value,
            count: *count,
        },
        Work::DeviceToDevice { dst, src, bytes } => GraphNode::Memcpy {
            dst: CopyEnd::Device(*dst),
            src: CopyEnd::Device(*src),
            bytes: *bytes,
        },
        Work::PinnedToDevice {
            dst,
            host,
            offset,
            bytes,
        } => GraphNode::Memcpy {
            dst: CopyEnd::Device(*dst),
            src: CopyEnd::Host(host + offset),
            bytes: *bytes,
        },
        Work::DeviceToPinned {
            host,
            offset,
            src,
            bytes,
        } => GraphNode::Memcpy {
            dst: CopyEnd::Host(host + offset),
            src: CopyEnd::Device(*src),
            bytes: *bytes,
        },
        // Refused while capturing, so never a node; described for completeness.
        Work::HostToDevice { .. } => GraphNode::Opaque {
            what: "copy from pageable host memory",
        },
        Work::Graph(_) => GraphNode::Opaque {
            what: "child graph",
        },
        Work::Record { .. } => GraphNode::Ordering {
            what: "event record",
        },
        Work::Wait { .. } => GraphNode::Ordering { what: "event wait" },
        // The real driver's text (`cuda/nodes.rs`).
        Work::GraphMemory { .. } => GraphNode::Opaque {
            what: "graph memory allocation or free",
        },
    }
}

/// `work` with the parameters of `node`, which must describe a node of the same kind and
/// shape (see [`Driver::graph_set_node`](crate::Driver::graph_set_node)), else
/// `CUDA_ERROR_INVALID_VALUE`.
pub(super) fn apply(work: &Work, node: &GraphNode) -> Result<Work, DriverError> {
    use CopyEnd::{Device, Host};
    let mut work = work.clone();
    match (&mut work, node) {
        (Work::Kernel { args, .. }, GraphNode::Kernel { args: new })
            if args.len() == new.len() && args.iter().zip(new).all(|(a, b)| a.len() == b.len()) =>
        {
            *args = new.as_slice().into();
        }
        (
            Work::Memset { dst, value, count },
            GraphNode::Memset {
                dst: d,
                value: v,
                count: c,
            },
        ) => (*dst, *value, *count) = (*d, *v, *c),
        (
            Work::DeviceToDevice { dst, src, bytes },
            GraphNode::Memcpy {
                dst: Device(d),
                src: Device(s),
                bytes: b,
            },
        ) => (*dst, *src, *bytes) = (*d, *s, *b),
        (
            Work::PinnedToDevice {
                dst,
                host,
                offset,
                bytes,
            },
            GraphNode::Memcpy {
                dst: Device(d),
                src: Host(h),
                bytes: b,
            },
        ) if *h == *host + *offset && b == bytes => *dst = *d,
        (
            Work::DeviceToPinned {
                host,
                offset,
                src,
                bytes,
            },
            GraphNode::Memcpy {
                dst: Host(h),
                src: Device(s),
                bytes: b,
            },
        ) if *h == *host + *offset && b == bytes => *src = *s,
        _ => return Err(DriverError::INVALID_VALUE),
    }
    Ok(work)
}

/// The device ranges `work` writes or reads by address (memsets and copies), for the
/// driver to check.
pub(super) fn device_ranges(work: &Work) -> Vec<(DevicePtr, u64)> {
    match work {
        Work::Memset { dst, value, count } => vec![(*dst, value.width() * count)],
        Work::DeviceToDevice { dst, src, bytes } => vec![(*dst, *bytes), (*src, *bytes)],
        Work::PinnedToDevice { dst, bytes, .. } => vec![(*dst, *bytes)],
        Work::DeviceToPinned { src, bytes, .. } => vec![(*src, *bytes)],
        _ => Vec::new(),
    }
}
