//! The real backend: CUDA's driver API through `cudarc::driver::{sys, result}`.
//!
//! libcuda is loaded at run time, by the driver's first act, not by [`CudaDriver::new`]:
//! first `is_culib_present()`, then (the process marked for [`fork`](crate::fork) safety)
//! `cuInit`; with no library, or when `cuInit` fails, the driver reports zero devices and
//! every other call returns that error. In a child forked after CUDA was initialised every
//! call returns [`DriverError::BAD_FORK`] and libcuda is not touched. Contexts are the
//! devices' primary contexts, retained lazily (as the CUDA runtime and PyTorch do) and bound
//! to the calling thread only when it differs.
//!
//! Every handle a caller passes is checked against a registry of the objects this driver
//! created, so a stale or made-up handle is `CUDA_ERROR_INVALID_HANDLE`, never a wild pointer
//! handed to libcuda.
use crate::malloc_log::MallocLog;
use crate::{CompileError, Driver, DriverError, ForeignStream, NvmlError};
use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc_sys;
use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, DeviceProperties, DevicePtr, EventFlags, EventHandle,
    FunctionHandle, GraphExecHandle, GraphHandle, GraphNode, HostPtr, IpcHandle, KernelArg,
    LaunchConfig, MemsetValue, ModuleHandle, PhysHandle, StreamFlags, StreamHandle, VaRange,
};
use parking_lot::RwLock;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

#[cfg(feature = "c-export")]
pub(crate) mod context_scope;
pub mod cublas;
pub mod cublaslt;
pub mod cufft;
mod devices;
mod events;
mod graphs;
mod host_register;
mod interop;
mod ipc;
mod kernels;
pub(crate) mod libraries;
mod lookups;
mod mem_pool;
mod memory;
pub mod nccl;
mod nodes;
mod peer;
mod ptx;
mod raw;
pub use raw::{RawGraph, RawLaunch};
mod streams;
mod vm;

/// Most kernel arguments one launch takes.
const MAX_KERNEL_ARGS: usize = 64;

fn check(r: sys::CUresult) -> Result<(), DriverError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError::from_code(r as i32))
    }
}

/// `Ok(true)` for success, `Ok(false)` for `CUDA_ERROR_NOT_READY`, else the error.
fn ready(r: sys::CUresult) -> Result<bool, DriverError> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError::from_code(e as i32)),
    }
}

#[derive(Default)]
struct Registry {
    streams: HashSet<(u16, u64)>,
    events: HashMap<u64, (u16, EventFlags)>,
    /// Loaded modules: their device and, for PTX images, each entry's parameter count.
    modules: HashMap<u64, (u16, HashMap<String, usize>)>,
    /// Looked-up functions: their device, module and, when the module was PTX, parameter
    /// count (read by [`nodes`] so that it never asks the driver about a parameter past the
    /// last).
    functions: HashMap<u64, Function>,
    graphs: HashMap<u64, u16>,
    /// What updates of instances read of a graph, once (`graph_exec_set_nodes`).
    graph_nodes: HashMap<u64, Arc<nodes::Cache>>,
    execs: HashMap<u64, u16>,
    hosts: BTreeMap<u64, u64>,
    /// Host memory from `host_malloc`: its length and whether it is registered now.
    mallocs: BTreeMap<u64, (u64, bool)>,
    phys: HashMap<u64, (u16, u64)>,
    /// The POSIX descriptors chunks were exported as (`vm_export`), closed with them.
    exports: HashMap<u64, std::os::fd::OwnedFd>,
    /// Other processes' memory opened here (`ipc_open_mem`), by (device, address).
    ipc_opened: HashSet<(u16, u64)>,
    /// Streams other libraries made, adopted (`stream_adopt`), with their adoption count.
    adopted: HashMap<(u16, u64), u32>,
}

/// A function looked up in a loaded module.
struct Function {
    device: u16,
    module: u64,
    params: Option<usize>,
}

impl Registry {
    /// Whether `raw` names a stream of device `dev` this driver may use: the legacy default
    /// stream, one it created, or one it adopted.
    fn knows_stream(&self, dev: u16, raw: u64) -> bool {
        raw == 0 || self.streams.contains(&(dev, raw)) || self.adopted.contains_key(&(dev, raw))
    }
}

struct DeviceSlot {
    device: sys::CUdevice,
    /// The primary context, as an address (raw pointers are not `Sync`).
    context: OnceLock<Result<usize, DriverError>>,
}

struct Loaded {
    devices: Vec<DeviceSlot>,
    registry: RwLock<Registry>,
    nvrtc_version: OnceLock<Result<(i32, i32), DriverError>>,
}

/// The real CUDA driver: libcuda loaded at run time, primary contexts bound lazily, every
/// handle checked against a registry of the objects this driver created.
pub struct CudaDriver {
    loaded: OnceLock<Result<Loaded, DriverError>>,
    mallocs: MallocLog,
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.loaded.get() {
            None => write!(f, "CudaDriver {{ uninitialised }}"),
            Some(Ok(l)) => write!(f, "CudaDriver {{ devices: {} }}", l.devices.len()),
            Some(Err(e)) => write!(f, "CudaDriver {{ unavailable: {e} }}"),
        }
    }
}

impl Default for CudaDriver {
    fn default() -> Self {
        CudaDriver::new()
    }
}

impl CudaDriver {
    /// A driver that loads and initialises libcuda at its first driver act. Never fails:
    /// without a driver or a device it reports zero devices, and
    /// [`CudaDriver::unavailable_reason`] says why.
    pub fn new() -> CudaDriver {
        CudaDriver {
            loaded: OnceLock::new(),
            mallocs: MallocLog::default(),
        }
    }

    fn load() -> Result<Loaded, DriverError> {
        // SAFETY: only tries to open the library by name; no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return Err(DriverError::LIBRARY_NOT_FOUND);
        }
        crate::fork::poison_fork();
        // SAFETY: cuInit(0) is the documented first call; the library is present.
        check(unsafe { sys::cuInit(0) })?;
        let mut count = 0;
        // SAFETY: writes one int through a valid pointer.
        check(unsafe { sys::cuDeviceGetCount(&mut count) })?;
        let devices = (0..count)
            .map(|i| {
                let mut device = 0;
                // SAFETY: `i` is below the device count; writes through a valid pointer.
                check(unsafe { sys::cuDeviceGet(&mut device, i) })?;
                Ok(DeviceSlot {
                    device,
                    context: OnceLock::new(),
                })
            })
            .collect::<Result<Vec<_>, DriverError>>()?;
        Ok(Loaded {
            devices,
            registry: RwLock::new(Registry::default()),
            nvrtc_version: OnceLock::new(),
        })
    }

    /// Whether this driver has made its first driver act (loading libcuda and `cuInit`),
    /// successfully or not. Asking NVML is not one.
    pub fn is_initialized(&self) -> bool {
        self.loaded.get().is_some()
    }

    /// Starts (`true`) or stops keeping the address of every successful `malloc`
    /// (`cuMemAlloc`), in order; either way what was kept is dropped. `ferrocuda replay
    /// --device cuda` keeps them so that a replay on the fake device can place its segments
    /// where this driver placed them (`FakeDriverBuilder::address_plan`).
    pub fn log_mallocs(&self, on: bool) {
        self.mallocs.set(on);
    }

    /// The addresses kept since [`log_mallocs`](Self::log_mallocs) or the last call, in
    /// `malloc` order, each with its device.
    pub fn take_malloc_log(&self) -> Vec<(DeviceIndex, DevicePtr)> {
        self.mallocs.take()
    }

    /// Why no device can be used, if none can (initialising the driver to find out).
    pub fn unavailable_reason(&self) -> Option<DriverError> {
        match self.loaded() {
            Err(e) => Some(e),
            Ok(l) if l.devices.is_empty() => Some(DriverError::NO_DEVICE),
            Ok(_) => None,
        }
    }

    /// The loaded driver, loading it at the first call; in a bad fork, that error before
    /// anything else.
    fn loaded(&self) -> Result<&Loaded, DriverError> {
        if crate::fork::in_bad_fork() {
            return Err(DriverError::BAD_FORK);
        }
        self.loaded.get_or_init(Self::load).as_ref().map_err(|e| *e)
    }

    /// Makes `dev`'s primary context current on this thread.
    fn bind(&self, dev: DeviceIndex) -> Result<&Loaded, DriverError> {
        let l = self.loaded()?;
        let slot = l
            .devices
            .get(dev.as_usize())
            .ok_or(DriverError::INVALID_DEVICE)?;
        let ctx = *slot
            .context
            .get_or_init(|| {
                let mut ctx = std::ptr::null_mut();
                // SAFETY: `slot.device` came from cuDeviceGet; writes through a valid pointer.
                check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, slot.device) })?;
                Ok(ctx as usize)
            })
            .as_ref()
            .map_err(|e| *e)?;
        let mut current = std::ptr::null_mut();
        // SAFETY: writes through a valid pointer.
        check(unsafe { sys::cuCtxGetCurrent(&mut current) })?;
        if current as usize != ctx {
            #[cfg(feature = "c-export")]
            context_scope::note_switch(current);
            // SAFETY: `ctx` is a retained primary context, never released while we live.
            check(unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) })?;
        }
        Ok(l)
    }

    fn is_capturing(&self, stream: sys::CUstream) -> Result<bool, DriverError> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `stream` was validated by `self.stream`; writes through a valid pointer.
        check(unsafe { sys::cuStreamIsCapturing(stream, &mut status) })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    fn nvrtc_version(&self) -> Result<(i32, i32), DriverError> {
        *self.loaded()?.nvrtc_version.get_or_init(|| {
            // SAFETY: only tries to open the library by name.
            if !unsafe { nvrtc_sys::is_culib_present() } {
                return Err(DriverError::NVRTC_NOT_FOUND);
            }
            let (mut major, mut minor) = (0, 0);
            // SAFETY: the library is present; writes two ints through valid pointers.
            let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
            if r == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                Ok((major, minor))
            } else {
                Err(DriverError::NVRTC_NOT_FOUND)
            }
        })
    }

    fn arch(&self, dev: DeviceIndex) -> Result<String, DriverError> {
        let p = self.device_properties(dev)?;
        Ok(format!("compute_{}{}", p.major, p.minor))
    }

    fn attribute(
        &self,
        dev: DeviceIndex,
        attr: sys::CUdevice_attribute,
    ) -> Result<i32, DriverError> {
        let l = self.loaded()?;
        let slot = l
            .devices
            .get(dev.as_usize())
            .ok_or(DriverError::INVALID_DEVICE)?;
        let mut v = 0;
        // SAFETY: valid device from cuDeviceGet; writes through a valid pointer.
        check(unsafe { sys::cuDeviceGetAttribute(&mut v, attr, slot.device) })?;
        Ok(v)
    }

    fn alloc_prop(&self, dev: DeviceIndex) -> Result<sys::CUmemAllocationProp, DriverError> {
        let l = self.loaded()?;
        let slot = l
            .devices
            .get(dev.as_usize())
            .ok_or(DriverError::INVALID_DEVICE)?;
        // SAFETY: a plain C struct for which all-zero bytes are valid (null pointer, zero enums
        // are valid values of these C enums as bindgen defines them).
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = slot.device;
        // Chunks can be shared with other processes as file descriptors, as PyTorch's
        // expandable segments request (`ExpandableSegment::map`).
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        Ok(prop)
    }
}

fn capture_mode(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    match mode {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

impl Driver for CudaDriver {
    fn backend(&self) -> &'static str {
        "cuda"
    }

    fn into_cuda(self: Arc<Self>) -> Option<Arc<CudaDriver>> {
        Some(self)
    }

    fn device_count(&self) -> Result<usize, DriverError> {
        Ok(self.loaded()?.devices.len())
    }

    fn nvml_device_count(&self) -> Result<usize, NvmlError> {
        crate::nvml::device_count()
    }

    fn gpu_processes(&self, dev: DeviceIndex) -> Vec<crate::nvml::GpuProcess> {
        devices::gpu_processes(self, dev)
    }

    fn device_properties(&self, dev: DeviceIndex) -> Result<DeviceProperties, DriverError> {
        devices::device_properties(self, dev)
    }

    fn mem_get_info(&self, dev: DeviceIndex) -> Result<(u64, u64), DriverError> {
        devices::mem_get_info(self, dev)
    }

    fn device_synchronize(&self, dev: DeviceIndex) -> Result<(), DriverError> {
        devices::device_synchronize(self, dev)
    }

    fn stream_priority_range(&self, dev: DeviceIndex) -> Result<(i32, i32), DriverError> {
        devices::stream_priority_range(self, dev)
    }

    fn malloc(&self, dev: DeviceIndex, bytes: u64) -> Result<DevicePtr, DriverError> {
        memory::malloc(self, dev, bytes)
    }

    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), DriverError> {
        memory::free(self, dev, ptr)
    }

    fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DriverError> {
        memory::host_alloc(self, bytes)
    }

    fn host_free(&self, ptr: HostPtr) -> Result<(), DriverError> {
        memory::host_free(self, ptr)
    }

    fn host_read(&self, src: HostPtr, offset: u64, dst: &mut [u8]) -> Result<(), DriverError> {
        memory::host_read(self, src, offset, dst)
    }

    fn host_write(&self, dst: HostPtr, offset: u64, src: &[u8]) -> Result<(), DriverError> {
        memory::host_write(self, dst, offset, src)
    }

    fn memset_async(
        &self,
        dst: DevicePtr,
        value: MemsetValue,
        count: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        memory::memset_async(self, dst, value, count, stream)
    }

    fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        memory::memcpy_htod_async(self, dst, src, stream)
    }

    fn memcpy_dtoh(
        &self,
        dst: &mut [u8],
        src: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        memory::memcpy_dtoh(self, dst, src, stream)
    }

    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        memory::memcpy_dtod_async(self, dst, src, bytes, stream)
    }

    fn memcpy_peer_async(
        &self,
        dst: (DeviceIndex, DevicePtr),
        src: (DeviceIndex, DevicePtr),
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        memory::memcpy_peer_async(self, dst, src, bytes, stream)
    }

    fn memcpy_htod_pinned_async(
        &self,
        dst: DevicePtr,
        src: (HostPtr, u64),
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        memory::memcpy_htod_pinned_async(self, dst, src, bytes, stream)
    }

    fn memcpy_dtoh_pinned_async(
        &self,
        dst: (HostPtr, u64),
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        memory::memcpy_dtoh_pinned_async(self, dst, src, bytes, stream)
    }

    fn stream_create(
        &self,
        dev: DeviceIndex,
        flags: StreamFlags,
    ) -> Result<StreamHandle, DriverError> {
        streams::stream_create(self, dev, flags)
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<(), DriverError> {
        streams::stream_destroy(self, stream)
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool, DriverError> {
        streams::stream_query(self, stream)
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<(), DriverError> {
        streams::stream_synchronize(self, stream)
    }

    fn stream_wait_event(
        &self,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        streams::stream_wait_event(self, stream, event)
    }

    fn event_create(
        &self,
        dev: DeviceIndex,
        flags: EventFlags,
    ) -> Result<EventHandle, DriverError> {
        events::event_create(self, dev, flags)
    }

    fn event_destroy(&self, event: EventHandle) -> Result<(), DriverError> {
        events::event_destroy(self, event)
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        events::event_record(self, event, stream)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        events::event_query(self, event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        events::event_synchronize(self, event)
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32, DriverError> {
        events::event_elapsed_ms(self, start, end)
    }

    fn compile_target(&self, dev: DeviceIndex) -> Result<Option<String>, DriverError> {
        kernels::compile_target(self, dev)
    }

    fn compile_source(
        &self,
        dev: DeviceIndex,
        source: &str,
        name: &str,
    ) -> Result<Vec<u8>, CompileError> {
        kernels::compile_source(self, dev, source, name)
    }

    fn module_load(&self, dev: DeviceIndex, image: &[u8]) -> Result<ModuleHandle, DriverError> {
        kernels::module_load(self, dev, image)
    }

    fn module_unload(&self, module: ModuleHandle) -> Result<(), DriverError> {
        kernels::module_unload(self, module)
    }

    fn module_function(
        &self,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        kernels::module_function(self, module, name)
    }

    fn launch(
        &self,
        function: FunctionHandle,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        kernels::launch(self, function, config, args, stream)
    }

    fn stream_begin_capture(
        &self,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), DriverError> {
        graphs::stream_begin_capture(self, stream, mode)
    }

    fn stream_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle, DriverError> {
        graphs::stream_end_capture(self, stream)
    }

    fn stream_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
        graphs::stream_capture_status(self, stream)
    }

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        graphs::exchange_capture_mode(self, mode)
    }

    fn graph_node_count(&self, graph: GraphHandle) -> Result<usize, DriverError> {
        graphs::graph_node_count(self, graph)
    }

    fn graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle, DriverError> {
        graphs::graph_instantiate(self, graph)
    }

    fn graph_upload(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<(), DriverError> {
        graphs::graph_upload(self, exec, stream)
    }

    fn graph_launch(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<(), DriverError> {
        graphs::graph_launch(self, exec, stream)
    }

    fn graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<(), DriverError> {
        graphs::graph_exec_destroy(self, exec)
    }

    fn graph_destroy(&self, graph: GraphHandle) -> Result<(), DriverError> {
        graphs::graph_destroy(self, graph)
    }

    fn graph_debug_dot(&self, graph: GraphHandle, path: &Path) -> Result<(), DriverError> {
        graphs::graph_debug_dot(self, graph, path)
    }

    fn graph_nodes(&self, graph: GraphHandle) -> Result<Vec<GraphNode>, DriverError> {
        graphs::graph_nodes(self, graph)
    }

    fn graph_set_node(
        &self,
        graph: GraphHandle,
        index: usize,
        node: &GraphNode,
    ) -> Result<(), DriverError> {
        graphs::graph_set_node(self, graph, index, node)
    }

    fn graph_exec_set_nodes(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
        changes: &[(usize, GraphNode)],
    ) -> Result<bool, DriverError> {
        graphs::graph_exec_set_nodes(self, exec, graph, changes)
    }

    fn graph_exec_update(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, DriverError> {
        graphs::graph_exec_update(self, exec, graph)
    }

    fn vm_granularity(&self, dev: DeviceIndex) -> Result<u64, DriverError> {
        vm::vm_granularity(self, dev)
    }

    fn vm_reserve(&self, dev: DeviceIndex, bytes: u64) -> Result<VaRange, DriverError> {
        vm::vm_reserve(self, dev, bytes)
    }

    fn vm_release(&self, range: VaRange) -> Result<(), DriverError> {
        vm::vm_release(self, range)
    }

    fn vm_create(&self, dev: DeviceIndex, bytes: u64) -> Result<PhysHandle, DriverError> {
        vm::vm_create(self, dev, bytes)
    }

    fn vm_destroy(&self, handle: PhysHandle) -> Result<(), DriverError> {
        vm::vm_destroy(self, handle)
    }

    fn vm_map(&self, at: DevicePtr, handle: PhysHandle) -> Result<(), DriverError> {
        vm::vm_map(self, at, handle)
    }

    fn vm_set_access(
        &self,
        dev: DeviceIndex,
        at: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        vm::vm_set_access(self, dev, at, bytes)
    }

    fn vm_unmap(&self, dev: DeviceIndex, at: DevicePtr, bytes: u64) -> Result<(), DriverError> {
        vm::vm_unmap(self, dev, at, bytes)
    }

    fn stream_adopt(&self, stream: &ForeignStream) -> Result<StreamHandle, DriverError> {
        interop::adopt(self, stream)
    }

    fn stream_forget(&self, stream: StreamHandle) -> Result<(), DriverError> {
        interop::forget(self, stream)
    }

    fn host_malloc(&self, bytes: u64) -> Result<HostPtr, DriverError> {
        host_register::malloc(self, bytes)
    }

    fn host_prefault(
        &self,
        ptr: HostPtr,
        offset: u64,
        bytes: u64,
        page: u64,
    ) -> Result<(), DriverError> {
        host_register::prefault(self, ptr, offset, bytes, page)
    }

    fn host_register(&self, ptr: HostPtr) -> Result<(), DriverError> {
        host_register::register(self, ptr)
    }

    fn host_unregister(&self, ptr: HostPtr) -> Result<(), DriverError> {
        host_register::unregister(self, ptr)
    }

    fn host_mfree(&self, ptr: HostPtr) -> Result<(), DriverError> {
        host_register::mfree(self, ptr)
    }

    fn mem_alloc_async(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError> {
        mem_pool::alloc_async(self, dev, bytes, stream)
    }

    fn mem_free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), DriverError> {
        mem_pool::free_async(self, ptr, stream)
    }

    fn mem_pool_set_release_threshold(
        &self,
        dev: DeviceIndex,
        bytes: u64,
    ) -> Result<(), DriverError> {
        mem_pool::set_release_threshold(self, dev, bytes)
    }

    fn mem_pool_usage(&self, dev: DeviceIndex) -> Result<crate::MemPoolUsage, DriverError> {
        mem_pool::usage(self, dev)
    }

    fn mem_pool_reset_peaks(&self, dev: DeviceIndex) -> Result<(), DriverError> {
        mem_pool::reset_peaks(self, dev)
    }

    fn mem_pool_trim_to(&self, dev: DeviceIndex, keep: u64) -> Result<(), DriverError> {
        mem_pool::trim_to(self, dev, keep)
    }

    fn device_can_access_peer(
        &self,
        dev: DeviceIndex,
        peer: DeviceIndex,
    ) -> Result<bool, DriverError> {
        self.can_access_peer(dev, peer)
    }

    fn enable_peer_access(&self, dev: DeviceIndex, peer: DeviceIndex) -> Result<(), DriverError> {
        self.enable_peer(dev, peer)
    }

    fn ipc_mem_handle(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<IpcHandle, DriverError> {
        ipc::ipc_mem_handle(self, dev, ptr)
    }

    fn ipc_open_mem(&self, dev: DeviceIndex, handle: &IpcHandle) -> Result<DevicePtr, DriverError> {
        ipc::ipc_open_mem(self, dev, handle)
    }

    fn ipc_close_mem(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), DriverError> {
        ipc::ipc_close_mem(self, dev, ptr)
    }

    fn ipc_event_handle(&self, event: EventHandle) -> Result<IpcHandle, DriverError> {
        ipc::ipc_event_handle(self, event)
    }

    fn ipc_open_event(
        &self,
        dev: DeviceIndex,
        handle: &IpcHandle,
    ) -> Result<EventHandle, DriverError> {
        ipc::ipc_open_event(self, dev, handle)
    }

    fn vm_export(&self, handle: PhysHandle) -> Result<i32, DriverError> {
        ipc::vm_export(self, handle)
    }

    fn vm_import(
        &self,
        dev: DeviceIndex,
        pid: u32,
        fd: i32,
        bytes: u64,
    ) -> Result<PhysHandle, DriverError> {
        ipc::vm_import(self, dev, pid, fd, bytes)
    }
}
