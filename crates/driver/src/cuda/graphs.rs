//! Captures and graphs on the real driver: a capture's end and status, instances made,
//! launched, updated and destroyed, and graph nodes read and set (`cuStreamEndCapture`,
//! `cuGraphInstantiateWithFlags`, `cuGraphLaunch`, `cuGraphExecUpdate`, and through
//! `nodes` the per-node calls), each handle checked against the registry.
use super::{CudaDriver, capture_mode, check, nodes};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{
    CaptureMode, CaptureStatus, GraphExecHandle, GraphHandle, GraphNode, StreamHandle,
};
use std::ffi::CString;
use std::path::Path;
use std::sync::Arc;

pub(super) fn stream_end_capture(
    driver: &CudaDriver,
    stream: StreamHandle,
) -> Result<GraphHandle, DriverError> {
    let s = driver.stream(stream)?;
    let mut g = std::ptr::null_mut();
    // SAFETY: `s` is live; writes through a valid pointer.
    let r = unsafe { sys::cuStreamEndCapture(s, &mut g) };
    if r != sys::CUresult::CUDA_SUCCESS {
        if !g.is_null() {
            // SAFETY: a graph returned with an error is ours to destroy.
            unsafe { sys::cuGraphDestroy(g) };
        }
        return Err(DriverError::from_code(r as i32));
    }
    let l = driver.loaded()?;
    l.registry.write().graphs.insert(g as u64, stream.device.0);
    Ok(GraphHandle {
        device: stream.device,
        raw: g as u64,
    })
}

pub(super) fn stream_capture_status(
    driver: &CudaDriver,
    stream: StreamHandle,
) -> Result<CaptureStatus, DriverError> {
    use sys::CUstreamCaptureStatus as S;
    let s = driver.stream(stream)?;
    let (mut status, mut id) = (S::CU_STREAM_CAPTURE_STATUS_NONE, 0u64);
    // SAFETY: `s` is live; optional outputs are null.
    check(unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            s,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })?;
    Ok(match status {
        S::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active { id },
        S::CU_STREAM_CAPTURE_STATUS_INVALIDATED => CaptureStatus::Invalidated,
        _ => CaptureStatus::None,
    })
}

pub(super) fn exchange_capture_mode(
    driver: &CudaDriver,
    mode: CaptureMode,
) -> Result<CaptureMode, DriverError> {
    use sys::CUstreamCaptureMode as M;
    driver.loaded()?;
    let mut m = capture_mode(mode);
    // SAFETY: swaps the calling thread's mode through a valid pointer.
    check(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) })?;
    Ok(match m {
        M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
        M::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
        _ => CaptureMode::Global,
    })
}

pub(super) fn graph_node_count(
    driver: &CudaDriver,
    graph: GraphHandle,
) -> Result<usize, DriverError> {
    let g = driver.graph(graph)?;
    let mut n = 0usize;
    // SAFETY: the graph is live; a null node array asks for the count only.
    check(unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) })?;
    Ok(n)
}

pub(super) fn graph_instantiate(
    driver: &CudaDriver,
    graph: GraphHandle,
) -> Result<GraphExecHandle, DriverError> {
    let g = driver.graph(graph)?;
    let mut e = std::ptr::null_mut();
    let flags =
        u64::from(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0);
    // SAFETY: the graph is live; writes through a valid pointer.
    check(unsafe { sys::cuGraphInstantiateWithFlags(&mut e, g, flags) })?;
    driver
        .loaded()?
        .registry
        .write()
        .execs
        .insert(e as u64, graph.device.0);
    Ok(GraphExecHandle {
        device: graph.device,
        raw: e as u64,
    })
}

pub(super) fn graph_upload(
    driver: &CudaDriver,
    exec: GraphExecHandle,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let e = driver.exec(exec)?;
    let s = driver.stream(stream)?;
    // SAFETY: both handles are live.
    check(unsafe { sys::cuGraphUpload(e, s) })
}

pub(super) fn graph_launch(
    driver: &CudaDriver,
    exec: GraphExecHandle,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let e = driver.exec(exec)?;
    let s = driver.stream(stream)?;
    // SAFETY: both handles are live.
    check(unsafe { sys::cuGraphLaunch(e, s) })
}

pub(super) fn graph_exec_destroy(
    driver: &CudaDriver,
    exec: GraphExecHandle,
) -> Result<(), DriverError> {
    let e = driver.exec(exec)?;
    driver.loaded()?.registry.write().execs.remove(&exec.raw);
    // SAFETY: live (registry) and destroyed once; launches in flight finish.
    check(unsafe { sys::cuGraphExecDestroy(e) })
}

pub(super) fn graph_destroy(driver: &CudaDriver, graph: GraphHandle) -> Result<(), DriverError> {
    let g = driver.graph(graph)?;
    let mut registry = driver.loaded()?.registry.write();
    registry.graphs.remove(&graph.raw);
    registry.graph_nodes.remove(&graph.raw);
    drop(registry);
    // SAFETY: live (registry) and destroyed once.
    check(unsafe { sys::cuGraphDestroy(g) })
}

pub(super) fn graph_debug_dot(
    driver: &CudaDriver,
    graph: GraphHandle,
    path: &Path,
) -> Result<(), DriverError> {
    let g = driver.graph(graph)?;
    let path =
        CString::new(path.to_string_lossy().as_bytes()).map_err(|_| DriverError::INVALID_VALUE)?;
    // SAFETY: the graph is live; `path` is NUL-terminated. Flag 1 = verbose.
    check(unsafe { sys::cuGraphDebugDotPrint(g, path.as_ptr(), 1) })
}

pub(super) fn graph_set_node(
    driver: &CudaDriver,
    graph: GraphHandle,
    index: usize,
    node: &GraphNode,
) -> Result<(), DriverError> {
    let g = driver.graph(graph)?;
    let target = *nodes::list(g)?
        .get(index)
        .ok_or(DriverError::INVALID_VALUE)?;
    nodes::Params::new(target, node, &param_counts(driver))?.set(target)
}

pub(super) fn graph_exec_set_nodes(
    driver: &CudaDriver,
    exec: GraphExecHandle,
    graph: GraphHandle,
    changes: &[(usize, GraphNode)],
) -> Result<bool, DriverError> {
    let (e, g) = (driver.exec(exec)?, driver.graph(graph)?);
    let ctx = driver.primary_context(exec.device)?;
    let registry = &driver.loaded()?.registry;
    let counts = param_counts(driver);
    let known = registry.read().graph_nodes.get(&graph.raw).cloned();
    let cache = match known {
        Some(cache) => cache,
        None => {
            let cache = Arc::new(nodes::Cache::read(g, &counts)?);
            let mut registry = registry.write();
            // Destroyed meanwhile by another thread: not kept.
            if registry.graphs.contains_key(&graph.raw) {
                registry.graph_nodes.insert(graph.raw, cache.clone());
            }
            cache
        }
    };
    // Every node's parameters are made before any is set, so that an error sets none.
    let params = (changes.iter())
        .map(|(index, to)| cache.params(*index, to, &counts))
        .collect::<Result<Vec<_>, DriverError>>()?;
    Ok(params.iter().all(|(node, p)| p.set_in_exec(e, *node, ctx)))
}

pub(super) fn graph_exec_update(
    driver: &CudaDriver,
    exec: GraphExecHandle,
    graph: GraphHandle,
) -> Result<bool, DriverError> {
    let (e, g) = (driver.exec(exec)?, driver.graph(graph)?);
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
    // SAFETY: both handles are live; writes through a valid pointer.
    let r = unsafe { sys::cuGraphExecUpdate_v2(e, g, &mut info) };
    match check(r) {
        Ok(()) => Ok(true),
        Err(e) if e == DriverError::GRAPH_EXEC_UPDATE_FAILURE => Ok(false),
        Err(e) => Err(e),
    }
}

pub(super) fn stream_begin_capture(
    driver: &CudaDriver,
    stream: StreamHandle,
    mode: CaptureMode,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    // SAFETY: `s` is live (or the legacy stream, which the driver refuses).
    check(unsafe { sys::cuStreamBeginCapture_v2(s, capture_mode(mode)) })
}

pub(super) fn graph_nodes(
    driver: &CudaDriver,
    graph: GraphHandle,
) -> Result<Vec<GraphNode>, DriverError> {
    let g = driver.graph(graph)?;
    let counts = param_counts(driver);
    (nodes::list(g)?.into_iter())
        .map(|node| nodes::describe(node, &counts))
        .collect()
}

/// The parameter counts of the functions of modules this driver loaded (see `ptx`).
fn param_counts(driver: &CudaDriver) -> impl Fn(sys::CUfunction) -> Option<usize> + '_ {
    move |f| {
        let loaded = driver.loaded().ok()?;
        let registry = loaded.registry.read();
        registry.functions.get(&(f as u64))?.params
    }
}
