//! The allocator's core: the device, the driver and the state behind one lock, and the
//! steps every path shares (taking the lock, which settles the thread cache first; waiting
//! for events; giving segments back; the out-of-memory report). The paths that grow and
//! shrink the cache are further `impl Engine` blocks, each in its own file, calling only
//! downwards: `slow_path` → `release` → `expandable_mapping` → this file.
use crate::error::{AllocError, OutOfMemory};
use crate::rounding::{pool_kind, round_plain, round_size};
use crate::state::{ReleaseTo, Released, Request, State};
use crate::thread_cache::{Registry, ThreadCache};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, DevicePtr, Frame, ProcessMemory, StreamHandle,
};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Called with the report of every out-of-memory error, outside the allocator's lock
/// (`torch._C._cuda_attach_out_of_memory_observer`).
pub type OomObserver = Arc<dyn Fn(&OutOfMemory) + Send + Sync>;

/// What the lock guards: the state, and every thread's slot in this allocator. Aligned so
/// that no line of it holds the lock word: threads waiting for the lock read that word,
/// and the holder reads and writes the state.
#[repr(align(128))]
pub(crate) struct Locked {
    pub(crate) state: State,
    pub(crate) slots: Registry,
}

impl std::ops::Deref for Locked {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl std::ops::DerefMut for Locked {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

/// The allocator's lock: a spin lock whose waiters yield the processor between looks.
///
/// Why not a parking mutex: its unlock is a compare-and-swap (it must learn whether a
/// thread sleeps), and a locked instruction waits until every store of the operation has
/// left the core. A spin lock's unlock is a plain release store, which does not wait. One
/// thread's mixed churn (`benches/alloc.rs`) took 8% less time per operation for that
/// alone. Waiting without sleeping is affordable because the lock is held only for short
/// stretches (never across `malloc`, `free` or a synchronization), contended requests are
/// mostly served by the holder (`combining`), and a waiter yields its processor, so a
/// holder that was descheduled gets it back.
pub(crate) type StateLock = spin::mutex::SpinMutex<Locked, spin::relax::Yield>;

/// The lock, held.
pub(crate) type Guard<'a> = spin::mutex::SpinMutexGuard<'a, Locked>;

/// One device's allocator below its public face. Lock discipline: one mutex guards the
/// state; it is never held across `malloc`, `free` or a synchronization of the driver
/// (only across non-blocking event record and query).
pub(crate) struct Engine {
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) device: DeviceIndex,
    pub(crate) device_total: u64,
    pub(crate) oom_observers: Mutex<Vec<OomObserver>>,
    /// The driver's mapping granularity, asked once.
    pub(crate) granularity: std::sync::OnceLock<u64>,
    /// This allocator's side of the per-thread front end.
    pub(crate) cache: ThreadCache,
    pub(crate) state: StateLock,
    /// Devices given access to this device's expandable segments (PyTorch's
    /// `devices_with_peer_access_`). Read-held from mapping pages until they are recorded in
    /// the segment, write-held while a new peer is opened to every mapped page: so no page
    /// is mapped without every peer's access. Lock order: this, then `state`.
    pub(crate) peers: parking_lot::RwLock<Vec<DeviceIndex>>,
}

impl Engine {
    pub(crate) fn new(
        driver: Arc<dyn Driver>,
        device: DeviceIndex,
        device_total: u64,
        state: State,
    ) -> Engine {
        Engine {
            driver,
            device,
            device_total,
            oom_observers: Mutex::new(Vec::new()),
            granularity: std::sync::OnceLock::new(),
            cache: ThreadCache::new(state.config.reuse.thread_cache),
            state: StateLock::new(Locked {
                state,
                slots: Registry::default(),
            }),
            peers: parking_lot::RwLock::default(),
        }
    }

    /// Locks the state for an operation, settling every thread-cache slot first: parked
    /// blocks are freed for real and every credit is dropped. At most one thread therefore
    /// holds a credit at any time (its grant is the last locked operation), and every
    /// locked operation sees every free that happened before it, as under PyTorch's one
    /// mutex. Also taken again after a driver call made outside the lock.
    #[inline(always)]
    pub(crate) fn lock(&self) -> Guard<'_> {
        self.settled(self.state.lock())
    }

    /// [`Engine::lock`] if the lock is free now. The lock word is read first (a plain
    /// load, which leaves its line shared): spin's `try_lock` is a bare compare-and-swap,
    /// which takes the line from the holder even when it fails, and the holder's next
    /// operation then waits for it (8 threads of 1 MiB pairs ran 5-7% faster on an H200
    /// host with the read: docs/measurements/h200_2026-12-02b).
    #[inline(always)]
    pub(crate) fn try_lock(&self) -> Option<Guard<'_>> {
        if self.state.is_locked() {
            return None;
        }
        self.state.try_lock().map(|g| self.settled(g))
    }

    /// The lock just taken, with every thread-cache slot settled and a due reclaim mark
    /// recorded.
    #[inline(always)]
    fn settled<'a>(&'a self, mut g: Guard<'a>) -> Guard<'a> {
        if self.cache.needs_settling() {
            let Locked { state, slots } = &mut *g;
            self.cache.settle_all(state, slots);
        }
        self.record_due_mark(&mut g.state);
        g
    }

    /// Request `bytes` on `stream` as the lock holder sees it (PyTorch's `malloc` up to its
    /// best fit): events that completed are processed first, then the size is rounded and
    /// the pool routed (`capture`: the stream's capture, asked while a pool is routed to).
    #[inline(always)]
    pub(crate) fn request(
        &self,
        st: &mut State,
        bytes: u64,
        stream: StreamHandle,
        frames: Option<Arc<[Frame]>>,
        capture: Option<u64>,
    ) -> Request {
        self.process_events(st);
        let size = if st.plain_rounding {
            round_plain(bytes)
        } else {
            round_size(bytes, &st.config)
        };
        Request {
            size,
            requested: bytes,
            kind: pool_kind(size),
            stream,
            pool: st.private.route(stream, capture),
            frames,
            capture,
        }
    }

    /// Holds freed block `id` back until the other streams that used it (`uses`) are done:
    /// an event on each, recorded now, or after the capture underway. A stream that takes
    /// no event is waited for instead (outside the lock), so the block is never reused
    /// early and never drops out of the books.
    ///
    /// A capture is underway when a pool is routed to one (PyTorch's `captures_underway`,
    /// c10/cuda/CUDACachingAllocator.cpp, `DeviceCachingAllocator::free`), and also when one
    /// of `uses` is capturing in a capture the allocator has not been told of yet (a free
    /// racing `cuStreamBeginCapture` ahead of `beginAllocateToPool`) or any more (racing
    /// `cuStreamEndCapture` after `endAllocateToPool`). An event recorded there would be
    /// recorded into the capture, never complete, and keep the block out of the pools for
    /// good; deferred, it is recorded once no capture is underway, as PyTorch's
    /// `insert_events_deferred_until_no_capture` does.
    #[cold]
    #[inline(never)]
    pub(crate) fn hold_back(
        &self,
        mut st: Guard<'_>,
        id: usize,
        uses: Vec<StreamHandle>,
    ) -> Result<(), AllocError> {
        let routed = st.private.capturing();
        let State { order, blocks, .. } = &mut st.state;
        if routed || self.any_capturing(&uses) {
            // Recording or querying events is illegal during capture: decide after it.
            order.defer(blocks, id, uses);
            return Ok(());
        }
        let unrecorded = order.record(&*self.driver, blocks, id, uses);
        if unrecorded.is_empty() {
            return Ok(());
        }
        st.blocks[id].event_count += 1;
        drop(st);
        let waited: Result<(), DriverError> = unrecorded
            .iter()
            .try_for_each(|s| self.driver.stream_synchronize(*s));
        let mut st = self.lock();
        st.blocks[id].event_count -= 1;
        if st.blocks[id].event_count == 0 {
            st.free_block(id);
        }
        waited.map_err(AllocError::from)
    }

    /// The out-of-memory error for an allocation of `requested` bytes (the segment size,
    /// PyTorch's `alloc_size`); the history's `oom` entry records `rounded`, the rounded
    /// request (PyTorch's `params.size()`).
    pub(crate) fn oom_report(
        &self,
        requested: u64,
        rounded: u64,
        beyond_one_exabyte: bool,
        stream: StreamHandle,
    ) -> AllocError {
        let device_free = self.driver.mem_get_info(self.device).map_or(0, |(f, _)| f);
        let processes = if beyond_one_exabyte {
            Vec::new()
        } else {
            let me = std::process::id();
            self.driver
                .gpu_processes(self.device)
                .into_iter()
                .map(|p| ProcessMemory {
                    pid: p.pid,
                    used: p.used,
                    this_process: p.pid == me,
                })
                .collect()
        };
        let mut st = self.lock();
        if !beyond_one_exabyte {
            st.history.record_oom(rounded, device_free, stream.raw);
        }
        let mut per_stream: FxHashMap<u64, (StreamHandle, u64)> = FxHashMap::default();
        let mut largest = 0;
        let mut allocated_in_private_pools = 0;
        for key in st.pools.keys() {
            let b = &st.blocks[key.id];
            if !key.pool.is_default() {
                allocated_in_private_pools += b.size;
            }
            largest = largest.max(b.size);
            per_stream
                .entry(b.stream)
                .or_insert((st.stream_handle(b.stream), 0))
                .1 += b.size;
        }
        let mut cached_per_stream: Vec<(StreamHandle, u64)> = per_stream.into_values().collect();
        cached_per_stream.sort_by_key(|(s, _)| s.raw);
        let report = OutOfMemory {
            device: self.device.0,
            requested,
            beyond_one_exabyte,
            device_total: self.device_total,
            device_free,
            processes,
            allowed: st.allowed_max,
            allocated: st.stats.allocated_bytes().current() as u64,
            reserved: st.stats.reserved_bytes.current() as u64,
            allocated_in_private_pools,
            largest_free_block: largest,
            cached_per_stream,
            non_releasable: st.stats.inactive_split_bytes.current() as u64,
            expandable_segments: st.config.expandable.enabled,
            rejected_by_fraction: false,
            forensics: None,
        };
        drop(st);
        if !beyond_one_exabyte {
            let observers = self.oom_observers.lock().clone();
            observers.iter().for_each(|o| o(&report));
        }
        AllocError::OutOfMemory(Box::new(report))
    }

    // ---- free and streams ----------------------------------------------------------------

    pub(crate) fn driver_oom(&self, e: DriverError, bytes: u64) -> AllocError {
        if e.is_out_of_memory() {
            self.oom_report(bytes, bytes, false, StreamHandle::legacy(self.device))
        } else {
            AllocError::from(e)
        }
    }

    /// A growth the memory fraction does not allow: no memory (the path goes on), or with
    /// `throw_on_cudamalloc_oom` an out-of-memory error at once, counted in
    /// `num_oom_rejections` (PyTorch's `alloc_block`, skipping every retry).
    pub(crate) fn refuse_over_fraction<'a>(
        &'a self,
        mut st: Guard<'a>,
        bytes: u64,
    ) -> Result<(Guard<'a>, Option<usize>), AllocError> {
        if !st.config.release.throw_on_cudamalloc_oom {
            return Ok((st, None));
        }
        st.stats.num_oom_rejections += 1;
        drop(st);
        let mut report = self.oom_report(bytes, bytes, false, StreamHandle::legacy(self.device));
        if let AllocError::OutOfMemory(oom) = &mut report {
            oom.rejected_by_fraction = true;
        }
        Err(report)
    }

    /// Frees blocks whose events completed, stream by stream, in order (after recording
    /// the events of blocks freed during a capture that has ended).
    #[inline(always)]
    pub(crate) fn process_events(&self, st: &mut State) {
        if !st.order.is_quiet() {
            self.process_pending_events(st);
        }
    }

    /// [`Engine::process_events`] with events outstanding or frees deferred.
    #[cold]
    fn process_pending_events(&self, st: &mut State) {
        if st.capturing() {
            return;
        }
        self.record_deferred(st);
        for (event, id) in st.order.completed(&*self.driver) {
            st.complete_event(event, id);
        }
    }

    /// `insert_events_deferred_until_no_capture`: records the events of the blocks freed
    /// during a capture (with no capture routed now). A block one of whose streams is still
    /// capturing, in a capture the allocator was not told of, stays deferred until it ends.
    pub(crate) fn record_deferred(&self, st: &mut State) {
        let deferred = st.order.take_deferred(&mut st.blocks);
        for (id, uses) in deferred {
            let State { order, blocks, .. } = &mut *st;
            if self.any_capturing(&uses) {
                order.defer(blocks, id, uses);
                continue;
            }
            // A stream that cannot take an event now: wait for it here (rare).
            for stream in order.record(&*self.driver, blocks, id, uses) {
                let _ = self.driver.stream_synchronize(stream);
            }
            if st.blocks[id].event_count == 0 && !st.blocks[id].allocated {
                st.free_block(id);
            }
        }
    }

    /// Whether one of `streams` takes part in a stream capture now (active, or invalidated
    /// and not yet ended), as the driver says: a non-blocking query
    /// (`cudaStreamGetCaptureInfo`), legal during any capture. The legacy stream counts as
    /// capturing while a blocking stream of its device captures (the query fails with
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` then): its work would join that capture and
    /// a query of it would invalidate it. A stream the driver cannot answer for otherwise
    /// counts as not capturing (recording its event fails and it is waited for).
    pub(crate) fn any_capturing(&self, streams: &[StreamHandle]) -> bool {
        streams.iter().any(|s| {
            matches!(
                self.driver.stream_capture_status(*s),
                Ok(CaptureStatus::Active { .. } | CaptureStatus::Invalidated)
                    | Err(DriverError::STREAM_CAPTURE_IMPLICIT)
            )
        })
    }

    /// This thread's capture mode set to relaxed until the guard drops (what
    /// `cudaMallocMaybeCapturing` and `CUDAStreamCaptureModeGuard` do): calls the driver
    /// counts as unsafe during a global capture, or this thread's own, are legal then.
    pub(crate) fn relaxed_capture(&self) -> RelaxedCapture<'_> {
        RelaxedCapture {
            driver: &*self.driver,
            previous: self.driver.exchange_capture_mode(CaptureMode::Relaxed).ok(),
        }
    }

    /// `synchronize_and_free_events`: waits (outside the lock) for every outstanding event
    /// and frees their blocks; counted in `num_sync_all_streams` whether or not any was
    /// outstanding, as PyTorch counts it.
    pub(crate) fn synchronize_events<'a>(&'a self, mut st: Guard<'a>) -> Guard<'a> {
        st.stats.num_sync_all_streams += 1;
        // As PyTorch's `synchronize_and_free_events`: the blocks freed during a capture
        // that has ended get their events first (this never runs during a capture).
        if !st.capturing() {
            self.record_deferred(&mut st);
        }
        if !st.order.has_pending() {
            return st;
        }
        let events = st.order.drain();
        drop(st);
        for (event, _) in &events {
            let _ = self.driver.event_synchronize(*event);
        }
        let mut st = self.lock();
        for (event, id) in events {
            st.complete_event(event, id);
        }
        st
    }

    // ---- giving memory back --------------------------------------------------------------

    /// Frees segments (outside the lock): to the driver, or to the pluggable allocator of
    /// their pool (`release_block`'s `raw_delete`).
    pub(crate) fn free_segments<'a>(&'a self, st: Guard<'a>, segments: Vec<Released>) -> Guard<'a> {
        if segments.is_empty() {
            return st;
        }
        drop(st);
        for Released { ptr, to } in segments {
            // A failed free leaves the address unusable; it was already unaccounted.
            let _ = match to {
                ReleaseTo::Pluggable(a) => a.raw_delete(DevicePtr(ptr)),
                ReleaseTo::Driver => self
                    .driver
                    .free(self.device, DevicePtr(ptr))
                    .map_err(Into::into),
                ReleaseTo::Pages(segment) => {
                    crate::sleep::pages::give_back(&*self.driver, segment);
                    Ok(())
                }
            };
        }
        self.lock()
    }
}

/// This thread's capture mode, relaxed by [`Engine::relaxed_capture`] and given back when
/// dropped.
pub(crate) struct RelaxedCapture<'a> {
    driver: &'a dyn Driver,
    previous: Option<CaptureMode>,
}

impl Drop for RelaxedCapture<'_> {
    fn drop(&mut self) {
        if let Some(mode) = self.previous {
            let _ = self.driver.exchange_capture_mode(mode);
        }
    }
}
