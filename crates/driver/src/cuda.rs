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
    FunctionHandle, GraphExecHandle, GraphHandle, GraphNode, HostPtr, KernelArg, LaunchConfig,
    MemsetValue, ModuleHandle, PhysHandle, StreamFlags, StreamHandle, VaRange,
};
use parking_lot::RwLock;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::collections::BTreeMap;
use std::ffi::{CString, c_void};
use std::path::Path;
use std::sync::{Arc, OnceLock};

#[cfg(feature = "c-export")]
pub(crate) mod context_scope;
mod host_register;
mod interop;
mod mem_pool;
pub mod nccl;
mod nodes;
mod peer;

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
    modules: HashMap<u64, u16>,
    functions: HashMap<u64, (u16, u64)>,
    graphs: HashMap<u64, u16>,
    /// What updates of instances read of a graph, once (`graph_exec_set_nodes`).
    graph_nodes: HashMap<u64, Arc<nodes::Cache>>,
    execs: HashMap<u64, u16>,
    hosts: BTreeMap<u64, u64>,
    /// Host memory from `host_malloc`: its length and whether it is registered now.
    mallocs: BTreeMap<u64, (u64, bool)>,
    phys: HashMap<u64, (u16, u64)>,
    /// Streams other libraries made, adopted (`stream_adopt`), with their adoption count.
    adopted: HashMap<(u16, u64), u32>,
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

    fn stream(&self, s: StreamHandle) -> Result<sys::CUstream, DriverError> {
        let l = self.bind(s.device)?;
        if !l.registry.read().knows_stream(s.device.0, s.raw) {
            return Err(DriverError::INVALID_HANDLE);
        }
        Ok(s.raw as sys::CUstream)
    }

    fn event(&self, e: EventHandle) -> Result<(sys::CUevent, EventFlags), DriverError> {
        let l = self.bind(e.device)?;
        let flags = match l.registry.read().events.get(&e.raw) {
            Some(&(d, flags)) if d == e.device.0 => flags,
            _ => return Err(DriverError::INVALID_HANDLE),
        };
        Ok((e.raw as sys::CUevent, flags))
    }

    fn graph(&self, g: GraphHandle) -> Result<sys::CUgraph, DriverError> {
        let l = self.bind(g.device)?;
        match l.registry.read().graphs.get(&g.raw) {
            Some(&d) if d == g.device.0 => Ok(g.raw as sys::CUgraph),
            _ => Err(DriverError::INVALID_HANDLE),
        }
    }

    fn exec(&self, e: GraphExecHandle) -> Result<sys::CUgraphExec, DriverError> {
        let l = self.bind(e.device)?;
        match l.registry.read().execs.get(&e.raw) {
            Some(&d) if d == e.device.0 => Ok(e.raw as sys::CUgraphExec),
            _ => Err(DriverError::INVALID_HANDLE),
        }
    }

    fn host(&self, h: HostPtr, offset: u64, bytes: u64) -> Result<*mut u8, DriverError> {
        let l = self.loaded()?;
        let registry = l.registry.read();
        let len = registry
            .hosts
            .get(&h.raw)
            .or_else(|| registry.mallocs.get(&h.raw).map(|(len, _)| len));
        let ok = len.is_some_and(|&len| offset.checked_add(bytes).is_some_and(|end| end <= len));
        if !ok {
            return Err(DriverError::INVALID_VALUE);
        }
        Ok((h.raw + offset) as *mut u8)
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
        Ok(prop)
    }
}

/// The raw baseline for launch-overhead benchmarks: one kernel launch prepared once and
/// issued through `cudarc::driver::result::launch_kernel` with no validation and no
/// allocation, as a hand-written cudarc program would. It owns its module and stream, so
/// nothing it launches on can be destroyed under it.
pub struct RawLaunch {
    driver: Arc<CudaDriver>,
    module: ModuleHandle,
    stream: StreamHandle,
    function: sys::CUfunction,
    config: LaunchConfig,
    /// The argument values; `params` points into this boxed slice (stable addresses).
    _args: Box<[u64]>,
    params: Box<[*mut c_void]>,
}

impl std::fmt::Debug for RawLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawLaunch")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RawLaunch {
    /// Loads `image` on `dev`, looks up `kernel` (whose parameters must all be 8 bytes
    /// wide, e.g. pointers) and prepares its launch with `args` on a new stream.
    pub fn new(
        driver: Arc<CudaDriver>,
        dev: DeviceIndex,
        image: &[u8],
        kernel: &str,
        config: LaunchConfig,
        args: &[u64],
    ) -> Result<RawLaunch, DriverError> {
        let module = driver.module_load(dev, image)?;
        let function = driver.module_function(module, kernel)?;
        let stream = driver.stream_create(
            dev,
            StreamFlags {
                non_blocking: true,
                priority: 0,
            },
        )?;
        let mut args: Box<[u64]> = args.into();
        let params = args
            .iter_mut()
            .map(|a| a as *mut u64 as *mut c_void)
            .collect();
        Ok(RawLaunch {
            driver,
            module,
            stream,
            function: function.raw as sys::CUfunction,
            config,
            _args: args,
            params,
        })
    }

    /// The stream the launches go to.
    pub fn stream(&self) -> StreamHandle {
        self.stream
    }

    /// Issues the launch.
    pub fn launch(&mut self) -> Result<(), DriverError> {
        let c = &self.config;
        // SAFETY: the function and stream belong to this object and live until it drops;
        // `params` points at `_args`, also owned here. The caller's device pointers can at
        // worst fault on the device, never on the host.
        unsafe {
            cudarc::driver::result::launch_kernel(
                self.function,
                c.grid,
                c.block,
                c.shared_mem_bytes,
                self.stream.raw as sys::CUstream,
                &mut self.params,
            )
        }
        .map_err(|e| DriverError::from_code(e.0 as i32))
    }
}

impl RawLaunch {
    /// `launches` copies of this launch captured into a graph and instantiated, with raw
    /// driver calls: the baseline that graph replays are measured against.
    pub fn capture_chain(&mut self, launches: usize) -> Result<RawGraph, DriverError> {
        let stream = self.stream.raw as sys::CUstream;
        let mode = capture_mode(CaptureMode::ThreadLocal);
        // SAFETY: the stream belongs to this object and is live.
        check(unsafe { sys::cuStreamBeginCapture_v2(stream, mode) })?;
        let launched = (0..launches).try_for_each(|_| self.launch());
        let mut graph = std::ptr::null_mut();
        // SAFETY: the stream is capturing; writes through a valid pointer.
        let ended = check(unsafe { sys::cuStreamEndCapture(stream, &mut graph) });
        let instantiated = launched.and(ended).and_then(|()| {
            let mut exec = std::ptr::null_mut();
            // SAFETY: the capture succeeded, so `graph` is a live graph.
            check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }).map(|()| exec)
        });
        if !graph.is_null() {
            // SAFETY: the graph is ours; the instantiated executable does not need it.
            unsafe { sys::cuGraphDestroy(graph) };
        }
        Ok(RawGraph {
            exec: instantiated?,
        })
    }

    /// Launches `graph` on this object's stream with bare `cuGraphLaunch`.
    pub fn launch_graph(&self, graph: &RawGraph) -> Result<(), DriverError> {
        // SAFETY: the stream belongs to this object and is live; the executable is owned by
        // `graph`, which is borrowed for the call.
        check(unsafe { sys::cuGraphLaunch(graph.exec, self.stream.raw as sys::CUstream) })
    }
}

/// An instantiated graph from [`RawLaunch::capture_chain`], launched with
/// [`RawLaunch::launch_graph`] (benchmark baseline).
pub struct RawGraph {
    exec: sys::CUgraphExec,
}

impl std::fmt::Debug for RawGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawGraph").finish_non_exhaustive()
    }
}

impl Drop for RawGraph {
    fn drop(&mut self) {
        // In a child forked after CUDA was initialised, libcuda must not be touched (the
        // driver's own calls refuse there; this one bypasses them).
        if crate::fork::in_bad_fork() {
            return;
        }
        // SAFETY: owned and destroyed once; launches in flight finish first.
        unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}

impl Drop for RawLaunch {
    fn drop(&mut self) {
        let _ = self.driver.stream_synchronize(self.stream);
        let _ = self.driver.stream_destroy(self.stream);
        let _ = self.driver.module_unload(self.module);
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

    fn device_count(&self) -> Result<usize, DriverError> {
        Ok(self.loaded()?.devices.len())
    }

    fn nvml_device_count(&self) -> Result<usize, NvmlError> {
        crate::nvml::device_count()
    }

    fn gpu_processes(&self, dev: DeviceIndex) -> Vec<crate::nvml::GpuProcess> {
        use sys::CUdevice_attribute as A;
        let pci = (|| {
            Ok::<_, DriverError>(format!(
                "{:08X}:{:02X}:{:02X}.0",
                self.attribute(dev, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
                self.attribute(dev, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
                self.attribute(dev, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
            ))
        })();
        pci.ok()
            .and_then(|id| crate::nvml::compute_processes(&id).ok())
            .unwrap_or_default()
    }

    fn device_properties(&self, dev: DeviceIndex) -> Result<DeviceProperties, DriverError> {
        use sys::CUdevice_attribute as A;
        let l = self.loaded()?;
        let slot = l
            .devices
            .get(dev.as_usize())
            .ok_or(DriverError::INVALID_DEVICE)?;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 bytes and we pass that length.
        check(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, slot.device) })?;
        // SAFETY: the driver wrote a NUL-terminated string into the buffer.
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut total = 0usize;
        // SAFETY: writes through a valid pointer.
        check(unsafe { sys::cuDeviceTotalMem_v2(&mut total, slot.device) })?;
        let attr = |a| self.attribute(dev, a).map(|v| v.max(0) as u32);
        Ok(DeviceProperties {
            name,
            major: attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            minor: attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            total_memory: total as u64,
            multi_processor_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            max_threads_per_multi_processor: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
            )?,
            warp_size: attr(A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
            l2_cache_size: u64::from(attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?),
        })
    }

    fn mem_get_info(&self, dev: DeviceIndex) -> Result<(u64, u64), DriverError> {
        self.bind(dev)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: a context is current; writes through valid pointers.
        check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    fn device_synchronize(&self, dev: DeviceIndex) -> Result<(), DriverError> {
        self.bind(dev)?;
        // SAFETY: a context is current.
        check(unsafe { sys::cuCtxSynchronize() })
    }

    fn stream_priority_range(&self, dev: DeviceIndex) -> Result<(i32, i32), DriverError> {
        self.bind(dev)?;
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: a context is current; writes through valid pointers.
        check(unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) })?;
        Ok((least, greatest))
    }

    fn malloc(&self, dev: DeviceIndex, bytes: u64) -> Result<DevicePtr, DriverError> {
        self.bind(dev)?;
        let mut ptr = 0;
        // SAFETY: a context is current; writes through a valid pointer.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes as usize) })?;
        self.mallocs.note(dev, DevicePtr(ptr));
        Ok(DevicePtr(ptr))
    }

    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), DriverError> {
        self.bind(dev)?;
        // SAFETY: the driver checks that `ptr` is an allocation base and fails otherwise.
        check(unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DriverError> {
        let l = self.bind(DeviceIndex(0))?;
        let mut p = std::ptr::null_mut();
        // SAFETY: a context is current; writes through a valid pointer.
        check(unsafe { sys::cuMemHostAlloc(&mut p, bytes.max(1) as usize, 0) })?;
        l.registry.write().hosts.insert(p as u64, bytes);
        Ok(HostPtr {
            raw: p as u64,
            bytes,
        })
    }

    fn host_free(&self, ptr: HostPtr) -> Result<(), DriverError> {
        let l = self.bind(DeviceIndex(0))?;
        l.registry
            .write()
            .hosts
            .remove(&ptr.raw)
            .ok_or(DriverError::INVALID_VALUE)?;
        // SAFETY: `ptr` came from cuMemHostAlloc (registry) and is freed once.
        check(unsafe { sys::cuMemFreeHost(ptr.raw as *mut c_void) })
    }

    fn host_read(&self, src: HostPtr, offset: u64, dst: &mut [u8]) -> Result<(), DriverError> {
        let p = self.host(src, offset, dst.len() as u64)?;
        // SAFETY: the range lies inside a live pinned allocation (checked by `host`) and
        // does not overlap `dst`, a Rust borrow.
        unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn host_write(&self, dst: HostPtr, offset: u64, src: &[u8]) -> Result<(), DriverError> {
        let p = self.host(dst, offset, src.len() as u64)?;
        // SAFETY: as in `host_read`, with the roles swapped.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
        Ok(())
    }

    fn memset_async(
        &self,
        dst: DevicePtr,
        value: MemsetValue,
        count: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        let n = count as usize;
        // SAFETY: `s` is a live stream; the driver validates the device range.
        check(unsafe {
            match value {
                MemsetValue::U8(v) => sys::cuMemsetD8Async(dst.0, v, n, s),
                MemsetValue::U16(v) => sys::cuMemsetD16Async(dst.0, v, n, s),
                MemsetValue::U32(v) => sys::cuMemsetD32Async(dst.0, v, n, s),
            }
        })
    }

    fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        // A captured copy would read `src` at every replay, long after this borrow ends.
        if self.is_capturing(s)? {
            return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
        }
        let mut memory_type = 0u32;
        // SAFETY: asks whether `src` is driver-known (pinned) memory; writes one u32.
        let pinned = unsafe {
            sys::cuPointerGetAttribute(
                (&mut memory_type as *mut u32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                src.as_ptr() as u64,
            )
        } == sys::CUresult::CUDA_SUCCESS;
        // SAFETY: `src` is valid for reads of its length for this call; from pageable memory
        // the driver has staged it before returning.
        check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr().cast(), src.len(), s) })?;
        if pinned {
            // From pinned memory the copy is truly asynchronous: wait before the borrow ends.
            // SAFETY: `s` is a live stream.
            check(unsafe { sys::cuStreamSynchronize(s) })?;
        }
        Ok(())
    }

    fn memcpy_dtoh(
        &self,
        dst: &mut [u8],
        src: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        if self.is_capturing(s)? {
            // Refuse as a synchronize would (this also breaks the capture, as CUDA does).
            // SAFETY: `s` is a live stream.
            check(unsafe { sys::cuStreamSynchronize(s) })?;
            return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
        }
        // SAFETY: `dst` is valid for writes of its length; we wait for the copy before the
        // borrow ends.
        check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src.0, dst.len(), s) })?;
        // SAFETY: `s` is a live stream.
        check(unsafe { sys::cuStreamSynchronize(s) })
    }

    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        // SAFETY: device addresses are validated by the driver.
        check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes as usize, s) })
    }

    fn memcpy_peer_async(
        &self,
        dst: (DeviceIndex, DevicePtr),
        src: (DeviceIndex, DevicePtr),
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        let (dst_ctx, src_ctx) = (self.primary_context(dst.0)?, self.primary_context(src.0)?);
        self.bind(stream.device)?;
        // SAFETY: both contexts are retained primary contexts; addresses validated by the driver.
        check(unsafe {
            sys::cuMemcpyPeerAsync(dst.1.0, dst_ctx, src.1.0, src_ctx, bytes as usize, s)
        })
    }

    fn memcpy_htod_pinned_async(
        &self,
        dst: DevicePtr,
        src: (HostPtr, u64),
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        let p = self.host(src.0, src.1, bytes)?;
        // SAFETY: the host range is inside a live pinned allocation owned by the caller.
        check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst.0, p.cast(), bytes as usize, s) })
    }

    fn memcpy_dtoh_pinned_async(
        &self,
        dst: (HostPtr, u64),
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        let p = self.host(dst.0, dst.1, bytes)?;
        // SAFETY: the host range is inside a live pinned allocation owned by the caller.
        check(unsafe { sys::cuMemcpyDtoHAsync_v2(p.cast(), src.0, bytes as usize, s) })
    }

    fn stream_create(
        &self,
        dev: DeviceIndex,
        flags: StreamFlags,
    ) -> Result<StreamHandle, DriverError> {
        let l = self.bind(dev)?;
        let mut s = std::ptr::null_mut();
        let f = if flags.non_blocking {
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32
        } else {
            0
        };
        // SAFETY: a context is current; writes through a valid pointer.
        check(unsafe { sys::cuStreamCreateWithPriority(&mut s, f, flags.priority) })?;
        l.registry.write().streams.insert((dev.0, s as u64));
        Ok(StreamHandle {
            device: dev,
            raw: s as u64,
        })
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<(), DriverError> {
        let l = self.bind(stream.device)?;
        if !l
            .registry
            .write()
            .streams
            .remove(&(stream.device.0, stream.raw))
        {
            return Err(DriverError::INVALID_HANDLE);
        }
        // SAFETY: the stream was live (registry) and is destroyed once.
        check(unsafe { sys::cuStreamDestroy_v2(stream.raw as sys::CUstream) })
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool, DriverError> {
        let s = self.stream(stream)?;
        // SAFETY: `s` is a live stream.
        ready(unsafe { sys::cuStreamQuery(s) })
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        // SAFETY: `s` is a live stream.
        check(unsafe { sys::cuStreamSynchronize(s) })
    }

    fn stream_wait_event(
        &self,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        let (e, _) = self.event(event)?;
        let s = self.stream(stream)?;
        // SAFETY: both handles are live.
        check(unsafe { sys::cuStreamWaitEvent(s, e, 0) })
    }

    fn event_create(
        &self,
        dev: DeviceIndex,
        flags: EventFlags,
    ) -> Result<EventHandle, DriverError> {
        use sys::CUevent_flags as F;
        let l = self.bind(dev)?;
        let mut bits = 0;
        if !flags.timing {
            bits |= F::CU_EVENT_DISABLE_TIMING as u32;
        }
        if flags.blocking {
            bits |= F::CU_EVENT_BLOCKING_SYNC as u32;
        }
        if flags.interprocess {
            bits |= F::CU_EVENT_INTERPROCESS as u32;
        }
        let mut e = std::ptr::null_mut();
        // SAFETY: a context is current; writes through a valid pointer.
        check(unsafe { sys::cuEventCreate(&mut e, bits) })?;
        l.registry.write().events.insert(e as u64, (dev.0, flags));
        Ok(EventHandle {
            device: dev,
            raw: e as u64,
        })
    }

    fn event_destroy(&self, event: EventHandle) -> Result<(), DriverError> {
        let l = self.bind(event.device)?;
        l.registry
            .write()
            .events
            .remove(&event.raw)
            .ok_or(DriverError::INVALID_HANDLE)?;
        // SAFETY: the event was live (registry) and is destroyed once.
        check(unsafe { sys::cuEventDestroy_v2(event.raw as sys::CUevent) })
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        let (e, _) = self.event(event)?;
        let s = self.stream(stream)?;
        // SAFETY: both handles are live.
        check(unsafe { sys::cuEventRecord(e, s) })
    }

    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        let (e, _) = self.event(event)?;
        // SAFETY: `e` is live.
        ready(unsafe { sys::cuEventQuery(e) })
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        let (e, _) = self.event(event)?;
        // SAFETY: `e` is live.
        check(unsafe { sys::cuEventSynchronize(e) })
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32, DriverError> {
        let (a, _) = self.event(start)?;
        let (b, _) = self.event(end)?;
        // SAFETY: both events are live.
        unsafe { cudarc::driver::result::event::elapsed(a, b) }
            .map_err(|e| DriverError::from_code(e.0 as i32))
    }

    fn compile_target(&self, dev: DeviceIndex) -> Result<Option<String>, DriverError> {
        let (major, minor) = self.nvrtc_version()?;
        Ok(Some(format!("nvrtc{major}.{minor}-{}", self.arch(dev)?)))
    }

    fn compile_source(
        &self,
        dev: DeviceIndex,
        source: &str,
        name: &str,
    ) -> Result<Vec<u8>, CompileError> {
        use cudarc::nvrtc::result as nvrtc;
        self.nvrtc_version()?;
        let arch = format!("--gpu-architecture={}", self.arch(dev)?);
        let nul = |s: &str| {
            CString::new(s).map_err(|_| CompileError::Rejected {
                log: "source or name contains a NUL byte".into(),
            })
        };
        let (src, cname) = (nul(source)?, nul(name)?);
        let nvrtc_err = |_| CompileError::Driver(DriverError::NVRTC_NOT_FOUND);
        let prog = nvrtc::create_program(&src, Some(&cname)).map_err(nvrtc_err)?;
        // SAFETY: `prog` is a live program; options are valid strings.
        let compiled = unsafe { nvrtc::compile_program(prog, &[arch, "--std=c++17".into()]) };
        let result = match compiled {
            // SAFETY: `prog` compiled; the PTX is copied out before the program is destroyed.
            Ok(()) => unsafe { nvrtc::get_ptx(prog) }
                .map(|ptx| ptx.into_iter().map(|c| c as u8).collect())
                .map_err(nvrtc_err),
            Err(_) => {
                // SAFETY: `prog` is live; the log is copied out.
                let log = unsafe { nvrtc::get_program_log(prog) }.unwrap_or_default();
                let bytes: Vec<u8> = log
                    .into_iter()
                    .map(|c| c as u8)
                    .take_while(|&c| c != 0)
                    .collect();
                Err(CompileError::Rejected {
                    log: String::from_utf8_lossy(&bytes).into_owned(),
                })
            }
        };
        // SAFETY: destroyed once, after its outputs were copied.
        let _ = unsafe { nvrtc::destroy_program(prog) };
        result
    }

    fn module_load(&self, dev: DeviceIndex, image: &[u8]) -> Result<ModuleHandle, DriverError> {
        let l = self.bind(dev)?;
        let mut owned;
        let image = if image.last() == Some(&0) {
            image
        } else {
            owned = image.to_vec();
            owned.push(0);
            &owned
        };
        let mut m = std::ptr::null_mut();
        // SAFETY: `image` is a NUL-terminated buffer that outlives the call; the driver
        // validates its contents.
        check(unsafe { sys::cuModuleLoadData(&mut m, image.as_ptr().cast()) })?;
        l.registry.write().modules.insert(m as u64, dev.0);
        Ok(ModuleHandle {
            device: dev,
            raw: m as u64,
        })
    }

    fn module_unload(&self, module: ModuleHandle) -> Result<(), DriverError> {
        let l = self.bind(module.device)?;
        let mut reg = l.registry.write();
        if reg.modules.remove(&module.raw).is_none() {
            return Err(DriverError::INVALID_HANDLE);
        }
        reg.functions.retain(|_, (_, m)| *m != module.raw);
        drop(reg);
        // SAFETY: the module was live (registry) and is unloaded once.
        check(unsafe { sys::cuModuleUnload(module.raw as sys::CUmodule) })
    }

    fn module_function(
        &self,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        let l = self.bind(module.device)?;
        if l.registry.read().modules.get(&module.raw) != Some(&module.device.0) {
            return Err(DriverError::INVALID_HANDLE);
        }
        let cname = CString::new(name).map_err(|_| DriverError::INVALID_VALUE)?;
        let mut f = std::ptr::null_mut();
        // SAFETY: the module is live; `cname` is NUL-terminated.
        check(unsafe {
            sys::cuModuleGetFunction(&mut f, module.raw as sys::CUmodule, cname.as_ptr())
        })?;
        l.registry
            .write()
            .functions
            .insert(f as u64, (module.device.0, module.raw));
        Ok(FunctionHandle {
            device: module.device,
            raw: f as u64,
        })
    }

    fn launch(
        &self,
        function: FunctionHandle,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let l = self.bind(stream.device)?;
        {
            let reg = l.registry.read();
            let f_ok = reg
                .functions
                .get(&function.raw)
                .is_some_and(|(d, _)| *d == function.device.0);
            let s_ok = reg.knows_stream(stream.device.0, stream.raw);
            if !f_ok || !s_ok || function.device != stream.device {
                return Err(DriverError::INVALID_HANDLE);
            }
        }
        if args.len() > MAX_KERNEL_ARGS {
            return Err(DriverError::INVALID_VALUE);
        }
        let param = |arg: &KernelArg<'_>| match arg {
            KernelArg::Value(bytes) => bytes.as_ptr() as *mut c_void,
            KernelArg::Ptr { ptr, .. } => ptr as *const DevicePtr as *mut c_void,
        };
        // Most kernels take a handful of arguments: fill only what is used.
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_KERNEL_ARGS];
        let used = &mut params[..args.len()];
        for (slot, arg) in used.iter_mut().zip(args) {
            *slot = param(arg);
        }
        let (g, b) = (config.grid, config.block);
        // SAFETY: handles are live (registry); each parameter points at its argument's bytes,
        // borrowed for this call, and cuLaunchKernel copies them before returning.
        check(unsafe {
            sys::cuLaunchKernel(
                function.raw as sys::CUfunction,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                config.shared_mem_bytes,
                stream.raw as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    fn stream_begin_capture(
        &self,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), DriverError> {
        let s = self.stream(stream)?;
        // SAFETY: `s` is live (or the legacy stream, which the driver refuses).
        check(unsafe { sys::cuStreamBeginCapture_v2(s, capture_mode(mode)) })
    }

    fn stream_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle, DriverError> {
        let s = self.stream(stream)?;
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
        let l = self.loaded()?;
        l.registry.write().graphs.insert(g as u64, stream.device.0);
        Ok(GraphHandle {
            device: stream.device,
            raw: g as u64,
        })
    }

    fn stream_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
        use sys::CUstreamCaptureStatus as S;
        let s = self.stream(stream)?;
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

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        use sys::CUstreamCaptureMode as M;
        self.loaded()?;
        let mut m = capture_mode(mode);
        // SAFETY: swaps the calling thread's mode through a valid pointer.
        check(unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) })?;
        Ok(match m {
            M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
            M::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
            _ => CaptureMode::Global,
        })
    }

    fn graph_node_count(&self, graph: GraphHandle) -> Result<usize, DriverError> {
        let g = self.graph(graph)?;
        let mut n = 0usize;
        // SAFETY: the graph is live; a null node array asks for the count only.
        check(unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) })?;
        Ok(n)
    }

    fn graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle, DriverError> {
        let g = self.graph(graph)?;
        let mut e = std::ptr::null_mut();
        let flags = u64::from(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0,
        );
        // SAFETY: the graph is live; writes through a valid pointer.
        check(unsafe { sys::cuGraphInstantiateWithFlags(&mut e, g, flags) })?;
        self.loaded()?
            .registry
            .write()
            .execs
            .insert(e as u64, graph.device.0);
        Ok(GraphExecHandle {
            device: graph.device,
            raw: e as u64,
        })
    }

    fn graph_upload(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<(), DriverError> {
        let e = self.exec(exec)?;
        let s = self.stream(stream)?;
        // SAFETY: both handles are live.
        check(unsafe { sys::cuGraphUpload(e, s) })
    }

    fn graph_launch(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<(), DriverError> {
        let e = self.exec(exec)?;
        let s = self.stream(stream)?;
        // SAFETY: both handles are live.
        check(unsafe { sys::cuGraphLaunch(e, s) })
    }

    fn graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<(), DriverError> {
        let e = self.exec(exec)?;
        self.loaded()?.registry.write().execs.remove(&exec.raw);
        // SAFETY: live (registry) and destroyed once; launches in flight finish.
        check(unsafe { sys::cuGraphExecDestroy(e) })
    }

    fn graph_destroy(&self, graph: GraphHandle) -> Result<(), DriverError> {
        let g = self.graph(graph)?;
        let mut registry = self.loaded()?.registry.write();
        registry.graphs.remove(&graph.raw);
        registry.graph_nodes.remove(&graph.raw);
        drop(registry);
        // SAFETY: live (registry) and destroyed once.
        check(unsafe { sys::cuGraphDestroy(g) })
    }

    fn graph_debug_dot(&self, graph: GraphHandle, path: &Path) -> Result<(), DriverError> {
        let g = self.graph(graph)?;
        let path = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: the graph is live; `path` is NUL-terminated. Flag 1 = verbose.
        check(unsafe { sys::cuGraphDebugDotPrint(g, path.as_ptr(), 1) })
    }

    fn graph_nodes(&self, graph: GraphHandle) -> Result<Vec<GraphNode>, DriverError> {
        let g = self.graph(graph)?;
        nodes::list(g)?.into_iter().map(nodes::describe).collect()
    }

    fn graph_set_node(
        &self,
        graph: GraphHandle,
        index: usize,
        node: &GraphNode,
    ) -> Result<(), DriverError> {
        let g = self.graph(graph)?;
        let target = *nodes::list(g)?
            .get(index)
            .ok_or(DriverError::INVALID_VALUE)?;
        nodes::Params::new(target, node)?.set(target)
    }

    fn graph_exec_set_nodes(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
        changes: &[(usize, GraphNode)],
    ) -> Result<bool, DriverError> {
        let (e, g) = (self.exec(exec)?, self.graph(graph)?);
        let ctx = self.primary_context(exec.device)?;
        let registry = &self.loaded()?.registry;
        let known = registry.read().graph_nodes.get(&graph.raw).cloned();
        let cache = match known {
            Some(cache) => cache,
            None => {
                let cache = Arc::new(nodes::Cache::read(g)?);
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
            .map(|(index, to)| cache.params(*index, to))
            .collect::<Result<Vec<_>, DriverError>>()?;
        Ok(params.iter().all(|(node, p)| p.set_in_exec(e, *node, ctx)))
    }

    fn graph_exec_update(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, DriverError> {
        let (e, g) = (self.exec(exec)?, self.graph(graph)?);
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

    fn vm_granularity(&self, dev: DeviceIndex) -> Result<u64, DriverError> {
        let prop = self.alloc_prop(dev)?;
        self.bind(dev)?;
        let mut g = 0usize;
        let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: `prop` is fully initialized; writes through a valid pointer.
        check(unsafe { sys::cuMemGetAllocationGranularity(&mut g, &prop, flag) })?;
        Ok(g as u64)
    }

    fn vm_reserve(&self, dev: DeviceIndex, bytes: u64) -> Result<VaRange, DriverError> {
        self.bind(dev)?;
        let mut base = 0;
        // SAFETY: a context is current; writes through a valid pointer.
        check(unsafe { sys::cuMemAddressReserve(&mut base, bytes as usize, 0, 0, 0) })?;
        Ok(VaRange {
            device: dev,
            base: DevicePtr(base),
            bytes,
        })
    }

    fn vm_release(&self, range: VaRange) -> Result<(), DriverError> {
        self.bind(range.device)?;
        // SAFETY: the driver checks that the range was reserved.
        check(unsafe { sys::cuMemAddressFree(range.base.0, range.bytes as usize) })
    }

    fn vm_create(&self, dev: DeviceIndex, bytes: u64) -> Result<PhysHandle, DriverError> {
        let prop = self.alloc_prop(dev)?;
        let l = self.bind(dev)?;
        let mut h = 0;
        // SAFETY: `prop` is fully initialized; writes through a valid pointer.
        check(unsafe { sys::cuMemCreate(&mut h, bytes as usize, &prop, 0) })?;
        l.registry.write().phys.insert(h, (dev.0, bytes));
        Ok(PhysHandle {
            device: dev,
            raw: h,
        })
    }

    fn vm_destroy(&self, handle: PhysHandle) -> Result<(), DriverError> {
        let l = self.bind(handle.device)?;
        l.registry
            .write()
            .phys
            .remove(&handle.raw)
            .ok_or(DriverError::INVALID_HANDLE)?;
        // SAFETY: the handle was live (registry) and is released once.
        check(unsafe { sys::cuMemRelease(handle.raw) })
    }

    fn vm_map(&self, at: DevicePtr, handle: PhysHandle) -> Result<(), DriverError> {
        let l = self.bind(handle.device)?;
        let bytes = match l.registry.read().phys.get(&handle.raw) {
            Some(&(d, b)) if d == handle.device.0 => b,
            _ => return Err(DriverError::INVALID_HANDLE),
        };
        // SAFETY: the handle is live; the driver checks the address range.
        check(unsafe { sys::cuMemMap(at.0, bytes as usize, 0, handle.raw, 0) })
    }

    fn vm_set_access(
        &self,
        dev: DeviceIndex,
        at: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let prop = self.alloc_prop(dev)?;
        self.bind(dev)?;
        let desc = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one valid descriptor; the driver checks the range.
        check(unsafe { sys::cuMemSetAccess(at.0, bytes as usize, &desc, 1) })
    }

    fn vm_unmap(&self, dev: DeviceIndex, at: DevicePtr, bytes: u64) -> Result<(), DriverError> {
        self.bind(dev)?;
        // SAFETY: the driver checks the range.
        check(unsafe { sys::cuMemUnmap(at.0, bytes as usize) })
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
}
