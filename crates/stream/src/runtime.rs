//! The runtime: one driver, its devices, the per-thread current device and streams.
use crate::error::same_runtime;
use crate::stream::Ownership;
use crate::{AvailabilityCheck, Event, PerDevice, Result, Stream, StreamError};
use ferrocuda_driver::{Driver, FakeDriver, ForeignStream, KernelContext};
use ferrocuda_types::{
    Device, DeviceIndex, DeviceKind, DeviceProperties, DevicePtr, EventFlags, StreamFlags,
    StreamHandle,
};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// Streams per priority in a device's pool, as PyTorch keeps them.
pub const STREAMS_PER_POOL: usize = 32;

static NEXT_RUNTIME_ID: AtomicU64 = AtomicU64::new(1);

/// Round-robin pool of streams of one priority, created on first use.
#[derive(Debug, Default)]
struct StreamPool {
    streams: OnceLock<Vec<Stream>>,
    next: AtomicUsize,
}

#[derive(Debug)]
struct DeviceState {
    default_stream: Stream,
    pools: [StreamPool; 2],
    capture_stream: OnceLock<Stream>,
    properties: OnceLock<DeviceProperties>,
    priority_range: Mutex<Option<(i32, i32)>>,
}

/// Per-thread state for one runtime: current device and current stream per device.
struct ThreadState {
    runtime: u64,
    device: DeviceIndex,
    streams: Vec<Option<Stream>>,
}

thread_local! {
    static THREAD: RefCell<Vec<ThreadState>> = const { RefCell::new(Vec::new()) };
}

/// `torch.cuda` for one driver: devices, streams, events and kernels.
///
/// Most programs use one runtime (the facade's global one); tests make one per backend.
/// Making a runtime initialises nothing: CUDA is initialised at the first call that needs a
/// device (PyTorch's lazy initialisation), or by [`Runtime::init`]. Asking NVML (see
/// [`Runtime::device_count`]) is not initialising.
#[derive(Debug)]
pub struct Runtime {
    id: u64,
    driver: Arc<dyn Driver>,
    /// The devices found at initialisation, or why there are none.
    devices: PerDevice<DeviceState>,
    /// PyTorch's `torch.cuda._initialized`: set by the first use that needs a device, not
    /// by counting them (`is_available`, `device_count`), which asks the driver all the same.
    initialized: AtomicBool,
    pub(crate) kernel_cache: crate::module::KernelCache,
    memory: parking_lot::RwLock<Arc<dyn crate::MemoryResource>>,
    host_memory: parking_lot::RwLock<Arc<dyn crate::HostMemoryResource>>,
    /// PyTorch's `p2pAccessEnabled_` cache: `(dev, dev_to_access)` → whether `dev` has
    /// access ([`Runtime::get_p2p_access`]).
    pub(crate) peer_access: Mutex<std::collections::HashMap<(u16, u16), bool>>,
    /// Large copies from pageable memory, staged by threads when `pageable_copy_threads`
    /// is set.
    pageable: crate::pageable_copy::PageableStaging,
}

impl Runtime {
    /// A runtime over `driver`, with the kernel cache configured from the environment.
    pub fn new(driver: Arc<dyn Driver>) -> Arc<Runtime> {
        Runtime::with_kernel_cache(driver, crate::module::KernelCache::from_env())
    }

    /// A runtime with an explicit kernel cache (`None`: no cache).
    pub fn with_kernel_cache(
        driver: Arc<dyn Driver>,
        cache: crate::module::KernelCache,
    ) -> Arc<Runtime> {
        Arc::new(Runtime {
            id: NEXT_RUNTIME_ID.fetch_add(1, Ordering::Relaxed),
            devices: PerDevice::default(),
            initialized: AtomicBool::new(false),
            kernel_cache: cache,
            peer_access: Mutex::default(),
            pageable: crate::pageable_copy::PageableStaging::new(driver.clone()),
            memory: parking_lot::RwLock::new(Arc::new(crate::DriverMemory(driver.clone()))),
            host_memory: parking_lot::RwLock::new(Arc::new(crate::DriverHostMemory(
                driver.clone(),
            ))),
            driver,
        })
    }

    /// Where device buffers get memory from.
    pub fn memory(&self) -> Arc<dyn crate::MemoryResource> {
        self.memory.read().clone()
    }

    /// Replaces the memory resource (the caching allocator installs itself here). Buffers
    /// already made keep the resource they came from.
    pub fn set_memory(&self, memory: Arc<dyn crate::MemoryResource>) {
        *self.memory.write() = memory;
    }

    /// Where pinned host buffers get memory from.
    pub fn host_memory(&self) -> Arc<dyn crate::HostMemoryResource> {
        self.host_memory.read().clone()
    }

    /// Replaces the pinned host memory resource (the caching host allocator installs itself
    /// here). Buffers already made keep the resource they came from.
    pub fn set_host_memory(&self, memory: Arc<dyn crate::HostMemoryResource>) {
        *self.host_memory.write() = memory;
    }

    /// How many threads stage a copy between pageable host memory and a device (of at least
    /// [`STAGED_MIN`](crate::STAGED_MIN) bytes to the device; to the host, of at least
    /// [`STAGED_READ_MIN`](crate::STAGED_READ_MIN) with at least
    /// [`READ_MIN_THREADS`](crate::READ_MIN_THREADS)): what the host memory resource says
    /// (the caching host allocator's `pageable_copy_threads`; 0, the default: the driver
    /// copies, as for PyTorch). See [`DeviceBuffer::copy_from_host`] and
    /// [`DeviceBuffer::to_host`].
    ///
    /// [`DeviceBuffer::copy_from_host`]: crate::DeviceBuffer::copy_from_host
    /// [`DeviceBuffer::to_host`]: crate::DeviceBuffer::to_host
    pub fn pageable_copy_threads(&self) -> usize {
        self.host_memory().pageable_copy_threads()
    }

    /// The thread count for a staged copy of `bytes` (asked only of a copy that could be
    /// staged: the answer takes the host allocator's lock).
    fn staging_threads(&self, bytes: usize) -> usize {
        if bytes >= crate::STAGED_MIN {
            self.pageable_copy_threads()
        } else {
            0
        }
    }

    /// Copies `src` from pageable host memory to `dst` on `stream`, as the driver's copy
    /// does (`src` consumed on return, the device write in stream order), staged through
    /// page-locked buffers by [`Runtime::pageable_copy_threads`] threads when that is set
    /// and the copy is at least [`STAGED_MIN`](crate::STAGED_MIN) bytes
    /// (`crates/stream/src/pageable_copy/` says how and what stays the same). Crate-private:
    /// `dst` must be a range the caller owns whole ([`DeviceBuffer::copy_from_host`]'s), since
    /// a staged copy that fails part way has written the chunks before the failure, where the
    /// driver refuses a bad range before writing anything.
    ///
    /// [`DeviceBuffer::copy_from_host`]: crate::DeviceBuffer::copy_from_host
    pub(crate) fn copy_from_pageable(
        &self,
        dst: DevicePtr,
        src: &[u8],
        stream: &Stream,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let threads = self.staging_threads(src.len());
        Ok(self
            .pageable
            .to_device(dst, src, stream.handle(), stream.device(), threads)?)
    }

    /// Copies `src` (device memory) to pageable host memory `dst` in `stream` order and
    /// waits for it, as the driver's copy does, staged as
    /// [`Runtime::copy_from_pageable`] stages (chunks transferred into page-locked buffers
    /// and copied out by threads) from [`STAGED_READ_MIN`](crate::STAGED_READ_MIN) bytes
    /// with at least [`READ_MIN_THREADS`](crate::READ_MIN_THREADS). Crate-private for the
    /// same reason: `src` must be a range the caller owns whole ([`DeviceBuffer::to_host`]'s).
    ///
    /// [`DeviceBuffer::to_host`]: crate::DeviceBuffer::to_host
    pub(crate) fn copy_to_pageable(
        &self,
        dst: &mut [u8],
        src: DevicePtr,
        stream: &Stream,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let threads = self.staging_threads(dst.len());
        Ok(self
            .pageable
            .to_host(dst, src, stream.handle(), stream.device(), threads)?)
    }

    /// The driver underneath.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// This runtime's number, unique in the process. Streams, events and kernels carry the
    /// number of the runtime that made them ([`Stream::runtime_id`]), and every operation
    /// refuses those of another runtime ([`StreamError::OtherRuntime`]).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// [`StreamError::OtherRuntime`] unless `stream` was made by this runtime. What the
    /// layers above call on a stream they were given before using its handle.
    pub fn check_stream(&self, stream: &Stream) -> Result<()> {
        same_runtime(self.id, stream.runtime_id(), "the stream")
    }

    /// [`StreamError::OtherRuntime`] unless `event` was made by this runtime.
    pub fn check_event(&self, event: &Event) -> Result<()> {
        same_runtime(self.id, event.runtime_id(), "the event")
    }

    /// [`StreamError::OtherRuntime`] unless `buffer` (`what`, in the error) was made on
    /// this runtime.
    pub(crate) fn check_buffer<T: ferrocuda_types::Element>(
        &self,
        buffer: &crate::DeviceBuffer<T>,
        what: &'static str,
    ) -> Result<()> {
        same_runtime(self.id, buffer.runtime().id(), what)
    }

    // ---- kernels on the fake device ------------------------------------------------------

    /// The fake device under this runtime, if it runs on one.
    pub fn fake(&self) -> Option<&FakeDriver> {
        self.driver.as_fake()
    }

    /// Registers `kernel` as the host function the fake device runs for the kernel called
    /// `name` (in any module whose source defines it), replacing one registered before;
    /// returns `true`. On the real driver nothing is registered (the CUDA source runs) and
    /// the answer is `false`, so a program that runs on both can call it unconditionally.
    ///
    /// Only a program's own kernels need this: the library's kernels (the gradient
    /// scaler's, the optimizers', the Philox generator's) are provided by the crates that
    /// own them when they load their module on a fake device. A kernel looked up with no
    /// host function is [`StreamError::KernelNotRegistered`], naming it.
    pub fn register_fake_kernel<F>(&self, name: &str, kernel: F) -> bool
    where
        F: Fn(&mut KernelContext<'_>) -> std::result::Result<(), String> + Send + Sync + 'static,
    {
        match self.fake() {
            Some(fake) => {
                fake.register_kernel(name, kernel);
                true
            }
            None => false,
        }
    }

    // ---- initialisation and devices ------------------------------------------------------

    /// Initialises CUDA for this runtime, once (`torch.cuda.init()`): the driver's `cuInit`
    /// and device count. Without a usable device, [`StreamError::NotAvailable`]; in a child
    /// forked after CUDA was initialised, [`StreamError::BadFork`].
    pub fn init(&self) -> Result<()> {
        self.devices().map(|_| ())
    }

    /// Whether something that needs a device has initialised CUDA through this runtime, and
    /// this process is not a child forked since (`torch.cuda.is_initialized()`, which is
    /// `_initialized`, set by `_lazy_init`). Counting devices asks the driver (`cuInit`,
    /// after which a fork is bad) without making this true, as PyTorch's
    /// `_cuda_getDeviceCount` does in `is_available()` and `device_count()`.
    pub fn is_initialized(&self) -> bool {
        self.initialized.load(Ordering::Acquire) && !ferrocuda_driver::fork::in_bad_fork()
    }

    /// The devices, initialising at the first call (in a bad fork, [`StreamError::BadFork`]):
    /// what every use that needs a device goes through (PyTorch's `_lazy_init`).
    fn devices(&self) -> Result<&[DeviceState]> {
        let found = self.found_devices()?;
        if !self.initialized.load(Ordering::Relaxed) {
            self.initialized.store(true, Ordering::Release);
        }
        Ok(found)
    }

    /// The devices, asking the driver at the first call, without counting as PyTorch's lazy
    /// initialisation (see [`Runtime::is_initialized`]).
    fn found_devices(&self) -> Result<&[DeviceState]> {
        self.devices.get_or_init(&*self.driver, |d| DeviceState {
            default_stream: Stream::wrap(
                self.driver.clone(),
                self.id,
                StreamHandle::legacy(d),
                0,
                Ownership::Borrowed,
            ),
            pools: Default::default(),
            capture_stream: OnceLock::new(),
            properties: OnceLock::new(),
            priority_range: Mutex::new(None),
        })
    }

    /// Whether at least one device can be used (`torch.cuda.is_available()`), checked as
    /// the environment says ([`AvailabilityCheck::from_env`]). Never fails, not even in a bad
    /// fork.
    pub fn is_available(&self) -> bool {
        self.is_available_by(AvailabilityCheck::from_env())
    }

    /// Whether at least one device can be used, checked by `check`: by the driver
    /// (initialising CUDA; in a bad fork, what was found before the fork), or by
    /// [`Runtime::device_count`] (NVML's count where it answers, leaving CUDA uninitialised).
    pub fn is_available_by(&self, check: AvailabilityCheck) -> bool {
        match check {
            AvailabilityCheck::Driver => self.driver_device_count() > 0,
            AvailabilityCheck::Nvml => self.device_count() > 0,
        }
    }

    /// Number of devices (`torch.cuda.device_count()`): once initialised, those found then
    /// (also in a bad fork); before, NVML's count with `CUDA_VISIBLE_DEVICES` applied, asked
    /// at every call as PyTorch does before `_lazy_init`, so that counting leaves CUDA
    /// uninitialised and a later fork safe; where NVML cannot say, the driver's (its first
    /// count, kept, as `_cuda_getDeviceCount` keeps it), which runs `cuInit`. 0 without a
    /// driver.
    pub fn device_count(&self) -> usize {
        if !self.initialized.load(Ordering::Acquire) {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
            let nvml = crate::availability::nvml_visible_count(visible.as_deref(), || {
                self.driver.nvml_device_count()
            });
            if let Some(n) = nvml {
                return n;
            }
        }
        self.driver_device_count()
    }

    /// The devices found at initialisation (PyTorch's `_cuda_getDeviceCount`, which keeps
    /// its first count), asking the driver now if needed; 0 when that fails.
    fn driver_device_count(&self) -> usize {
        match self.devices.made() {
            Some(found) => found.map_or(0, <[_]>::len),
            None => self.found_devices().map_or(0, <[_]>::len),
        }
    }

    /// Checks a device index (initialising CUDA at the first call).
    pub fn check_device(&self, dev: DeviceIndex) -> Result<DeviceIndex> {
        self.device_state(dev).map(|_| dev)
    }

    /// Resolves a [`Device`] to an index: `cuda` means the current device; `cpu` is an error.
    pub fn resolve(&self, device: &Device) -> Result<DeviceIndex> {
        match (device.kind, device.index) {
            (DeviceKind::Cpu, _) => Err(StreamError::NotCuda),
            (DeviceKind::Cuda, Some(i)) => self.check_device(i),
            (DeviceKind::Cuda, None) => self.check_device(self.current_device()),
        }
    }

    fn device_state(&self, dev: DeviceIndex) -> Result<&DeviceState> {
        let states = self.devices()?;
        states
            .get(dev.as_usize())
            .ok_or(StreamError::InvalidDevice {
                index: dev.0,
                count: states.len(),
            })
    }

    fn with_thread<R>(&self, f: impl FnOnce(&mut ThreadState) -> R) -> R {
        THREAD.with(|t| {
            let mut states = t.borrow_mut();
            let i = match states.iter().position(|s| s.runtime == self.id) {
                Some(i) => i,
                None => {
                    states.push(ThreadState {
                        runtime: self.id,
                        device: DeviceIndex(0),
                        streams: Vec::new(),
                    });
                    states.len() - 1
                }
            };
            f(&mut states[i])
        })
    }

    // ---- devices -------------------------------------------------------------------------

    /// This thread's current device (`torch.cuda.current_device()`); device 0 at first.
    pub fn current_device(&self) -> DeviceIndex {
        self.with_thread(|t| t.device)
    }

    /// Sets this thread's current device (`torch.cuda.set_device`).
    pub fn set_device(&self, dev: DeviceIndex) -> Result<()> {
        self.check_device(dev)?;
        self.with_thread(|t| t.device = dev);
        Ok(())
    }

    /// Makes `dev` current until the guard drops (`with torch.cuda.device(dev)`). Guards nest.
    pub fn device_guard(&self, dev: DeviceIndex) -> Result<DeviceGuard<'_>> {
        let previous = self.current_device();
        self.set_device(dev)?;
        Ok(DeviceGuard {
            runtime: self,
            previous,
            _not_send: PhantomData,
        })
    }

    /// Name, capability, memory and SMs (`torch.cuda.get_device_properties`).
    pub fn device_properties(&self, dev: DeviceIndex) -> Result<DeviceProperties> {
        let state = self.device_state(dev)?;
        if let Some(p) = state.properties.get() {
            return Ok(p.clone());
        }
        let p = self.driver.device_properties(dev)?;
        Ok(state.properties.get_or_init(|| p).clone())
    }

    /// `(free, total)` bytes (`torch.cuda.mem_get_info`).
    pub fn mem_get_info(&self, dev: DeviceIndex) -> Result<(u64, u64)> {
        self.check_device(dev)?;
        Ok(self.driver.mem_get_info(dev)?)
    }

    /// Waits for all work on `dev` (`torch.cuda.synchronize`).
    pub fn synchronize(&self, dev: DeviceIndex) -> Result<()> {
        self.check_device(dev)?;
        Ok(self.driver.device_synchronize(dev)?)
    }

    // ---- streams -------------------------------------------------------------------------

    /// The legacy default stream of `dev`.
    pub fn default_stream(&self, dev: DeviceIndex) -> Result<Stream> {
        Ok(self.device_state(dev)?.default_stream.clone())
    }

    /// This thread's current stream on `dev`; the default stream unless set.
    pub fn current_stream(&self, dev: DeviceIndex) -> Result<Stream> {
        let state = self.device_state(dev)?;
        let set = self.with_thread(|t| t.streams.get(dev.as_usize()).cloned().flatten());
        Ok(set.unwrap_or_else(|| state.default_stream.clone()))
    }

    /// Makes `stream` this thread's current stream on its device, and that device the
    /// current device (`torch.cuda.set_stream`, which sets the stream's device first). A
    /// stream of another runtime is [`StreamError::OtherRuntime`].
    pub fn set_stream(&self, stream: &Stream) -> Result<()> {
        self.check_stream(stream)?;
        let dev = self.check_device(stream.device())?;
        self.with_thread(|t| {
            t.device = dev;
            if t.streams.len() <= dev.as_usize() {
                t.streams.resize(dev.as_usize() + 1, None);
            }
            t.streams[dev.as_usize()] = Some(stream.clone());
        });
        Ok(())
    }

    /// Makes `stream` current, and its device current, until the guard drops
    /// (`with torch.cuda.stream(s)`). A stream of another runtime is
    /// [`StreamError::OtherRuntime`], and nothing changes.
    pub fn stream_guard(&self, stream: &Stream) -> Result<StreamGuard<'_>> {
        self.check_stream(stream)?;
        let dev = stream.device();
        let previous_stream = self.current_stream(dev)?;
        let device = self.device_guard(dev)?;
        self.set_stream(stream)?;
        Ok(StreamGuard {
            runtime: self,
            previous_stream,
            _device: device,
        })
    }

    /// The stream priority range of `dev` as `(least, greatest)`; greatest is most negative.
    pub fn priority_range(&self, dev: DeviceIndex) -> Result<(i32, i32)> {
        let state = self.device_state(dev)?;
        let mut cached = state.priority_range.lock();
        if let Some(r) = *cached {
            return Ok(r);
        }
        let r = self.driver.stream_priority_range(dev)?;
        *cached = Some(r);
        Ok(r)
    }

    /// A new stream owned by the caller, destroyed when the last clone drops. The priority is
    /// clamped into the device's range (lower is higher, as in CUDA).
    pub fn new_stream(&self, dev: DeviceIndex, priority: i32) -> Result<Stream> {
        let (least, greatest) = self.priority_range(dev)?;
        let priority = priority.clamp(greatest, least);
        let handle = self.driver.stream_create(
            dev,
            StreamFlags {
                non_blocking: true,
                priority,
            },
        )?;
        Ok(Stream::wrap(
            self.driver.clone(),
            self.id,
            handle,
            priority,
            Ownership::Owned,
        ))
    }

    /// A stream from the device's pool (`torch.cuda.Stream()` in PyTorch): 32 per priority,
    /// handed out round robin, never destroyed.
    pub fn stream_from_pool(&self, dev: DeviceIndex, high_priority: bool) -> Result<Stream> {
        let state = self.device_state(dev)?;
        let (least, greatest) = self.priority_range(dev)?;
        let (pool, priority) = if high_priority {
            // c10/cuda/CUDAStream.cpp: `max_stream_priorities` is the device's number of
            // priorities, at most `max_compile_time_stream_priorities` (4), and the high
            // pool's priority `-max_stream_priorities + 1` (-3 on a (0, -5) device).
            let levels = (least - greatest + 1).clamp(1, 4);
            (&state.pools[1], -(levels - 1))
        } else {
            (&state.pools[0], least)
        };
        let streams = match pool.streams.get() {
            Some(s) => s,
            None => {
                let made = (0..STREAMS_PER_POOL)
                    .map(|_| {
                        let flags = StreamFlags {
                            non_blocking: true,
                            priority,
                        };
                        let h = self.driver.stream_create(dev, flags)?;
                        Ok(Stream::wrap(
                            self.driver.clone(),
                            self.id,
                            h,
                            priority,
                            Ownership::Owned,
                        ))
                    })
                    .collect::<Result<Vec<_>>>()?;
                // A racing thread may have won; its pool is kept and ours dropped (destroyed).
                pool.streams.get_or_init(|| made)
            }
        };
        let i = pool.next.fetch_add(1, Ordering::Relaxed) % STREAMS_PER_POOL;
        Ok(streams[i].clone())
    }

    /// The stream graph captures use when they are given none: a stream from the device's
    /// pool, drawn at the first call and the same ever after (PyTorch's class-level
    /// `torch.cuda.graph.default_capture_stream`, torch/cuda/graphs.py, kept per device
    /// here). Captures that share a memory pool reuse each other's blocks only when they
    /// capture on one stream, since cached blocks are tagged by stream.
    pub fn default_capture_stream(&self, dev: DeviceIndex) -> Result<Stream> {
        let state = self.device_state(dev)?;
        if let Some(s) = state.capture_stream.get() {
            return Ok(s.clone());
        }
        let drawn = self.stream_from_pool(dev, false)?;
        Ok(state.capture_stream.get_or_init(|| drawn).clone())
    }

    /// Wraps a stream created outside ferrocuda (`torch.cuda.ExternalStream`). It is not
    /// destroyed by ferrocuda. The handle must name a live stream of this driver.
    pub fn external_stream(&self, handle: StreamHandle) -> Result<Stream> {
        self.check_device(handle.device)?;
        // Validates the handle before anything is built on it.
        self.driver.stream_query(handle)?;
        Ok(Stream::wrap(
            self.driver.clone(),
            self.id,
            handle,
            0,
            Ownership::Borrowed,
        ))
    }

    /// Adopts a stream another library made (a cudarc stream: [`ForeignStream::cudarc`]),
    /// as `torch.cuda.ExternalStream` wraps a raw stream: work of ferrocuda can go on it (make
    /// it current with [`Runtime::stream_guard`]) and it is never destroyed by ferrocuda. The
    /// returned stream keeps the foreign one alive; when its last clone drops, the driver
    /// forgets it. Adopting one stream twice gives two equal streams. Its priority reads 0,
    /// as for [`Runtime::external_stream`].
    pub fn adopt_stream(&self, foreign: ForeignStream) -> Result<Stream> {
        self.check_device(foreign.device())?;
        let handle = self.driver.stream_adopt(&foreign)?;
        Ok(Stream::wrap(
            self.driver.clone(),
            self.id,
            handle,
            0,
            Ownership::Adopted(foreign),
        ))
    }

    // ---- events --------------------------------------------------------------------------

    /// A new event (`torch.cuda.Event(enable_timing, blocking, interprocess)`), created on
    /// the driver at its first record.
    pub fn new_event(&self, flags: EventFlags) -> Result<Event> {
        if flags.interprocess && flags.timing {
            return Err(StreamError::InterprocessTiming);
        }
        Ok(Event::new(self.driver.clone(), self.id, flags))
    }
}

/// Restores the previous current device when dropped. Not `Send`: it belongs to its thread.
#[derive(Debug)]
#[must_use = "the device is restored when the guard drops"]
pub struct DeviceGuard<'a> {
    runtime: &'a Runtime,
    previous: DeviceIndex,
    _not_send: PhantomData<*const ()>,
}

impl DeviceGuard<'_> {
    /// The device that was current before the guard.
    pub fn previous(&self) -> DeviceIndex {
        self.previous
    }
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        let previous = self.previous;
        self.runtime.with_thread(|t| t.device = previous);
    }
}

/// Restores the previous current stream (and device) when dropped.
#[derive(Debug)]
#[must_use = "the stream is restored when the guard drops"]
pub struct StreamGuard<'a> {
    runtime: &'a Runtime,
    previous_stream: Stream,
    _device: DeviceGuard<'a>,
}

impl Drop for StreamGuard<'_> {
    fn drop(&mut self) {
        let dev = self.previous_stream.device();
        let previous = self.previous_stream.clone();
        self.runtime.with_thread(|t| {
            if let Some(slot) = t.streams.get_mut(dev.as_usize()) {
                *slot = Some(previous);
            }
        });
    }
}
