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
mod addresses;
mod busy;
mod host_register;
mod interop;
mod kernels;
mod mem_pool;
mod memory;
mod nodes;
mod peer;
mod work;

pub use addresses::{AddressPlan, AddressPlanError, PLAN_REGION, PlanUse, WhenUnusable};
pub use peer::PeerCopies;
pub use work::{HostKernel, KernelContext};

use crate::malloc_log::MallocLog;
use crate::nvml::GpuProcess;
use crate::{CompileError, Driver, DriverError, ForeignStream, MemPoolUsage, NvmlError};
use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, DeviceProperties, DevicePtr, EventFlags, EventHandle,
    FunctionHandle, GraphExecHandle, GraphHandle, GraphNode, HostPtr, KernelArg, LaunchConfig,
    MemsetValue, ModuleHandle, PhysHandle, StreamFlags, StreamHandle, VaRange,
};
use memory::{GRANULARITY, Memory, device_of};
use parking_lot::{Mutex, MutexGuard};
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::ThreadId;
use std::time::Instant;
use work::{Node, Work, execute};

/// When enqueued work completes on the fake device.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// At once, as it is enqueued.
    Eager,
    /// When a test advances the stream, or when the host blocks on it.
    Manual,
}

/// The driver acts the fake counts, one per [`Driver`] method.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[allow(missing_docs)]
pub enum Call {
    DeviceCount,
    NvmlDeviceCount,
    DeviceProperties,
    MemGetInfo,
    DeviceSynchronize,
    StreamPriorityRange,
    Malloc,
    Free,
    HostAlloc,
    HostFree,
    HostRead,
    HostWrite,
    Memset,
    MemcpyHtoD,
    MemcpyDtoH,
    MemcpyDtoD,
    MemcpyPeer,
    MemcpyHtoDPinned,
    MemcpyDtoHPinned,
    StreamCreate,
    StreamDestroy,
    StreamQuery,
    StreamSynchronize,
    StreamWaitEvent,
    EventCreate,
    EventDestroy,
    EventRecord,
    EventQuery,
    EventSynchronize,
    EventElapsed,
    CompileTarget,
    CompileSource,
    ModuleLoad,
    ModuleUnload,
    ModuleFunction,
    Launch,
    BeginCapture,
    EndCapture,
    CaptureStatus,
    ExchangeCaptureMode,
    GraphNodeCount,
    GraphInstantiate,
    GraphUpload,
    GraphLaunch,
    GraphExecDestroy,
    GraphDestroy,
    GraphDebugDot,
    GraphNodes,
    GraphSetNode,
    GraphExecSetNodes,
    GraphExecUpdate,
    VmGranularity,
    VmReserve,
    VmRelease,
    VmCreate,
    VmDestroy,
    VmMap,
    VmSetAccess,
    VmUnmap,
    StreamAdopt,
    StreamForget,
    HostMalloc,
    HostPrefault,
    HostRegister,
    HostUnregister,
    HostMfree,
    MemAllocAsync,
    MemFreeAsync,
    MemPoolSetReleaseThreshold,
    MemPoolUsage,
    MemPoolResetPeaks,
    MemPoolTrimTo,
    DeviceCanAccessPeer,
    EnablePeerAccess,
    GpuProcesses,
}

const CALL_KINDS: usize = Call::GpuProcesses as usize + 1;

/// Configures a [`FakeDriver`].
#[derive(Debug, Clone)]
pub struct FakeDriverBuilder {
    devices: usize,
    capacity: u64,
    completion: Completion,
    backing: bool,
    launch_blocking: bool,
    nvml: Result<usize, NvmlError>,
    processes: Vec<GpuProcess>,
    plans: Vec<(DeviceIndex, AddressPlan)>,
    no_peer: Vec<(u16, u16)>,
}

impl Default for FakeDriverBuilder {
    fn default() -> Self {
        FakeDriverBuilder {
            devices: 1,
            capacity: 80 << 30,
            completion: Completion::Eager,
            backing: true,
            launch_blocking: std::env::var("CUDA_LAUNCH_BLOCKING").is_ok_and(|v| v == "1"),
            processes: Vec::new(),
            nvml: Err(NvmlError::LibraryNotFound(
                "the fake device has no NVML (FakeDriverBuilder::nvml gives it one)".into(),
            )),
            plans: Vec::new(),
            no_peer: Vec::new(),
        }
    }
}

impl FakeDriverBuilder {
    /// Number of devices (default 1).
    pub fn devices(mut self, n: usize) -> Self {
        self.devices = n.min(usize::from(u16::MAX));
        self
    }
    /// Memory per device in bytes (default 80 GiB): what `mem_get_info` and the device
    /// properties report as total, so a memory fraction means what it means on a GPU of
    /// that size, and the limit above which `malloc` runs out of memory.
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = bytes;
        self
    }
    /// When work completes (default eager).
    pub fn completion(mut self, c: Completion) -> Self {
        self.completion = c;
        self
    }
    /// Whether written device bytes are kept (default true). Off, writes are dropped and
    /// reads give zeros: for replays that only need addresses.
    pub fn backing(mut self, on: bool) -> Self {
        self.backing = on;
        self
    }
    /// Kernel launches complete before `launch` returns, as with `CUDA_LAUNCH_BLOCKING=1`
    /// (the default follows that variable).
    pub fn launch_blocking(mut self, on: bool) -> Self {
        self.launch_blocking = on;
        self
    }
    /// What NVML answers ([`Driver::nvml_device_count`]). The default is no NVML, as on a
    /// machine without an NVIDIA driver (CI).
    pub fn nvml(mut self, answer: Result<usize, NvmlError>) -> Self {
        self.nvml = answer;
        self
    }

    /// The compute processes NVML lists on every device ([`Driver::gpu_processes`]); none
    /// by default.
    pub fn gpu_processes(mut self, processes: Vec<GpuProcess>) -> Self {
        self.processes = processes;
        self
    }

    /// Address mode for device `dev`: its successful `malloc`s take `plan`'s addresses in
    /// order (moved into the device's span, see [`AddressPlan`]). Replaces an earlier plan
    /// for `dev`; a plan for a device the driver does not have is never used.
    pub fn address_plan(mut self, dev: DeviceIndex, plan: AddressPlan) -> Self {
        self.plans.retain(|(d, _)| *d != dev);
        self.plans.push((dev, plan));
        self
    }

    /// The driver.
    pub fn build(self) -> FakeDriver {
        let mut memory = Memory::new(self.devices, self.capacity, self.backing);
        for (dev, plan) in &self.plans {
            memory.set_plan(*dev, plan);
        }
        let streams = (0..self.devices as u16)
            .map(|d| {
                (
                    (d, 0),
                    FakeStream::new(DeviceIndex(d), StreamFlags::default()),
                )
            })
            .collect();
        FakeDriver {
            calls: std::array::from_fn(|_| AtomicU64::new(0)),
            launch_blocking: self.launch_blocking,
            nvml: self.nvml,
            processes: self.processes,
            initialized: AtomicBool::new(false),
            hooks: Mutex::new(Vec::new()),
            hooked: AtomicBool::new(false),
            mallocs: MallocLog::default(),
            state: Mutex::new(State {
                devices: self.devices,
                completion: self.completion,
                memory,
                streams,
                events: HashMap::new(),
                modules: HashMap::new(),
                functions: HashMap::new(),
                kernels: HashMap::new(),
                graphs: HashMap::new(),
                execs: HashMap::new(),
                hosts: HashMap::new(),
                mallocs: host_register::Mallocs::default(),
                next_host: 0x1000_0000,
                next_id: 1,
                captures: HashMap::new(),
                sticky: vec![None; self.devices],
                failures: Vec::new(),
                foreign: HashMap::new(),
                pools: Vec::new(),
                peers: peer::Peers::new(&self.no_peer),
                busy: busy::Busy::default(),
            }),
        }
    }
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

    /// How many times `call` was made.
    pub fn calls(&self, call: Call) -> u64 {
        self.calls[call as usize].load(Ordering::Relaxed)
    }

    /// Whether the fake has been initialised: by its first driver act, as libcuda is by
    /// `cuInit` (asking NVML is not one).
    pub fn is_initialized(&self) -> bool {
        self.initialized.load(Ordering::Relaxed)
    }

    fn count(&self, call: Call) {
        self.calls[call as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Runs `hook` at the start of the next call of kind `call`, on the calling thread and
    /// before the fake takes its own lock: for tests in which another thread must act while
    /// a caller is inside the driver (an allocator's lock is released around `malloc`).
    pub fn before_next(&self, call: Call, hook: impl FnOnce() + Send + 'static) {
        self.hooks.lock().push((call, Box::new(hook)));
        self.hooked.store(true, Ordering::Release);
    }

    /// Makes the `nth` next call of kind `call` (1 = the very next) fail with `error`.
    pub fn fail_nth(&self, call: Call, nth: u64, error: DriverError) {
        self.state.lock().failures.push(Failure {
            call,
            remaining: nth.max(1),
            error,
        });
    }

    /// Switches between eager and manual completion.
    pub fn set_completion(&self, completion: Completion) {
        self.state.lock().completion = completion;
    }

    /// Completes up to `max_items` items of work on `stream` (all when `None`), stopping at
    /// a wait for an event that has not completed. Returns how many completed.
    pub fn advance(
        &self,
        stream: StreamHandle,
        max_items: Option<usize>,
    ) -> Result<usize, DriverError> {
        let mut st = self.state.lock();
        let key = st.stream_key(stream)?;
        Ok(st.run(key, None, max_items.unwrap_or(usize::MAX), false))
    }

    /// Completes everything that can complete without forcing, on every stream.
    pub fn advance_all(&self) -> usize {
        let mut st = self.state.lock();
        let mut total = 0;
        loop {
            let keys = st.busy.queued_anywhere();
            let done: usize = keys
                .into_iter()
                .map(|k| st.run(k, None, usize::MAX, false))
                .sum();
            if done == 0 {
                return total;
            }
            total += done;
        }
    }

    /// Items of work enqueued on `stream` and not completed.
    pub fn pending(&self, stream: StreamHandle) -> Result<usize, DriverError> {
        let st = self.state.lock();
        let key = st.stream_key(stream)?;
        Ok(st.streams.get(&key).map_or(0, |s| s.queue.len()))
    }

    /// Starts (`true`) or stops keeping the address of every successful `malloc`, in
    /// order, as [`CudaDriver::log_mallocs`](crate::CudaDriver::log_mallocs) does.
    pub fn log_mallocs(&self, on: bool) {
        self.mallocs.set(on);
    }

    /// The addresses kept since [`log_mallocs`](Self::log_mallocs) or the last call, in
    /// `malloc` order, each with its device.
    pub fn take_malloc_log(&self) -> Vec<(DeviceIndex, DevicePtr)> {
        self.mallocs.take()
    }

    /// How device `dev`'s `malloc`s used its address plan so far (`None` without one).
    pub fn address_plan_use(&self, dev: DeviceIndex) -> Option<PlanUse> {
        self.state.lock().memory.plan_use(dev)
    }

    /// Host bytes that back touched device memory.
    pub fn backed_bytes(&self) -> u64 {
        self.state.lock().memory.backed_bytes()
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

impl State {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn check_device(&self, dev: DeviceIndex) -> Result<(), DriverError> {
        if dev.as_usize() < self.devices {
            Ok(())
        } else {
            Err(DriverError::INVALID_DEVICE)
        }
    }

    fn stream_key(&self, s: StreamHandle) -> Result<StreamKey, DriverError> {
        let key = (s.device.0, s.raw);
        match self.streams.get(&key) {
            Some(_) if self.foreign.get(&key) == Some(&0) => Err(DriverError::INVALID_HANDLE),
            Some(_) => Ok(key),
            None if s.device.as_usize() >= self.devices => Err(DriverError::INVALID_DEVICE),
            None => Err(DriverError::INVALID_HANDLE),
        }
    }

    fn event(&self, e: EventHandle) -> Result<&FakeEvent, DriverError> {
        self.events
            .get(&e.raw)
            .filter(|ev| ev.device == e.device)
            .ok_or(DriverError::INVALID_HANDLE)
    }

    // ---- capture rules ----------------------------------------------------------------

    /// A "potentially unsafe" call (graphs spec §8.2): refused with 900, and the captures
    /// that refuse it invalidated, depending on this thread's mode and open captures.
    fn check_unsafe_call(&mut self) -> Result<(), DriverError> {
        let me = std::thread::current().id();
        let my_mode = THREAD_CAPTURE_MODE.with(Cell::get);
        let mut blocked = false;
        for c in self.captures.values_mut() {
            let own = c.thread == me && c.mode != CaptureMode::Relaxed;
            let other_global = c.thread != me && c.mode == CaptureMode::Global;
            let blocks = match my_mode {
                CaptureMode::Relaxed => false,
                CaptureMode::ThreadLocal => own,
                CaptureMode::Global => own || other_global,
            };
            if blocks {
                c.invalidated = true;
                blocked = true;
            }
        }
        if blocked {
            Err(DriverError::STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }

    /// Synchronizing or querying a capturing stream is always refused and breaks the capture.
    fn refuse_if_capturing(&mut self, key: StreamKey) -> Result<(), DriverError> {
        let link = self.streams.get(&key).and_then(|s| s.capture.clone());
        if let Some(link) = link {
            if let Some(c) = self.captures.get_mut(&link.id) {
                c.invalidated = true;
            }
            return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
        }
        Ok(())
    }

    // ---- enqueue and run ----------------------------------------------------------------

    /// Enqueues work on a stream, or records it as a graph node if the stream is capturing.
    fn enqueue(&mut self, key: StreamKey, work: Work) -> Result<(), DriverError> {
        let stream = self
            .streams
            .get_mut(&key)
            .ok_or(DriverError::INVALID_HANDLE)?;
        if let Some(link) = stream.capture.as_mut() {
            let cap = self
                .captures
                .get_mut(&link.id)
                .ok_or(DriverError::STREAM_CAPTURE_INVALIDATED)?;
            if cap.invalidated {
                return Err(DriverError::STREAM_CAPTURE_INVALIDATED);
            }
            cap.nodes.push(Node {
                work,
                deps: std::mem::take(&mut link.deps),
            });
            link.deps = vec![cap.nodes.len() - 1];
            return Ok(());
        }
        let device = stream.device;
        let implicit = self.implicit_waits(key, device)?;
        let stream = self
            .streams
            .get_mut(&key)
            .ok_or(DriverError::INVALID_HANDLE)?;
        for wait in implicit {
            stream.queue.push_back(wait);
            stream.enqueued += 1;
        }
        stream.queue.push_back(work);
        stream.enqueued += 1;
        self.busy.set_queued(key, true);
        if self.completion == Completion::Eager {
            self.run(key, None, usize::MAX, false);
        }
        Ok(())
    }

    /// The legacy stream and blocking streams wait for each other's earlier work. Legacy
    /// work while a blocking stream of the device is capturing breaks that capture (906).
    fn implicit_waits(
        &mut self,
        key: StreamKey,
        device: DeviceIndex,
    ) -> Result<Vec<Work>, DriverError> {
        let legacy = (device.0, 0);
        let is_legacy = key == legacy;
        if !is_legacy && self.streams.get(&key).is_some_and(|s| s.flags.non_blocking) {
            return Ok(Vec::new());
        }
        if is_legacy {
            let capturing = self.busy.capturing_on(device.0);
            self.busy.visited(capturing.len());
            let broken: Vec<u64> = capturing
                .into_iter()
                .filter_map(|k| self.streams.get(&k).map(|s| (k, s)))
                .filter(|(k, s)| k.0 == device.0 && !s.flags.non_blocking && k.1 != 0)
                .filter_map(|(_, s)| s.capture.as_ref().map(|l| l.id))
                .collect();
            if !broken.is_empty() {
                for id in broken {
                    if let Some(c) = self.captures.get_mut(&id) {
                        c.invalidated = true;
                    }
                }
                return Err(DriverError::STREAM_CAPTURE_IMPLICIT);
            }
        }
        // Only a stream with work queued can be waited for: the legacy stream waits for the
        // device's busy streams, a blocking stream for the legacy stream.
        let candidates = if is_legacy {
            self.busy.queued_on(device.0)
        } else {
            vec![legacy]
        };
        self.busy.visited(candidates.len());
        Ok(candidates
            .into_iter()
            .filter_map(|k| self.streams.get(&k).map(|s| (k, s)))
            .filter(|(k, s)| {
                *k != key
                    && k.0 == device.0
                    && s.enqueued > s.completed
                    && if is_legacy {
                        !s.flags.non_blocking
                    } else {
                        k.1 == 0
                    }
            })
            .map(|(k, s)| Work::Wait {
                stream: k,
                seq: s.enqueued,
            })
            .collect())
    }

    fn is_done(&self, stream: StreamKey, seq: u64) -> bool {
        self.streams.get(&stream).is_none_or(|s| s.completed >= seq)
    }

    /// Completes work on `key` in order until `until` items are done (all if `None`) or
    /// `budget` items ran. A wait on incomplete work stops the run unless `force`, which
    /// first completes the awaited stream (as a GPU would, eventually).
    fn run(&mut self, key: StreamKey, until: Option<u64>, mut budget: usize, force: bool) -> usize {
        self.busy.visited(1);
        let mut done = 0;
        while budget > 0 {
            let Some(stream) = self.streams.get_mut(&key) else {
                break;
            };
            if until.is_some_and(|u| stream.completed >= u) {
                break;
            }
            let Some(front) = stream.queue.front() else {
                break;
            };
            if let Work::Wait { stream: other, seq } = *front
                && !self.is_done(other, seq)
            {
                if !force || other == key {
                    break;
                }
                self.run(other, Some(seq), usize::MAX, true);
                if !self.is_done(other, seq) {
                    break;
                }
            }
            let Some(stream) = self.streams.get_mut(&key) else {
                break;
            };
            let Some(work) = stream.queue.pop_front() else {
                break;
            };
            let device = stream.device;
            stream.completed += 1;
            if stream.queue.is_empty() {
                self.busy.set_queued(key, false);
            }
            self.complete(&work, device);
            done += 1;
            budget -= 1;
        }
        done
    }

    fn complete(&mut self, work: &Work, device: DeviceIndex) {
        if let Work::Record { event, generation } = work {
            if let Some(FakeEvent {
                recorded:
                    Recorded::Stream {
                        generation: g, at, ..
                    },
                ..
            }) = self.events.get_mut(event)
                && g == generation
            {
                *at = Some(Instant::now());
            }
            return;
        }
        if let Err(e) = execute(work, &mut self.memory, &mut self.hosts)
            && let Some(slot) = self.sticky.get_mut(device.as_usize())
        {
            slot.get_or_insert(e);
        }
    }

    /// Completes everything on `key` (a host-blocking wait).
    fn drain(&mut self, key: StreamKey) -> Result<(), DriverError> {
        self.run(key, None, usize::MAX, true);
        let s = self.streams.get(&key).ok_or(DriverError::INVALID_HANDLE)?;
        match self.sticky.get(s.device.as_usize()).copied().flatten() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn drain_device(&mut self, dev: DeviceIndex) -> Result<(), DriverError> {
        // A stream with nothing queued has nothing to run: visit only the busy ones.
        for k in self.busy.queued_on(dev.0) {
            self.run(k, None, usize::MAX, true);
        }
        match self.sticky.get(dev.as_usize()).copied().flatten() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn event_done(&self, ev: &FakeEvent) -> bool {
        match ev.recorded {
            Recorded::Nowhere => true,
            Recorded::Stream { stream, seq, .. } => self.is_done(stream, seq),
            Recorded::Captured { .. } => false,
        }
    }

    /// Refuses queries of events recorded inside a capture (907), breaking the capture.
    fn refuse_captured_event(
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

    fn dev_ptr_check(&self, ptr: DevicePtr, bytes: u64) -> Result<DeviceIndex, DriverError> {
        self.memory
            .check(ptr, bytes)
            .map_err(|_| DriverError::INVALID_VALUE)?;
        device_of(ptr).ok_or(DriverError::INVALID_VALUE)
    }

    fn host_range(&self, h: HostPtr, offset: u64, bytes: u64) -> Result<(), DriverError> {
        let buf = self.hosts.get(&h.raw).ok_or(DriverError::INVALID_VALUE)?;
        if offset
            .checked_add(bytes)
            .is_some_and(|end| end <= buf.len() as u64)
        {
            Ok(())
        } else {
            Err(DriverError::INVALID_VALUE)
        }
    }

    fn graph(&self, g: GraphHandle) -> Result<&FakeGraph, DriverError> {
        self.graphs
            .get(&g.raw)
            .filter(|x| x.device == g.device)
            .ok_or(DriverError::INVALID_HANDLE)
    }

    fn end_capture(&mut self, key: StreamKey) -> Result<Vec<Node>, DriverError> {
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
fn reaches(nodes: &[Node], from: &[usize], target: usize) -> bool {
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

/// Whether the source defines `name` as an identifier (not as part of a longer one).
fn defines(source: &str, name: &str) -> bool {
    source.match_indices(name).any(|(i, _)| {
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let before = source[..i].chars().next_back().is_none_or(|c| !ident(c));
        let after = source[i + name.len()..]
            .chars()
            .next()
            .is_none_or(|c| !ident(c));
        before && after && source[..i].contains("__global__")
    })
}

fn fake_properties(capacity: u64) -> DeviceProperties {
    DeviceProperties {
        name: "ferrocuda fake device".into(),
        major: 9,
        minor: 0,
        total_memory: capacity,
        multi_processor_count: 132,
        max_threads_per_multi_processor: 2048,
        warp_size: 32,
        l2_cache_size: 50 << 20,
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
        self.count(Call::NvmlDeviceCount);
        self.nvml.clone()
    }

    fn gpu_processes(&self, _dev: DeviceIndex) -> Vec<GpuProcess> {
        self.count(Call::GpuProcesses);
        self.processes.clone()
    }

    fn device_properties(&self, dev: DeviceIndex) -> Result<DeviceProperties, DriverError> {
        let st = self.enter(Call::DeviceProperties)?;
        st.check_device(dev)?;
        Ok(fake_properties(st.memory.capacity(dev)))
    }

    fn mem_get_info(&self, dev: DeviceIndex) -> Result<(u64, u64), DriverError> {
        self.enter(Call::MemGetInfo)?.memory.info(dev)
    }

    fn device_synchronize(&self, dev: DeviceIndex) -> Result<(), DriverError> {
        let mut st = self.enter(Call::DeviceSynchronize)?;
        st.check_device(dev)?;
        st.check_unsafe_call()?;
        st.drain_device(dev)
    }

    fn stream_priority_range(&self, dev: DeviceIndex) -> Result<(i32, i32), DriverError> {
        self.enter(Call::StreamPriorityRange)?.check_device(dev)?;
        Ok((0, -5))
    }

    fn malloc(&self, dev: DeviceIndex, bytes: u64) -> Result<DevicePtr, DriverError> {
        let mut st = self.enter(Call::Malloc)?;
        st.check_device(dev)?;
        st.check_unsafe_call()?;
        let ptr = st.memory.malloc(dev, bytes)?;
        self.mallocs.note(dev, ptr);
        Ok(ptr)
    }

    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), DriverError> {
        let mut st = self.enter(Call::Free)?;
        st.check_device(dev)?;
        st.check_unsafe_call()?;
        // cuMemFree waits for the device's work, as the real driver does in practice.
        let _ = st.drain_device(dev);
        st.memory.free(dev, ptr)
    }

    fn host_alloc(&self, bytes: u64) -> Result<HostPtr, DriverError> {
        let mut st = self.enter(Call::HostAlloc)?;
        st.check_unsafe_call()?;
        let data = host_register::host_bytes(bytes)?;
        let raw = st.next_host;
        st.next_host += bytes.max(1).div_ceil(4096) * 4096;
        st.hosts.insert(raw, data);
        Ok(HostPtr { raw, bytes })
    }

    fn host_free(&self, ptr: HostPtr) -> Result<(), DriverError> {
        let mut st = self.enter(Call::HostFree)?;
        st.check_unsafe_call()?;
        if st.mallocs.contains(ptr) {
            return Err(DriverError::INVALID_VALUE);
        }
        st.hosts
            .remove(&ptr.raw)
            .map(|_| ())
            .ok_or(DriverError::INVALID_VALUE)
    }

    fn host_read(&self, src: HostPtr, offset: u64, dst: &mut [u8]) -> Result<(), DriverError> {
        let st = self.enter(Call::HostRead)?;
        st.host_range(src, offset, dst.len() as u64)?;
        let buf = st.hosts.get(&src.raw).ok_or(DriverError::INVALID_VALUE)?;
        dst.copy_from_slice(&buf[offset as usize..offset as usize + dst.len()]);
        Ok(())
    }

    fn host_write(&self, dst: HostPtr, offset: u64, src: &[u8]) -> Result<(), DriverError> {
        let mut st = self.enter(Call::HostWrite)?;
        st.host_range(dst, offset, src.len() as u64)?;
        let buf = st
            .hosts
            .get_mut(&dst.raw)
            .ok_or(DriverError::INVALID_VALUE)?;
        buf[offset as usize..offset as usize + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn memset_async(
        &self,
        dst: DevicePtr,
        value: MemsetValue,
        count: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::Memset)?;
        let key = st.stream_key(stream)?;
        st.dev_ptr_check(dst, value.width() * count)?;
        st.enqueue(key, Work::Memset { dst, value, count })
    }

    fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemcpyHtoD)?;
        let key = st.stream_key(stream)?;
        st.dev_ptr_check(dst, src.len() as u64)?;
        // A captured copy would read `src` at every replay, long after the borrow ends.
        if st.streams.get(&key).is_some_and(|s| s.capture.is_some()) {
            return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
        }
        st.enqueue(
            key,
            Work::HostToDevice {
                dst,
                bytes: src.into(),
            },
        )
    }

    fn memcpy_dtoh(
        &self,
        dst: &mut [u8],
        src: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemcpyDtoH)?;
        let key = st.stream_key(stream)?;
        st.dev_ptr_check(src, dst.len() as u64)?;
        st.refuse_if_capturing(key)?;
        st.check_unsafe_call()?;
        st.drain(key)?;
        st.memory.read(src, dst)
    }

    fn memcpy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemcpyDtoD)?;
        let key = st.stream_key(stream)?;
        st.dev_ptr_check(dst, bytes)?;
        st.dev_ptr_check(src, bytes)?;
        st.enqueue(key, Work::DeviceToDevice { dst, src, bytes })
    }

    fn memcpy_peer_async(
        &self,
        dst: (DeviceIndex, DevicePtr),
        src: (DeviceIndex, DevicePtr),
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemcpyPeer)?;
        let key = st.stream_key(stream)?;
        if st.dev_ptr_check(dst.1, bytes)? != dst.0 || st.dev_ptr_check(src.1, bytes)? != src.0 {
            return Err(DriverError::INVALID_VALUE);
        }
        st.route_peer_copy(DeviceIndex(key.0), dst, src, bytes)?;
        st.enqueue(
            key,
            Work::DeviceToDevice {
                dst: dst.1,
                src: src.1,
                bytes,
            },
        )
    }

    fn memcpy_htod_pinned_async(
        &self,
        dst: DevicePtr,
        src: (HostPtr, u64),
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemcpyHtoDPinned)?;
        let key = st.stream_key(stream)?;
        st.dev_ptr_check(dst, bytes)?;
        st.host_range(src.0, src.1, bytes)?;
        st.enqueue(
            key,
            Work::PinnedToDevice {
                dst,
                host: src.0.raw,
                offset: src.1,
                bytes,
            },
        )
    }

    fn memcpy_dtoh_pinned_async(
        &self,
        dst: (HostPtr, u64),
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::MemcpyDtoHPinned)?;
        let key = st.stream_key(stream)?;
        st.dev_ptr_check(src, bytes)?;
        st.host_range(dst.0, dst.1, bytes)?;
        st.enqueue(
            key,
            Work::DeviceToPinned {
                host: dst.0.raw,
                offset: dst.1,
                src,
                bytes,
            },
        )
    }

    fn stream_create(
        &self,
        dev: DeviceIndex,
        flags: StreamFlags,
    ) -> Result<StreamHandle, DriverError> {
        let mut st = self.enter(Call::StreamCreate)?;
        st.check_device(dev)?;
        let raw = st.id();
        let flags = StreamFlags {
            priority: flags.priority.clamp(-5, 0),
            ..flags
        };
        st.streams.insert((dev.0, raw), FakeStream::new(dev, flags));
        Ok(StreamHandle { device: dev, raw })
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::StreamDestroy)?;
        let key = st.stream_key(stream)?;
        // The legacy stream is the device's, an adopted one its maker's.
        if key.1 == 0 || st.foreign.contains_key(&key) {
            return Err(DriverError::INVALID_HANDLE);
        }
        // Work already enqueued still runs (it completes now; nothing can observe it later).
        st.run(key, None, usize::MAX, true);
        st.streams.remove(&key);
        st.busy.forget(key);
        Ok(())
    }

    fn stream_query(&self, stream: StreamHandle) -> Result<bool, DriverError> {
        let mut st = self.enter(Call::StreamQuery)?;
        let key = st.stream_key(stream)?;
        st.refuse_if_capturing(key)?;
        st.check_unsafe_call()?;
        if let Some(e) = st.sticky.get(stream.device.as_usize()).copied().flatten() {
            return Err(e);
        }
        Ok(st.streams.get(&key).is_some_and(|s| s.queue.is_empty()))
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::StreamSynchronize)?;
        let key = st.stream_key(stream)?;
        st.refuse_if_capturing(key)?;
        st.check_unsafe_call()?;
        st.drain(key)
    }

    fn stream_wait_event(
        &self,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::StreamWaitEvent)?;
        let key = st.stream_key(stream)?;
        let wait = match &st.event(event)?.recorded {
            Recorded::Nowhere => return Ok(()),
            Recorded::Stream {
                stream: other, seq, ..
            } => Work::Wait {
                stream: *other,
                seq: *seq,
            },
            Recorded::Captured { capture, deps } => {
                let (capture, deps) = (*capture, deps.clone());
                let s = st
                    .streams
                    .get_mut(&key)
                    .ok_or(DriverError::INVALID_HANDLE)?;
                match s.capture.as_mut() {
                    Some(link) if link.id == capture => {
                        for d in deps {
                            if !link.deps.contains(&d) {
                                link.deps.push(d);
                            }
                        }
                    }
                    Some(_) => return Err(DriverError::STREAM_CAPTURE_MERGE),
                    None => {
                        // The stream joins the capture: a fork.
                        s.capture = Some(CaptureLink { id: capture, deps });
                        st.busy.set_capturing(key, true);
                        if let Some(c) = st.captures.get_mut(&capture) {
                            c.members.push(key);
                        }
                    }
                }
                return Ok(());
            }
        };
        if st.streams.get(&key).is_some_and(|s| s.capture.is_some()) {
            // An event from outside the capture: already ordered before the capture.
            return Ok(());
        }
        st.enqueue(key, wait)
    }

    fn event_create(
        &self,
        dev: DeviceIndex,
        flags: EventFlags,
    ) -> Result<EventHandle, DriverError> {
        let mut st = self.enter(Call::EventCreate)?;
        st.check_device(dev)?;
        if flags.interprocess && flags.timing {
            return Err(DriverError::INVALID_VALUE);
        }
        let raw = st.id();
        st.events.insert(
            raw,
            FakeEvent {
                device: dev,
                flags,
                recorded: Recorded::Nowhere,
                generation: 0,
            },
        );
        Ok(EventHandle { device: dev, raw })
    }

    fn event_destroy(&self, event: EventHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::EventDestroy)?;
        st.event(event)?;
        st.events.remove(&event.raw);
        Ok(())
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::EventRecord)?;
        let key = st.stream_key(stream)?;
        if st.event(event)?.device != stream.device {
            return Err(DriverError::INVALID_HANDLE);
        }
        let link = st.streams.get(&key).and_then(|s| s.capture.clone());
        if let Some(link) = link {
            if st.captures.get(&link.id).is_some_and(|c| c.invalidated) {
                return Err(DriverError::STREAM_CAPTURE_INVALIDATED);
            }
            if let Some(ev) = st.events.get_mut(&event.raw) {
                ev.recorded = Recorded::Captured {
                    capture: link.id,
                    deps: link.deps,
                };
            }
            return Ok(());
        }
        let generation = st.events.get(&event.raw).map_or(0, |e| e.generation + 1);
        let seq = st.streams.get(&key).map_or(0, |s| s.enqueued + 1);
        if let Some(ev) = st.events.get_mut(&event.raw) {
            ev.generation = generation;
            ev.recorded = Recorded::Stream {
                stream: key,
                seq,
                generation,
                at: None,
            };
        }
        // Implicit legacy-stream waits may come first; the record is the last item.
        st.enqueue(
            key,
            Work::Record {
                event: event.raw,
                generation,
            },
        )?;
        let seq = st.streams.get(&key).map_or(seq, |s| s.enqueued);
        if let Some(FakeEvent {
            recorded: Recorded::Stream { seq: s, .. },
            ..
        }) = st.events.get_mut(&event.raw)
        {
            *s = seq;
        }
        Ok(())
    }

    fn event_query(&self, event: EventHandle) -> Result<bool, DriverError> {
        let mut st = self.enter(Call::EventQuery)?;
        st.refuse_captured_event(event, DriverError::CAPTURED_EVENT)?;
        st.check_unsafe_call()?;
        let ev = st.event(event)?;
        Ok(st.event_done(ev))
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::EventSynchronize)?;
        st.refuse_captured_event(event, DriverError::INVALID_VALUE)?;
        st.check_unsafe_call()?;
        if let Recorded::Stream { stream, seq, .. } = st.event(event)?.recorded {
            st.run(stream, Some(seq), usize::MAX, true);
            if let Some(e) = st.sticky.get(event.device.as_usize()).copied().flatten() {
                return Err(e);
            }
        }
        Ok(())
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> Result<f32, DriverError> {
        let st = self.enter(Call::EventElapsed)?;
        let stamp = |e: EventHandle| -> Result<Instant, DriverError> {
            let ev = st.event(e)?;
            if !ev.flags.timing {
                return Err(DriverError::INVALID_HANDLE);
            }
            match ev.recorded {
                Recorded::Stream { at: Some(t), .. } => Ok(t),
                Recorded::Stream { at: None, .. } => Err(DriverError::NOT_READY),
                _ => Err(DriverError::INVALID_HANDLE),
            }
        };
        let (a, b) = (stamp(start)?, stamp(end)?);
        let ms = if b >= a {
            (b - a).as_secs_f64() * 1e3
        } else {
            -((a - b).as_secs_f64() * 1e3)
        };
        Ok(ms as f32)
    }

    fn compile_target(&self, dev: DeviceIndex) -> Result<Option<String>, DriverError> {
        self.enter(Call::CompileTarget)?.check_device(dev)?;
        Ok(Some("fake-compute_90".into()))
    }

    fn compile_source(
        &self,
        dev: DeviceIndex,
        source: &str,
        name: &str,
    ) -> Result<Vec<u8>, CompileError> {
        self.enter(Call::CompileSource)?.check_device(dev)?;
        if let Some((line, text)) = source
            .lines()
            .enumerate()
            .find(|(_, l)| l.trim_start().starts_with("#error"))
        {
            return Err(CompileError::Rejected {
                log: format!("{name}({}): catastrophic error: {}", line + 1, text.trim()),
            });
        }
        Ok([FAKE_IMAGE_MAGIC, source.as_bytes()].concat())
    }

    fn module_load(&self, dev: DeviceIndex, image: &[u8]) -> Result<ModuleHandle, DriverError> {
        let mut st = self.enter(Call::ModuleLoad)?;
        st.check_device(dev)?;
        st.check_unsafe_call()?;
        let source = image
            .strip_prefix(FAKE_IMAGE_MAGIC)
            .ok_or(DriverError::INVALID_IMAGE)?;
        let source = String::from_utf8(source.to_vec()).map_err(|_| DriverError::INVALID_IMAGE)?;
        let raw = st.id();
        st.modules.insert(
            raw,
            FakeModule {
                device: dev,
                source,
            },
        );
        Ok(ModuleHandle { device: dev, raw })
    }

    fn module_unload(&self, module: ModuleHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::ModuleUnload)?;
        st.modules
            .remove(&module.raw)
            .ok_or(DriverError::INVALID_HANDLE)?;
        st.functions.retain(|_, f| f.module != module.raw);
        // cuModuleUnload waits for the device's running kernels (seen on an H100).
        let _ = st.drain_device(module.device);
        Ok(())
    }

    fn module_function(
        &self,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        let mut st = self.enter(Call::ModuleFunction)?;
        let m = st
            .modules
            .get(&module.raw)
            .filter(|m| m.device == module.device);
        let m = m.ok_or(DriverError::INVALID_HANDLE)?;
        if !defines(&m.source, name) {
            return Err(DriverError::NOT_FOUND);
        }
        let device = m.device;
        let kernel = st
            .kernels
            .get(name)
            .cloned()
            .ok_or(DriverError::KERNEL_NOT_REGISTERED)?;
        let raw = st.id();
        st.functions.insert(
            raw,
            FakeFunction {
                device,
                module: module.raw,
                name: name.into(),
                kernel,
            },
        );
        Ok(FunctionHandle { device, raw })
    }

    fn launch(
        &self,
        function: FunctionHandle,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::Launch)?;
        let key = st.stream_key(stream)?;
        let f = st
            .functions
            .get(&function.raw)
            .filter(|f| f.device == function.device);
        let f = f.ok_or(DriverError::INVALID_HANDLE)?;
        if f.device != stream.device {
            return Err(DriverError::INVALID_HANDLE);
        }
        if config.total_threads() == 0 || config.block.0 * config.block.1 * config.block.2 > 1024 {
            return Err(DriverError::INVALID_VALUE);
        }
        let work = Work::Kernel {
            name: f.name.clone(),
            kernel: f.kernel.clone(),
            config: *config,
            device: f.device,
            args: args.iter().map(|a| a.bytes().to_vec()).collect(),
        };
        st.enqueue(key, work)?;
        let capturing = st.streams.get(&key).is_some_and(|s| s.capture.is_some());
        if self.launch_blocking && !capturing {
            st.drain(key)?;
        }
        Ok(())
    }

    fn stream_begin_capture(
        &self,
        stream: StreamHandle,
        mode: CaptureMode,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::BeginCapture)?;
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

    fn stream_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle, DriverError> {
        let mut st = self.enter(Call::EndCapture)?;
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

    fn stream_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus, DriverError> {
        let st = self.enter(Call::CaptureStatus)?;
        let key = st.stream_key(stream)?;
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

    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode, DriverError> {
        let _st = self.enter(Call::ExchangeCaptureMode)?;
        Ok(THREAD_CAPTURE_MODE.with(|m| m.replace(mode)))
    }

    fn graph_node_count(&self, graph: GraphHandle) -> Result<usize, DriverError> {
        Ok(self.enter(Call::GraphNodeCount)?.graph(graph)?.nodes.len())
    }

    fn graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle, DriverError> {
        let mut st = self.enter(Call::GraphInstantiate)?;
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

    fn graph_upload(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<(), DriverError> {
        let st = self.enter(Call::GraphUpload)?;
        st.stream_key(stream)?;
        st.execs
            .get(&exec.raw)
            .filter(|e| e.device == exec.device)
            .map(|_| ())
            .ok_or(DriverError::INVALID_HANDLE)
    }

    fn graph_launch(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::GraphLaunch)?;
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

    fn graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::GraphExecDestroy)?;
        st.execs
            .remove(&exec.raw)
            .map(|_| ())
            .ok_or(DriverError::INVALID_HANDLE)
    }

    fn graph_destroy(&self, graph: GraphHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::GraphDestroy)?;
        st.graph(graph)?;
        st.graphs.remove(&graph.raw);
        Ok(())
    }

    fn graph_debug_dot(&self, graph: GraphHandle, path: &Path) -> Result<(), DriverError> {
        let st = self.enter(Call::GraphDebugDot)?;
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

    fn graph_nodes(&self, graph: GraphHandle) -> Result<Vec<GraphNode>, DriverError> {
        let st = self.enter(Call::GraphNodes)?;
        let g = st.graph(graph)?;
        Ok(g.nodes.iter().map(|n| nodes::describe(&n.work)).collect())
    }

    fn graph_set_node(
        &self,
        graph: GraphHandle,
        index: usize,
        node: &GraphNode,
    ) -> Result<(), DriverError> {
        let mut st = self.enter(Call::GraphSetNode)?;
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

    fn graph_exec_set_nodes(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
        changes: &[(usize, GraphNode)],
    ) -> Result<bool, DriverError> {
        let mut st = match self.enter(Call::GraphExecSetNodes) {
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

    fn graph_exec_update(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, DriverError> {
        let mut st = match self.enter(Call::GraphExecUpdate) {
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

    fn vm_granularity(&self, dev: DeviceIndex) -> Result<u64, DriverError> {
        self.enter(Call::VmGranularity)?.check_device(dev)?;
        Ok(GRANULARITY)
    }

    fn vm_reserve(&self, dev: DeviceIndex, bytes: u64) -> Result<VaRange, DriverError> {
        let base = self.enter(Call::VmReserve)?.memory.reserve(dev, bytes)?;
        Ok(VaRange {
            device: dev,
            base,
            bytes,
        })
    }

    fn vm_release(&self, range: VaRange) -> Result<(), DriverError> {
        self.enter(Call::VmRelease)?
            .memory
            .unreserve(range.device, range.base, range.bytes)
    }

    fn vm_create(&self, dev: DeviceIndex, bytes: u64) -> Result<PhysHandle, DriverError> {
        let mut st = self.enter(Call::VmCreate)?;
        if !bytes.is_multiple_of(GRANULARITY) {
            return Err(DriverError::INVALID_VALUE);
        }
        let raw = st.memory.create_chunk(dev, bytes)?;
        Ok(PhysHandle { device: dev, raw })
    }

    fn vm_destroy(&self, handle: PhysHandle) -> Result<(), DriverError> {
        let mut st = self.enter(Call::VmDestroy)?;
        if st.memory.chunk_device(handle.raw) != Some(handle.device) {
            return Err(DriverError::INVALID_HANDLE);
        }
        st.memory.release_chunk(handle.raw)
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
        let mut st = self.enter(Call::VmUnmap)?;
        if device_of(at) != Some(dev) {
            return Err(DriverError::INVALID_VALUE);
        }
        st.memory.unmap(at, bytes)
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
        self.enter(Call::DeviceCanAccessPeer)?
            .can_access_peer(dev, peer)
    }

    fn enable_peer_access(&self, dev: DeviceIndex, peer: DeviceIndex) -> Result<(), DriverError> {
        self.enter(Call::EnablePeerAccess)?.enable_peer(dev, peer)
    }
}
