//! The parameters of graph nodes through the driver API: what
//! [`Driver::graph_nodes`](crate::Driver::graph_nodes) reads and
//! [`Driver::graph_set_node`](crate::Driver::graph_set_node) writes. Every function takes
//! nodes of a graph the caller checked against the registry.
//!
//! Enum values the driver writes (a node's type, a copy's memory types) are read as the
//! integers they are in C before anything is read as a Rust enum, so a value these bindings
//! do not know is an opaque node, never an invalid enum.
use super::check;
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{CopyEnd, DevicePtr, GraphNode, MemsetValue};
use std::ffi::c_void;
use std::mem::MaybeUninit;
use sys::CUgraphNodeType as NodeType;
use sys::CUmemorytype as MemoryType;

/// The nodes of a live graph, in the driver's order.
pub(super) fn list(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>, DriverError> {
    let mut count = 0usize;
    // SAFETY: the graph is live; a null array asks for the count only.
    check(unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) })?;
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` holds `count` slots; the driver fills at most that many.
    check(unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) })?;
    nodes.truncate(count);
    Ok(nodes)
}

/// What `node` is, with the parameters of the kinds [`GraphNode`] describes.
pub(super) fn describe(
    node: sys::CUgraphNode,
    counts: ParamCounts<'_>,
) -> Result<GraphNode, DriverError> {
    let kind = node_type(node)?;
    let is = |t: NodeType| kind == t as u32;
    Ok(if is(NodeType::CU_GRAPH_NODE_TYPE_KERNEL) {
        match read_kernel(node, counts)? {
            Some(kernel) => GraphNode::Kernel { args: kernel.args },
            None => opaque("kernel without a parameter array"),
        }
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_MEMSET) {
        memset_node(&read_memset(node)?)
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_MEMCPY) {
        read_memcpy(node)?.map_or(opaque("copy of an unknown memory type"), |p| {
            memcpy_node(&p)
        })
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_EMPTY) {
        GraphNode::Ordering { what: "empty" }
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_WAIT_EVENT) {
        GraphNode::Ordering { what: "event wait" }
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_EVENT_RECORD) {
        GraphNode::Ordering {
            what: "event record",
        }
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL)
        || is(NodeType::CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT)
    {
        GraphNode::Ordering {
            what: "external semaphore",
        }
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_HOST) {
        opaque("host function")
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_GRAPH) {
        opaque("child graph")
    } else if is(NodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        || is(NodeType::CU_GRAPH_NODE_TYPE_MEM_FREE)
    {
        opaque("graph memory allocation or free")
    } else {
        opaque("node of a kind ferrocuda does not read")
    })
}

/// The parameters `to` describes, for `node` or an instance's copy of it: a kernel's
/// function and launch shape and a copy's or memset's layout are `node`'s, what `to` names
/// is new. See [`Driver::graph_set_node`](crate::Driver::graph_set_node) for what must
/// match; anything else is `CUDA_ERROR_INVALID_VALUE`.
pub(super) enum Params {
    Kernel(KernelParams),
    Memset(sys::CUDA_MEMSET_NODE_PARAMS),
    Memcpy(sys::CUDA_MEMCPY3D),
}

impl Params {
    pub(super) fn new(
        node: sys::CUgraphNode,
        to: &GraphNode,
        counts: ParamCounts<'_>,
    ) -> Result<Params, DriverError> {
        let kind = node_type(node)?;
        Ok(match to {
            GraphNode::Kernel { args } if kind == NodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32 => {
                Params::Kernel(kernel_params(node, args, counts)?)
            }
            GraphNode::Memset { dst, value, count }
                if kind == NodeType::CU_GRAPH_NODE_TYPE_MEMSET as u32 =>
            {
                Params::Memset(memset_params(node, *dst, *value, *count)?)
            }
            GraphNode::Memcpy { dst, src, bytes }
                if kind == NodeType::CU_GRAPH_NODE_TYPE_MEMCPY as u32 =>
            {
                Params::Memcpy(memcpy_params(node, *dst, *src, *bytes)?)
            }
            _ => return Err(DriverError::INVALID_VALUE),
        })
    }

    /// Gives `node` of its graph these parameters.
    pub(super) fn set(&self, node: sys::CUgraphNode) -> Result<(), DriverError> {
        check(match self {
            // SAFETY: a kernel node of a live graph; one pointer per parameter, each to as
            // many bytes as the parameter takes (checked when made), all owned by `p`, which
            // the call copies.
            Params::Kernel(p) => unsafe { sys::cuGraphKernelNodeSetParams_v2(node, &p.params) },
            // SAFETY: a memset node of a live graph; a fully initialised struct; the driver
            // checks the device range.
            Params::Memset(p) => unsafe { sys::cuGraphMemsetNodeSetParams(node, p) },
            // SAFETY: a memcpy node of a live graph; the host pointers are the ones the
            // driver returned for this node (a host end may not change), and the driver
            // checks device ranges.
            Params::Memcpy(p) => unsafe { sys::cuGraphMemcpyNodeSetParams(node, p) },
        })
    }

    /// Gives the copy of `node` in the instance `exec` of its graph these parameters, the
    /// graph's node left as it is (`cuGraphExecKernelNodeSetParams`,
    /// `cuGraphExecMemsetNodeSetParams`, `cuGraphExecMemcpyNodeSetParams`, in `ctx`).
    /// `false`: the driver refused.
    pub(super) fn set_in_exec(
        &self,
        exec: sys::CUgraphExec,
        node: sys::CUgraphNode,
        ctx: sys::CUcontext,
    ) -> bool {
        let r = match self {
            // SAFETY: `exec` is a live instance of the graph `node` belongs to; `p` holds
            // the node's function and launch shape and one pointer per parameter to as many
            // bytes as the parameter takes, all owned by `p`, which the call copies.
            Params::Kernel(p) => unsafe {
                sys::cuGraphExecKernelNodeSetParams_v2(exec, node, &p.params)
            },
            // SAFETY: as above; a fully initialised struct, `ctx` the live context of the
            // instance's device; the driver checks the device range.
            Params::Memset(p) => unsafe { sys::cuGraphExecMemsetNodeSetParams(exec, node, p, ctx) },
            // SAFETY: as above; host ends are the driver's own for this node.
            Params::Memcpy(p) => unsafe { sys::cuGraphExecMemcpyNodeSetParams(exec, node, p, ctx) },
        };
        r == sys::CUresult::CUDA_SUCCESS
    }
}

fn opaque(what: &'static str) -> GraphNode {
    GraphNode::Opaque { what }
}

/// The node's type as the integer the driver wrote.
fn node_type(node: sys::CUgraphNode) -> Result<u32, DriverError> {
    let mut kind = 0u32;
    // SAFETY: `node` belongs to a live graph; the driver writes one C enum (four bytes, the
    // layout of `CUgraphNodeType`, which is `repr(u32)`) into a `u32`.
    check(unsafe { sys::cuGraphNodeGetType(node, (&raw mut kind).cast()) })?;
    Ok(kind)
}

/// A kernel node's parameters and the bytes of each of its arguments.
struct Kernel {
    params: sys::CUDA_KERNEL_NODE_PARAMS,
    args: Vec<Vec<u8>>,
}

/// The parameter count of a function, where the module it came from said (PTX images; see
/// `ptx`). `None`: a function ferrocuda did not load, whose parameters are probed.
pub(super) type ParamCounts<'a> = &'a dyn Fn(sys::CUfunction) -> Option<usize>;

/// The kernel node's parameters, or `None` when its arguments cannot be read (launched
/// with `extra`, or through a library kernel handle).
fn read_kernel(
    node: sys::CUgraphNode,
    counts: ParamCounts<'_>,
) -> Result<Option<Kernel>, DriverError> {
    // SAFETY: all-zero is a valid value of this plain C struct (null pointers, zeros).
    let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a kernel node of a live graph; writes through a valid pointer.
    check(unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) })?;
    if params.kernelParams.is_null() || params.func.is_null() {
        return Ok(None);
    }
    // A function of a module ferrocuda loaded is asked about its parameters only; another
    // one (cuFuncGetParamCount is not in CUDA 13.0's driver) is probed until the driver
    // says there is no further parameter, which it reports as a failed call.
    let known = counts(params.func);
    let mut args = Vec::new();
    while known.is_none_or(|n| args.len() < n) {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: `func` is the node's live function; writes through valid pointers.
        let r = unsafe { sys::cuFuncGetParamInfo(params.func, args.len(), &mut offset, &mut size) };
        match r {
            sys::CUresult::CUDA_SUCCESS => {}
            sys::CUresult::CUDA_ERROR_INVALID_VALUE if known.is_none() => break,
            e => return Err(DriverError::from_code(e as i32)),
        }
        // SAFETY: the node's parameter array has one pointer per kernel parameter, each to
        // `size` readable bytes (the driver's copy, valid while the node is unchanged).
        let bytes = unsafe {
            let arg = *params.kernelParams.add(args.len()) as *const u8;
            std::slice::from_raw_parts(arg, size).to_vec()
        };
        args.push(bytes);
    }
    Ok(Some(Kernel { params, args }))
}

/// A kernel node's parameters as set, with the argument bytes they point to.
pub(super) struct KernelParams {
    params: sys::CUDA_KERNEL_NODE_PARAMS,
    /// What `params.kernelParams` points to: one pointer per argument, each to its bytes
    /// (heap buffers, which stay where they are when this struct moves).
    _pointers: Vec<*mut c_void>,
    _values: Vec<Vec<u8>>,
}

/// `node`'s kernel parameters with the argument bytes `args` (as many, of the same sizes).
fn kernel_params(
    node: sys::CUgraphNode,
    args: &[Vec<u8>],
    counts: ParamCounts<'_>,
) -> Result<KernelParams, DriverError> {
    let current = read_kernel(node, counts)?.ok_or(DriverError::INVALID_VALUE)?;
    KernelBase::of(&current).with_args(args)
}

/// A kernel node's function, launch shape and parameter sizes: what its parameters are
/// made from, whatever its arguments.
struct KernelBase {
    /// With no parameter array.
    params: sys::CUDA_KERNEL_NODE_PARAMS,
    sizes: Vec<usize>,
}

impl KernelBase {
    fn of(kernel: &Kernel) -> KernelBase {
        let mut params = kernel.params;
        params.kernelParams = std::ptr::null_mut();
        params.extra = std::ptr::null_mut();
        KernelBase {
            params,
            sizes: kernel.args.iter().map(Vec::len).collect(),
        }
    }

    /// The parameters with the argument bytes `args` (as many, of the same sizes).
    fn with_args(&self, args: &[Vec<u8>]) -> Result<KernelParams, DriverError> {
        let same_shape = self.sizes.len() == args.len()
            && self
                .sizes
                .iter()
                .zip(args)
                .all(|(size, a)| *size == a.len());
        if !same_shape {
            return Err(DriverError::INVALID_VALUE);
        }
        let mut values = args.to_vec();
        let mut pointers: Vec<*mut c_void> =
            values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        let mut params = self.params;
        params.kernelParams = pointers.as_mut_ptr();
        Ok(KernelParams {
            params,
            _pointers: pointers,
            _values: values,
        })
    }
}

/// What an update of an instance needs of a captured graph, read once (at its first such
/// update): its nodes in the driver's order, and each kernel node's function, launch shape
/// and parameter sizes, which no ferrocuda call changes (`graph_set_node` sets arguments
/// only, and a captured graph gains no node). Dropped with the graph.
pub(super) struct Cache {
    list: Vec<sys::CUgraphNode>,
    kernels: Vec<Option<KernelBase>>,
}

// SAFETY: the node handles and the function and context handles inside the kernel
// parameters are opaque driver handles, only ever passed back to the driver (which is
// thread-safe), never dereferenced here; the parameter array pointers are null.
unsafe impl Send for Cache {}
// SAFETY: as for `Send`; nothing here is mutated after `read`.
unsafe impl Sync for Cache {}

impl Cache {
    /// Reads the nodes of the live `graph`.
    pub(super) fn read(graph: sys::CUgraph, counts: ParamCounts<'_>) -> Result<Cache, DriverError> {
        let list = list(graph)?;
        let kernels = (list.iter())
            .map(|&node| {
                if node_type(node)? != NodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32 {
                    return Ok(None);
                }
                Ok(read_kernel(node, counts)?.as_ref().map(KernelBase::of))
            })
            .collect::<Result<_, DriverError>>()?;
        Ok(Cache { list, kernels })
    }

    /// Node `index` with the parameters `to` describes (see [`Params::new`]): a kernel's
    /// made from what was read, another node's read from it now.
    pub(super) fn params(
        &self,
        index: usize,
        to: &GraphNode,
        counts: ParamCounts<'_>,
    ) -> Result<(sys::CUgraphNode, Params), DriverError> {
        let node = *self.list.get(index).ok_or(DriverError::INVALID_VALUE)?;
        let params = match (to, self.kernels.get(index)) {
            (GraphNode::Kernel { args }, Some(Some(base))) => Params::Kernel(base.with_args(args)?),
            _ => Params::new(node, to, counts)?,
        };
        Ok((node, params))
    }
}

fn read_memset(node: sys::CUgraphNode) -> Result<sys::CUDA_MEMSET_NODE_PARAMS, DriverError> {
    // SAFETY: all-zero is a valid value of this plain C struct (integers only).
    let mut params: sys::CUDA_MEMSET_NODE_PARAMS = unsafe { std::mem::zeroed() };
    // SAFETY: a memset node of a live graph; writes through a valid pointer.
    check(unsafe { sys::cuGraphMemsetNodeGetParams(node, &mut params) })?;
    Ok(params)
}

fn memset_node(p: &sys::CUDA_MEMSET_NODE_PARAMS) -> GraphNode {
    if p.height > 1 {
        return opaque("2-D memset");
    }
    let value = match p.elementSize {
        1 => MemsetValue::U8(p.value as u8),
        2 => MemsetValue::U16(p.value as u16),
        4 => MemsetValue::U32(p.value),
        _ => return opaque("memset of an unknown element size"),
    };
    GraphNode::Memset {
        dst: DevicePtr(p.dst),
        value,
        count: p.width as u64,
    }
}

/// `node`'s memset parameters writing `count` times `value` at `dst`.
fn memset_params(
    node: sys::CUgraphNode,
    dst: DevicePtr,
    value: MemsetValue,
    count: u64,
) -> Result<sys::CUDA_MEMSET_NODE_PARAMS, DriverError> {
    let mut p = read_memset(node)?;
    if p.height > 1 {
        return Err(DriverError::INVALID_VALUE);
    }
    let (bits, width) = match value {
        MemsetValue::U8(v) => (u32::from(v), 1),
        MemsetValue::U16(v) => (u32::from(v), 2),
        MemsetValue::U32(v) => (v, 4),
    };
    p.dst = dst.0;
    p.value = bits;
    p.elementSize = width;
    p.width = usize::try_from(count).map_err(|_| DriverError::INVALID_VALUE)?;
    Ok(p)
}

/// The copy node's parameters, or `None` when a memory type is one these bindings do not
/// know.
fn read_memcpy(node: sys::CUgraphNode) -> Result<Option<sys::CUDA_MEMCPY3D>, DriverError> {
    let mut p = MaybeUninit::<sys::CUDA_MEMCPY3D>::zeroed();
    // SAFETY: a memcpy node of a live graph; the driver writes the whole struct.
    check(unsafe { sys::cuGraphMemcpyNodeGetParams(node, p.as_mut_ptr()) })?;
    let raw = p.as_ptr();
    // SAFETY: reads the two memory types as the C integers they are, through pointers into
    // the struct the driver wrote; nothing is read as a Rust enum yet.
    let types = unsafe {
        [
            (&raw const (*raw).srcMemoryType).cast::<u32>().read(),
            (&raw const (*raw).dstMemoryType).cast::<u32>().read(),
        ]
    };
    let known = [
        MemoryType::CU_MEMORYTYPE_HOST,
        MemoryType::CU_MEMORYTYPE_DEVICE,
        MemoryType::CU_MEMORYTYPE_ARRAY,
        MemoryType::CU_MEMORYTYPE_UNIFIED,
    ];
    if !types.iter().all(|&t| known.iter().any(|&k| k as u32 == t)) {
        return Ok(None);
    }
    // SAFETY: both memory types are values of their enum (checked above); every other field
    // is an integer or a pointer, valid for any bits.
    Ok(Some(unsafe { p.assume_init() }))
}

/// One end of a copy: device memory (or a unified address) or host memory, with its offsets;
/// `None` for an array or an end that is not 1-D.
fn copy_end(
    kind: MemoryType,
    host: *const c_void,
    device: sys::CUdeviceptr,
    (x, y, z): (usize, usize, usize),
) -> Option<CopyEnd> {
    if y != 0 || z != 0 {
        return None;
    }
    match kind {
        MemoryType::CU_MEMORYTYPE_HOST => Some(CopyEnd::Host(host as u64 + x as u64)),
        MemoryType::CU_MEMORYTYPE_DEVICE | MemoryType::CU_MEMORYTYPE_UNIFIED => {
            Some(CopyEnd::Device(DevicePtr(device + x as u64)))
        }
        MemoryType::CU_MEMORYTYPE_ARRAY => None,
    }
}

/// `(dst, src)` of a 1-D copy.
fn copy_ends(p: &sys::CUDA_MEMCPY3D) -> Option<(CopyEnd, CopyEnd)> {
    if p.Height > 1 || p.Depth > 1 || p.srcLOD != 0 || p.dstLOD != 0 {
        return None;
    }
    let src = copy_end(
        p.srcMemoryType,
        p.srcHost,
        p.srcDevice,
        (p.srcXInBytes, p.srcY, p.srcZ),
    )?;
    let dst = copy_end(
        p.dstMemoryType,
        p.dstHost.cast_const(),
        p.dstDevice,
        (p.dstXInBytes, p.dstY, p.dstZ),
    )?;
    Some((dst, src))
}

fn memcpy_node(p: &sys::CUDA_MEMCPY3D) -> GraphNode {
    match copy_ends(p) {
        Some((dst, src)) => GraphNode::Memcpy {
            dst,
            src,
            bytes: p.WidthInBytes as u64,
        },
        None => opaque("copy that is not 1-D"),
    }
}

/// `node`'s copy parameters with the ends `dst` and `src` and the length `bytes` (a host
/// end may not change, nor a length that touches one).
fn memcpy_params(
    node: sys::CUgraphNode,
    dst: CopyEnd,
    src: CopyEnd,
    bytes: u64,
) -> Result<sys::CUDA_MEMCPY3D, DriverError> {
    let mut p = read_memcpy(node)?.ok_or(DriverError::INVALID_VALUE)?;
    let (dst_now, src_now) = copy_ends(&p).ok_or(DriverError::INVALID_VALUE)?;
    let touches_host = [dst_now, src_now]
        .iter()
        .any(|e| matches!(e, CopyEnd::Host(_)));
    if touches_host && bytes != p.WidthInBytes as u64 {
        return Err(DriverError::INVALID_VALUE);
    }
    retarget(dst_now, dst, p.dstXInBytes, &mut p.dstDevice)?;
    retarget(src_now, src, p.srcXInBytes, &mut p.srcDevice)?;
    p.WidthInBytes = usize::try_from(bytes).map_err(|_| DriverError::INVALID_VALUE)?;
    Ok(p)
}

/// Points a device end at `wanted` (keeping the copy's x offset); a host end must stay.
fn retarget(
    current: CopyEnd,
    wanted: CopyEnd,
    x: usize,
    device: &mut sys::CUdeviceptr,
) -> Result<(), DriverError> {
    match (current, wanted) {
        (CopyEnd::Device(_), CopyEnd::Device(to)) => {
            *device =
                to.0.checked_sub(x as u64)
                    .ok_or(DriverError::INVALID_VALUE)?;
            Ok(())
        }
        (CopyEnd::Host(a), CopyEnd::Host(b)) if a == b => Ok(()),
        _ => Err(DriverError::INVALID_VALUE),
    }
}
