//! The seam between ferrocuda and a CUDA device: the [`Driver`] trait and its two backends.
//!
//! This is the only crate that touches CUDA. Everything above it (streams, the caching
//! allocator, graphs, autocast) asks a `dyn Driver` for one driver act at a time, so the
//! same code and the same test suite run on a real GPU ([`CudaDriver`]) and on a fake device
//! kept in host memory ([`FakeDriver`]).
//!
//! # Example
//! The fake device, asked one driver act at a time (the layers above do this for you):
//! ```
//! use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver};
//! use ferrocuda_types::{DeviceIndex, StreamHandle};
//!
//! let fake = FakeDriver::builder().devices(2).build();
//! assert_eq!(fake.device_count()?, 2);
//! let (dev, stream) = (DeviceIndex(0), StreamHandle::legacy(DeviceIndex(0)));
//! let ptr = fake.malloc(dev, 1 << 20)?;
//! fake.memcpy_htod_async(ptr, &[1, 2, 3, 4], stream)?;
//! let mut back = [0u8; 4];
//! fake.memcpy_dtoh(&mut back, ptr, stream)?;
//! assert_eq!(back, [1, 2, 3, 4]);
//! fake.free(dev, ptr)?;
//! assert_eq!(fake.calls(Call::Malloc), 1); // every act is counted
//! // A pointer it no longer holds is a typed error, not undefined behaviour.
//! assert!(fake.free(dev, ptr).is_err());
//! # Ok::<(), DriverError>(())
//! ```
//!
//! # Design choices
//! - **One method per driver act.** No method hides policy (caching, retries, ordering):
//!   policy lives in the layers above, where it can be tested on the fake device.
//! - **Handles are names, not owners.** Methods take `Copy` handles from `ferrocuda-types`;
//!   the layers above own lifetimes. Both backends still check every handle they are given
//!   against the objects they created, so a handle used after its object was destroyed (or
//!   one made up) is a typed `CUDA_ERROR_INVALID_HANDLE`, never undefined behaviour.
//! - **No driver is data.** [`CudaDriver::new`] never fails and initialises nothing: libcuda
//!   is loaded at the first driver act; without it, or without a device, the driver reports
//!   zero devices and every call returns a [`DriverError`]. No NVML is data too
//!   ([`NvmlError`]).
//! - **Fork safety is the driver's** ([`fork`]): initialising a driver marks the process, as
//!   PyTorch's `poison_fork`; in a child forked afterwards every call of either backend
//!   fails with [`DriverError::BAD_FORK`] before reaching libcuda.
//! - **NVML is asked without CUDA** ([`Driver::nvml_device_count`], [`nvml`]), for
//!   PyTorch's NVML-based availability check; the fake models it.
//! - **Errors format from a static table** ([`DriverError`]): printing an error never calls
//!   the driver.
//! - **The fake is a real backend** (after wgpu's no-op backend): device memory is address
//!   space backed by host pages only once touched, streams are in-order queues, events
//!   complete when a test says so (manual mode) or at once (eager mode), capture records work
//!   into graphs and enforces the driver's capture rules with the driver's error codes, the
//!   virtual-memory API maps physical chunks at 2 MiB granularity, out-of-memory comes from a
//!   capacity or is injected at the N-th call, and every call is counted.
//! - `unsafe` lives here only, each block with a `// SAFETY:` note.
//! - **CUDA's math libraries are called here too** ([`cublas`], [`cublaslt`], [`cufft`]), loaded at run
//!   time: their usual names, then the folders of [`LIBRARY_PATH_VAR`]; a missing library is
//!   a typed "unavailable", never cudarc's panic.
//! - **Other libraries' code is called here too**: allocator functions of a shared library
//!   ([`pluggable`], PyTorch's `CUDAPluggableAllocator`), and cudarc's safe API beside ours
//!   ([`interop`]: its streams adopted, never destroyed; device memory lent to it through its
//!   pointer traits). A missing library or function is a typed error. And the other way:
//!   `c_export` (feature `c-export`) holds the C functions PyTorch calls in
//!   `libferrocuda_torch.so`, turning its raw pointers into typed values.
//!
//! # What the layer above must do
//! - Never use a handle after destroying its object (it gets an error, not the object).
//! - Order work between streams itself (events); the driver does no implicit syncing beyond
//!   CUDA's own.
//! - Not hold its own locks across driver calls that can block (synchronize, free).
//! - Apply `CUDA_VISIBLE_DEVICES` to NVML's count itself (libcuda applies it to its own).

#[cfg(feature = "c-export")]
pub mod c_export;
mod cuda;
mod error;
pub mod fake;
pub mod fork;
pub mod interop;
mod malloc_log;
pub mod nvml;
pub mod pluggable;
pub mod shared_counters;

pub use cuda::libraries::LIBRARY_PATH_VAR;
pub use cuda::{CudaDriver, RawGraph, RawLaunch, cublas, cublaslt, cufft, nccl};
pub use error::{CompileError, DriverError};
pub use fake::{Completion, FakeDriver, FakeDriverBuilder, KernelContext, PeerCopies};
pub use interop::ForeignStream;
pub use nvml::{GpuProcess, NvmlError};
pub use pluggable::{Hook, PluggableError, PluggableLibrary};

use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, DeviceProperties, DevicePtr, EventFlags, EventHandle,
    FunctionHandle, GraphExecHandle, GraphHandle, GraphNode, HostPtr, IpcHandle, KernelArg,
    LaunchConfig, MemsetValue, ModuleHandle, PhysHandle, StreamFlags, StreamHandle, VaRange,
};
use std::path::Path;

/// Everything the layers above may ask of a device: one method per driver act.
///
/// Implementations validate handles and device indices (a bad one is an error), but apply
/// no policy. Every method may be called from any thread.
pub trait Driver: Send + Sync + std::fmt::Debug + 'static {
    /// A short name of the backend: `"cuda"` or `"fake"`.
    fn backend(&self) -> &'static str;

    /// The fake device, when this driver is one (`None`, the default, for the real driver).
    /// Not a driver act: it lets the layers above register the host functions the fake runs
    /// for their kernels ([`FakeDriver::register_kernel`], [`FakeDriver::provide_kernel`])
    /// on whatever fake device a runtime was given.
    fn as_fake(&self) -> Option<&FakeDriver> {
        None
    }

    /// This driver as the CUDA driver, for libraries that call CUDA themselves on its
    /// contexts (NCCL's communicators); `None`, the default, for the fake.
    fn into_cuda(self: std::sync::Arc<Self>) -> Option<std::sync::Arc<CudaDriver>> {
        None
    }

    // ---- devices -------------------------------------------------------------------------
    /// Devices visible to this process. Without a driver, the reason (the runtime above
    /// reports 0 devices then, as `torch.cuda.device_count()` does).
    fn device_count(&self) -> Result<usize, DriverError>;
    /// Devices NVML reports, asked without initialising the driver (PyTorch's NVML-based
    /// availability check): the real backend asks libnvidia-ml ([`nvml::device_count`]), the
    /// fake answers what it was built with (by default no NVML, as on a machine without an
    /// NVIDIA driver).
    fn nvml_device_count(&self) -> Result<usize, NvmlError>;
    /// The compute processes NVML lists on `dev`, with the device memory each uses (what
    /// PyTorch's out-of-memory message reports, `reportProcessMemoryInfo`): empty where NVML
    /// is missing or fails, as PyTorch 2.15 leaves the part out then. The fake lists what it
    /// was built with ([`fake::FakeDriverBuilder::gpu_processes`]).
    fn gpu_processes(&self, dev: DeviceIndex) -> Vec<nvml::GpuProcess>;
    /// Name, capability, memory and SM count of `dev`.
    fn device_properties(&self, dev: DeviceIndex) -> Result<DeviceProperties, DriverError>;
    /// `(free, total)` device memory in bytes (`cuMemGetInfo`).
    fn mem_get_info(&self, dev: DeviceIndex) -> Result<(u64, u64), DriverError>;
    /// Waits for all work on `dev` (`cuCtxSynchronize`).
    fn device_synchronize(&self, dev: DeviceIndex) -> Result<(), DriverError>;
    /// `(least, greatest)` stream priority; greatest is the most negative number.
    fn stream_priority_range(&self, dev: DeviceIndex) -> Result<(i32, i32), DriverError>;

    // ---- memory --------------------------------------------------------------------------
    /// Allocates device memory (`cuMemAlloc`).
    fn malloc(&self, dev: DeviceIndex, bytes: u64) -> Result<DevicePtr, DriverError>;
    /// Frees memory from [`Driver::malloc`] (`cuMemFree`).
    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), DriverError>;
    /// Allocates page-locked host memory (`cuMemHostAlloc`).
    fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DriverError>;
    /// Frees page-locked host memory (`cuMemFreeHost`).
    fn host_free(&self, ptr: HostPtr) -> Result<(), DriverError>;
    /// Reads page-locked host memory. Bytes a pending copy will write are unspecified.
    fn host_read(&self, src: HostPtr, offset: u64, dst: &mut [u8]) -> Result<(), DriverError>;
    /// Writes page-locked host memory.
    fn host_write(&self, dst: HostPtr, offset: u64, src: &[u8]) -> Result<(), DriverError>;
    /// Fills `count` elements at `dst` with `value`, ordered on `stream`.
    fn memset_async(
        &self,
        dst: DevicePtr,
        value: MemsetValue,
        count: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    /// Copies host bytes to the device, ordered on `stream`. `src` has been consumed when
    /// this returns (it may be dropped at once); the device write completes in stream order.
    fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    /// Copies device bytes to the host in `stream` order and waits for the copy.
    fn memcpy_dtoh(
        &self,
        dst: &mut [u8],
        src: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    /// Copies between two regions of the stream's device, ordered on `stream`.
    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    /// Copies between devices (`cuMemcpyPeerAsync`), ordered on `stream`: directly when the
    /// stream's device has peer access to the other one, staged through the host by the
    /// driver otherwise.
    fn memcpy_peer_async(
        &self,
        dst: (DeviceIndex, DevicePtr),
        src: (DeviceIndex, DevicePtr),
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    /// Copies page-locked host memory to the device, truly asynchronously.
    fn memcpy_htod_pinned_async(
        &self,
        dst: DevicePtr,
        src: (HostPtr, u64),
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    /// Copies device memory into page-locked host memory, truly asynchronously.
    fn memcpy_dtoh_pinned_async(
        &self,
        dst: (HostPtr, u64),
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    // ---- streams -------------------------------------------------------------------------
    /// Creates a stream (`cuStreamCreateWithPriority`).
    fn stream_create(
        &self,
        dev: DeviceIndex,
        flags: StreamFlags,
    ) -> Result<StreamHandle, DriverError>;
    /// Destroys a stream; work already enqueued still runs.
    fn stream_destroy(&self, stream: StreamHandle) -> Result<(), DriverError>;
    /// Whether all work enqueued on `stream` has completed.
    fn stream_query(&self, stream: StreamHandle) -> Result<bool, DriverError>;
    /// Waits for all work enqueued on `stream`.
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<(), DriverError>;
    /// Makes future work on `stream` wait for the event's last record.
    fn stream_wait_event(
        &self,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), DriverError>;

    // ---- events --------------------------------------------------------------------------
    /// Creates an event.
    fn event_create(&self, dev: DeviceIndex, flags: EventFlags)
    -> Result<EventHandle, DriverError>;
    /// Destroys an event.
    fn event_destroy(&self, event: EventHandle) -> Result<(), DriverError>;
    /// Records the event at the current end of `stream`.
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError>;
    /// Whether the work before the event's last record has completed.
    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError>;
    /// Waits for the event's last record.
    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError>;
    /// Milliseconds between two completed timing events.
    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32, DriverError>;

    // ---- kernels -------------------------------------------------------------------------
    /// What compiled images for `dev` depend on (compiler version and target), for cache
    /// keys; `None` when images must not be cached.
    fn compile_target(&self, dev: DeviceIndex) -> Result<Option<String>, DriverError>;
    /// Compiles CUDA C++ source for `dev` into an image [`Driver::module_load`] accepts.
    fn compile_source(
        &self,
        dev: DeviceIndex,
        source: &str,
        name: &str,
    ) -> Result<Vec<u8>, CompileError>;
    /// Loads a compiled image (`cuModuleLoadData`).
    fn module_load(&self, dev: DeviceIndex, image: &[u8]) -> Result<ModuleHandle, DriverError>;
    /// Unloads a module; its functions become invalid.
    fn module_unload(&self, module: ModuleHandle) -> Result<(), DriverError>;
    /// Looks up a kernel by its (`extern "C"`) name.
    fn module_function(
        &self,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError>;
    /// Launches a kernel on `stream` (`cuLaunchKernel`).
    fn launch(
        &self,
        function: FunctionHandle,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    // ---- capture and graphs --------------------------------------------------------------
    /// Starts capturing `stream` into a graph (`cuStreamBeginCapture_v2`).
    fn stream_begin_capture(
        &self,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), DriverError>;
    /// Ends the capture begun on `stream` and returns its graph (`cuStreamEndCapture`).
    fn stream_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle, DriverError>;
    /// The capture status of `stream`, with the capture id when active.
    fn stream_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus, DriverError>;
    /// Sets the calling thread's capture mode and returns the previous one
    /// (`cuThreadExchangeStreamCaptureMode`).
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError>;
    /// Number of nodes in a graph.
    fn graph_node_count(&self, graph: GraphHandle) -> Result<usize, DriverError>;
    /// Instantiates a graph (`cuGraphInstantiateWithFlags`, auto-free-on-launch).
    fn graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle, DriverError>;
    /// Stages an instantiated graph on the device (`cuGraphUpload`).
    fn graph_upload(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<(), DriverError>;
    /// Launches an instantiated graph on `stream` (`cuGraphLaunch`).
    fn graph_launch(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<(), DriverError>;
    /// Destroys an instantiated graph; launches in flight finish.
    fn graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<(), DriverError>;
    /// Destroys a graph.
    fn graph_destroy(&self, graph: GraphHandle) -> Result<(), DriverError>;
    /// Writes the graph as Graphviz DOT (`cuGraphDebugDotPrint`).
    fn graph_debug_dot(&self, graph: GraphHandle, path: &Path) -> Result<(), DriverError>;
    /// The nodes of `graph` in the driver's order (`cuGraphGetNodes`): kernels with their
    /// argument bytes (`cuGraphKernelNodeGetParams`, sizes from `cuFuncGetParamInfo`), 1-D
    /// memsets (`cuGraphMemsetNodeGetParams`) and 1-D copies (`cuGraphMemcpyNodeGetParams`)
    /// with their parameters, every other node by its kind only.
    fn graph_nodes(&self, graph: GraphHandle) -> Result<Vec<GraphNode>, DriverError>;
    /// Sets the parameters of node `index` (in [`Driver::graph_nodes`]' order) of `graph`
    /// (`cuGraphKernelNodeSetParams`, `cuGraphMemsetNodeSetParams`,
    /// `cuGraphMemcpyNodeSetParams`). `node` must describe a node of the same kind and shape:
    /// a kernel with as many arguments of the same sizes, a 1-D memset, a 1-D copy with the
    /// same kinds of ends (and, where an end is host memory, the same host address and
    /// length); anything else (an opaque or ordering node, an index past the last node) is
    /// `CUDA_ERROR_INVALID_VALUE`. An instantiated
    /// graph sees the change only through [`Driver::graph_exec_update`].
    fn graph_set_node(
        &self,
        graph: GraphHandle,
        index: usize,
        node: &GraphNode,
    ) -> Result<(), DriverError>;
    /// Applies `graph`'s current node parameters to `exec` in place (`cuGraphExecUpdate`).
    /// `Ok(false)`: the topology differs, so `exec` was left alone and must be
    /// re-instantiated.
    fn graph_exec_update(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, DriverError>;
    /// Gives the nodes of `exec`, an instance of `graph`, at the indices `changes` names
    /// (in [`Driver::graph_nodes`]' order) the parameters each describes, `graph` left as
    /// it is (`cuGraphExecKernelNodeSetParams`, `cuGraphExecMemsetNodeSetParams`,
    /// `cuGraphExecMemcpyNodeSetParams`); what must match is as for
    /// [`Driver::graph_set_node`], against `graph`'s node. An error sets nothing.
    /// `Ok(false)`: the driver refused a node, and `exec` may hold some of the changes: the
    /// caller brings it up otherwise ([`Driver::graph_exec_update`] from a graph holding
    /// what it wants, or a new instance).
    fn graph_exec_set_nodes(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
        changes: &[(usize, GraphNode)],
    ) -> Result<bool, DriverError>;

    // ---- virtual memory ------------------------------------------------------------------
    /// The granularity of physical chunks and mappings (`cuMemGetAllocationGranularity`).
    fn vm_granularity(&self, dev: DeviceIndex) -> Result<u64, DriverError>;
    /// Reserves a range of virtual addresses (`cuMemAddressReserve`).
    fn vm_reserve(&self, dev: DeviceIndex, bytes: u64) -> Result<VaRange, DriverError>;
    /// Gives back a reserved range; nothing may be mapped in it (`cuMemAddressFree`).
    fn vm_release(&self, range: VaRange) -> Result<(), DriverError>;
    /// Creates physical device memory (`cuMemCreate`).
    fn vm_create(&self, dev: DeviceIndex, bytes: u64) -> Result<PhysHandle, DriverError>;
    /// Releases physical memory; it is freed once unmapped everywhere (`cuMemRelease`).
    fn vm_destroy(&self, handle: PhysHandle) -> Result<(), DriverError>;
    /// Maps all of `handle` at `at` (`cuMemMap`).
    fn vm_map(&self, at: DevicePtr, handle: PhysHandle) -> Result<(), DriverError>;
    /// Makes `[at, at + bytes)` readable and writable by `dev` (`cuMemSetAccess`). `dev` may
    /// be a peer of the memory's device (PyTorch's `ExpandableSegment::setAccess` for peers);
    /// one that cannot access it is `CUDA_ERROR_INVALID_DEVICE`.
    fn vm_set_access(&self, dev: DeviceIndex, at: DevicePtr, bytes: u64)
    -> Result<(), DriverError>;
    /// Unmaps `[at, at + bytes)` (`cuMemUnmap`).
    fn vm_unmap(&self, dev: DeviceIndex, at: DevicePtr, bytes: u64) -> Result<(), DriverError>;

    // ---- interop: streams made by other libraries (cudarc) -------------------------------
    /// Makes a stream another library made usable through this driver, without owning it:
    /// the handle works in every stream method until [`Driver::stream_forget`] (adopting
    /// one stream twice needs two forgets); this driver never destroys it. The legacy
    /// default stream (raw 0) is that device's own. A cudarc stream must belong to the
    /// primary context of its device, which is what this driver uses
    /// (`CUDA_ERROR_INVALID_CONTEXT` otherwise); a foreign stream of another backend is
    /// `CUDA_ERROR_INVALID_HANDLE`.
    fn stream_adopt(&self, stream: &ForeignStream) -> Result<StreamHandle, DriverError>;
    /// Ends one adoption of `stream` (the stream itself lives on with its maker). A handle
    /// not adopted is `CUDA_ERROR_INVALID_HANDLE`.
    fn stream_forget(&self, stream: StreamHandle) -> Result<(), DriverError>;

    // ---- pinned host memory: the register path (the pinned host allocator) --------------
    /// Allocates pageable host memory (`malloc`), to be page-locked by
    /// [`Driver::host_register`]. The host methods read and write it, and it can be the host
    /// end of the pinned copies ([`Driver::memcpy_htod_pinned_async`], ...), which the driver
    /// stages until it is registered. [`Driver::host_free`] refuses it.
    fn host_malloc(&self, bytes: u64) -> Result<HostPtr, DriverError>;
    /// Pre-faults `[offset, offset + bytes)` of memory from [`Driver::host_malloc`]: writes a
    /// zero to every `page`-aligned address in that range (PyTorch's `mapPagesForRegister`),
    /// so that registering it does not fault pages in under the driver's lock. Several
    /// threads may pre-fault disjoint ranges of one allocation at once.
    fn host_prefault(
        &self,
        ptr: HostPtr,
        offset: u64,
        bytes: u64,
        page: u64,
    ) -> Result<(), DriverError>;
    /// Page-locks all of an allocation from [`Driver::host_malloc`] for every device
    /// (`cuMemHostRegister`, default flags).
    fn host_register(&self, ptr: HostPtr) -> Result<(), DriverError>;
    /// Undoes [`Driver::host_register`] (`cuMemHostUnregister`).
    fn host_unregister(&self, ptr: HostPtr) -> Result<(), DriverError>;
    /// Frees memory from [`Driver::host_malloc`] (`free`); it must be unregistered first.
    fn host_mfree(&self, ptr: HostPtr) -> Result<(), DriverError>;

    // ---- stream-ordered allocation (the cudaMallocAsync backend) -------------------------
    /// Allocates from `dev`'s default memory pool in `stream` order (`cuMemAllocAsync`):
    /// a block freed on `stream` is reusable at once, one freed on another stream once that
    /// free has completed; otherwise the pool grows. On a capturing stream it is a graph
    /// memory node instead: the graph's memory, outside the default pool and its usage, at
    /// an address fixed for the graph's life.
    fn mem_alloc_async(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr, DriverError>;
    /// Gives memory from [`Driver::mem_alloc_async`] back to its pool in `stream` order
    /// (`cuMemFreeAsync`): reusable once the work enqueued on `stream` so far completes.
    /// On a capturing stream it is a graph free node, which must name graph memory (else
    /// `CUDA_ERROR_INVALID_VALUE`); outside a capture it also frees graph memory a launch
    /// (or the capture) allocated.
    fn mem_free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), DriverError>;
    /// The four pool calls below are "potentially unsafe" during a capture, as `malloc`:
    /// from a thread whose capture mode forbids them they fail with
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidate the capture (the driver's
    /// rule; `torch.cuda.memory_stats()` inside a capture under PyTorch's cudaMallocAsync
    /// backend fails the same way).
    ///
    /// Sets the release threshold of `dev`'s default pool (`cuMemPoolSetAttribute`,
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`): unused memory above it goes back to the device
    /// at synchronizations; `u64::MAX` keeps everything.
    fn mem_pool_set_release_threshold(
        &self,
        dev: DeviceIndex,
        bytes: u64,
    ) -> Result<(), DriverError>;
    /// Reserved and used bytes of `dev`'s default pool, with their high-water marks
    /// (`cuMemPoolGetAttribute`, `CU_MEMPOOL_ATTR_{RESERVED,USED}_MEM_{CURRENT,HIGH}`).
    fn mem_pool_usage(&self, dev: DeviceIndex) -> Result<MemPoolUsage, DriverError>;
    /// Resets both high-water marks of `dev`'s default pool to their current values
    /// (setting `CU_MEMPOOL_ATTR_{RESERVED,USED}_MEM_HIGH` to 0).
    fn mem_pool_reset_peaks(&self, dev: DeviceIndex) -> Result<(), DriverError>;
    /// Releases unused memory of `dev`'s default pool until it holds at most `keep` bytes
    /// (`cuMemPoolTrimTo`); frees not yet completed stay.
    fn mem_pool_trim_to(&self, dev: DeviceIndex, keep: u64) -> Result<(), DriverError>;

    // ---- several devices: peer access ----------------------------------------------------
    /// Whether `dev` can access `peer`'s memory directly (`cuDeviceCanAccessPeer`); a device
    /// and itself: `false`, as CUDA answers.
    fn device_can_access_peer(
        &self,
        dev: DeviceIndex,
        peer: DeviceIndex,
    ) -> Result<bool, DriverError>;
    /// Lets `dev` access `peer`'s memory (`cuCtxEnablePeerAccess` in `dev`'s primary
    /// context). Enabling twice is [`DriverError::PEER_ACCESS_ALREADY_ENABLED`], a pair that
    /// cannot is [`DriverError::PEER_ACCESS_UNSUPPORTED`], a device and itself
    /// [`DriverError::INVALID_DEVICE`]: the policy (PyTorch's "already enabled is fine") is
    /// the caller's.
    fn enable_peer_access(&self, dev: DeviceIndex, peer: DeviceIndex) -> Result<(), DriverError>;

    // ---- sharing with other processes (CUDA IPC) -----------------------------------------
    /// The handle another process opens `dev`'s `cuMemAlloc` allocation at `ptr` (its start)
    /// with (`cuIpcGetMemHandle`).
    fn ipc_mem_handle(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<IpcHandle, DriverError>;
    /// Another process's allocation mapped into `dev`'s context (`cuIpcOpenMemHandle` with
    /// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, as PyTorch opens them). A process cannot open
    /// its own handles on the real driver.
    fn ipc_open_mem(&self, dev: DeviceIndex, handle: &IpcHandle) -> Result<DevicePtr, DriverError>;
    /// Unmaps memory [`Driver::ipc_open_mem`] mapped (`cuIpcCloseMemHandle`).
    fn ipc_close_mem(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), DriverError>;
    /// The handle of an event made with [`EventFlags::interprocess`]
    /// (`cuIpcGetEventHandle`).
    fn ipc_event_handle(&self, event: EventHandle) -> Result<IpcHandle, DriverError>;
    /// Another process's event, as an event of `dev` this process may wait on and destroy
    /// (`cuIpcOpenEventHandle`).
    fn ipc_open_event(
        &self,
        dev: DeviceIndex,
        handle: &IpcHandle,
    ) -> Result<EventHandle, DriverError>;
    /// The POSIX file descriptor another process imports a physical chunk with
    /// (`cuMemExportToShareableHandle`): made at the first call, the same one after it,
    /// closed when the chunk is destroyed.
    fn vm_export(&self, handle: PhysHandle) -> Result<i32, DriverError>;
    /// Process `pid`'s descriptor `fd` of a chunk of `bytes` (from its
    /// [`Driver::vm_export`]), fetched (`pidfd_getfd`, which needs the right to trace that
    /// process) and imported as a chunk of `dev` (`cuMemImportFromShareableHandle`);
    /// destroyed with [`Driver::vm_destroy`]. A failing system call is
    /// [`DriverError::OPERATING_SYSTEM`].
    fn vm_import(
        &self,
        dev: DeviceIndex,
        pid: u32,
        fd: i32,
        bytes: u64,
    ) -> Result<PhysHandle, DriverError>;
}

/// What a stream-ordered memory pool holds ([`Driver::mem_pool_usage`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MemPoolUsage {
    /// Bytes the pool holds from the device.
    pub reserved: u64,
    /// Highest `reserved` since the last reset.
    pub reserved_high: u64,
    /// Bytes of live allocations.
    pub used: u64,
    /// Highest `used` since the last reset.
    pub used_high: u64,
}
pub use fake::Call;
