//! The `backend:cudaMallocAsync` allocator: PyTorch's `CudaMallocAsyncAllocator`
//! (`c10/cuda/CUDAMallocAsyncAllocator.cpp`) over the driver's stream-ordered allocator.
//!
//! It caches nothing itself: each device's default pool does, its release threshold set to
//! `u64::MAX` so freed memory stays reserved (`lazy_init_device`). The allocator keeps only
//! what PyTorch keeps (`ptr_info`): each live pointer's size, creation stream, the streams
//! `record_stream` added and whether it was allocated during a capture, plus its own count
//! of bytes in use per device for the memory fraction.
//!
//! - **Free** (`free_impl`): a pointer used only on its creation stream is freed there
//!   (`cuMemFreeAsync`). One used on other streams is freed on the device's "unifying"
//!   stream (a stream of its own, made at the device's first use), which first waits on
//!   events recorded on the creation stream and on every recorded stream.
//! - **Memory fraction** (`setMemoryFraction`): a limit of `fraction × total` bytes checked
//!   against the allocator's own count before the driver is asked; passing it is an
//!   out-of-memory error with PyTorch's text ([`PoolOutOfMemory`]).
//! - **Out of memory from the pool**: the allocating stream is synchronized, the pool
//!   trimmed to nothing and the allocation tried once more (PyTorch 2.15) before the error;
//!   not while a capture is underway (a synchronization would invalidate it).
//! - **Statistics** (`getDeviceStats`): `allocated_bytes` and `active_bytes` are the pool's
//!   used memory, `reserved_bytes` its reserved memory (current and peak, aggregate only);
//!   everything else is zero.
//! - **Capture** (`beginAllocateToPool` … `endAllocateToPool`): one capture per process;
//!   pool ids are ignored; frees of pointers allocated outside the capture are deferred
//!   until it ends (with PyTorch's warning), and every stream freed on during the capture
//!   is joined back into the capturing stream before it ends.
//! - Unlike PyTorch, no lock is held across the blocking calls of the out-of-memory retry
//!   and `empty_cache` (device synchronization); allocation and free (which do not block)
//!   run under the allocator's one mutex, as PyTorch's `general_mutex`.
use crate::AllocError;
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{
    DeviceIndex, DevicePtr, EventFlags, PoolOutOfMemory, StreamFlags, StreamHandle,
};
use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;
use std::sync::{Arc, OnceLock};

mod inspect;

pub use inspect::ASYNC_IGNORES_WARNING;

/// PyTorch refuses requests of 1 EB or more before anything else.
const ONE_EXABYTE: u64 = 1 << 60;

/// What PyTorch's `PtrUsage` records of a live pointer.
#[derive(Clone, Debug)]
struct PtrUsage {
    /// Side streams added by `record_stream` (not the creation stream), in order.
    recorded: Vec<StreamHandle>,
    creation: StreamHandle,
    size: u64,
    captured: bool,
}

/// Per device: made at its first use (`lazy_init_device`).
#[derive(Copy, Clone, Debug)]
struct DeviceState {
    /// The stream frees of pointers used on several streams go through.
    unifying: StreamHandle,
    /// `pytorch_used_bytes`.
    used: u64,
    /// `pytorch_memory_limits` (`u64::MAX` until a fraction is set).
    limit: u64,
}

#[derive(Debug, Default)]
struct State {
    devices: Vec<Option<DeviceState>>,
    ptrs: FxHashMap<u64, PtrUsage>,
    /// Frees of uncaptured pointers asked for during a capture, done after it.
    deferred: Vec<DevicePtr>,
    capture_underway: bool,
    /// Streams freed on during the capture, joined into the capture stream at its end.
    capture_free_streams: Vec<StreamHandle>,
    warned_deferred_free: bool,
    warned_reset_accumulated: bool,
    warnings: Vec<String>,
}

impl State {
    fn warn(&mut self, text: String) {
        self.warnings.push(text);
    }
}

/// PyTorch's `backend:cudaMallocAsync` allocator for every device of one driver (its state
/// is process-wide in PyTorch: one capture at a time, one pointer table). Making it
/// initialises nothing: the driver is asked for its devices at the first use.
#[derive(Debug)]
pub struct AsyncAllocator {
    driver: Arc<dyn Driver>,
    /// `init(device_count)`: made at the first use.
    device_count: OnceLock<usize>,
    state: Mutex<State>,
}

impl AsyncAllocator {
    /// The allocator for the devices of `driver`.
    pub fn new(driver: Arc<dyn Driver>) -> Arc<AsyncAllocator> {
        Arc::new(AsyncAllocator {
            driver,
            device_count: OnceLock::new(),
            state: Mutex::new(State::default()),
        })
    }

    /// `name()`: what `get_allocator_backend` reports.
    pub fn name(&self) -> &'static str {
        "cudaMallocAsync"
    }

    /// The driver it allocates through.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// `init(device_count)`, which CUDA's lazy initialisation runs (the first use does it
    /// too): asks the driver for its devices.
    pub fn init(&self) -> Result<usize, AllocError> {
        if let Some(&n) = self.device_count.get() {
            return Ok(n);
        }
        let n = self
            .driver
            .device_count()
            .map_err(|e| match AllocError::from(e) {
                AllocError::Driver(reason) => AllocError::NotAvailable { reason },
                other => other,
            })?;
        Ok(*self.device_count.get_or_init(|| n))
    }

    /// `initialized()`.
    pub fn is_initialized(&self) -> bool {
        self.device_count.get().is_some()
    }

    /// `assertValidDevice`: PyTorch's "Invalid device argument." past the last device.
    fn check_device(&self, dev: DeviceIndex) -> Result<(), AllocError> {
        let count = self.init()?;
        if dev.as_usize() < count {
            Ok(())
        } else {
            Err(AllocError::AsyncNoSuchDevice {
                device: dev.0,
                count,
            })
        }
    }

    /// `lazy_init_device`: the pool keeps everything, the unifying stream is made.
    fn device_state<'a>(
        &self,
        st: &'a mut State,
        dev: DeviceIndex,
    ) -> Result<&'a mut DeviceState, AllocError> {
        self.check_device(dev)?;
        if st.devices.len() <= dev.as_usize() {
            st.devices.resize(dev.as_usize() + 1, None);
        }
        let i = dev.as_usize();
        if st.devices[i].is_none() {
            self.driver.mem_pool_set_release_threshold(dev, u64::MAX)?;
            let unifying = self.driver.stream_create(
                dev,
                StreamFlags {
                    non_blocking: true,
                    priority: 0,
                },
            )?;
            return Ok(st.devices[i].insert(DeviceState {
                unifying,
                used: 0,
                limit: u64::MAX,
            }));
        }
        st.devices[i].as_mut().ok_or(AllocError::AsyncNoSuchDevice {
            device: dev.0,
            count: i,
        })
    }

    /// `mallocAsync`: `bytes` on `dev` in `stream` order (address 0 for 0 bytes, as
    /// `raw_alloc`). Out of memory from the pool: synchronize, trim, one retry.
    pub fn allocate(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr, AllocError> {
        if bytes >= ONE_EXABYTE {
            return Err(AllocError::OutOfMemory(Box::new(
                ferrocuda_types::OutOfMemory {
                    device: dev.0,
                    requested: bytes,
                    beyond_one_exabyte: true,
                    device_total: 0,
                    device_free: 0,
                    processes: Vec::new(),
                    allowed: None,
                    allocated: 0,
                    reserved: 0,
                    allocated_in_private_pools: 0,
                    largest_free_block: 0,
                    cached_per_stream: Vec::new(),
                    non_releasable: 0,
                    expandable_segments: false,
                    rejected_by_fraction: false,
                    forensics: None,
                },
            )));
        }
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        self.check_device(dev)?;
        match self.try_allocate(dev, bytes, stream)? {
            Ok(ptr) => return Ok(ptr),
            Err(Refused::Limit) => {}
            // While a capture is underway no stream is synchronized: a capturing stream's
            // synchronization would invalidate the capture (and, in global mode, so would
            // another stream's), so the out-of-memory error stands and the capture goes on.
            Err(Refused::Pool) if self.capture_underway() => {}
            Err(Refused::Pool) => {
                // PyTorch 2.15 (#188110): synchronize the stream, trim the pool's idle
                // memory, retry once. Trimming cannot help a refusal by the allocator's own
                // count, so that one is not retried. Where the synchronization or the trim
                // fails, the out-of-memory error stands.
                let trimmed = self
                    .driver
                    .stream_synchronize(stream)
                    .and_then(|()| self.driver.mem_pool_trim_to(dev, 0));
                if trimmed.is_ok()
                    && let Ok(ptr) = self.try_allocate(dev, bytes, stream)?
                {
                    return Ok(ptr);
                }
            }
        }
        Err(self.out_of_memory(dev, bytes))
    }

    /// One attempt: `Ok(Err(_))` when refused for memory.
    fn try_allocate(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<Result<DevicePtr, Refused>, AllocError> {
        let mut st = self.state.lock();
        if !st.capture_underway && !st.deferred.is_empty() {
            // Each deferred free is tried once; one the driver refuses (a recorded stream
            // destroyed since, say) is reported as a warning rather than failing this
            // unrelated allocation or keeping the others.
            for ptr in std::mem::take(&mut st.deferred) {
                if let Err(e) = self.free_impl(&mut st, ptr) {
                    st.warn(format!(
                        "ferrocuda: the deferred free of {:#x} failed: {e}",
                        ptr.0
                    ));
                }
            }
        }
        let capture_underway = st.capture_underway;
        let ds = self.device_state(&mut st, dev)?;
        if ds.used.saturating_add(bytes) > ds.limit {
            return Ok(Err(Refused::Limit));
        }
        let ptr = match self.driver.mem_alloc_async(dev, bytes, stream) {
            Ok(ptr) => ptr,
            Err(DriverError::OUT_OF_MEMORY) => return Ok(Err(Refused::Pool)),
            Err(e) => return Err(e.into()),
        };
        ds.used += bytes;
        st.ptrs.insert(
            ptr.0,
            PtrUsage {
                recorded: Vec::new(),
                creation: stream,
                size: bytes,
                captured: capture_underway,
            },
        );
        Ok(Ok(ptr))
    }

    /// PyTorch's out-of-memory error for `bytes` on `dev`.
    fn out_of_memory(&self, dev: DeviceIndex, bytes: u64) -> AllocError {
        let (device_free, device_total) = match self.driver.mem_get_info(dev) {
            Ok(info) => info,
            Err(e) => return e.into(),
        };
        let st = self.state.lock();
        let ds = st.devices.get(dev.as_usize()).copied().flatten();
        AllocError::PoolOutOfMemory(Box::new(PoolOutOfMemory {
            device: dev.0,
            allocated: ds.map_or(0, |d| d.used),
            requested: bytes,
            device_total,
            device_free,
            limit: ds.map_or(u64::MAX, |d| d.limit),
        }))
    }

    /// `freeAsync`: gives `ptr` back in stream order; during a capture, a pointer allocated
    /// outside it is freed only after the capture (with PyTorch's warning, once).
    pub fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let mut st = self.state.lock();
        let usage = st.ptrs.get(&ptr.0).ok_or(AllocError::InvalidPointer(ptr))?;
        let captured = usage.captured;
        if st.capture_underway {
            if !captured {
                if !st.warned_deferred_free {
                    st.warned_deferred_free = true;
                    st.warn(format!(
                        "freeAsync() was called on an uncaptured allocation during graph capture (address = {:#x}). This may be benign, for example, a Python tensor in the capture might happen to shadow (use the same name as) an unrelated temporary tensor from somewhere before capture, pushing the earlier tensor out of scope. However, if the tensor we're freeing here IS used by the capture, freeing it is an error, and may cause illegal memory accesses or memory corruption during graph replay.",
                        ptr.0
                    ));
                }
                st.deferred.push(ptr);
                return Ok(());
            }
        } else if captured {
            st.warn(format!(
                "Attempting uncaptured free of a captured allocation with address {:#x}\nThis is technically allowed, but may indicate you are losing the last user-visible tensor through which the allocation can be accessed, so you'll have no way to view the data after future replays of the owning graph.",
                ptr.0
            ));
        }
        self.free_impl(&mut st, ptr)
    }

    /// `free_impl`. The pointer leaves the books before the driver is asked, so that a
    /// refusal (a capture invalidated meanwhile, a recorded stream destroyed) cannot leave
    /// bytes counted that no owner will free again; the refusal is returned.
    fn free_impl(&self, st: &mut MutexGuard<'_, State>, ptr: DevicePtr) -> Result<(), AllocError> {
        let usage = st
            .ptrs
            .remove(&ptr.0)
            .ok_or(AllocError::InvalidPointer(ptr))?;
        let PtrUsage {
            creation,
            size,
            recorded,
            ..
        } = usage;
        let dev = creation.device;
        self.device_state(st, dev)?.used -= size;
        let free_stream = if recorded.is_empty() {
            creation
        } else {
            let unifying = self.device_state(st, dev)?.unifying;
            self.sync_raw(creation, unifying)?;
            for s in &recorded {
                match self.sync_raw(*s, unifying) {
                    // A recorded stream destroyed since cannot be waited on (PyTorch never
                    // destroys streams): outside a capture the device is synchronized
                    // instead, which covers its last work. Rare, so under the lock.
                    Err(AllocError::Driver(e))
                        if e == DriverError::INVALID_HANDLE && !st.capture_underway =>
                    {
                        self.driver.device_synchronize(dev)?;
                    }
                    other => other?,
                }
            }
            unifying
        };
        self.driver.mem_free_async(ptr, free_stream)?;
        if st.capture_underway && !st.capture_free_streams.contains(&free_stream) {
            st.capture_free_streams.push(free_stream);
        }
        Ok(())
    }

    /// `sync_raw`: `dependent` waits for the work enqueued on `dependency` so far.
    fn sync_raw(
        &self,
        dependency: StreamHandle,
        dependent: StreamHandle,
    ) -> Result<(), AllocError> {
        let event = self
            .driver
            .event_create(dependency.device, EventFlags::default())?;
        let waited = self
            .driver
            .event_record(event, dependency)
            .and_then(|()| self.driver.stream_wait_event(dependent, event));
        let destroyed = self.driver.event_destroy(event);
        waited.and(destroyed)?;
        Ok(())
    }

    /// `recordStream`: `stream` uses `ptr`, so its free waits for `stream`'s work. The
    /// creation stream itself is not recorded (PyTorch's warning). Address 0 is ignored.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), AllocError> {
        if ptr.0 == 0 {
            return Ok(());
        }
        let mut st = self.state.lock();
        let usage = st
            .ptrs
            .get_mut(&ptr.0)
            .ok_or(AllocError::InvalidPointer(ptr))?;
        if usage.creation == stream {
            st.warn(
                "Called record_stream on tensor whose original creation stream matches the recorded stream. This is unnecessary and has no effect.".into(),
            );
        } else if !usage.recorded.contains(&stream) {
            usage.recorded.push(stream);
        }
        Ok(())
    }

    /// `getBaseAllocation`: the pointer itself and its size.
    pub fn base_allocation(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64), AllocError> {
        let st = self.state.lock();
        let usage = st.ptrs.get(&ptr.0).ok_or(AllocError::InvalidPointer(ptr))?;
        Ok((ptr, usage.size))
    }

    /// Warnings PyTorch would have raised (`TORCH_WARN`) since the last call, in order.
    pub fn take_warnings(&self) -> Vec<String> {
        std::mem::take(&mut self.state.lock().warnings)
    }

    // ---- capture ---------------------------------------------------------------------

    /// `beginAllocateToPool` (the pool id and stream filter are ignored): a capture on
    /// `dev` begins; one at a time per process. The device is set up first if no
    /// allocation did it yet: its pool's release threshold cannot be set once the capture
    /// has begun (the driver refuses pool calls then), and in PyTorch it is always set up by
    /// then, since `CUDAGraph::capture_begin` allocates its generator's graph-state tensors
    /// before it begins capturing.
    pub fn begin_allocate_to_pool(&self, dev: DeviceIndex) -> Result<(), AllocError> {
        let mut st = self.state.lock();
        if st.capture_underway {
            return Err(AllocError::CaptureUnderway);
        }
        self.device_state(&mut st, dev)?;
        st.capture_free_streams.clear();
        st.capture_underway = true;
        Ok(())
    }

    /// `endAllocateToPool`: every stream freed on during the capture is joined into
    /// `capture_stream`, and the capture is over (deferred frees run at the next
    /// allocation).
    pub fn end_allocate_to_pool(&self, capture_stream: StreamHandle) -> Result<(), AllocError> {
        self.check_device(capture_stream.device)?;
        let mut st = self.state.lock();
        if !st.capture_underway {
            return Err(AllocError::NoCaptureUnderway);
        }
        // The capture is over whatever the joins do: a failed join must not leave every
        // later capture refused and every uncaptured free deferred for good.
        st.capture_underway = false;
        let mut joined = Ok(());
        for s in std::mem::take(&mut st.capture_free_streams) {
            match self.sync_raw(s, capture_stream) {
                // A stream destroyed since (PyTorch never destroys its streams) has no
                // later work to order: nothing to join.
                Err(AllocError::Driver(e)) if e == DriverError::INVALID_HANDLE => {}
                Err(e) if joined.is_ok() => joined = Err(e),
                _ => {}
            }
        }
        joined
    }

    /// `releasePool`: nothing to do (pointers made during the capture are freed by their
    /// owners).
    pub fn release_pool(&self) {}

    /// Whether a capture is under way.
    pub fn capture_underway(&self) -> bool {
        self.state.lock().capture_underway
    }
}

/// Why an attempt gave no memory.
enum Refused {
    /// The memory fraction's limit.
    Limit,
    /// The driver's pool.
    Pool,
}
