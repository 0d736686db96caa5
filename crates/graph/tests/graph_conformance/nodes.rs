//! The driver's view of a captured graph's nodes (`graph_nodes`, `graph_set_node`), which
//! `update_inputs` is built on: read and set on both backends, then instantiated, updated
//! in place and replayed.
use crate::{D0, N, Setup, TestResult};
use ferrocuda_driver::DriverError;
use ferrocuda_testkit::Harness;
use ferrocuda_types::{CaptureMode, CopyEnd, DevicePtr, GraphNode, MemsetValue};

/// The arguments of `add_one_f32(x, n)`, as the kernel node holds them.
fn add_one_args(x: DevicePtr) -> Vec<Vec<u8>> {
    vec![
        x.0.to_le_bytes().to_vec(),
        (N as u32).to_le_bytes().to_vec(),
    ]
}

/// A memset, a kernel, a device-to-device copy and a copy into page-locked memory captured
/// with raw driver calls are read back with their parameters; three are pointed at another
/// buffer; what cannot be set is refused; the instance runs the new parameters and takes a
/// memset's new value in place.
pub(crate) fn graph_nodes_are_read_and_set(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let d = s.h.rt.driver();
    let stream = s.h.rt.new_stream(D0, 0)?;
    let (x, x2, y) = (s.buffer(0.0)?, s.buffer(0.0)?, s.buffer(0.0)?);
    let bytes = x.bytes();
    let host = d.host_alloc(bytes)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    let five = MemsetValue::U32(5f32.to_bits());
    d.stream_begin_capture(stream.handle(), CaptureMode::ThreadLocal)?;
    d.memset_async(x.ptr(), five, N as u64, stream.handle())?;
    s.add_one(&stream, &x)?;
    d.memcpy_dtod_async(y.ptr(), x.ptr(), bytes, stream.handle())?;
    d.memcpy_dtoh_pinned_async((host, 0), x.ptr(), bytes, stream.handle())?;
    let graph = d.stream_end_capture(stream.handle())?;

    let nodes = d.graph_nodes(graph)?;
    let read = [
        GraphNode::Memset {
            dst: x.ptr(),
            value: five,
            count: N as u64,
        },
        GraphNode::Kernel {
            args: add_one_args(x.ptr()),
        },
        GraphNode::Memcpy {
            dst: CopyEnd::Device(y.ptr()),
            src: CopyEnd::Device(x.ptr()),
            bytes,
        },
    ];
    assert_eq!(nodes.len(), 4, "{nodes:?}");
    assert_eq!(nodes[..3], read);
    let GraphNode::Memcpy {
        dst: pinned,
        src: CopyEnd::Device(from),
        bytes: copied,
    } = nodes[3]
    else {
        return Err(format!(
            "node 3 is not the copy into page-locked memory: {:?}",
            nodes[3]
        )
        .into());
    };
    assert_eq!((from, copied), (x.ptr(), bytes));
    // The real driver may describe page-locked memory by its unified address.
    assert!(
        matches!(pinned, CopyEnd::Host(a) | CopyEnd::Device(DevicePtr(a)) if a == host.raw),
        "the copy writes the page-locked buffer: {pinned:?} vs {:#x}",
        host.raw
    );

    let repointed = [
        GraphNode::Memset {
            dst: x2.ptr(),
            value: five,
            count: N as u64,
        },
        GraphNode::Kernel {
            args: add_one_args(x2.ptr()),
        },
        GraphNode::Memcpy {
            dst: CopyEnd::Device(y.ptr()),
            src: CopyEnd::Device(x2.ptr()),
            bytes,
        },
    ];
    for (index, node) in repointed.iter().enumerate() {
        d.graph_set_node(graph, index, node)?;
    }
    assert_eq!(d.graph_nodes(graph)?[..3], repointed);

    let invalid = Err(DriverError::INVALID_VALUE);
    let mut short = add_one_args(x2.ptr());
    short.pop();
    let mut wide = add_one_args(x2.ptr());
    wide[1] = vec![0; 8];
    assert_eq!(
        d.graph_set_node(graph, 0, &repointed[1]),
        invalid,
        "a kernel's parameters for a memset"
    );
    let fewer = GraphNode::Kernel { args: short };
    assert_eq!(
        d.graph_set_node(graph, 1, &fewer),
        invalid,
        "one argument fewer"
    );
    let other_size = GraphNode::Kernel { args: wide };
    assert_eq!(
        d.graph_set_node(graph, 1, &other_size),
        invalid,
        "an argument of another size"
    );
    assert_eq!(
        d.graph_set_node(graph, 4, &repointed[0]),
        invalid,
        "there is no node 4"
    );
    let ordering = GraphNode::Ordering { what: "empty" };
    assert_eq!(
        d.graph_set_node(graph, 0, &ordering),
        invalid,
        "nothing to set"
    );
    if let CopyEnd::Host(a) = pinned {
        let elsewhere = GraphNode::Memcpy {
            dst: CopyEnd::Host(a + 4),
            src: CopyEnd::Device(x2.ptr()),
            bytes,
        };
        assert_eq!(
            d.graph_set_node(graph, 3, &elsewhere),
            invalid,
            "a host end stays"
        );
    }
    assert_eq!(
        d.graph_nodes(graph)?[..3],
        repointed,
        "refusals change nothing"
    );

    let exec = d.graph_instantiate(graph)?;
    d.graph_launch(exec, stream.handle())?;
    s.expect(&stream, &x2, 6.0, "x2: set to 5, then incremented")?;
    s.expect(&stream, &y, 6.0, "y copies x2")?;
    s.expect(&stream, &x, 0.0, "x is no longer written")?;
    let mut out = vec![1u8; bytes as usize];
    d.host_read(host, 0, &mut out)?;
    assert!(
        out.iter().all(|&b| b == 0),
        "the page-locked copy still reads x"
    );

    let seven = GraphNode::Memset {
        dst: x2.ptr(),
        value: MemsetValue::U32(7f32.to_bits()),
        count: N as u64,
    };
    d.graph_set_node(graph, 0, &seven)?;
    assert!(
        d.graph_exec_update(exec, graph)?,
        "a memset's value changes in place"
    );
    d.graph_launch(exec, stream.handle())?;
    s.expect(&stream, &x2, 8.0, "x2: set to 7, then incremented")?;
    d.graph_exec_destroy(exec)?;
    d.graph_destroy(graph)?;
    d.host_free(host)?;
    Ok(())
}
