//! The host allocator's books, all behind one lock: every block, the pools (free lists of 64
//! power-of-two buckets and the queue of pending events), the routes of private pools, and
//! the statistics. Every method here is bookkeeping only: no driver call is made with this
//! state borrowed (the callers in `mod.rs`, `events.rs` and `memory.rs` make them).
use super::BUCKETS;
use super::stats::Stats;
use crate::AllocError;
use crate::private_pools::{Route, Routes, begin_route, end_route};
use ferrocuda_types::{EventHandle, HostRange, PinnedConfig, PoolId, StreamHandle};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// The bucket of a block of `size` bytes: `ceil(log2(size))` (`Log2_64_Ceil`), for
/// `1 <= size <= 2^63`.
pub(crate) fn size_index(size: u64) -> usize {
    size.max(1).next_power_of_two().trailing_zeros() as usize
}

/// Where a block's memory came from, so that it goes back the same way even if the
/// configuration changed since (PyTorch's per-pointer `use_host_register` record).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// `cudaHostAlloc`.
    HostAlloc,
    /// `malloc`, pre-fault, `cudaHostRegister`.
    Register,
    /// A piece of the reserve segment: never given back.
    Reserve,
}

/// One block: never split, handed out whole.
#[derive(Debug)]
pub(crate) struct Block {
    pub(crate) range: HostRange,
    pub(crate) source: Source,
    pub(crate) pool: PoolId,
    pub(crate) allocated: bool,
    /// Events recorded at its last free and not yet seen complete.
    pub(crate) event_count: usize,
    /// Streams that used it since it was handed out (`record_event`).
    pub(crate) streams: Vec<StreamHandle>,
    /// Handed out while the allocating stream was capturing: never gets events, and once
    /// used by a stream it is retired for good (graph addresses must stay valid).
    pub(crate) during_capture: bool,
}

impl Block {
    pub(crate) fn size(&self) -> u64 {
        self.range.bytes
    }
}

/// The free lists and event queue of one pool (PyTorch's `HostBlockPool`).
#[derive(Debug)]
pub(crate) struct BlockPool {
    /// Free blocks by address, per bucket; the newest at the back.
    free: Vec<VecDeque<u64>>,
    /// `(event, block)` pairs: new ones at the front, the oldest processed from the back.
    pub(crate) events: VecDeque<(EventHandle, u64)>,
    /// Blocks this pool owns.
    blocks: usize,
}

impl Default for BlockPool {
    fn default() -> Self {
        BlockPool {
            free: vec![VecDeque::new(); BUCKETS],
            events: VecDeque::new(),
            blocks: 0,
        }
    }
}

/// A capture's private pool (PyTorch's `HostPrivatePool`).
#[derive(Debug, Default)]
struct PrivatePool {
    /// Graphs holding it; at 0 it is freeable: `empty_cache` gives its free blocks back and
    /// forgets it once it owns none.
    use_count: u32,
    blocks: BlockPool,
}

/// What a free leaves to do outside the lock.
#[derive(Debug)]
pub(crate) enum Freed {
    /// Nothing: the block is cached (or retired, or it was the null range).
    Done,
    /// The block exceeds `pinned_max_cached_size`: give it back to the driver.
    Release(Block),
    /// Record an event on each stream, then queue them with [`State::queue_events`].
    Record(PoolId, Vec<StreamHandle>),
}

/// Everything behind the host allocator's lock.
#[derive(Debug, Default)]
pub(crate) struct State {
    blocks: FxHashMap<u64, Block>,
    default: BlockPool,
    private: FxHashMap<PoolId, PrivatePool>,
    /// Pools being allocated to, newest last, with the thread that began each.
    routes: Routes,
    pub(crate) stats: Stats,
    /// The `pinned_*` options, read under the lock every request takes anyway (a lock of
    /// their own would be two more contended atomics per request on many threads).
    pub(crate) config: PinnedConfig,
}

impl State {
    /// Nothing allocated yet, under `config`.
    pub(crate) fn new(config: PinnedConfig) -> State {
        State {
            config,
            ..State::default()
        }
    }

    /// `pinned_max_cached_size_mb` in bytes (unlimited when unset).
    pub(crate) fn max_cached(&self) -> u64 {
        self.config.max_cached_size.unwrap_or(u64::MAX)
    }

    pub(crate) fn pool_mut(&mut self, pool: PoolId) -> Option<&mut BlockPool> {
        if pool.is_default() {
            Some(&mut self.default)
        } else {
            self.private.get_mut(&pool).map(|p| &mut p.blocks)
        }
    }

    // ---- private pools -----------------------------------------------------------------

    /// Whether any pool is being allocated to.
    pub(crate) fn routing(&self) -> bool {
        !self.routes.is_empty()
    }

    /// The pool an allocation on `stream` (in capture `capture`) goes to: the oldest route
    /// that takes it, as PyTorch's host allocator walks `captures_underway_` (its device
    /// allocator takes the newest; a stream is in one capture at most, so the two differ
    /// only for overlapping thread or stream routes).
    pub(crate) fn route(&self, stream: StreamHandle, capture: Option<u64>) -> PoolId {
        let me = std::thread::current().id();
        self.routes
            .iter()
            .find(|(_, route, began)| route.takes(stream, capture, me, *began))
            .map_or(PoolId::DEFAULT, |(pool, _, _)| *pool)
    }

    /// `begin_allocate_to_pool`: the pool gains a user and takes what `route` takes.
    pub(crate) fn begin(&mut self, pool: PoolId, route: Route) -> Result<(), AllocError> {
        begin_route(&mut self.routes, pool, route)?;
        self.private.entry(pool).or_default().use_count += 1;
        Ok(())
    }

    /// `end_allocate_to_pool`: no more allocations go to `pool`; it keeps its user.
    pub(crate) fn end(&mut self, pool: PoolId) -> Result<(), AllocError> {
        end_route(&mut self.routes, pool)
    }

    /// `release_pool`: one user fewer; at none the pool is freeable.
    pub(crate) fn release(&mut self, pool: PoolId) -> Result<(), AllocError> {
        let p = self.private.get_mut(&pool).filter(|p| p.use_count > 0);
        let p =
            p.ok_or_else(|| AllocError::Pool(format!("releasePool: pool {pool} is not in use")))?;
        p.use_count -= 1;
        Ok(())
    }

    /// The private pools nobody holds (PyTorch's `graph_pools_freeable_`).
    pub(crate) fn freeable(&self) -> Vec<PoolId> {
        let mut pools: Vec<PoolId> = self
            .private
            .iter()
            .filter(|(_, p)| p.use_count == 0)
            .map(|(id, _)| *id)
            .collect();
        pools.sort_unstable();
        pools
    }

    /// Forgets a freeable pool that owns no block any more; whether it did.
    pub(crate) fn forget_if_empty(&mut self, pool: PoolId) -> bool {
        let empty = self
            .private
            .get(&pool)
            .is_some_and(|p| p.use_count == 0 && p.blocks.blocks == 0);
        if empty {
            self.private.remove(&pool);
        }
        empty
    }

    /// Private pools still known (held, or freeable with blocks left).
    pub(crate) fn private_pools(&self) -> usize {
        self.private.len()
    }

    // ---- blocks ------------------------------------------------------------------------

    /// `get_free_block`: the newest free block of `pool` in the bucket of `size` that is at
    /// least `size` long (all are, unless unrounded sizes share the bucket), handed out.
    pub(crate) fn take_free(
        &mut self,
        pool: PoolId,
        size: u64,
        during_capture: bool,
    ) -> Option<HostRange> {
        let index = size_index(size);
        let State {
            blocks,
            default,
            private,
            ..
        } = self;
        let list = if pool.is_default() {
            &mut default.free[index]
        } else {
            &mut private.get_mut(&pool)?.blocks.free[index]
        };
        let at = list
            .iter()
            .rposition(|a| blocks.get(a).is_some_and(|b| b.size() >= size))?;
        let addr = list.remove(at)?;
        let block = self.blocks.get_mut(&addr)?;
        block.allocated = true;
        block.during_capture = during_capture;
        self.stats.activate(index, block.size());
        Some(block.range)
    }

    /// `add_allocated_block`: a new block from the driver (or the reserve), handed out.
    pub(crate) fn add_block(
        &mut self,
        range: HostRange,
        source: Source,
        pool: PoolId,
        during_capture: bool,
    ) {
        if let Some(p) = self.pool_mut(pool) {
            p.blocks += 1;
        }
        self.stats.add(size_index(range.bytes), range.bytes);
        self.blocks.insert(
            range.addr(),
            Block {
                range,
                source,
                pool,
                allocated: true,
                event_count: 0,
                streams: Vec::new(),
                during_capture,
            },
        );
    }

    /// `record_event`: `stream` uses the block at `addr`. `Ok(false)` for an address that
    /// is no block of this allocator (PyTorch's `false`).
    pub(crate) fn record_stream(
        &mut self,
        addr: u64,
        stream: StreamHandle,
    ) -> Result<bool, AllocError> {
        let Some(block) = self.blocks.get_mut(&addr) else {
            return Ok(false);
        };
        if !block.allocated {
            return Err(AllocError::HostBlockNotAllocated(addr));
        }
        if !block.streams.contains(&stream) {
            block.streams.push(stream);
        }
        Ok(true)
    }

    /// `free`: the block at `addr` is no longer handed out. Without streams it is cached
    /// (or released when larger than `pinned_max_cached_size_mb`); used during a capture it is
    /// retired; otherwise each stream that used it gets an event, recorded by the caller.
    pub(crate) fn free(&mut self, addr: u64) -> Result<Freed, AllocError> {
        let block = self
            .blocks
            .get_mut(&addr)
            .filter(|b| b.allocated)
            .ok_or(AllocError::InvalidHostPointer(addr))?;
        block.allocated = false;
        let streams = std::mem::take(&mut block.streams);
        if streams.is_empty() {
            return Ok(self.make_available(addr));
        }
        block.event_count += streams.len();
        if block.during_capture {
            // No event can tell when a captured use ends: the block is never reused.
            return Ok(Freed::Done);
        }
        Ok(Freed::Record(block.pool, streams))
    }

    /// Queues the events recorded for a free at the front of `pool`'s queue.
    pub(crate) fn queue_events(&mut self, pool: PoolId, events: Vec<(EventHandle, u64)>) {
        if let Some(p) = self.pool_mut(pool) {
            for e in events {
                p.events.push_front(e);
            }
        }
    }

    /// One event of the block at `addr` completed; at its last the block is available.
    pub(crate) fn event_done(&mut self, addr: u64) -> Freed {
        let Some(block) = self.blocks.get_mut(&addr) else {
            return Freed::Done;
        };
        block.event_count = block.event_count.saturating_sub(1);
        if block.event_count == 0 && !block.allocated {
            self.make_available(addr)
        } else {
            Freed::Done
        }
    }

    /// A block no stream holds any more: back on its pool's free list, or out of the books
    /// to be released when it is larger than `pinned_max_cached_size_mb`.
    fn make_available(&mut self, addr: u64) -> Freed {
        let Some(block) = self.blocks.get(&addr) else {
            return Freed::Done;
        };
        let (size, pool) = (block.size(), block.pool);
        let index = size_index(size);
        self.stats.deactivate(index, size);
        if size > self.max_cached() {
            return self.remove(addr).map_or(Freed::Done, Freed::Release);
        }
        if let Some(p) = self.pool_mut(pool) {
            p.free[index].push_back(addr);
        }
        Freed::Done
    }

    /// Takes a block out of the books (it is about to go back to the driver).
    fn remove(&mut self, addr: u64) -> Option<Block> {
        let block = self.blocks.remove(&addr)?;
        if let Some(p) = self.pool_mut(block.pool) {
            p.blocks -= 1;
        }
        self.stats.remove(block.size());
        Some(block)
    }

    /// `free_from_pool`: takes every free block of `pool` out of the books, to be released.
    pub(crate) fn drain_free(&mut self, pool: PoolId) -> Vec<Block> {
        let Some(p) = self.pool_mut(pool) else {
            return Vec::new();
        };
        let addrs: Vec<u64> = p.free.iter_mut().flat_map(std::mem::take).collect();
        addrs.into_iter().filter_map(|a| self.remove(a)).collect()
    }

    /// The allocator is going: every free block of every pool out of the books (to be
    /// released), every queued event (to be destroyed), and whether no block is left.
    pub(crate) fn wind_up(&mut self) -> (Vec<Block>, Vec<EventHandle>, bool) {
        let pools: Vec<PoolId> = std::iter::once(PoolId::DEFAULT)
            .chain(self.private.keys().copied())
            .collect();
        let mut blocks = Vec::new();
        let mut events = Vec::new();
        for pool in pools {
            blocks.extend(self.drain_free(pool));
            if let Some(p) = self.pool_mut(pool) {
                events.extend(p.events.drain(..).map(|(e, _)| e));
            }
        }
        (blocks, events, self.blocks.is_empty())
    }

    /// Checks the books: every block is handed out, free in its pool's bucket, waiting for
    /// events or retired, exactly once; pools own what they count; the statistics equal a
    /// recount. For tests.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut listed: FxHashMap<u64, usize> = FxHashMap::default();
        let mut owned: FxHashMap<PoolId, usize> = FxHashMap::default();
        let pools = std::iter::once((PoolId::DEFAULT, &self.default))
            .chain(self.private.iter().map(|(id, p)| (*id, &p.blocks)));
        for (id, pool) in pools {
            owned.insert(id, pool.blocks);
            for (index, list) in pool.free.iter().enumerate() {
                for addr in list {
                    let b = self
                        .blocks
                        .get(addr)
                        .ok_or(format!("{addr:#x} freed twice"))?;
                    if b.allocated || b.event_count != 0 || b.pool != id {
                        return Err(format!("{addr:#x} is free but {b:?}"));
                    }
                    if size_index(b.size()) != index {
                        return Err(format!("{addr:#x} is in bucket {index}"));
                    }
                    *listed.entry(*addr).or_default() += 1;
                }
            }
        }
        if let Some((addr, _)) = listed.iter().find(|(_, n)| **n > 1) {
            return Err(format!("{addr:#x} is free more than once"));
        }
        for id in owned.keys() {
            let n = self.blocks.values().filter(|b| b.pool == *id).count();
            if owned[id] != n {
                return Err(format!("pool {id} counts {} blocks, owns {n}", owned[id]));
            }
        }
        let live = self
            .blocks
            .values()
            .filter(|b| !listed.contains_key(&b.range.addr()));
        self.stats.check(
            self.blocks.values().map(|b| b.size()),
            live.map(|b| b.size()),
        )
    }
}
