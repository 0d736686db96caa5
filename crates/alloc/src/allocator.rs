//! One device's caching allocator.
//!
//! The helpers of `allocate` and `free` under the lock are `#[inline(always)]`: a churn of
//! mixed requests spent a tenth of its instructions in their calls (saving and restoring
//! registers, passing results through memory), and inlining them cut its time by 3%.
use crate::block::{Block, Blocks, Link, NO_LIST};
use crate::error::{AllocError, OutOfMemory};
use crate::expandable::{Expandable, ExpandableSegment, Grow, Unmap};
use crate::free_list::{key, key_size};
use crate::free_pools::{FreeKey, Pools, oversize_refuses};
use crate::history::{History, HistoryContext, HistoryMode, HistoryOptions, capture_frames};
use crate::private_pools::PrivatePools;
use crate::private_pools::Route;
use crate::rounding::{ONE_EXABYTE, allocation_size, pool_kind, round_size};
use crate::stream_order::StreamOrder;
use crate::tally::Tally;
use crate::thread_cache::{self, Credit, PARKED, Shared, Slot};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{
    AllocatorConfig, DeviceIndex, DevicePtr, DeviceStats, EventHandle, PhysHandle, PoolKind,
    StreamHandle,
};
use ferrocuda_types::{
    AllocatorSettings, CaptureMode, CaptureStatus, Frame, PoolId, SnapshotBlock, SnapshotSegment,
    TraceEntry,
};
use parking_lot::{Mutex, MutexGuard};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

const SMALL_SIZE: u64 = crate::rounding::SMALL_SIZE;

/// One allocation request on its way through the paths.
struct Request {
    /// Rounded size.
    size: u64,
    /// Bytes asked for.
    requested: u64,
    kind: PoolKind,
    stream: StreamHandle,
    /// The pool it is served from: default, or a private pool it is routed to.
    pool: PoolId,
    /// Where it was made, when history records stacks.
    frames: Option<Arc<[Frame]>>,
}

/// A live allocation handed out by [`CachingAllocator::allocate`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Its address (null for a zero-byte request).
    pub ptr: DevicePtr,
    /// Bytes usable (the rounded size).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The stream it was allocated on.
    pub stream: StreamHandle,
}

/// A block of the allocator as tests and snapshots see it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Address.
    pub ptr: DevicePtr,
    /// Size in bytes.
    pub size: u64,
    /// Requested bytes (allocated blocks).
    pub requested: u64,
    /// Pool.
    pub pool: PoolKind,
    /// Allocated to a user.
    pub allocated: bool,
    /// Freed but waiting for events on other streams.
    pub pending_events: bool,
    /// Address of the segment it was carved from.
    pub segment: DevicePtr,
    /// Its allocation stream.
    pub stream: StreamHandle,
    /// Backed by device memory (false only for unmapped ranges of expandable segments).
    pub mapped: bool,
    /// Part of an expandable segment.
    pub expandable: bool,
    /// The pool it belongs to.
    pub pool_id: PoolId,
}

struct State {
    device: DeviceIndex,
    config: AllocatorConfig,
    blocks: Blocks,
    pools: Pools,
    /// Events holding freed blocks back for the streams that used them.
    order: StreamOrder,
    stats: Tally,
    /// Bytes held from the driver, including segments being allocated right now.
    total_reserved: u64,
    allowed_max: Option<u64>,
    /// Segments counted in `oversize_segments`, by address.
    oversize_segments: rustc_hash::FxHashSet<u64>,
    /// Expandable segments: ranges, pages, unmapped pieces, spare pages.
    expandable: Expandable,
    history: History,
    /// Private pools and the routes into them.
    private: PrivatePools,
    /// Every thread's slot in this allocator (`thread_cache`).
    slots: Vec<Arc<Slot>>,
}

/// PyTorch's caching allocator for one device, over any [`Driver`].
///
/// Lock discipline: one mutex guards the state; it is never held across `malloc`, `free`
/// or a synchronization of the driver (only across non-blocking event record and query).
pub struct CachingAllocator {
    driver: Arc<dyn Driver>,
    device: DeviceIndex,
    device_total: u64,
    caching: bool,
    uncached: Mutex<FxHashMap<u64, (u64, u64)>>,
    oom_observers: Mutex<Vec<OomObserver>>,
    granularity: std::sync::OnceLock<u64>,
    /// Number of pools being recorded to, readable without the lock (the hot path asks the
    /// driver for capture status only when it is not zero).
    routing: std::sync::atomic::AtomicUsize,
    /// The history context, readable without the lock (stacks are captured outside it).
    context: std::sync::atomic::AtomicU8,
    /// This allocator's key in the threads' slot tables.
    id: u64,
    /// Shared with the threads' slots: exited threads, outstanding credits, the backoff.
    shared: Arc<Shared>,
    state: Mutex<State>,
}

impl Drop for CachingAllocator {
    /// Gives back every segment, page, address range and event not handed out (private
    /// pools lose their users with the allocator). Blocks still allocated keep their
    /// segments, so a pointer kept past the allocator never sees its memory reused. Nothing
    /// is printed: a library does not write to the program's standard error, and the
    /// caller can read `allocated_bytes` before dropping.
    fn drop(&mut self) {
        if self.caching {
            self.give_back_everything();
        }
        for slot in &self.state.get_mut().slots {
            slot.retired.store(true, Ordering::Release);
        }
    }
}

/// Called with the report of every out-of-memory error, outside the allocator's lock
/// (`torch._C._cuda_attach_out_of_memory_observer`).
pub type OomObserver = Arc<dyn Fn(&OutOfMemory) + Send + Sync>;

impl std::fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("device", &self.device)
            .field("caching", &self.caching)
            .finish_non_exhaustive()
    }
}

impl CachingAllocator {
    /// An allocator for `device`. `caching: false` passes every request to the driver
    /// (`FERROCUDA_NO_CUDA_MEMORY_CACHING=1`).
    pub fn new(
        driver: Arc<dyn Driver>,
        device: DeviceIndex,
        config: AllocatorConfig,
        caching: bool,
    ) -> Result<CachingAllocator, AllocError> {
        let (_, device_total) = driver.mem_get_info(device)?;
        let fraction = config.per_process_memory_fraction;
        let stats = Tally {
            max_split_size: config.max_split_size.map_or(-1, |m| m as i64),
            ..Tally::default()
        };
        let allocator = CachingAllocator {
            driver,
            device,
            device_total,
            caching,
            uncached: Mutex::new(FxHashMap::default()),
            oom_observers: Mutex::new(Vec::new()),
            granularity: std::sync::OnceLock::new(),
            context: std::sync::atomic::AtomicU8::new(HistoryContext::Never as u8),
            routing: std::sync::atomic::AtomicUsize::new(0),
            id: thread_cache::next_allocator_id(),
            shared: Arc::new(Shared::default()),
            state: Mutex::new(State {
                device,
                config,
                blocks: Blocks::default(),
                pools: Pools::default(),
                order: StreamOrder::default(),
                stats,
                total_reserved: 0,
                allowed_max: None,
                oversize_segments: Default::default(),
                expandable: Expandable::default(),
                history: History::default(),
                private: PrivatePools::default(),
                slots: Vec::new(),
            }),
        };
        allocator.set_memory_fraction(fraction)?;
        Ok(allocator)
    }

    /// Adds an observer called on every out-of-memory error.
    pub fn add_oom_observer(&self, observer: OomObserver) {
        self.oom_observers.lock().push(observer);
    }

    /// Starts, changes or stops recording history (`_record_memory_history`).
    pub fn record_memory_history(&self, options: HistoryOptions) {
        self.context
            .store(options.context as u8, std::sync::atomic::Ordering::Relaxed);
        self.lock().history.set(options);
    }

    /// The segments with their blocks (one segment per contiguous mapped run of an
    /// expandable segment) and the recorded history, as `torch.cuda.memory._snapshot()`
    /// has them. Taking a snapshot records a `snapshot` event.
    pub fn snapshot(&self) -> (Vec<SnapshotSegment>, Vec<TraceEntry>) {
        let mut st = self.lock();
        let state_of = |b: &Block| {
            if b.allocated {
                "active_allocated"
            } else if b.event_count > 0 {
                "active_pending_free"
            } else {
                "inactive"
            }
        };
        let mut segments = Vec::new();
        for (head, b) in st.blocks.iter().enumerate() {
            let starts_run =
                !b.vacant && b.mapped && b.prev.get().is_none_or(|p| !st.blocks[p].mapped);
            if !starts_run {
                continue;
            }
            let mut seg = SnapshotSegment {
                device: self.device.0,
                address: b.ptr,
                total_size: 0,
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                stream: b.stream,
                segment_type: if b.pool == PoolKind::Small {
                    "small"
                } else {
                    "large"
                }
                .into(),
                segment_pool_id: (b.pool_id.0, b.pool_id.1),
                is_expandable: b.segment.is_some(),
                frames: Vec::new(),
                blocks: Vec::new(),
            };
            let mut cursor = Some(head);
            while let Some(i) = cursor.filter(|&i| st.blocks[i].mapped) {
                let x = &st.blocks[i];
                let active = x.allocated || x.event_count > 0;
                seg.total_size += x.size;
                if x.allocated {
                    seg.allocated_size += x.size;
                }
                if active {
                    seg.active_size += x.size;
                    seg.requested_size += x.requested;
                }
                seg.blocks.push(SnapshotBlock {
                    address: x.ptr,
                    size: x.size,
                    requested_size: x.requested,
                    state: state_of(x).into(),
                    frames: x
                        .frames
                        .as_deref()
                        .map(<[Frame]>::to_vec)
                        .unwrap_or_default(),
                });
                cursor = x.next.get();
            }
            segments.push(seg);
        }
        segments.sort_by_key(|s| s.address);
        let active = st.stats.active_bytes.current() as u64;
        st.history.record("snapshot", 0, active, 0, None);
        (segments, st.history.entries())
    }

    /// `allocator_settings` of a snapshot.
    pub fn allocator_settings(&self) -> AllocatorSettings {
        let c = self.lock().config.clone();
        AllocatorSettings {
            conf: c.to_string(),
            max_split_size: c.max_split_size.map_or(-1, |m| m as i64),
            garbage_collection_threshold: c.garbage_collection_threshold,
            expandable_segments: c.expandable_segments,
            roundup_power2_divisions: c
                .roundup_power2_divisions
                .iter()
                .enumerate()
                .map(|(i, d)| ((1u64 << i).to_string(), *d))
                .collect(),
        }
    }

    /// The device.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// Whether requests are cached (false with `*_NO_CUDA_MEMORY_CACHING=1`).
    pub fn is_caching(&self) -> bool {
        self.caching
    }

    /// The configuration in force.
    pub fn config(&self) -> AllocatorConfig {
        self.lock().config.clone()
    }

    /// Re-parses the configuration (PyTorch's `_set_allocator_settings`); on error nothing
    /// changes.
    pub fn update_config(&self, s: &str) -> Result<(), AllocError> {
        let mut st = self.lock();
        st.config.update(s)?;
        st.stats.max_split_size = st.config.max_split_size.map_or(-1, |m| m as i64);
        Ok(())
    }

    /// `set_per_process_memory_fraction`: reserved bytes may not exceed `fraction` of the
    /// device; 1 removes the limit.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidFraction(fraction));
        }
        let mut st = self.lock();
        st.allowed_max = (fraction < 1.0).then_some((fraction * self.device_total as f64) as u64);
        st.config.per_process_memory_fraction = fraction;
        Ok(())
    }

    /// `get_per_process_memory_fraction`.
    pub fn memory_fraction(&self) -> f64 {
        self.state
            .lock()
            .allowed_max
            .map_or(1.0, |a| a as f64 / self.device_total as f64)
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> DeviceStats {
        self.lock().stats.snapshot()
    }

    /// `reset_peak_memory_stats`.
    pub fn reset_peak_stats(&self) {
        self.lock().stats.reset_peak();
    }

    /// `reset_accumulated_memory_stats`.
    pub fn reset_accumulated_stats(&self) {
        self.lock().stats.reset_accumulated();
    }

    /// Every block, in address order per segment.
    pub fn blocks(&self) -> Vec<BlockInfo> {
        let st = self.lock();
        let mut out = Vec::new();
        for (id, b) in st.blocks.iter().enumerate() {
            if b.prev.is_some() || b.vacant {
                continue;
            }
            let mut cursor = Some(id);
            while let Some(i) = cursor {
                let x = &st.blocks[i];
                out.push(BlockInfo {
                    ptr: DevicePtr(x.ptr),
                    size: x.size,
                    requested: x.requested,
                    pool: x.pool,
                    allocated: x.allocated,
                    pending_events: x.event_count > 0,
                    segment: DevicePtr(b.ptr),
                    stream: st.stream_handle(x.stream),
                    mapped: x.mapped,
                    expandable: x.segment.is_some(),
                    pool_id: x.pool_id,
                });
                cursor = x.next.get();
            }
        }
        out
    }

    /// Recounts everything from the blocks and compares with the books: no two blocks
    /// overlap, neighbours touch, the current statistics equal a recount, reserved bytes
    /// equal the sum of segments. For tests and debugging; `Err` says what differs.
    pub fn check_invariants(&self) -> Result<(), String> {
        let blocks = self.blocks();
        let st = self.lock();
        let mut by_addr: Vec<&BlockInfo> = blocks.iter().collect();
        by_addr.sort_by_key(|b| b.ptr.0);
        for w in by_addr.windows(2) {
            if w[0].ptr.0 + w[0].size > w[1].ptr.0 {
                return Err(format!("blocks overlap: {:?} and {:?}", w[0], w[1]));
            }
        }
        let mut want = DeviceStats::default();
        // (pool, mapped bytes, blocks, expandable) per segment.
        let mut segments: FxHashMap<u64, (PoolKind, u64, usize, bool)> = FxHashMap::default();
        for b in &blocks {
            let seg = segments
                .entry(b.segment.0)
                .or_insert((b.pool, 0, 0, b.expandable));
            if b.mapped {
                seg.1 += b.size;
            }
            seg.2 += 1;
        }
        for b in blocks.iter().filter(|b| b.mapped) {
            // Expandable blocks never count as inactive splits.
            let split = !b.expandable && segments.get(&b.segment.0).is_some_and(|s| s.2 > 1);
            if b.allocated {
                want.allocation.increase(b.pool, 1);
                want.allocated_bytes.increase(b.pool, b.size as i64);
            }
            if b.allocated || b.pending_events {
                want.active.increase(b.pool, 1);
                want.active_bytes.increase(b.pool, b.size as i64);
                want.requested_bytes.increase(b.pool, b.requested as i64);
            } else if split {
                want.inactive_split.increase(b.pool, 1);
                want.inactive_split_bytes.increase(b.pool, b.size as i64);
            }
        }
        for (kind, size, _, expandable) in segments.values() {
            // Expandable memory counts as reserved, but not as segments (PyTorch's rule).
            if !expandable {
                want.segment.increase(*kind, 1);
            }
            want.reserved_bytes.increase(*kind, *size as i64);
        }
        // Pages unmapped for reuse by `expandable_segments_reclaim` are still reserved.
        for kind in [PoolKind::Small, PoolKind::Large] {
            want.reserved_bytes
                .increase(kind, st.expandable.spare_bytes(kind) as i64);
        }
        let have = st.stats.snapshot();
        for ((name, a), (_, b)) in have.arrays().into_iter().zip(want.arrays()) {
            for (pool, x, y) in [
                ("all", &a.all, &b.all),
                ("small", &a.small_pool, &b.small_pool),
                ("large", &a.large_pool, &b.large_pool),
            ] {
                if x.current != y.current {
                    return Err(format!(
                        "{name}.{pool}.current is {} but a recount gives {}",
                        x.current, y.current
                    ));
                }
            }
        }
        let spare: u64 = st
            .expandable
            .spare_pages
            .iter()
            .flatten()
            .map(|(_, p)| p)
            .sum();
        let reserved: u64 = segments.values().map(|s| s.1).sum::<u64>() + spare;
        if reserved != st.total_reserved {
            return Err(format!(
                "reserved {} but segments sum to {reserved}",
                st.total_reserved
            ));
        }
        // Every slot was just settled and dropped its credit (under the lock, none comes back).
        let credits = self.shared.credits.load(Ordering::Acquire);
        if credits != 0 {
            return Err(format!(
                "{credits} credits outstanding after settling every slot"
            ));
        }
        st.blocks.check_addresses()?;
        let free = st.pools.len();
        let in_pool = st
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, b)| b.in_pool && !b.vacant)
            .count();
        if free != in_pool {
            return Err(format!(
                "{free} keys in the free lists but {in_pool} blocks marked free"
            ));
        }
        Ok(())
    }

    // ---- allocate ------------------------------------------------------------------------

    /// Allocates `bytes` for use on `stream`. Zero bytes give a null pointer.
    pub fn allocate(&self, bytes: u64, stream: StreamHandle) -> Result<Allocation, AllocError> {
        if bytes >= ONE_EXABYTE {
            // PyTorch refuses these before its device allocator (`NativeCachingAllocator::
            // malloc`): no statistic, no history entry, no observer.
            return Err(self.oom_report(bytes, true, stream));
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
                .driver
                .malloc(self.device, bytes)
                .map_err(|e| self.driver_oom(e, bytes))?;
            self.uncached.lock().insert(ptr.0, (bytes, stream.raw));
            return Ok(Allocation {
                ptr,
                size: bytes,
                requested: bytes,
                stream,
            });
        }
        // The block this thread just freed, if its credit covers this request. With no
        // credit outstanding, no slot can hold a block.
        if self.outstanding_credits()
            && let Some(Some((ptr, size))) =
                thread_cache::with_slot(self.id, |s| s.reuse(bytes, stream.raw))
        {
            return Ok(Allocation {
                ptr: DevicePtr(ptr),
                size,
                requested: bytes,
                stream,
            });
        }
        // Stacks are gathered before taking the lock: they are slow.
        let context = self.context.load(std::sync::atomic::Ordering::Relaxed);
        let frames = (context >= HistoryContext::State as u8).then(capture_frames);
        // While a pool is being recorded to, ask the driver which capture this stream is in
        // (a cheap query, made before taking the lock).
        let capture = if self.routing.load(std::sync::atomic::Ordering::Acquire) > 0 {
            match self.driver.stream_capture_status(stream)? {
                CaptureStatus::Active { id } => Some(id),
                _ => None,
            }
        } else {
            None
        };
        let mut st = self.lock();
        self.process_events(&mut st);
        let size = round_size(bytes, &st.config);
        let pool = st.private.route(stream, capture);
        let req = Request {
            size,
            requested: bytes,
            kind: pool_kind(size),
            stream,
            pool,
            frames,
        };
        if let Some(id) = st.take_free_block(req.pool, req.kind, stream, size) {
            return Ok(self.hand_out(&mut st, id, &req));
        }
        self.slow_path(st, req)
    }

    /// `use_block`, then a credit for the calling thread's slot where one is due.
    #[inline(always)]
    fn hand_out(&self, st: &mut State, id: usize, req: &Request) -> Allocation {
        let (id, allocation) = st.use_block(id, req);
        if !self.shared.wants_credit() {
            return allocation;
        }
        let Some(credit) = st.credit(id, req) else {
            return allocation;
        };
        let (ptr, stream) = (allocation.ptr.0, allocation.stream.raw);
        let granted = thread_cache::with_slot(self.id, |slot| {
            // The slot is idle (the operation began by settling it), unless it took the
            // lock more than once on the way.
            self.settle(st, slot);
            slot.grant(id, ptr, stream, credit);
        });
        if granted.is_none() {
            // A thread's first credit makes its slot.
            let Some(slot) = thread_cache::register(self.id, &self.shared) else {
                return allocation;
            };
            slot.grant(id, ptr, stream, credit);
            st.slots.push(slot);
        }
        allocation
    }

    /// Whether any slot holds a block (if the calling thread's does, this is true: its own
    /// grant counted it, and only taking the block out of the slot uncounts it).
    #[inline]
    fn outstanding_credits(&self) -> bool {
        self.shared.credits.load(Ordering::Acquire) > 0
    }

    /// Locks the state for an operation, settling every slot first: parked blocks are
    /// freed for real and every credit is dropped. At most one thread therefore holds a
    /// credit at any time (its grant is the last locked operation), and every locked
    /// operation sees every free that happened before it, as under PyTorch's one mutex.
    /// Also taken again after a driver call made outside the lock.
    #[inline(always)]
    fn lock(&self) -> MutexGuard<'_, State> {
        let mut st = self.state.lock();
        // Exact under the lock: credits are granted and ended with it held.
        if self.shared.credits.load(Ordering::Relaxed) > 0
            || self.shared.orphans.load(Ordering::Acquire) > 0
        {
            self.settle_all(&mut st);
        }
        st
    }

    /// Settles every slot (see [`CachingAllocator::lock`]) and forgets the slots of exited
    /// threads.
    fn settle_all(&self, st: &mut State) {
        self.shared.orphans.store(0, Ordering::Release);
        let slots = std::mem::take(&mut st.slots);
        for slot in &slots {
            self.settle(st, slot);
        }
        st.slots = slots;
        st.slots.retain(|s| !s.orphaned.load(Ordering::Acquire));
    }

    /// Folds a slot's reuses into the statistics, frees its parked block for real and ends
    /// its credit.
    fn settle(&self, st: &mut State, slot: &Slot) {
        let Some(was) = slot.seize() else {
            return;
        };
        slot.fold_into(&mut st.stats);
        slot.end_credit();
        if was == PARKED {
            let id = slot.block.load(Ordering::Relaxed);
            // A credited block has no other stream's uses: freeing it needs no event.
            let uses = st.release_live(id, None);
            debug_assert!(uses.is_empty());
            st.free_block(id);
        }
    }

    /// What `DeviceCachingAllocator::malloc` (c10/cuda/CUDACachingAllocator.cpp) does when
    /// best fit finds nothing: garbage collection (with a memory fraction), a new segment,
    /// the oversize release (`release_available_cached_blocks`) and a new segment, then
    /// `release_cached_blocks` (every event waited for, every cached segment of the default
    /// pool and of unretained private pools freed) and a last, counted retry. The
    /// ferrocuda-only keys `garbage_collection_without_fraction`, `cross_stream_reuse`,
    /// `oom_search_after_sync` and `oom_release_partial` add their steps.
    fn slow_path<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        req: Request,
    ) -> Result<Allocation, AllocError> {
        let Request {
            size,
            kind,
            stream,
            pool,
            ..
        } = req;
        let segment = allocation_size(size, &st.config);
        // While a capture is underway nothing may be freed or synchronized: only new memory.
        let capturing = st.capturing();
        if st.gc_enabled() && !capturing {
            let limit = st.allowed_max.unwrap_or(self.device_total);
            st = self.garbage_collect(st, limit);
        }
        if st.config.cross_stream_reuse
            && !capturing
            && let Some(id) = self.take_from_other_stream(&mut st, pool, kind, stream, size)?
        {
            return Ok(self.hand_out(&mut st, id, &req));
        }
        let (s, found) = self.grow(st, size, segment, pool, kind, stream)?;
        st = s;
        if let Some(id) = found {
            return Ok(self.hand_out(&mut st, id, &req));
        }
        // The oversize release touches the default pool only: PyTorch's also frees blocks
        // of a private pool being recorded to (pytorch#159594).
        if st.config.max_split_size.is_some() && pool.is_default() && !capturing {
            let (s, enough) = self.release_oversize(st, size, kind, stream);
            st = s;
            if enough || st.config.oom_release_partial {
                let (s, found) = self.grow(st, size, segment, pool, kind, stream)?;
                st = s;
                if let Some(id) = found {
                    return Ok(self.hand_out(&mut st, id, &req));
                }
            }
        }
        if capturing {
            // No synchronization and no cudaFree while a capture is underway.
            st.stats.num_ooms += 1;
            drop(st);
            return Err(self.oom_report(segment, false, stream));
        }
        if st.config.oom_search_after_sync {
            // The block needed may be one that other streams' events held back (PyTorch
            // never looks again: pytorch#189504).
            st = self.synchronize_events(st);
            if let Some(id) = st.take_free_block(pool, kind, stream, size) {
                return Ok(self.hand_out(&mut st, id, &req));
            }
        }
        if st.config.oom_release_partial {
            // As much cached memory as the request needs, largest segments first.
            st = self.release_cached(st, Some(segment));
            let (s, found) = self.grow(st, size, segment, pool, kind, stream)?;
            st = s;
            if let Some(id) = found {
                return Ok(self.hand_out(&mut st, id, &req));
            }
        }
        st = self.release_cached(self.synchronize_events(st), None);
        st.stats.num_alloc_retries += 1;
        let (s, found) = self.grow(st, size, segment, pool, kind, stream)?;
        st = s;
        if let Some(id) = found {
            return Ok(self.hand_out(&mut st, id, &req));
        }
        st.stats.num_ooms += 1;
        drop(st);
        Err(self.oom_report(segment, false, stream))
    }

    /// `alloc_block`: more device memory for a request of rounded `size`: a mapped
    /// expandable range when expandable segments are on, else a new `segment`-byte segment.
    fn grow<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        size: u64,
        segment: u64,
        pool: PoolId,
        kind: PoolKind,
        stream: StreamHandle,
    ) -> Result<(MutexGuard<'a, State>, Option<usize>), AllocError> {
        // Private (graph) pools use plain segments.
        if st.config.expandable_segments && pool.is_default() {
            self.alloc_expandable(st, size, kind, stream)
        } else {
            self.alloc_segment(st, segment, pool, kind, stream)
        }
    }

    /// `alloc_block`: a new segment from the driver, outside the lock. `Ok(None)` when the
    /// device (or the memory fraction) has no room.
    fn alloc_segment<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        bytes: u64,
        pool: PoolId,
        kind: PoolKind,
        stream: StreamHandle,
    ) -> Result<(MutexGuard<'a, State>, Option<usize>), AllocError> {
        if st.over_fraction(bytes) {
            return self.refuse_over_fraction(st, bytes);
        }
        st.total_reserved += bytes;
        let capturing = st.private.routing();
        drop(st);
        // A device allocation made while this thread captures is legal in relaxed mode (it is
        // not part of the graph); other modes would refuse it and break the capture.
        let previous = if capturing {
            self.driver.exchange_capture_mode(CaptureMode::Relaxed).ok()
        } else {
            None
        };
        let result = self.driver.malloc(self.device, bytes);
        if let Some(mode) = previous {
            let _ = self.driver.exchange_capture_mode(mode);
        }
        let mut st = self.lock();
        match result {
            Ok(ptr) => {
                let id = st.blocks.insert(Block::new(
                    ptr.0,
                    bytes,
                    stream.raw,
                    kind,
                    true,
                    Link::NONE,
                    pool,
                ));
                let oversize = st.config.max_split_size.is_some_and(|m| bytes >= m);
                if oversize {
                    st.oversize_segments.insert(ptr.0);
                    st.stats.oversize_segments.increase(1);
                }
                st.history
                    .record("segment_alloc", ptr.0, bytes, stream.raw, None);
                st.private.segment_added(pool);
                let s = &mut st.stats;
                s.segment.increase(kind, 1);
                s.reserved_bytes.increase(kind, bytes as i64);
                s.num_device_alloc += 1;
                Ok((st, Some(id)))
            }
            Err(e) if e.is_out_of_memory() => {
                st.total_reserved -= bytes;
                Ok((st, None))
            }
            Err(e) => {
                st.total_reserved -= bytes;
                Err(AllocError::Driver(e))
            }
        }
    }

    /// `cross_stream_reuse`: the smallest whole free segment of the request's pool, cached by
    /// another stream, that fits
    /// (oversize rules apply), moved to `stream`, which is made to wait for the work its old
    /// stream enqueued so far. Only whole segments move, so a segment never mixes streams.
    fn take_from_other_stream(
        &self,
        st: &mut State,
        pool: PoolId,
        kind: PoolKind,
        stream: StreamHandle,
        size: u64,
    ) -> Result<Option<usize>, AllocError> {
        let fits = |k: &FreeKey| k.size >= size && !oversize_refuses(size, k.size, &st.config);
        let best = st
            .pools
            .keys_of(kind)
            .filter(|k| {
                k.pool == pool
                    && k.stream != stream.raw
                    && fits(k)
                    && !st.blocks[k.id].is_split()
                    && st.blocks[k.id].segment.is_none()
            })
            .min_by_key(|k| (k.size, k.ptr));
        let Some(found) = best else { return Ok(None) };
        let owner = st.stream_handle(st.blocks[found.id].stream);
        let event = st.order.event(&*self.driver, self.device)?;
        let ordered = self
            .driver
            .event_record(event, owner)
            .and_then(|()| self.driver.stream_wait_event(stream, event));
        // The wait captured the event's state: it can be recorded again at once.
        st.order.give_back(event);
        ordered?;
        st.pool_remove(found.id);
        st.blocks[found.id].stream = stream.raw;
        st.blocks[found.id].list = NO_LIST;
        Ok(Some(found.id))
    }

    /// A growth the memory fraction does not allow: no memory (the path goes on), or with
    /// `throw_on_cudamalloc_oom` an out-of-memory error at once, counted in
    /// `num_oom_rejections` (PyTorch's `alloc_block`, skipping every retry).
    fn refuse_over_fraction<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        bytes: u64,
    ) -> Result<(MutexGuard<'a, State>, Option<usize>), AllocError> {
        if !st.config.throw_on_cudamalloc_oom {
            return Ok((st, None));
        }
        st.stats.num_oom_rejections += 1;
        drop(st);
        let mut report = self.oom_report(bytes, false, StreamHandle::legacy(self.device));
        if let AllocError::OutOfMemory(oom) = &mut report {
            oom.rejected_by_fraction = true;
        }
        Err(report)
    }

    fn driver_oom(&self, e: DriverError, bytes: u64) -> AllocError {
        if e.is_out_of_memory() {
            self.oom_report(bytes, false, StreamHandle::legacy(self.device))
        } else {
            AllocError::Driver(e)
        }
    }

    fn oom_report(
        &self,
        requested: u64,
        beyond_one_exabyte: bool,
        stream: StreamHandle,
    ) -> AllocError {
        let device_free = self.driver.mem_get_info(self.device).map_or(0, |(f, _)| f);
        let mut st = self.lock();
        if !beyond_one_exabyte {
            st.history.record_oom(requested, device_free, stream.raw);
        }
        let mut per_stream: FxHashMap<u64, (StreamHandle, u64)> = FxHashMap::default();
        let mut largest = 0;
        for key in st.pools.keys() {
            let b = &st.blocks[key.id];
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
            allowed: st.allowed_max,
            allocated: st.stats.allocated_bytes.current() as u64,
            reserved: st.stats.reserved_bytes.current() as u64,
            largest_free_block: largest,
            cached_per_stream,
            non_releasable: st.stats.inactive_split_bytes.current() as u64,
            expandable_segments: st.config.expandable_segments,
            rejected_by_fraction: false,
        };
        drop(st);
        if !beyond_one_exabyte {
            let observers = self.oom_observers.lock().clone();
            observers.iter().for_each(|o| o(&report));
        }
        AllocError::OutOfMemory(Box::new(report))
    }

    // ---- free and streams ----------------------------------------------------------------

    /// Returns an allocation. Blocks used on other streams (`record_stream`) become
    /// reusable once those streams' work recorded so far has completed.
    pub fn free(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        if ptr.0 == 0 {
            return Ok(());
        }
        if !self.caching {
            self.uncached
                .lock()
                .remove(&ptr.0)
                .ok_or(AllocError::InvalidPointer(ptr))?;
            return Ok(self.driver.free(self.device, ptr)?);
        }
        if self.outstanding_credits()
            && thread_cache::with_slot(self.id, |slot| slot.park(ptr.0)) == Some(true)
        {
            return Ok(());
        }
        let context = self.context.load(std::sync::atomic::Ordering::Relaxed);
        let free_frames = (context >= HistoryContext::All as u8).then(capture_frames);
        let mut st = self.lock();
        let Some(id) = st.blocks.allocated_at(ptr.0) else {
            return Err(AllocError::InvalidPointer(ptr));
        };
        let uses = st.release_live(id, free_frames.as_ref());
        if uses.is_empty() {
            st.free_block(id);
            return Ok(());
        }
        if st.capturing() {
            // Recording or querying events is illegal during capture: decide after it.
            let State { order, blocks, .. } = &mut *st;
            order.defer(blocks, id, uses);
            return Ok(());
        }
        let State { order, blocks, .. } = &mut *st;
        let unrecorded = order.record(&*self.driver, self.device, blocks, id, uses);
        if unrecorded.is_empty() {
            return Ok(());
        }
        // No event could mark these streams' progress: wait for them instead (outside the
        // lock), so the block is never reused early and never drops out of the books.
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
        waited.map_err(AllocError::Driver)
    }

    /// Marks `ptr` as used by `stream` (`Tensor.record_stream`): its memory is not reused
    /// until the work enqueued on `stream` before the free has completed.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<(), AllocError> {
        if ptr.0 == 0 || !self.caching {
            return Ok(());
        }
        let mut st = self.lock();
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

    /// Frees blocks whose events completed, stream by stream, in order (after recording
    /// the events of blocks freed during a capture that has ended).
    fn process_events(&self, st: &mut State) {
        if st.order.is_quiet() || st.capturing() {
            return;
        }
        let deferred = st.order.take_deferred(&mut st.blocks);
        for (id, uses) in deferred {
            let State { order, blocks, .. } = &mut *st;
            // A stream that cannot take an event now: wait for it here (rare).
            for stream in order.record(&*self.driver, self.device, blocks, id, uses) {
                let _ = self.driver.stream_synchronize(stream);
            }
            if st.blocks[id].event_count == 0 && !st.blocks[id].allocated {
                st.free_block(id);
            }
        }
        for (event, id) in st.order.completed(&*self.driver) {
            st.complete_event(event, id);
        }
    }

    /// `synchronize_and_free_events`: waits (outside the lock) for every outstanding event
    /// and frees their blocks; counted in `num_sync_all_streams` whether or not any was
    /// outstanding, as PyTorch counts it.
    fn synchronize_events<'a>(&'a self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        st.stats.num_sync_all_streams += 1;
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

    /// Frees segments (outside the lock).
    fn free_segments<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        ptrs: Vec<u64>,
    ) -> MutexGuard<'a, State> {
        if ptrs.is_empty() {
            return st;
        }
        drop(st);
        for p in ptrs {
            // A failed free leaves the address unusable; it was already unaccounted.
            let _ = self.driver.free(self.device, DevicePtr(p));
        }
        self.lock()
    }

    /// Releases whole free segments: all of them (`None`) or, largest first, until
    /// `Some(bytes)` are released.
    fn release_cached<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        enough: Option<u64>,
    ) -> MutexGuard<'a, State> {
        let mut candidates: Vec<FreeKey> = st
            .pools
            .keys()
            .filter(|k| {
                !st.blocks[k.id].is_split()
                    && st.blocks[k.id].segment.is_none()
                    && st.private.releasable(k.pool)
            })
            .collect();
        candidates.sort_by_key(|k| std::cmp::Reverse(k.size));
        let mut freed = 0;
        let mut ptrs = Vec::new();
        for k in candidates {
            if enough.is_some_and(|e| freed >= e) {
                break;
            }
            freed += k.size;
            ptrs.push(st.release_segment(k.id));
        }
        let st = self.free_segments(st, ptrs);
        if enough.is_some_and(|e| freed >= e) {
            return st;
        }
        self.release_expandable(st, Unmap::All)
    }

    /// `release_available_cached_blocks`, with `max_split_size` (M) set, for a request of
    /// rounded `size` in the default pool: the smallest free block of this stream of at
    /// least `max(size, M)` is freed if it is an ordinary one; else this stream's blocks
    /// below that, largest first, while they are oversize, until as many bytes are freed
    /// (expandable ones are passed over). Returns whether enough was freed; what was freed
    /// stays freed either way.
    fn release_oversize<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        size: u64,
        kind: PoolKind,
        stream: StreamHandle,
    ) -> (MutexGuard<'a, State>, bool) {
        let Some(m) = st.config.max_split_size else {
            return (st, false);
        };
        let wanted = size.max(m);
        let Some(list) = st.pools.list(PoolId::DEFAULT, stream.raw, kind) else {
            return (st, false);
        };
        // Only whole segments: a free block over the limit can still be a piece of a
        // segment split under an earlier, larger `max_split_size_mb`, and PyTorch's
        // `release_block` would free the segment under its live neighbours.
        let whole = |id: usize| st.blocks[id].segment.is_none() && !st.blocks[id].is_split();
        let (chosen, enough) = match list.first_from(key(wanted, 0)) {
            Some(f) if whole(f.id) => (vec![f.id], true),
            _ => {
                let below: Vec<(u64, usize)> = list
                    .iter()
                    .map(|(k, id)| (key_size(k), id))
                    .take_while(|(size, _)| *size < wanted)
                    .collect();
                let mut total = 0;
                let mut chosen = Vec::new();
                for &(size, id) in below.iter().rev() {
                    if total >= wanted || size < m {
                        break;
                    }
                    if whole(id) {
                        total += size;
                        chosen.push(id);
                    }
                }
                (chosen, total >= wanted)
            }
        };
        let ptrs = chosen
            .into_iter()
            .map(|id| st.release_segment(id))
            .collect();
        (self.free_segments(st, ptrs), enough)
    }

    /// `garbage_collect_cached_blocks`: once more than `garbage_collection_threshold` of
    /// `limit` is reserved, frees whole free segments of the default large pool whose age
    /// (searches of that pool since the block was freed) is at least the average, round
    /// after round, until the excess is reclaimed or a round frees nothing. Expandable
    /// blocks count in the average but are never freed, as in PyTorch.
    fn garbage_collect<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        limit: u64,
    ) -> MutexGuard<'a, State> {
        let threshold = (st.config.garbage_collection_threshold * limit as f64) as u64;
        if st.total_reserved <= threshold {
            return st;
        }
        let target = st.total_reserved - threshold;
        let mut candidates: Vec<(usize, u64)> = st
            .pools
            .keys_of(PoolKind::Large)
            .filter(|k| k.pool.is_default() && !st.blocks[k.id].is_split())
            .map(|k| (k.id, st.pools.gc_clock - st.blocks[k.id].gc_base))
            .collect();
        let mut total_age: u64 = candidates.iter().map(|(_, age)| age).sum();
        let mut reclaimed = 0;
        let mut ptrs = Vec::new();
        let mut freed_any = true;
        while reclaimed < target && freed_any && !candidates.is_empty() {
            let average = total_age as f64 / candidates.len() as f64;
            freed_any = false;
            let mut kept = Vec::with_capacity(candidates.len());
            for (id, age) in candidates {
                if st.blocks[id].segment.is_none() && age as f64 >= average {
                    freed_any = true;
                    reclaimed += st.blocks[id].size;
                    total_age -= age;
                    ptrs.push(st.release_segment(id));
                } else {
                    kept.push((id, age));
                }
            }
            candidates = kept;
        }
        self.free_segments(st, ptrs)
    }

    /// What `Drop` does: waits for outstanding events, ends every private pool's retention,
    /// frees every free segment and page and destroys the spare events.
    fn give_back_everything(&self) {
        let mut st = self.lock();
        st.private.forget_users();
        let mut st = self.release_cached(self.synchronize_events(st), None);
        let events = st.order.take_spare();
        drop(st);
        for e in events {
            let _ = self.driver.event_destroy(e);
        }
    }

    /// `empty_cache`: waits for outstanding events, then gives every whole free segment
    /// back to the driver. Segments with a live piece stay (the "non-releasable" memory).
    pub fn empty_cache(&self) {
        if !self.caching || self.lock().capturing() {
            // Nothing is synchronized or freed while a capture is underway.
            return;
        }
        let st = self.synchronize_events(self.lock());
        drop(self.release_cached(st, None));
    }
}

impl State {
    /// The handle of this device's stream `raw`.
    fn stream_handle(&self, raw: u64) -> StreamHandle {
        StreamHandle {
            device: self.device,
            raw,
        }
    }

    /// `free`'s bookkeeping for allocated block `id`: no longer allocated, history and
    /// statistics told. Returns the other streams that used it.
    #[inline(always)]
    fn release_live(&mut self, id: usize, frames: Option<&Arc<[Frame]>>) -> Vec<StreamHandle> {
        let b = &mut self.blocks[id];
        b.allocated = false;
        let (ptr, requested, stream) = (b.ptr, b.requested, b.stream);
        let (kind, size, oversize) = (b.pool, b.size, b.oversize);
        // (Looked at only when there are some: the list lies in the block's cold line.)
        let uses = if std::mem::take(&mut b.has_uses) {
            std::mem::take(&mut b.stream_uses)
        } else {
            Vec::new()
        };
        self.history
            .record("free_requested", ptr, requested, stream, frames);
        self.stats.allocation.decrease(kind, 1);
        self.stats.allocated_bytes.decrease(kind, size as i64);
        if oversize {
            self.stats.oversize_allocations.decrease(1);
        }
        uses
    }

    /// The credit of live block `id`, just handed out for `req`: due when
    /// PyTorch's free of it followed by the same request would hand out the same block and
    /// leave every other block and every current statistic as they were, with no peak
    /// passed on the way (see `thread_cache`).
    fn credit(&self, id: usize, req: &Request) -> Option<Credit> {
        let c = &self.config;
        if !c.thread_cache
            || c.garbage_collection_threshold > 0.0
            || self.history.options.mode != HistoryMode::Off
            || self.private.routing()
            || !self.order.is_quiet()
        {
            return None;
        }
        let b = &self.blocks[id];
        let expandable = b.segment.is_some();
        // (With expandable segments switched off, the search skips expandable blocks.)
        if (expandable && !c.expandable_segments)
            || b.size != req.size
            || self.blocks.mergeable(b.prev).is_some()
        {
            return None;
        }
        // The free merges the free block after it, if any...
        let next = self.blocks.mergeable(b.next);
        let next_size = next.map_or(0, |n| self.blocks[n].size);
        let merged = b.size + next_size;
        if oversize_refuses(b.size, merged, c) {
            return None;
        }
        // ... the search must find the merged block first (an expandable one must also not
        // be passed over for the next candidate, which could grow by less: spec §4.5). Best
        // fit has just chosen this block, so only blocks freed by other threads while the
        // slow path waited for the driver (lock released) can fail these checks...
        let next_key = next.map(|n| key(next_size, self.blocks[n].ptr));
        let rival = self.pools.list(b.pool_id, b.stream, b.pool).and_then(|l| {
            l.range_from(key(b.size, 0))
                .find(|(k, _)| Some(*k) != next_key)
        });
        let merged_next = next.map_or(b.next, |n| self.blocks[n].next);
        let growable = merged + self.blocks.unmapped_after(merged_next);
        if rival.is_some_and(|(k, r)| {
            k < key(merged, b.ptr)
                || (expandable
                    && self.blocks[r].size + self.blocks.unmapped_after(self.blocks[r].next)
                        < growable)
        }) {
            return None;
        }
        // ... and split the same remainder off again.
        if next.is_some() && !self.split_worthwhile(expandable, b.pool, b.size, next_size) {
            return None;
        }
        // How `inactive_split` moves: (counted at all, bytes counted, rise of the count and
        // of the bytes between the free and the search). Expandable blocks never count.
        let (inactive, inactive_bytes, rise) = match next {
            _ if expandable => (false, 0, (0, 0)),
            None if b.is_split() => (true, b.size, (1, b.size)),
            None => (false, 0, (0, 0)),
            Some(n) if b.prev.is_some() || self.blocks[n].next.is_some() => {
                (true, merged, (0, b.size))
            }
            Some(_) => (true, next_size, (0, 0)),
        };
        let s = &self.stats;
        if s.inactive_split.would_peak(b.pool, rise.0 as i64)
            || s.inactive_split_bytes.would_peak(b.pool, rise.1 as i64)
        {
            return None;
        }
        Some(Credit {
            kind: b.pool,
            size: b.size,
            requested: b.requested,
            oversize: b.oversize,
            inactive,
            inactive_bytes,
        })
    }

    #[inline(always)]
    fn pool_insert(&mut self, id: usize) {
        self.pools.add(&mut self.blocks, id);
    }

    #[inline(always)]
    fn pool_remove(&mut self, id: usize) {
        self.pools.remove(&mut self.blocks, id);
    }

    /// Best fit on the request's stream with the oversize rules; a search of the default
    /// large pool ticks the garbage-collection clock while collection is on.
    #[inline(always)]
    fn take_free_block(
        &mut self,
        pool: PoolId,
        kind: PoolKind,
        stream: StreamHandle,
        size: u64,
    ) -> Option<usize> {
        let count = pool.is_default() && kind == PoolKind::Large && self.gc_enabled();
        self.pools.take(
            &mut self.blocks,
            (pool, kind, stream),
            size,
            &self.config,
            count,
        )
    }

    fn should_split(&self, id: usize, size: u64) -> bool {
        let b = &self.blocks[id];
        self.split_worthwhile(b.segment.is_some(), b.pool, size, b.size - size)
    }

    /// Whether a free block cut for `size` keeps `remaining` bytes as a block of its own.
    fn split_worthwhile(
        &self,
        expandable: bool,
        kind: PoolKind,
        size: u64,
        remaining: u64,
    ) -> bool {
        // Expandable blocks and the small pool keep any remainder of a minimum block; the
        // large pool keeps one above the small-pool size, below `max_split_size`. Both are
        // computed and one picked without a branch: which pool a request hits is random.
        let by_minimum = expandable | (kind == PoolKind::Small);
        let minimum = remaining >= crate::rounding::MIN_BLOCK_SIZE;
        let large =
            (size < self.config.max_split_size.unwrap_or(u64::MAX)) & (remaining > SMALL_SIZE);
        (by_minimum & minimum) | (!by_minimum & large)
    }

    /// `alloc_found_block`: splits if worthwhile and hands the low part out (returned with
    /// its id).
    #[inline(always)]
    fn use_block(&mut self, id: usize, req: &Request) -> (usize, Allocation) {
        let (size, requested) = (req.size, req.requested);
        let kind = self.blocks[id].pool;
        let was_split = self.blocks[id].is_split();
        // Expandable blocks are never counted as inactive splits (PyTorch's rule).
        let counted = self.blocks[id].segment.is_none();
        let id = if self.should_split(id, size) {
            let remaining = self.blocks[id].size - size;
            let new = self.blocks.split_front(id, size);
            self.pool_insert(id);
            if counted && was_split {
                self.stats.inactive_split_bytes.decrease(kind, size as i64);
            } else if counted {
                self.stats.inactive_split.increase(kind, 1);
                self.stats
                    .inactive_split_bytes
                    .increase(kind, remaining as i64);
            }
            new
        } else {
            if counted && was_split {
                self.stats.inactive_split.decrease(kind, 1);
                self.stats
                    .inactive_split_bytes
                    .decrease(kind, self.blocks[id].size as i64);
            }
            id
        };
        let max_split = self.config.max_split_size;
        let b = &mut self.blocks[id];
        let (ptr, size, stream) = (b.ptr, b.size, b.stream);
        let oversize = max_split.is_some_and(|m| size >= m);
        b.allocated = true;
        b.requested = requested;
        b.oversize = oversize;
        if req.frames.is_some() {
            // (A free block has none: `free_block` took them.)
            b.frames = req.frames.clone();
            b.has_frames = true;
        }
        let s = &mut self.stats;
        s.allocation.increase(kind, 1);
        s.allocated_bytes.increase(kind, size as i64);
        s.active.increase(kind, 1);
        s.active_bytes.increase(kind, size as i64);
        s.requested_bytes.increase(kind, requested as i64);
        if oversize {
            s.oversize_allocations.increase(1);
        }
        let on_trace = self.history.options.context >= HistoryContext::Alloc;
        self.history.record(
            "alloc",
            ptr,
            requested,
            stream,
            req.frames.as_ref().filter(|_| on_trace),
        );
        (
            id,
            Allocation {
                ptr: DevicePtr(ptr),
                size,
                requested,
                stream: self.stream_handle(stream),
            },
        )
    }

    /// An event of block `id` completed: the block is freed once it waits for none and is
    /// no longer allocated.
    fn complete_event(&mut self, event: EventHandle, id: usize) {
        if self.order.complete(&mut self.blocks, event, id) && !self.blocks[id].allocated {
            self.free_block(id);
        }
    }

    /// `free_block`: merges with free neighbours and returns the block to its pool.
    #[inline(always)]
    fn free_block(&mut self, id: usize) {
        let b = &mut self.blocks[id];
        let (ptr, stream, kind) = (b.ptr, b.stream, b.pool);
        let (size, requested, counted) = (b.size, b.requested, b.segment.is_none());
        let frames = if std::mem::take(&mut b.has_frames) {
            let with_frames = self.history.options.context >= HistoryContext::All;
            b.frames.take().filter(|_| with_frames)
        } else {
            None
        };
        b.requested = 0;
        let (prev, next) = (b.prev, b.next);
        // The record that stays: a free block before this one absorbs it (its address is
        // already mapped to it), else this one absorbs a free block after it. Either way
        // one address leaves the map.
        let mut keep = id;
        if let Some(p) = self.blocks.mergeable(prev) {
            self.absorb(p, id, counted, kind);
            keep = p;
        }
        if let Some(n) = self.blocks.mergeable(next) {
            self.absorb(keep, n, counted, kind);
        }
        self.history
            .record("free_completed", ptr, requested, stream, frames.as_ref());
        if counted && self.blocks[keep].is_split() {
            let bytes = self.blocks[keep].size;
            self.stats.inactive_split.increase(kind, 1);
            self.stats.inactive_split_bytes.increase(kind, bytes as i64);
        }
        self.pool_insert(keep);
        let s = &mut self.stats;
        s.active.decrease(kind, 1);
        s.active_bytes.decrease(kind, size as i64);
        s.requested_bytes.decrease(kind, requested as i64);
    }

    /// `free_block`'s merge: block `id` takes in `next`, the block right after it, one of
    /// them being free in the pool (it leaves the pool and, if counted, the inactive splits).
    #[inline(always)]
    fn absorb(&mut self, id: usize, next: usize, counted: bool, kind: PoolKind) {
        let free = if self.blocks[id].in_pool { id } else { next };
        self.pool_remove(free);
        if counted {
            let free_size = self.blocks[free].size;
            self.stats.inactive_split.decrease(kind, 1);
            self.stats
                .inactive_split_bytes
                .decrease(kind, free_size as i64);
        }
        self.blocks.absorb_next(id, next);
    }

    /// Takes a whole free segment out of the books; the caller frees the returned address.
    fn release_segment(&mut self, id: usize) -> u64 {
        self.pool_remove(id);
        let b = &self.blocks[id];
        let (ptr, size, kind) = (b.ptr, b.size, b.pool);
        let (stream, pool) = (self.blocks[id].stream, self.blocks[id].pool_id);
        self.history.record("segment_free", ptr, size, stream, None);
        self.private.segment_released(pool);
        if self.oversize_segments.remove(&ptr) {
            self.stats.oversize_segments.decrease(1);
        }
        let s = &mut self.stats;
        s.segment.decrease(kind, 1);
        s.reserved_bytes.decrease(kind, size as i64);
        s.num_device_free += 1;
        self.total_reserved -= size;
        self.blocks.vacate(id);
        ptr
    }
}

impl CachingAllocator {
    /// The page of an expandable segment of `kind`: 2 MiB small, the large segment size
    /// large; it must be a multiple of the driver's granularity (queried, not assumed).
    fn page_size(&self, st: &State, kind: PoolKind) -> Result<u64, AllocError> {
        let page = match kind {
            PoolKind::Small => crate::rounding::SMALL_BUFFER,
            PoolKind::Large => st.config.large_segment_size,
        };
        let granularity = *self
            .granularity
            .get_or_init(|| self.driver.vm_granularity(self.device).unwrap_or(0));
        if granularity == 0 || page % granularity != 0 {
            return Err(AllocError::Driver(DriverError::NOT_SUPPORTED));
        }
        Ok(page)
    }

    /// Reserves a new expandable segment's address range (outside the lock): 9/8 of the
    /// device, or `expandable_segments_reserve`, never more than 9/8.
    fn new_segment<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        kind: PoolKind,
        stream: StreamHandle,
        page: u64,
    ) -> Result<MutexGuard<'a, State>, AllocError> {
        let cap = self.device_total + self.device_total / 8;
        let want = match st.config.expandable_segments_reserve {
            Some(ferrocuda_types::ReserveSize::Fraction(f)) => {
                (f * self.device_total as f64) as u64
            }
            Some(ferrocuda_types::ReserveSize::Bytes(b)) => b,
            None => cap,
        };
        let bytes = want.clamp(page, cap.max(page)).div_ceil(page) * page;
        drop(st);
        let va = match self.driver.vm_reserve(self.device, bytes) {
            Ok(va) => va,
            // Address space used up: no room, like a device out of memory.
            Err(e) if e.is_out_of_memory() => return Ok(self.lock()),
            Err(e) => return Err(e.into()),
        };
        let mut st = self.lock();
        let segment = st.expandable.add(ExpandableSegment {
            va,
            page,
            handles: vec![None; (bytes / page) as usize],
            stream,
        });
        let id = st.blocks.insert(Block::new(
            va.base.0,
            bytes,
            stream.raw,
            kind,
            false,
            Link::from(Some(segment)),
            PoolId::DEFAULT,
        ));
        st.unmapped_insert(id);
        Ok(st)
    }

    /// `try_allocate_expandable_block`: finds (or reserves) room for `size` bytes in this
    /// stream's expandable segments, maps what is missing, and returns the range as one
    /// free block. Mapping is transactional: if any page fails, the pages mapped by this
    /// call are unmapped and released, and the segment is as it was (PyTorch #188008).
    fn alloc_expandable<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        size: u64,
        kind: PoolKind,
        stream: StreamHandle,
    ) -> Result<(MutexGuard<'a, State>, Option<usize>), AllocError> {
        let start = match st.expandable.find(&st.blocks, stream, kind, size) {
            Some(s) => s,
            None => {
                let page = self.page_size(&st, kind)?;
                st = self.new_segment(st, kind, stream, page)?;
                match st.expandable.find(&st.blocks, stream, kind, size) {
                    Some(s) => s,
                    None => return Ok((st, None)),
                }
            }
        };
        // A segment keeps the page size it was made with, whatever the configuration says
        // now (`large_segment_size_mb` may have changed since).
        let Some(page) = st.expandable.page_of(&st.blocks, start) else {
            return Ok((st, None));
        };
        let mut plan = Vec::new();
        let (mut covered, mut cur) = (0, Some(start));
        while covered < size {
            let Some(id) = cur.filter(|&i| st.blocks[i].growable()) else {
                return Ok((st, None));
            };
            let b = &st.blocks[id];
            if b.in_pool {
                plan.push(Grow::Take(id));
                covered += b.size;
            } else {
                let bytes = ((size - covered).div_ceil(page) * page).min(b.size);
                plan.push(Grow::Map(id, bytes));
                covered += bytes;
            }
            cur = b.next.get();
        }
        let to_map: u64 = plan
            .iter()
            .map(|g| if let Grow::Map(_, b) = g { *b } else { 0 })
            .sum();
        for g in &plan {
            match *g {
                Grow::Take(id) => st.pool_remove(id),
                Grow::Map(id, _) => st.unmapped_remove(id),
            }
            let (Grow::Take(id) | Grow::Map(id, _)) = *g;
            st.blocks[id].busy = true;
        }
        // `expandable_segments_reclaim`: free whole pages elsewhere in this stream's ranges
        // are unmapped (after a stream sync) and mapped here instead of new memory.
        let pages = to_map / page;
        let spare_now = st.expandable.spare_pages[kind.index()]
            .iter()
            .filter(|(_, p)| *p == page)
            .count() as u64;
        if st.config.expandable_segments_reclaim && pages > spare_now {
            st = self.release_expandable(
                st,
                Unmap::Reclaim {
                    stream,
                    kind,
                    pages: pages - spare_now,
                    page,
                },
            );
        }
        let mut reuse: Vec<PhysHandle> = Vec::new();
        st.expandable.spare_pages[kind.index()].retain(|&(h, p)| {
            let take = p == page && (reuse.len() as u64) < pages;
            if take {
                reuse.push(h);
            }
            !take
        });
        let created = to_map - reuse.len() as u64 * page;
        if st.over_fraction(created) {
            st.expandable.spare_pages[kind.index()].extend(reuse.into_iter().map(|h| (h, page)));
            st.undo_grow(&plan);
            return self.refuse_over_fraction(st, created);
        }
        st.total_reserved += created;
        let jobs: Vec<(u64, u64)> = plan
            .iter()
            .filter_map(|g| {
                if let Grow::Map(id, b) = *g {
                    Some((st.blocks[id].ptr, b))
                } else {
                    None
                }
            })
            .collect();
        drop(st);
        let (mapped, spare_back) = self.map_pages(&jobs, page, reuse);
        let mut st = self.lock();
        st.expandable.spare_pages[kind.index()].extend(spare_back.into_iter().map(|h| (h, page)));
        let handles = match mapped {
            Ok(h) => h,
            Err(e) => {
                st.total_reserved -= created;
                st.undo_grow(&plan);
                return if e.is_out_of_memory() {
                    Ok((st, None))
                } else {
                    Err(e.into())
                };
            }
        };
        let mut pieces = Vec::new();
        let mut handles = handles.into_iter();
        for g in plan {
            match g {
                Grow::Take(id) => pieces.push(id),
                Grow::Map(id, bytes) => {
                    let piece = if bytes < st.blocks[id].size {
                        let front = st.blocks.split_front(id, bytes);
                        st.blocks[id].busy = false;
                        st.unmapped_insert(id);
                        front
                    } else {
                        id
                    };
                    st.blocks[piece].mapped = true;
                    let ptr = st.blocks[piece].ptr;
                    st.store_pages(piece, handles.next().unwrap_or_default());
                    st.stats.num_device_alloc += 1;
                    st.history
                        .record("segment_map", ptr, bytes, stream.raw, None);
                    pieces.push(piece);
                }
            }
        }
        st.stats.reserved_bytes.increase(kind, created as i64);
        let first = pieces[0];
        for next in pieces.into_iter().skip(1) {
            st.blocks.absorb_next(first, next);
        }
        st.blocks[first].busy = false;
        Ok((st, Some(first)))
    }

    /// Maps `bytes` at each address, a page at a time, then grants access. All or nothing.
    /// Returns the pages mapped per job (or the error), and the spare pages not used (all
    /// of them after a failure: a rollback unmaps them again).
    fn map_pages(
        &self,
        jobs: &[(u64, u64)],
        page: u64,
        mut spare: Vec<PhysHandle>,
    ) -> (Result<Vec<Vec<PhysHandle>>, DriverError>, Vec<PhysHandle>) {
        let d = &self.driver;
        let from_spare: std::collections::HashSet<PhysHandle> = spare.iter().copied().collect();
        let mut done: Vec<Vec<PhysHandle>> = Vec::new();
        let mut result = Ok(());
        'jobs: for &(addr, bytes) in jobs {
            done.push(Vec::new());
            for p in 0..bytes / page {
                let h = match spare.pop() {
                    Some(h) => h,
                    None => match d.vm_create(self.device, page) {
                        Ok(h) => h,
                        Err(e) => {
                            result = Err(e);
                            break 'jobs;
                        }
                    },
                };
                if let Err(e) = d.vm_map(DevicePtr(addr + p * page), h) {
                    if from_spare.contains(&h) {
                        spare.push(h);
                    } else {
                        let _ = d.vm_destroy(h);
                    }
                    result = Err(e);
                    break 'jobs;
                }
                if let Some(v) = done.last_mut() {
                    v.push(h);
                }
            }
            if let Err(e) = d.vm_set_access(self.device, DevicePtr(addr), bytes) {
                result = Err(e);
                break;
            }
        }
        match result {
            Ok(()) => (Ok(done), spare),
            Err(e) => {
                for (&(addr, _), handles) in jobs.iter().zip(&done) {
                    for (p, h) in handles.iter().enumerate() {
                        let _ = d.vm_unmap(self.device, DevicePtr(addr + p as u64 * page), page);
                        if from_spare.contains(h) {
                            spare.push(*h);
                        } else {
                            let _ = d.vm_destroy(*h);
                        }
                    }
                }
                (Err(e), spare)
            }
        }
    }

    /// Unmaps the whole pages inside free expandable blocks (partial pages at either end
    /// stay mapped), after waiting for each segment's stream: the driver's unmap does not
    /// wait for queued work. Segments left entirely unmapped give their range back.
    fn release_expandable<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        scope: Unmap,
    ) -> MutexGuard<'a, State> {
        let candidates: Vec<usize> = st
            .pools
            .keys()
            .filter(|k| st.blocks[k.id].segment.is_some())
            .filter(|k| match scope {
                Unmap::All => true,
                Unmap::Reclaim {
                    stream, kind, page, ..
                } => {
                    k.stream == stream.raw
                        && st.blocks[k.id].pool == kind
                        && st.expandable.page_of(&st.blocks, k.id) == Some(page)
                }
            })
            .map(|k| k.id)
            .collect();
        let mut wanted = match scope {
            Unmap::All => u64::MAX,
            Unmap::Reclaim { pages, .. } => pages,
        };
        let mut jobs: Vec<(usize, u64, u64, Vec<PhysHandle>, StreamHandle, PoolKind)> = Vec::new();
        for id in candidates {
            if wanted == 0 {
                break;
            }
            let b = &st.blocks[id];
            let Some(seg) = st.expandable.segment_of(&st.blocks, id) else {
                continue;
            };
            let (base, page) = (seg.va.base.0, seg.page);
            let first = base + (b.ptr - base).div_ceil(page) * page;
            let last = base + (b.ptr + b.size - base) / page * page;
            if last <= first {
                continue;
            }
            let last = last.min(first.saturating_add(wanted.saturating_mul(page)));
            wanted -= (last - first) / page;
            let (end, kind, stream) = (b.ptr + b.size, b.pool, seg.stream);
            st.pool_remove(id);
            let mut mid = id;
            let head_bytes = first - st.blocks[id].ptr;
            if head_bytes > 0 {
                let head = st.blocks.split_front(id, head_bytes);
                st.pool_insert(head);
            }
            if last < end {
                mid = st.blocks.split_front(id, last - first);
                st.pool_insert(id);
            }
            st.blocks[mid].busy = true;
            let handles = st.take_pages(mid, first, last);
            jobs.push((mid, first, last - first, handles, stream, kind));
        }
        if jobs.is_empty() {
            return match scope {
                Unmap::All => self.destroy_spare_pages(st),
                Unmap::Reclaim { .. } => st,
            };
        }
        drop(st);
        let mut synced: Vec<StreamHandle> = Vec::new();
        for (_, addr, bytes, handles, stream, _) in &jobs {
            if !synced.contains(stream) {
                let _ = self.driver.stream_synchronize(*stream);
                synced.push(*stream);
            }
            let _ = self.driver.vm_unmap(self.device, DevicePtr(*addr), *bytes);
            if matches!(scope, Unmap::All) {
                for h in handles {
                    let _ = self.driver.vm_destroy(*h);
                }
            }
        }
        let mut st = self.lock();
        let mut ranges = Vec::new();
        for (mid, addr, bytes, handles, stream, kind) in jobs {
            st.history
                .record("segment_unmap", addr, bytes, stream.raw, None);
            if matches!(scope, Unmap::All) {
                st.stats.reserved_bytes.decrease(kind, bytes as i64);
                st.stats.num_device_free += 1;
                st.total_reserved -= bytes;
            } else {
                // Kept for remapping: still physical memory, still reserved.
                let page = bytes / handles.len().max(1) as u64;
                st.expandable.spare_pages[kind.index()]
                    .extend(handles.into_iter().map(|h| (h, page)));
            }
            ranges.extend(st.settle_unmapped(mid));
        }
        if matches!(scope, Unmap::All) {
            st = self.destroy_spare_pages(st);
        }
        if ranges.is_empty() {
            return st;
        }
        drop(st);
        for va in ranges {
            let _ = self.driver.vm_release(va);
        }
        self.lock()
    }

    /// Gives the spare pages of `expandable_segments_reclaim` back to the driver.
    fn destroy_spare_pages<'a>(&'a self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        let spare: Vec<(PoolKind, Vec<(PhysHandle, u64)>)> = [PoolKind::Small, PoolKind::Large]
            .into_iter()
            .map(|kind| {
                (
                    kind,
                    std::mem::take(&mut st.expandable.spare_pages[kind.index()]),
                )
            })
            .filter(|(_, h)| !h.is_empty())
            .collect();
        if spare.is_empty() {
            return st;
        }
        drop(st);
        for (h, _) in spare.iter().flat_map(|(_, h)| h) {
            let _ = self.driver.vm_destroy(*h);
        }
        let mut st = self.lock();
        for (kind, handles) in spare {
            let bytes: u64 = handles.iter().map(|(_, p)| p).sum();
            st.stats.reserved_bytes.decrease(kind, bytes as i64);
            st.stats.num_device_free += 1;
            st.total_reserved -= bytes;
        }
        st
    }
}

impl State {
    /// Whether any stream capture records into a pool now.
    fn capturing(&self) -> bool {
        self.private.capturing()
    }

    fn unmapped_insert(&mut self, id: usize) {
        self.expandable.insert_unmapped(&mut self.blocks, id);
    }

    fn unmapped_remove(&mut self, id: usize) {
        self.expandable.remove_unmapped(&self.blocks, id);
    }

    fn store_pages(&mut self, id: usize, pages: Vec<PhysHandle>) {
        self.expandable.store_pages(&self.blocks, id, pages);
    }

    fn take_pages(&mut self, id: usize, first: u64, last: u64) -> Vec<PhysHandle> {
        self.expandable.take_pages(&self.blocks, id, first, last)
    }

    fn settle_unmapped(&mut self, id: usize) -> Option<ferrocuda_types::VaRange> {
        self.expandable.settle_unmapped(&mut self.blocks, id)
    }

    /// Puts back the blocks a growth plan set aside: taken free blocks return to their free
    /// list, holes to be mapped to the unmapped set.
    fn undo_grow(&mut self, plan: &[Grow]) {
        for g in plan {
            match *g {
                Grow::Take(id) => {
                    self.blocks[id].busy = false;
                    self.pool_insert(id);
                }
                Grow::Map(id, _) => self.unmapped_insert(id),
            }
        }
    }

    /// Whether growing by `bytes` would pass the memory fraction's limit.
    fn over_fraction(&self, bytes: u64) -> bool {
        self.allowed_max
            .is_some_and(|max| self.total_reserved.saturating_add(bytes) > max)
    }

    /// Whether garbage collection runs (PyTorch: a memory fraction and a threshold).
    fn gc_enabled(&self) -> bool {
        self.config.garbage_collection_threshold > 0.0
            && (self.allowed_max.is_some() || self.config.garbage_collection_without_fraction)
    }
}

impl CachingAllocator {
    /// Creates private pool `pool`, or adds a user to it (`create_or_incref`).
    pub fn retain_pool(&self, pool: PoolId) {
        self.lock().private.retain(pool);
    }

    /// Drops a user of `pool` (`releasePool`). At zero users its free segments go back to
    /// the driver at the next `empty_cache` (or OOM retry); blocks still allocated from it
    /// stay valid until freed.
    pub fn release_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        self.lock().private.release(pool)
    }

    /// Users of `pool` (`getPoolUseCount`), if it exists.
    pub fn pool_use_count(&self, pool: PoolId) -> Option<u32> {
        self.lock().private.use_count(pool)
    }

    /// Routes allocations that `route` takes into `pool` until [`end_allocate_to_pool`]
    /// (`beginAllocateToPool`); the pool gains a user.
    ///
    /// [`end_allocate_to_pool`]: CachingAllocator::end_allocate_to_pool
    pub fn begin_allocate_to_pool(&self, pool: PoolId, route: Route) -> Result<(), AllocError> {
        self.lock().private.begin(pool, route)?;
        self.routing
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Stops routing into `pool` (`endAllocateToPool`); the pool keeps its user.
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        self.lock().private.end(pool)?;
        self.routing
            .fetch_sub(1, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// The blocks of `pool`, by segment.
    pub fn pool_blocks(&self, pool: PoolId) -> Vec<BlockInfo> {
        self.blocks()
            .into_iter()
            .filter(|b| b.pool_id == pool)
            .collect()
    }
}
