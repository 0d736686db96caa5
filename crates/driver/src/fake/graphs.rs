//! Captures and graphs on the fake device: the capture rules of the graphs spec §8.2–8.3
//! with the driver's codes (a "potentially unsafe" call during a capture, an unjoined fork,
//! an invalidated capture), a capture's end into a graph, instances made, launched, updated
//! and destroyed, and graph nodes read and set.
use super::work::Node;
use super::work::Work;
use super::{
    Call, Capture, CaptureLink, FakeDriver, FakeGraph, THREAD_CAPTURE_MODE, mem_pool, nodes,
};
use super::{Recorded, State, StreamKey};
use crate::DriverError;
use ferrocuda_types::EventHandle;
use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, GraphExecHandle, GraphHandle, GraphNode, StreamHandle,
};
use std::cell::Cell;
use std::path::Path;

pub(super) fn stream_begin_capture(
    driver: &FakeDriver,
    stream: StreamHandle,
    mode: CaptureMode,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::BeginCapture)?;
    let key = st.stream_key(stream)?;
    if key.1 == 0 {
        return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
    }
    if st.streams.get(&key).is_some_and(|s| s.capture.is_some()) {
        return Err(DriverError::ILLEGAL_STATE);
    }
    let id = st.id();
    st.captures.insert(
        id,
        Capture {
            origin: key,
            device: stream.device,
            mode,
            thread: std::thread::current().id(),
            nodes: Vec::new(),
            members: vec![key],
            invalidated: false,
        },
    );
    if let Some(s) = st.streams.get_mut(&key) {
        s.capture = Some(CaptureLink {
            id,
            deps: Vec::new(),
        });
        st.busy.set_capturing(key, true);
    }
    Ok(())
}

pub(super) fn stream_end_capture(
    driver: &FakeDriver,
    stream: StreamHandle,
) -> Result<GraphHandle, DriverError> {
    let mut st = driver.enter(Call::EndCapture)?;
    let key = st.stream_key(stream)?;
    let nodes = st.end_capture(key)?;
    let raw = st.id();
    st.graphs.insert(
        raw,
        FakeGraph {
            device: stream.device,
            nodes: nodes.into(),
        },
    );
    Ok(GraphHandle {
        device: stream.device,
        raw,
    })
}

pub(super) fn stream_capture_status(
    driver: &FakeDriver,
    stream: StreamHandle,
) -> Result<CaptureStatus, DriverError> {
    let mut st = driver.enter(Call::CaptureStatus)?;
    let key = st.stream_key(stream)?;
    // As cuStreamGetCaptureInfo: asked of the legacy stream while a blocking stream of its
    // device captures, it fails with 906, and that capture stays valid.
    if stream.is_legacy() && !st.blocking_captures_on(stream.device).is_empty() {
        return Err(DriverError::STREAM_CAPTURE_IMPLICIT);
    }
    let link = st.streams.get(&key).and_then(|s| s.capture.as_ref());
    Ok(
        match link.and_then(|l| st.captures.get(&l.id).map(|c| (l.id, c))) {
            None => CaptureStatus::None,
            Some((_, c)) if c.invalidated => CaptureStatus::Invalidated,
            Some((id, c)) => {
                debug_assert_eq!(c.device, stream.device);
                CaptureStatus::Active { id }
            }
        },
    )
}

pub(super) fn exchange_capture_mode(
    driver: &FakeDriver,
    mode: CaptureMode,
) -> Result<CaptureMode, DriverError> {
    let _st = driver.enter(Call::ExchangeCaptureMode)?;
    Ok(THREAD_CAPTURE_MODE.with(|m| m.replace(mode)))
}

pub(super) fn graph_instantiate(
    driver: &FakeDriver,
    graph: GraphHandle,
) -> Result<GraphExecHandle, DriverError> {
    let mut st = driver.enter(Call::GraphInstantiate)?;
    let nodes = st.graph(graph)?.nodes.clone();
    let raw = st.id();
    st.execs.insert(
        raw,
        FakeGraph {
            device: graph.device,
            nodes,
        },
    );
    Ok(GraphExecHandle {
        device: graph.device,
        raw,
    })
}

pub(super) fn graph_upload(
    driver: &FakeDriver,
    exec: GraphExecHandle,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let st = driver.enter(Call::GraphUpload)?;
    st.stream_key(stream)?;
    st.execs
        .get(&exec.raw)
        .filter(|e| e.device == exec.device)
        .map(|_| ())
        .ok_or(DriverError::INVALID_HANDLE)
}

pub(super) fn graph_launch(
    driver: &FakeDriver,
    exec: GraphExecHandle,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::GraphLaunch)?;
    let key = st.stream_key(stream)?;
    let e = st
        .execs
        .get(&exec.raw)
        .filter(|e| e.device == exec.device && e.device == stream.device);
    let nodes = e.ok_or(DriverError::INVALID_HANDLE)?.nodes.clone();
    st.enqueue(key, Work::Graph(nodes.clone()))?;
    if st.streams.get(&key).is_some_and(|s| s.capture.is_some()) {
        return Ok(()); // a child graph node: its memory nodes run when the parent does
    }
    mem_pool::launch_graph_memory(&mut st, &nodes)
}

pub(super) fn graph_exec_destroy(
    driver: &FakeDriver,
    exec: GraphExecHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::GraphExecDestroy)?;
    st.execs
        .remove(&exec.raw)
        .map(|_| ())
        .ok_or(DriverError::INVALID_HANDLE)
}

pub(super) fn graph_destroy(driver: &FakeDriver, graph: GraphHandle) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::GraphDestroy)?;
    st.graph(graph)?;
    st.graphs.remove(&graph.raw);
    Ok(())
}

pub(super) fn graph_debug_dot(
    driver: &FakeDriver,
    graph: GraphHandle,
    path: &Path,
) -> Result<(), DriverError> {
    let st = driver.enter(Call::GraphDebugDot)?;
    let g = st.graph(graph)?;
    let mut dot = String::from("digraph ferrocuda_fake_graph {\n");
    for (i, n) in g.nodes.iter().enumerate() {
        dot += &format!("  n{i} [label=\"{}\"];\n", n.work.label());
        for d in &n.deps {
            dot += &format!("  n{d} -> n{i};\n");
        }
    }
    dot += "}\n";
    std::fs::write(path, dot).map_err(|_| DriverError::OPERATING_SYSTEM)
}

pub(super) fn graph_nodes(
    driver: &FakeDriver,
    graph: GraphHandle,
) -> Result<Vec<GraphNode>, DriverError> {
    let st = driver.enter(Call::GraphNodes)?;
    let g = st.graph(graph)?;
    Ok(g.nodes.iter().map(|n| nodes::describe(&n.work)).collect())
}

pub(super) fn graph_set_node(
    driver: &FakeDriver,
    graph: GraphHandle,
    index: usize,
    node: &GraphNode,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::GraphSetNode)?;
    let mut changed = st.graph(graph)?.nodes.to_vec();
    let slot = changed.get_mut(index).ok_or(DriverError::INVALID_VALUE)?;
    slot.work = nodes::apply(&slot.work, node)?;
    for (ptr, bytes) in nodes::device_ranges(&slot.work) {
        st.dev_ptr_check(ptr, bytes)?;
    }
    if let Some(g) = st.graphs.get_mut(&graph.raw) {
        g.nodes = changed.into();
    }
    Ok(())
}

pub(super) fn graph_exec_set_nodes(
    driver: &FakeDriver,
    exec: GraphExecHandle,
    graph: GraphHandle,
    changes: &[(usize, GraphNode)],
) -> Result<bool, DriverError> {
    let mut st = match driver.enter(Call::GraphExecSetNodes) {
        // An injected refusal reads as the real driver's refusing a node.
        Err(e) if e == DriverError::GRAPH_EXEC_UPDATE_FAILURE => return Ok(false),
        entered => entered?,
    };
    st.graph(graph)?;
    let e = st.execs.get(&exec.raw).filter(|e| e.device == exec.device);
    let mut changed = e.ok_or(DriverError::INVALID_HANDLE)?.nodes.to_vec();
    for (index, node) in changes {
        let slot = changed.get_mut(*index).ok_or(DriverError::INVALID_VALUE)?;
        slot.work = nodes::apply(&slot.work, node)?;
        for (ptr, bytes) in nodes::device_ranges(&slot.work) {
            st.dev_ptr_check(ptr, bytes)?;
        }
    }
    if let Some(e) = st.execs.get_mut(&exec.raw) {
        e.nodes = changed.into();
    }
    Ok(true)
}

pub(super) fn graph_exec_update(
    driver: &FakeDriver,
    exec: GraphExecHandle,
    graph: GraphHandle,
) -> Result<bool, DriverError> {
    let mut st = match driver.enter(Call::GraphExecUpdate) {
        // An injected refusal reads as the real driver's: leave `exec`, re-instantiate.
        Err(e) if e == DriverError::GRAPH_EXEC_UPDATE_FAILURE => return Ok(false),
        entered => entered?,
    };
    let nodes = st.graph(graph)?.nodes.clone();
    let e = st
        .execs
        .get_mut(&exec.raw)
        .filter(|e| e.device == exec.device);
    let e = e.ok_or(DriverError::INVALID_HANDLE)?;
    let same_kind = |a: &Work, b: &Work| match (a, b) {
        (Work::Kernel { name: x, .. }, Work::Kernel { name: y, .. }) => x == y,
        _ => std::mem::discriminant(a) == std::mem::discriminant(b),
    };
    let same_topology = e.nodes.len() == nodes.len()
        && e.nodes
            .iter()
            .zip(nodes.iter())
            .all(|(a, b)| a.deps == b.deps && same_kind(&a.work, &b.work));
    if same_topology {
        e.nodes = nodes;
    }
    Ok(same_topology)
}

impl State {
    /// Invalidates every capture `breaks` picks (by id) and refuses the call with `code`;
    /// lets the call through when it picks none. The refusals of calls a capture forbids
    /// elsewhere than on its own stream are this with their own rule.
    pub(super) fn refuse_breaking(
        &mut self,
        code: DriverError,
        breaks: impl Fn(u64, &Capture) -> bool,
    ) -> Result<(), DriverError> {
        let mut refused = false;
        for (&id, c) in self.captures.iter_mut() {
            if breaks(id, c) {
                c.invalidated = true;
                refused = true;
            }
        }
        if refused { Err(code) } else { Ok(()) }
    }

    /// A "potentially unsafe" call (graphs spec §8.2): refused with 900, and the captures
    /// that refuse it invalidated, depending on this thread's mode and open captures.
    pub(super) fn check_unsafe_call(&mut self) -> Result<(), DriverError> {
        let me = std::thread::current().id();
        let my_mode = THREAD_CAPTURE_MODE.with(Cell::get);
        self.refuse_breaking(DriverError::STREAM_CAPTURE_UNSUPPORTED, |_, c| {
            let own = c.thread == me && c.mode != CaptureMode::Relaxed;
            let other_global = c.thread != me && c.mode == CaptureMode::Global;
            match my_mode {
                CaptureMode::Relaxed => false,
                CaptureMode::ThreadLocal => own,
                CaptureMode::Global => own || other_global,
            }
        })
    }

    /// Synchronizing the device while any of its streams captures: refused with 900, and
    /// every capture on the device invalidated, whatever the capture's mode, the calling
    /// thread's mode, or which thread calls (seen on an H200 for blocking and non-blocking
    /// capturing streams: docs/measurements/h200_2026-12-01g/legacy_probe.py for the
    /// capturing thread, docs/measurements/h200_2026-12-01h/ctx_sync_probe.py for another).
    pub(super) fn refuse_device_sync_during_captures(
        &mut self,
        device: DeviceIndex,
    ) -> Result<(), DriverError> {
        self.refuse_breaking(DriverError::STREAM_CAPTURE_UNSUPPORTED, |_, c| {
            c.device == device
        })
    }

    /// Synchronizing or querying a capturing stream is always refused and breaks the capture.
    pub(super) fn refuse_if_capturing(&mut self, key: StreamKey) -> Result<(), DriverError> {
        let link = self.streams.get(&key).and_then(|s| s.capture.clone());
        if let Some(link) = link {
            if let Some(c) = self.captures.get_mut(&link.id) {
                c.invalidated = true;
            }
            return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    /// Refuses queries of events recorded inside a capture (907), breaking the capture.
    pub(super) fn refuse_captured_event(
        &mut self,
        e: EventHandle,
        code: DriverError,
    ) -> Result<(), DriverError> {
        if let Recorded::Captured { capture, .. } = self.event(e)?.recorded {
            if let Some(c) = self.captures.get_mut(&capture) {
                c.invalidated = true;
            }
            return Err(code);
        }
        Ok(())
    }

    pub(super) fn end_capture(&mut self, key: StreamKey) -> Result<Vec<Node>, DriverError> {
        let link = self.streams.get(&key).and_then(|s| s.capture.clone());
        let link = link.ok_or(DriverError::ILLEGAL_STATE)?;
        let cap = self
            .captures
            .get(&link.id)
            .ok_or(DriverError::ILLEGAL_STATE)?;
        if cap.origin != key {
            return Err(DriverError::STREAM_CAPTURE_UNMATCHED);
        }
        let wrong_thread =
            cap.mode != CaptureMode::Relaxed && cap.thread != std::thread::current().id();
        let Some(cap) = self.captures.remove(&link.id) else {
            return Err(DriverError::ILLEGAL_STATE);
        };
        let mut joined = true;
        for member in &cap.members {
            if let Some(s) = self.streams.get_mut(member) {
                if *member != key {
                    // A forked stream is joined when the origin depends on everything it did.
                    let tail = s
                        .capture
                        .as_ref()
                        .map(|l| l.deps.clone())
                        .unwrap_or_default();
                    joined &= tail.iter().all(|n| reaches(&cap.nodes, &link.deps, *n));
                }
                s.capture = None;
                self.busy.set_capturing(*member, false);
            }
        }
        // The real driver refuses an end from the wrong thread but ends the capture anyway.
        if wrong_thread {
            return Err(DriverError::STREAM_CAPTURE_WRONG_THREAD);
        }
        if cap.invalidated {
            return Err(DriverError::STREAM_CAPTURE_INVALIDATED);
        }
        if !joined {
            return Err(DriverError::STREAM_CAPTURE_UNJOINED);
        }
        Ok(cap.nodes)
    }
}

/// Whether node `target` is one of `from` or an ancestor of one of them.
pub(super) fn reaches(nodes: &[Node], from: &[usize], target: usize) -> bool {
    let mut stack: Vec<usize> = from.to_vec();
    let mut seen = vec![false; nodes.len()];
    while let Some(n) = stack.pop() {
        if n == target {
            return true;
        }
        if n < target || std::mem::replace(&mut seen[n], true) {
            continue;
        }
        stack.extend(nodes[n].deps.iter().copied());
    }
    false
}
