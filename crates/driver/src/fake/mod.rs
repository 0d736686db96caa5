//! The fake device: a real [`Driver`] backend kept in host memory.
//!
//! Streams are in-order queues of work items. In [`Completion::Eager`] mode work completes as it
//! is enqueued; in [`Completion::Manual`] mode it completes only when a test calls
//! [`FakeDriver::advance`] (or when the host blocks on it: a synchronize completes what it
//! waits for, as a real GPU eventually would). Capture turns enqueued work into graph nodes
//! and enforces the capture rules of the graphs spec §8.2–8.3 with the driver's codes.
//!
//! It is initialised as a CUDA process is: by its first driver act (its `cuInit`), which marks
//! the process for [`fork`](crate::fork) safety; in a child forked after that, every act fails
//! with [`DriverError::BAD_FORK`]. Its NVML answers what [`FakeDriverBuilder::nvml`] says.
//! Device memory comes at fresh, increasing addresses, or, in address mode
//! ([`FakeDriverBuilder::address_plan`]), at a recorded list of addresses in order (what a
//! real driver gave PyTorch), so differential tests and replays break best-fit ties as the
//! recording did. [`FakeDriverBuilder::capacity`] sets the device's total memory.
#![forbid(unsafe_code)]
mod addresses;
mod builder;
mod busy;
mod calls;
mod control;
mod device_memory;
mod devices;
mod events;
mod graphs;
mod host_register;
mod interop;
mod ipc;
mod kernels;
mod lookups;
mod mem_pool;
mod memory;
mod nodes;
mod peer;
mod queues;
mod streams;
mod vm;
mod work;

pub use addresses::{AddressPlan, AddressPlanError, PLAN_REGION, PlanUse, WhenUnusable};
pub use builder::FakeDriverBuilder;
use calls::CALL_KINDS;
pub use calls::Call;
pub use peer::PeerCopies;
pub use work::{HostKernel, KernelContext};

use crate::malloc_log::MallocLog;
use crate::nvml::GpuProcess;
use crate::{CompileError, Driver, DriverError, ForeignStream, MemPoolUsage, NvmlError};
use addresses::device_of;
use device_memory::Memory;
use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, DeviceProperties, DevicePtr, EventFlags, EventHandle,
    FunctionHandle, GraphExecHandle, GraphHandle, GraphNode, HostPtr, IpcHandle, KernelArg,
    LaunchConfig, MemsetValue, ModuleHandle, PhysHandle, StreamFlags, StreamHandle, VaRange,
};
use parking_lot::{Mutex, MutexGuard};
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::ThreadId;
use std::time::Instant;
use work::{Node, Work};

/// When enqueued work completes on the fake device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// At once, as it is enqueued.
    Eager,
    /// When a test advances the stream, or when the host blocks on it.
    Manual,
}

type StreamKey = (u16, u64);

struct FakeStream {
    device: DeviceIndex,
    flags: StreamFlags,
    queue: VecDeque<Work>,
    enqueued: u64,
    completed: u64,
    capture: Option<CaptureLink>,
}

impl FakeStream {
    fn new(device: DeviceIndex, flags: StreamFlags) -> FakeStream {
        FakeStream {
            device,
            flags,
            queue: VecDeque::new(),
            enqueued: 0,
            completed: 0,
            capture: None,
        }
    }
}

#[derive(Clone)]
struct CaptureLink {
    id: u64,
    deps: Vec<usize>,
}

struct Capture {
    origin: StreamKey,
    device: DeviceIndex,
    mode: CaptureMode,
    thread: ThreadId,
    nodes: Vec<Node>,
    members: Vec<StreamKey>,
    invalidated: bool,
}

#[derive(Clone)]
enum Recorded {
    Nowhere,
    Stream {
        stream: StreamKey,
        seq: u64,
        generation: u64,
        at: Option<Instant>,
    },
    Captured {
        capture: u64,
        deps: Vec<usize>,
    },
}

struct FakeEvent {
    device: DeviceIndex,
    flags: EventFlags,
    recorded: Recorded,
    generation: u64,
}

struct FakeModule {
    device: DeviceIndex,
    source: String,
}

struct FakeFunction {
    device: DeviceIndex,
    module: u64,
    name: Arc<str>,
    kernel: Arc<HostKernel>,
}

struct FakeGraph {
    device: DeviceIndex,
    nodes: Arc<[Node]>,
}

struct Failure {
    call: Call,
    remaining: u64,
    error: DriverError,
}

struct State {
    devices: usize,
    completion: Completion,
    memory: Memory,
    streams: HashMap<StreamKey, FakeStream>,
    events: HashMap<u64, FakeEvent>,
    modules: HashMap<u64, FakeModule>,
    functions: HashMap<u64, FakeFunction>,
    kernels: HashMap<String, Arc<HostKernel>>,
    graphs: HashMap<u64, FakeGraph>,
    execs: HashMap<u64, FakeGraph>,
    hosts: HashMap<u64, Vec<u8>>,
    /// Which of `hosts` came from `host_malloc` (pageable, perhaps registered).
    mallocs: host_register::Mallocs,
    next_host: u64,
    next_id: u64,
    captures: HashMap<u64, Capture>,
    sticky: Vec<Option<DriverError>>,
    failures: Vec<Failure>,
    /// Streams of "another library" (`FakeDriver::foreign_stream`), with how many times
    /// they are adopted: usable through the driver only while adopted.
    foreign: HashMap<StreamKey, u32>,
    /// Each device's default stream-ordered memory pool, made at its first use.
    pools: Vec<mem_pool::Pool>,
    peers: peer::Peers,
    /// Chunks exported as descriptors (`vm_export`), and the fake descriptors' numbers.
    exports: ipc::Exports,
    /// Memory opened from a handle (`ipc_open_mem`), by (device, address).
    ipc_opened: std::collections::HashSet<(u16, u64)>,
    /// The streams with work queued and those capturing: what walks over a device's
    /// streams visit.
    busy: busy::Busy,
}

thread_local! {
    static THREAD_CAPTURE_MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

/// Image prefix of "compiled" fake modules.
const FAKE_IMAGE_MAGIC: &[u8] = b"// ferrocuda fake image\n";

/// A device kept in host memory. See the [module docs](crate::fake).
pub struct FakeDriver {
    calls: [AtomicU64; CALL_KINDS],
    launch_blocking: bool,
    nvml: Result<usize, NvmlError>,
    processes: Vec<GpuProcess>,
    /// Set by the first driver act (the fake's `cuInit`).
    initialized: AtomicBool,
    /// Hooks run at the start of a call of their kind (`before_next`), and whether any is set.
    hooks: Mutex<Vec<(Call, Hook)>>,
    hooked: AtomicBool,
    mallocs: MallocLog,
    /// Which fake this is, in this process: its IPC handles name it, so another fake
    /// refuses them as another machine's.
    instance: u64,
    state: Mutex<State>,
}

/// A test's code run inside a driver call.
type Hook = Box<dyn FnOnce() + Send>;

impl std::fmt::Debug for FakeDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeDriver")
            .field("launch_blocking", &self.launch_blocking)
            .finish_non_exhaustive()
    }
}

impl Default for FakeDriver {
    fn default() -> Self {
        FakeDriver::builder().build()
    }
}

impl FakeDriver {
    /// A builder with the defaults: one device of 80 GiB, eager completion.
    pub fn builder() -> FakeDriverBuilder {
        FakeDriverBuilder::default()
    }

    /// Registers a host function as the kernel called `name` in any module whose source
    /// defines it, replacing one registered before (functions already looked up keep the
    /// one they found). Library kernels need no registration: the crate that owns them
    /// provides them ([`FakeDriver::provide_kernel`]) when it loads their module.
    pub fn register_kernel<F>(&self, name: &str, kernel: F)
    where
        F: Fn(&mut KernelContext<'_>) -> Result<(), String> + Send + Sync + 'static,
    {
        self.state
            .lock()
            .kernels
            .insert(name.to_owned(), Arc::new(kernel));
    }

    /// Whether the fake has been initialised: by its first driver act, as libcuda is by
    /// `cuInit` (asking NVML is not one).
    pub fn is_initialized(&self) -> bool {
        self.initialized.load(Ordering::Relaxed)
    }

    fn count(&self, call: Call) {
        self.calls[call as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts the call, refuses it in a bad fork, marks the process for fork safety at the
    /// first call, takes the lock, and applies an injected failure if one is due.
    fn enter(&self, call: Call) -> Result<MutexGuard<'_, State>, DriverError> {
        self.count(call);
        if crate::fork::in_bad_fork() {
            return Err(DriverError::BAD_FORK);
        }
        if !self.initialized.load(Ordering::Relaxed) {
            crate::fork::poison_fork();
            self.initialized.store(true, Ordering::Relaxed);
        }
        if self.hooked.load(Ordering::Acquire) {
            let hook = {
                let mut hooks = self.hooks.lock();
                let hook = hooks
                    .iter()
                    .position(|(c, _)| *c == call)
                    .map(|i| hooks.swap_remove(i).1);
                self.hooked.store(!hooks.is_empty(), Ordering::Release);
                hook
            };
            if let Some(hook) = hook {
                hook();
            }
        }
        let mut st = self.state.lock();
        if let Some(i) = st.failures.iter_mut().position(|f| {
            f.call == call && {
                f.remaining -= 1;
                f.remaining == 0
            }
        }) {
            return Err(st.failures.swap_remove(i).error);
        }
        Ok(st)
    }
}

impl Driver for FakeDriver {
    fn backend(&self) -> &'static str {
        "fake"
    }

    fn as_fake(&self) -> Option<&FakeDriver> {
        Some(self)
    }

    fn device_count(&self) -> Result<usize, DriverError> {
        Ok(self.enter(Call::DeviceCount)?.devices)
    }

    fn nvml_device_count(&self) -> Result<usize, NvmlError> {
        devices::nvml_device_count(self)
    }

    fn gpu_processes(&self, _dev: DeviceIndex) -> Vec<GpuProcess> {
        devices::gpu_processes(self, _dev)
    }

    fn device_properties(&self, dev: DeviceIndex) -> Result<DeviceProperties, DriverError> {
        devices::device_properties(self, dev)
    }

    fn mem_get_info(&self, dev: DeviceIndex) -> Result<(u64, u64), DriverError> {
        self.enter(Call::MemGetInfo)?.memory.info(dev)
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
        Ok(self.enter(Call::GraphNodeCount)?.graph(graph)?.nodes.len())
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
        self.enter(Call::VmMap)?.memory.map(at, handle.raw, false)
    }

    fn vm_set_access(
        &self,
        dev: DeviceIndex,
        at: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.enter(Call::VmSetAccess)?.set_access(dev, at, bytes)
    }

    fn vm_unmap(&self, dev: DeviceIndex, at: DevicePtr, bytes: u64) -> Result<(), DriverError> {
        vm::vm_unmap(self, dev, at, bytes)
    }

    fn stream_adopt(&self, stream: &ForeignStream) -> Result<StreamHandle, DriverError> {
        let mut st = self.enter(Call::StreamAdopt)?;
        interop::adopt(&mut st, stream)
    }

    fn stream_forget(&self, stream: StreamHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::StreamForget)?;
        interop::forget(&mut st, stream)
    }

    fn host_malloc(&self, bytes: u64) -> Result<HostPtr, DriverError> {
        host_register::malloc(&mut *self.enter(Call::HostMalloc)?, bytes)
    }

    fn host_prefault(
        &self,
        ptr: HostPtr,
        offset: u64,
        bytes: u64,
        page: u64,
    ) -> Result<(), DriverError> {
        host_register::prefault(
            &mut *self.enter(Call::HostPrefault)?,
            ptr,
            offset,
            bytes,
            page,
        )
    }

    fn host_register(&self, ptr: HostPtr) -> Result<(), DriverError> {
        host_register::register(&mut *self.enter(Call::HostRegister)?, ptr, true)
    }

    fn host_unregister(&self, ptr: HostPtr) -> Result<(), DriverError> {
        host_register::register(&mut *self.enter(Call::HostUnregister)?, ptr, false)
    }

    fn host_mfree(&self, ptr: HostPtr) -> Result<(), DriverError> {
        host_register::mfree(&mut *self.enter(Call::HostMfree)?, ptr)
    }

    fn mem_alloc_async(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError> {
        let mut st = self.enter(Call::MemAllocAsync)?;
        mem_pool::alloc_async(&mut st, dev, bytes, stream)
    }

    fn mem_free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemFreeAsync)?;
        mem_pool::free_async(&mut st, ptr, stream)
    }

    fn mem_pool_set_release_threshold(
        &self,
        dev: DeviceIndex,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemPoolSetReleaseThreshold)?;
        st.check_unsafe_call()?;
        mem_pool::set_release_threshold(&mut st, dev, bytes)
    }

    fn mem_pool_usage(&self, dev: DeviceIndex) -> Result<MemPoolUsage, DriverError> {
        let mut st = self.enter(Call::MemPoolUsage)?;
        st.check_unsafe_call()?;
        mem_pool::usage(&mut st, dev)
    }

    fn mem_pool_reset_peaks(&self, dev: DeviceIndex) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemPoolResetPeaks)?;
        st.check_unsafe_call()?;
        mem_pool::reset_peaks(&mut st, dev)
    }

    fn mem_pool_trim_to(&self, dev: DeviceIndex, keep: u64) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemPoolTrimTo)?;
        st.check_unsafe_call()?;
        mem_pool::trim_to(&mut st, dev, keep)
    }

    fn device_can_access_peer(
        &self,
        dev: DeviceIndex,
        peer: DeviceIndex,
    ) -> Result<bool, DriverError> {
        peer::device_can_access_peer(self, dev, peer)
    }

    fn enable_peer_access(&self, dev: DeviceIndex, peer: DeviceIndex) -> Result<(), DriverError> {
        self.enter(Call::EnablePeerAccess)?.enable_peer(dev, peer)
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
