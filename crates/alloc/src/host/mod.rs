//! PyTorch's pinned host caching allocator (`CachingHostAllocator`,
//! aten/src/ATen/core/CachingHostAllocator.h and aten/src/ATen/cuda/CachingHostAllocator.cpp;
//! allocator spec §9): page-locked host memory for `pin_memory()`, `empty(...,
//! pin_memory=True)` and the staging of non-blocking copies.
//!
//! - Requests are rounded up to a power of two (unless larger than
//!   `pinned_max_round_threshold_mb` or `pinned_max_cached_size_mb`) and served whole:
//!   blocks are never split. Free blocks wait in 64 buckets (`ceil(log2(size))`) per pool;
//!   a request takes the newest block of its bucket that is large enough.
//! - A freed block that streams used (`record_event`, which non-blocking copies call) gets
//!   an event per stream and is reused only once all of them completed; events are
//!   processed oldest first at each allocation, a pass stopping at the first not ready
//!   (or by a background thread every 100 µs with `pinned_use_background_threads`).
//! - New memory comes from the reserve segment (`pinned_reserve_segment_size_mb`), else
//!   `cudaHostAlloc`, or `malloc` + pre-fault + `cudaHostRegister`
//!   (`pinned_use_cuda_host_register`, the pre-fault split over
//!   `pinned_num_register_threads` threads); blocks larger than
//!   `pinned_max_cached_size_mb` go back to the driver when freed instead of being cached.
//! - Stream captures allocate from private pools (`begin_allocate_to_pool`, with the
//!   device allocator's [`Route`]s); a block handed out during a capture never gets events,
//!   and once a stream used it, it is retired for good (graph addresses stay valid).
//! - `empty_cache` gives every cached block of the default pool and of unheld private
//!   pools back to the driver (reserve pieces stay in the slab).
//! - Statistics have PyTorch's `host_memory_stats` keys and its per-bucket peak sums.
//!
//! # Design choices
//! - One lock over the books (`state`), never held across a driver call: events are
//!   recorded, queried and made, and memory is allocated and freed, with it released
//!   (PyTorch splits the books over several mutexes for the same reason; a pair of
//!   allocate and free takes the lock twice).
//! - Blocks are named by their host address; a reserve piece is a range inside the slab.
//! - Where PyTorch has since fixed a bug, the fix is followed: active statistics drop on
//!   every free (#169561), and a request never takes a smaller cached block of its bucket
//!   (#192722).
//!
//! # What the layer above must do
//! - Pass the current stream of the current device to [`HostAllocator::allocate`] (it
//!   decides a capture's private pool), and call [`HostAllocator::record_event`] for every
//!   stream that uses a block before freeing it.
//! - Route captures to private pools and release them (the graph layer does, beside the
//!   device allocator's pools).
mod background;
mod events;
mod memory;
mod state;
mod stats;

use crate::{AllocError, Route};
use ferrocuda_driver::Driver;
use ferrocuda_stream::{HostMemoryResource, StreamError};
use ferrocuda_types::{
    CaptureStatus, HostPtr, HostRange, HostStats, PinnedConfig, PoolId, StreamHandle,
};
use parking_lot::Mutex;
use state::{Freed, State};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// Free-list buckets: one per `ceil(log2(size))` (PyTorch's `MAX_SIZE_INDEX`).
pub(crate) const BUCKETS: usize = 64;

/// The largest request: its bucket, `ceil(log2(size))`, must be below 64.
const MAX_REQUEST: u64 = 1 << 63;

/// The rounded size of a request of `size` bytes (`1 <= size <= 2^63`): the next power of
/// two, unless `size` exceeds `pinned_max_round_threshold_mb` or
/// `pinned_max_cached_size_mb`, which keep it exact.
pub fn round_size(size: u64, config: &PinnedConfig) -> u64 {
    let limit = |v: Option<u64>| v.unwrap_or(u64::MAX);
    if size <= limit(config.max_round_threshold) && size <= limit(config.max_cached_size) {
        size.next_power_of_two()
    } else {
        size
    }
}

/// The null range: what a request of 0 bytes gets (PyTorch's null pointer).
const NULL: HostRange = HostRange {
    base: HostPtr { raw: 0, bytes: 0 },
    offset: 0,
    bytes: 0,
};

/// The pinned host caching allocator of one driver (see the [module docs](self)). Made in
/// an [`Arc`] (its background thread holds a weak reference); it serves
/// [`PinnedBuffer`](ferrocuda_stream::PinnedBuffer)s as a [`HostMemoryResource`].
#[derive(Debug)]
pub struct HostAllocator {
    driver: Arc<dyn Driver>,
    state: Mutex<State>,
    /// Whether any pool is being allocated to (PyTorch's `captures_underway_empty_`,
    /// negated): read without the lock on every allocation.
    routing: AtomicBool,
    events: events::EventPool,
    reserve: memory::Reserve,
    background: AtomicBool,
    me: Weak<HostAllocator>,
    suppressed: AtomicU64,
}

impl HostAllocator {
    /// A host allocator over `driver` with the `pinned_*` options of a configuration
    /// ([`AllocatorConfig::pinned`](ferrocuda_types::AllocatorConfig::pinned)).
    pub fn new(driver: Arc<dyn Driver>, config: PinnedConfig) -> Arc<HostAllocator> {
        Arc::new_cyclic(|me| HostAllocator {
            driver,
            state: Mutex::new(State::new(config)),
            routing: AtomicBool::new(false),
            events: events::EventPool::default(),
            reserve: memory::Reserve::default(),
            background: AtomicBool::new(false),
            me: me.clone(),
            suppressed: AtomicU64::new(0),
        })
    }

    /// Page-locked memory for `bytes` (rounded: the range may be longer), asked for while
    /// `stream` is the current stream. 0 bytes give the null range and count nothing.
    pub fn allocate(&self, bytes: u64, stream: StreamHandle) -> Result<HostRange, AllocError> {
        if bytes == 0 {
            return Ok(NULL);
        }
        if bytes > MAX_REQUEST {
            return Err(AllocError::HostRequestTooLarge(bytes));
        }
        let (pool, during_capture) = self.pool_for(stream)?;
        // The background thread processes the default pool's events; private pools are
        // processed inline (their allocations happen during captures, with none pending).
        // With no event pending (the common case) one lock serves the whole hit.
        let (background, size, pending) = {
            let mut st = self.state.lock();
            let background = st.config.use_background_threads;
            let size = round_size(bytes, &st.config);
            let inline = !(background && pool.is_default());
            let pending = inline && st.pool_mut(pool).is_some_and(|p| !p.events.is_empty());
            if !pending && let Some(range) = st.take_free(pool, size, during_capture) {
                return Ok(range);
            }
            (background, size, pending)
        };
        if pending {
            self.process_events(pool)?;
            if let Some(range) = self.state.lock().take_free(pool, size, during_capture) {
                return Ok(range);
            }
        }
        if background {
            self.start_background();
        }
        let (range, source) = self.new_memory(size)?;
        self.state
            .lock()
            .add_block(range, source, pool, during_capture);
        Ok(range)
    }

    /// The pool an allocation on `stream` goes to, and whether `stream` is capturing
    /// (asked of the driver only while some pool is being allocated to).
    fn pool_for(&self, stream: StreamHandle) -> Result<(PoolId, bool), AllocError> {
        if !self.routing.load(Ordering::Relaxed) {
            return Ok((PoolId::DEFAULT, false));
        }
        let capture = match self.driver.stream_capture_status(stream)? {
            CaptureStatus::Active { id } => Some(id),
            _ => None,
        };
        Ok((self.state.lock().route(stream, capture), capture.is_some()))
    }

    /// Gives back the block at host address `addr` (`free`; 0 is the null range). It is
    /// reused once the work its recorded streams had enqueued completes. A driver error
    /// recording those events retires the block and is returned, unless
    /// `pinned_free_catch_all` is set: then it is counted
    /// ([`HostAllocator::suppressed_free_errors`]) and the free succeeds.
    pub fn free(&self, addr: u64) -> Result<(), AllocError> {
        if addr == 0 {
            return Ok(());
        }
        let freed = self.state.lock().free(addr)?;
        let done = match freed {
            Freed::Done => Ok(()),
            Freed::Release(block) => self.release(block),
            Freed::Record(pool, streams) => self.record_events(pool, addr, &streams),
        };
        match done {
            Err(_) if self.state.lock().config.free_catch_all => {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            other => other,
        }
    }

    /// Errors `pinned_free_catch_all` swallowed so far (PyTorch logs "Suppressed exception
    /// in pinned allocator free()" for each).
    pub fn suppressed_free_errors(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }

    /// `record_event` (`CachingHostAllocator_recordEvent`): `stream` uses the block at
    /// `addr`, so that once freed it waits for the work enqueued there so far. `Ok(false)`
    /// for an address that is no block of this allocator; an error for a freed block.
    pub fn record_event(&self, addr: u64, stream: StreamHandle) -> Result<bool, AllocError> {
        self.state.lock().record_stream(addr, stream)
    }

    /// `torch._C._host_emptyCache()`: processes the events of the default pool and gives
    /// its cached blocks back to the driver, then does the same for every private pool no
    /// graph holds, forgetting those left without blocks. Blocks in use, waiting for
    /// events, or retired stay. Every block is tried; the first driver error is returned.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let mut first = None;
        let pools = std::iter::once(PoolId::DEFAULT).chain(self.state.lock().freeable());
        for pool in pools {
            let processed = self.process_events(pool);
            let blocks = self.state.lock().drain_free(pool);
            let released = blocks.into_iter().map(|b| self.release(b));
            for r in std::iter::once(processed).chain(released) {
                if let Err(e) = r {
                    first.get_or_insert(e);
                }
            }
            if !pool.is_default() {
                self.state.lock().forget_if_empty(pool);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// `torch.cuda.host_memory_stats()` (unflattened: [`HostStats::to_map`] flattens).
    pub fn stats(&self) -> HostStats {
        self.state.lock().stats.snapshot()
    }

    /// `torch.cuda.reset_peak_host_memory_stats()`.
    pub fn reset_peak_stats(&self) {
        self.state.lock().stats.reset_peak();
    }

    /// `torch.cuda.reset_accumulated_host_memory_stats()`.
    pub fn reset_accumulated_stats(&self) {
        self.state.lock().stats.reset_accumulated();
    }

    /// `begin_allocate_to_pool`: allocations that `route` takes go to `pool` (made if new),
    /// which gains a user, until [`HostAllocator::end_allocate_to_pool`].
    pub fn begin_allocate_to_pool(&self, pool: PoolId, route: Route) -> Result<(), AllocError> {
        let mut st = self.state.lock();
        st.begin(pool, route)?;
        self.routing.store(st.routing(), Ordering::Relaxed);
        Ok(())
    }

    /// `end_allocate_to_pool`: allocations stop going to `pool`; it keeps its user.
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        let mut st = self.state.lock();
        st.end(pool)?;
        self.routing.store(st.routing(), Ordering::Relaxed);
        Ok(())
    }

    /// `release_pool`: `pool` has one user fewer; with none, `empty_cache` gives its cached
    /// blocks back and forgets it once it owns none.
    pub fn release_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        self.state.lock().release(pool)
    }

    /// Private pools still known: held, or unheld with blocks left.
    pub fn private_pool_count(&self) -> usize {
        self.state.lock().private_pools()
    }

    /// Applies a configuration string as a re-parse does (`_set_allocator_settings`): the
    /// `pinned_*` options take effect from the next request (the reserve segment's size
    /// only before the first slow-path allocation, as PyTorch's static). The string's other
    /// keys must be valid but are the device allocator's ([`PinnedConfig::update`]).
    pub fn update_config(&self, s: &str) -> Result<(), AllocError> {
        Ok(self.state.lock().config.update(s)?)
    }

    /// The configuration in force.
    pub fn config(&self) -> PinnedConfig {
        self.state.lock().config.clone()
    }

    /// Checks the books (each block in one place, pools' counts, statistics equal a
    /// recount). For tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.state.lock().check()
    }
}

/// What the allocator caches goes back to the driver when it is dropped: its free blocks,
/// the reserve slab if no piece of it is left in use, and its events. Blocks still handed
/// out or waiting for events are left alone (a device may still use them). PyTorch's
/// allocator lives as long as the process and never does this.
impl Drop for HostAllocator {
    fn drop(&mut self) {
        let (blocks, queued, none_left) = self.state.get_mut().wind_up();
        for block in blocks {
            let _ = self.release(block);
        }
        if none_left {
            let _ = self.release_slab();
        }
        for event in queued.into_iter().chain(self.events.drain()) {
            let _ = self.driver.event_destroy(event);
        }
    }
}

impl HostMemoryResource for HostAllocator {
    fn allocate_host(&self, bytes: u64, stream: StreamHandle) -> Result<HostRange, StreamError> {
        Ok(self.allocate(bytes, stream)?)
    }

    fn free_host(&self, range: HostRange) -> Result<(), StreamError> {
        Ok(self.free(range.addr())?)
    }

    fn record_host_use(&self, range: HostRange, stream: StreamHandle) -> Result<(), StreamError> {
        self.record_event(range.addr(), stream)?;
        Ok(())
    }

    fn pageable_copy_threads(&self) -> usize {
        self.state.lock().config.pageable_copy_threads as usize
    }
}
