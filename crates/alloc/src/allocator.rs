//! One device's caching allocator: its public face. Allocation and free take the fast
//! paths here (the thread cache, then best fit under the lock); what happens when best fit
//! finds nothing is `slow_path`, giving memory back is `release`, the state and its
//! block-level steps are `state`, looking at it is `inspect`.
//!
//! The helpers of `allocate` and `free` under the lock are `#[inline(always)]`: a churn of
//! mixed requests spent a tenth of its instructions in their calls (saving and restoring
//! registers, passing results through memory), and inlining them cut its time by 3%. The
//! paths a cached churn never takes (the capture query while a pool is recorded to, caching
//! off, a free that waits for other streams, the OOM report) are the opposite: out of line
//! and cold, they leave the hot path its registers (11 instructions fewer per operation).
use crate::block::{Allocation, Blocks};
use crate::combining::{Combined, Op};
use crate::engine::{Engine, Locked, OomObserver};
use crate::error::AllocError;
use crate::expandable::Expandable;
use crate::free_pools::Pools;
use crate::history::{History, HistoryContext, HistoryOptions, capture_frames};
use crate::pluggable::PluggableAllocator;
use crate::private_pools::{PrivatePools, Route, SegmentSource, Wakefulness};
use crate::rounding::ONE_EXABYTE;
use crate::state::{Request, State};
use crate::stream_order::StreamOrder;
use crate::tally::Tally;
use ferrocuda_driver::Driver;
use ferrocuda_types::{
    AllocatorBackend as Backend, AllocatorConfig, CaptureStatus, DeviceIndex, DevicePtr, Frame,
    PoolId, StreamHandle,
};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// Whether an allocator keeps freed blocks for reuse.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Caching {
    /// Freed blocks are cached and reused (PyTorch's default).
    On,
    /// Every request goes to the driver and every free back to it
    /// (`PYTORCH_NO_CUDA_MEMORY_CACHING=1`).
    Off,
}

/// PyTorch's caching allocator for one device, over any [`Driver`].
pub struct CachingAllocator {
    pub(crate) engine: Engine,
    pub(crate) caching: bool,
    /// With caching off: every live allocation, its size and stream.
    pub(crate) uncached: Mutex<FxHashMap<u64, (u64, u64)>>,
    /// Number of pools being recorded to, readable without the lock (the hot path asks the
    /// driver for capture status only when it is not zero).
    routing: AtomicUsize,
    /// The history context, readable without the lock (stacks are captured outside it).
    pub(crate) context: AtomicU8,
    /// Sleepable pools not awake (asleep or changing), readable without the lock: a graph
    /// replay asks whether its pool sleeps, and the answer is no at one load while none
    /// does.
    pub(crate) sleeping: AtomicUsize,
    /// Blocks shared with other processes, and theirs opened here (`ipc`).
    pub(crate) ipc: crate::ipc::Sharing,
}

impl Drop for CachingAllocator {
    /// Gives back every segment, page, address range and event not handed out (private
    /// pools lose their users with the allocator). Blocks still allocated keep their
    /// segments, so a pointer kept past the allocator never sees its memory reused. Nothing
    /// is printed: a library does not write to the program's standard error, and the
    /// caller can read `allocated_bytes` before dropping.
    fn drop(&mut self) {
        if self.caching {
            self.engine.give_back_everything();
        }
        self.engine.state.get_mut().slots.retire();
    }
}

impl std::fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("device", &self.engine.device)
            .field("caching", &self.caching)
            .finish_non_exhaustive()
    }
}

impl CachingAllocator {
    /// An allocator for `device`. [`Caching::Off`] passes every request to the driver
    /// (`FERROCUDA_NO_CUDA_MEMORY_CACHING=1`).
    pub fn new(
        driver: Arc<dyn Driver>,
        device: DeviceIndex,
        config: AllocatorConfig,
        caching: Caching,
    ) -> Result<CachingAllocator, AllocError> {
        if config.backend != Backend::Native {
            return Err(AllocError::WrongBackend);
        }
        let (_, device_total) = driver.mem_get_info(device)?;
        let fraction = config.release.per_process_memory_fraction;
        let stats = Tally::new(config.sizes.max_split_size.map_or(-1, |m| m as i64));
        let mut expandable = Expandable::default();
        expandable.set_reclaim(config.expandable.reclaim);
        let state = State {
            device,
            plain_rounding: crate::rounding::rounds_plainly(&config),
            oversize: crate::free_pools::OversizeRule::of(&config),
            config,
            blocks: Blocks::default(),
            pools: Pools::default(),
            order: StreamOrder::default(),
            stats,
            total_reserved: 0,
            allowed_max: None,
            oversize_segments: Default::default(),
            expandable,
            history: History::default(),
            private: PrivatePools::default(),
            paged: Default::default(),
        };
        let allocator = CachingAllocator {
            engine: Engine::new(driver, device, device_total, state),
            caching: caching == Caching::On,
            uncached: Mutex::new(FxHashMap::default()),
            context: AtomicU8::new(HistoryContext::Never as u8),
            routing: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            ipc: Default::default(),
        };
        allocator.set_memory_fraction(fraction)?;
        Ok(allocator)
    }

    /// Adds an observer called on every out-of-memory error.
    pub fn add_oom_observer(&self, observer: OomObserver) {
        self.engine.oom_observers.lock().push(observer);
    }

    /// Starts, changes or stops recording history (`_record_memory_history`).
    pub fn record_memory_history(&self, options: HistoryOptions) {
        self.context.store(options.context as u8, Ordering::Relaxed);
        self.engine.lock().history.set(options);
    }

    /// The device.
    pub fn device(&self) -> DeviceIndex {
        self.engine.device
    }

    /// Whether requests are cached (false with `*_NO_CUDA_MEMORY_CACHING=1`).
    pub fn is_caching(&self) -> bool {
        self.caching
    }

    /// The configuration in force.
    pub fn config(&self) -> AllocatorConfig {
        self.engine.lock().config.clone()
    }

    /// Re-parses the configuration (PyTorch's `_set_allocator_settings`); on error nothing
    /// changes.
    pub fn update_config(&self, s: &str) -> Result<(), AllocError> {
        let mut st = self.engine.lock();
        let mut next = st.config.clone();
        next.update(s)?;
        if next.backend != Backend::Native {
            return Err(AllocError::WrongBackend);
        }
        self.engine.cache.enable(next.reuse.thread_cache);
        st.set_config(next);
        Ok(())
    }

    /// `set_per_process_memory_fraction`: reserved bytes may not exceed `fraction` of the
    /// device; 1 removes the limit.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidFraction(fraction));
        }
        let mut st = self.engine.lock();
        st.allowed_max =
            (fraction < 1.0).then_some((fraction * self.engine.device_total as f64) as u64);
        st.config.release.per_process_memory_fraction = fraction;
        Ok(())
    }

    /// `get_per_process_memory_fraction`.
    pub fn memory_fraction(&self) -> f64 {
        self.engine
            .state
            .lock()
            .allowed_max
            .map_or(1.0, |a| a as f64 / self.engine.device_total as f64)
    }

    // ---- allocate ------------------------------------------------------------------------

    /// Allocates `bytes` for use on `stream`. Zero bytes give a null pointer. Out of memory
    /// is [`AllocError::OutOfMemory`] with PyTorch's figures (and, with `oom_forensics`,
    /// ours).
    pub fn allocate(&self, bytes: u64, stream: StreamHandle) -> Result<Allocation, AllocError> {
        self.allocate_or_report(bytes, stream)
            .map_err(|e| self.with_forensics(e, stream))
    }

    #[inline(always)]
    fn allocate_or_report(
        &self,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<Allocation, AllocError> {
        if bytes >= ONE_EXABYTE {
            // PyTorch refuses these before its device allocator (`NativeCachingAllocator::
            // malloc`): no statistic, no history entry, no observer.
            return Err(self.engine.oom_report(bytes, bytes, true, stream));
        }
        if bytes == 0 {
            return Ok(Allocation {
                ptr: DevicePtr(0),
                size: 0,
                requested: 0,
                stream,
            });
        }
        if !self.caching {
            let ptr = self
                .engine
                .driver
                .malloc(self.engine.device, bytes)
                .map_err(|e| self.engine.driver_oom(e, bytes))?;
            self.uncached.lock().insert(ptr.0, (bytes, stream.raw));
            return Ok(Allocation {
                ptr,
                size: bytes,
                requested: bytes,
                stream,
            });
        }
        // The block this thread just freed, if its credit covers this request.
        if let Some((ptr, size)) = self.engine.cache.reuse(bytes, stream.raw) {
            return Ok(Allocation {
                ptr: DevicePtr(ptr),
                size,
                requested: bytes,
                stream,
            });
        }
        // Stacks are gathered before taking the lock: they are slow.
        if self.context.load(Ordering::Relaxed) >= HistoryContext::State as u8 {
            return self.allocate_recording(bytes, stream);
        }
        self.allocate_locked(bytes, stream, None)
    }

    /// `allocate` while history records stacks: out of line, so that the usual path has no
    /// stack to carry (and drop).
    #[cold]
    #[inline(never)]
    fn allocate_recording(
        &self,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<Allocation, AllocError> {
        self.allocate_locked(bytes, stream, Some(capture_frames()))
    }

    /// `allocate` from the lock on, with the request's stack if history records stacks.
    #[inline(always)]
    fn allocate_locked(
        &self,
        bytes: u64,
        stream: StreamHandle,
        frames: Option<Arc<[Frame]>>,
    ) -> Result<Allocation, AllocError> {
        // While a pool is being recorded to, ask the driver which capture this stream is in
        // (a cheap query, made before taking the lock).
        let routed = self.routing.load(Ordering::Acquire) > 0;
        let capture = if routed {
            self.capture_of(stream)?
        } else {
            None
        };
        // With the lock taken, the thread holding it may serve this request with its own.
        // (A route may depend on the calling thread: routed requests are not published.)
        let mut st = if frames.is_none() && !routed && self.engine.cache.enabled() {
            match self.engine.lock_or_combine(Op::Alloc {
                bytes,
                stream: stream.raw,
            }) {
                Combined::Served { ptr, size } => {
                    return Ok(Allocation {
                        ptr: DevicePtr(ptr),
                        size,
                        requested: bytes,
                        stream,
                    });
                }
                Combined::Locked(g) => g,
            }
        } else {
            self.engine.lock()
        };
        let req = self.engine.request(&mut st, bytes, stream, frames, capture);
        if routed && st.private.wakefulness(req.pool) != Wakefulness::Awake {
            return Err(crate::SleepError::Asleep(req.pool).into());
        }
        if let Some(id) = st.take_free_block(req.pool, req.kind, stream, req.size) {
            return Ok(self.hand_out(&mut st, id, &req));
        }
        if self.ipc.any_limbo() {
            // PyTorch's free-memory callbacks: blocks other processes gave back are freed,
            // and the search runs again.
            drop(st);
            let freed = self.ipc_collect();
            st = self.engine.lock();
            if freed && let Some(id) = st.take_free_block(req.pool, req.kind, stream, req.size) {
                return Ok(self.hand_out(&mut st, id, &req));
            }
        }
        let (mut st, id) = self.engine.slow_path(st, &req)?;
        Ok(self.hand_out(&mut st, id, &req))
    }

    /// `alloc_found_block`, then a thread-cache credit for the calling thread where one is
    /// due.
    #[inline(always)]
    fn hand_out(&self, locked: &mut Locked, id: usize, req: &Request) -> Allocation {
        let (id, allocation) = locked.state.use_block(id, req);
        let Locked { state, slots } = locked;
        self.engine.cache.grant(state, slots, id, req, &allocation);
        allocation
    }

    // ---- free and streams ----------------------------------------------------------------

    /// Returns an allocation. Blocks used on other streams (`record_stream`) become
    /// reusable once those streams' work recorded so far has completed.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        if ptr.0 == 0 {
            return Ok(());
        }
        // A block another process holds is not freed (one relaxed load while none is).
        if self.ipc.any_sent() && self.ipc_hold_back(ptr)? {
            return Ok(());
        }
        if !self.caching {
            return self.free_uncached(ptr);
        }
        if self.engine.cache.park(ptr.0) {
            return Ok(());
        }
        if self.context.load(Ordering::Relaxed) >= HistoryContext::All as u8 {
            return self.free_recording(ptr);
        }
        self.free_locked(ptr, None)
    }

    /// `free` while history records the stacks of frees: out of line, as
    /// [`allocate_recording`](Self::allocate_recording).
    #[cold]
    #[inline(never)]
    fn free_recording(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.free_locked(ptr, Some(&capture_frames()))
    }

    /// `free` from the lock on, with the free's stack if history records those.
    #[inline(always)]
    fn free_locked(
        &self,
        ptr: DevicePtr,
        free_frames: Option<&Arc<[Frame]>>,
    ) -> Result<(), AllocError> {
        let combinable = self.routing.load(Ordering::Acquire) == 0 && self.engine.cache.enabled();
        let mut st = if free_frames.is_none() && combinable {
            match self.engine.lock_or_combine(Op::Free { ptr: ptr.0 }) {
                Combined::Served { .. } => return Ok(()),
                Combined::Locked(g) => g,
            }
        } else {
            self.engine.lock()
        };
        let Some(id) = st.blocks.allocated_at_to_free(ptr.0) else {
            return Err(AllocError::InvalidPointer(ptr));
        };
        // (The uses lie in the block's cold line: looked at only when there are some.)
        if st.blocks[id].has_uses {
            let uses = st.take_uses(id);
            st.release_live(id, free_frames, true);
            return self.engine.hold_back(st, id, uses);
        }
        st.free_now(id, free_frames);
        self.engine.record_due_mark(&mut st);
        Ok(())
    }

    /// `free` with caching off (`*_NO_CUDA_MEMORY_CACHING=1`): straight to the driver.
    /// Out of line, as the other paths a cached free does not take.
    #[cold]
    #[inline(never)]
    fn free_uncached(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.uncached
            .lock()
            .remove(&ptr.0)
            .ok_or(AllocError::InvalidPointer(ptr))?;
        Ok(self.engine.driver.free(self.engine.device, ptr)?)
    }

    /// Marks `ptr` as used by `stream` (`Tensor.record_stream`): its memory is not reused
    /// until the work enqueued on `stream` before the free has completed.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), AllocError> {
        if ptr.0 == 0 || !self.caching {
            return Ok(());
        }
        let mut st = self.engine.lock();
        // A pointer inside an allocation (a view with an offset) protects the allocation.
        let id = match st.blocks.allocated_at(ptr.0) {
            Some(id) => id,
            None => st
                .blocks
                .iter()
                .position(|b| !b.vacant && b.allocated && (b.ptr..b.ptr + b.size).contains(&ptr.0))
                .ok_or(AllocError::InvalidPointer(ptr))?,
        };
        let b = &st.blocks[id];
        if stream.raw == b.stream || b.stream_uses.contains(&stream) {
            return Ok(());
        }
        let b = &mut st.blocks[id];
        b.stream_uses.push(stream);
        b.has_uses = true;
        Ok(())
    }

    /// `empty_cache`: waits for outstanding events, then gives every whole free segment
    /// back to the driver. Segments with a live piece stay (the "non-releasable" memory).
    pub fn empty_cache(&self) {
        if !self.caching || self.engine.lock().capturing() {
            // Nothing is synchronized or freed while a capture is underway.
            return;
        }
        let st = self.engine.synchronize_events(self.engine.lock());
        drop(self.engine.release_cached(st, None));
    }

    // ---- private pools -------------------------------------------------------------------

    /// Creates private pool `pool`, or adds a user to it (`create_or_incref`).
    pub fn retain_pool(&self, pool: PoolId) {
        self.engine.lock().private.retain(pool);
    }

    /// Creates private pool `pool` with one user, whose segments come from `allocator` and
    /// go back to it (`createOrIncrefPool(device, id, allocator)` for
    /// `MemPool(allocator=…)`): this allocator still splits, caches and counts them. Such a
    /// pool has no expandable segments, as no private pool has. A pool that exists already
    /// is [`AllocError::Pool`] (PyTorch asserts).
    pub fn create_pool_with_allocator(
        &self,
        pool: PoolId,
        allocator: Arc<PluggableAllocator>,
    ) -> Result<(), AllocError> {
        self.engine
            .lock()
            .private
            .create_with_source(pool, SegmentSource::Pluggable(allocator))
    }

    /// `emptyCache(mempool_id)` for a private pool: gives back its whole free segments (to
    /// its allocator, if it has one) if nobody holds it any more; other pools are left
    /// alone and no event is waited for. Nothing happens while a capture is underway.
    pub fn empty_cache_pool(&self, pool: PoolId) {
        if pool.is_default() {
            return self.empty_cache();
        }
        let st = self.engine.lock();
        if !self.caching || st.capturing() {
            // Nothing is freed while a capture is underway.
            return;
        }
        drop(self.engine.release_pool_cached(st, pool));
    }

    /// Drops a user of `pool` (`releasePool`). At zero users its free segments go back to
    /// the driver at the next `empty_cache` (or OOM retry); blocks still allocated from it
    /// stay valid until freed.
    pub fn release_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        self.engine.lock().private.release(pool)
    }

    /// Users of `pool` (`getPoolUseCount`), if it exists.
    pub fn pool_use_count(&self, pool: PoolId) -> Option<u32> {
        self.engine.lock().private.use_count(pool)
    }

    /// Routes allocations that `route` takes into `pool` until [`end_allocate_to_pool`]
    /// (`beginAllocateToPool`); the pool gains a user.
    ///
    /// [`end_allocate_to_pool`]: CachingAllocator::end_allocate_to_pool
    pub fn begin_allocate_to_pool(&self, pool: PoolId, route: Route) -> Result<(), AllocError> {
        self.engine.lock().private.begin(pool, route)?;
        self.routing.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// The capture `stream` is recording into, asked of the driver only while some pool is
    /// being recorded to (else `None` with no driver call): where an allocation on `stream`
    /// may be routed, and what a library holding memory per stream (cuBLAS's workspaces)
    /// must not keep across captures.
    pub fn routed_capture(&self, stream: StreamHandle) -> Result<Option<u64>, AllocError> {
        if self.routing.load(Ordering::Acquire) == 0 {
            return Ok(None);
        }
        self.capture_of(stream)
    }

    /// The capture `stream` is recording into, asked of the driver.
    #[cold]
    #[inline(never)]
    fn capture_of(&self, stream: StreamHandle) -> Result<Option<u64>, AllocError> {
        Ok(match self.engine.driver.stream_capture_status(stream)? {
            CaptureStatus::Active { id } => Some(id),
            _ => None,
        })
    }

    /// Stops routing into `pool` (`endAllocateToPool`); the pool keeps its user.
    ///
    /// When no capture is routed any more, the blocks freed with other streams' uses while
    /// one was get their end-of-life events now (`insert_events_deferred_until_no_capture`,
    /// which PyTorch runs at the next allocator call with no capture underway; this is the
    /// first): recorded right after the capture, they complete with the work that was on
    /// those streams, and once it has the next request of their size on their stream gets
    /// them back, even if no allocation came in between.
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        let mut st = self.engine.lock();
        st.private.end(pool)?;
        self.routing.fetch_sub(1, Ordering::Release);
        if !st.capturing() {
            self.engine.record_deferred(&mut st);
        }
        Ok(())
    }
}
