//! What the allocator's lock guards, and the block-level steps of PyTorch's
//! `DeviceCachingAllocator` (c10/cuda/CUDACachingAllocator.cpp) on it: handing a found
//! block out (`alloc_found_block`), freeing one (`free_block`, with the merges and the
//! `inactive_split` books), taking a whole segment out of the books. Each part of the
//! state is a type of its own (blocks, free pools, stream order, expandable address space,
//! private pools); this file composes them. Nothing here calls the driver.
use crate::block::{Allocation, Block, Blocks, Link};
use crate::expandable::{Expandable, Grow, UnmapJob};
use crate::free_pools::{OversizeRule, Pools};
use crate::history::{History, HistoryContext};
use crate::pluggable::PluggableAllocator;
use crate::private_pools::{PrivatePools, SegmentSource};
use crate::sleep::pages::{PagedSegment, PagedSegments};
use crate::stream_order::StreamOrder;
use crate::tally::Tally;
use ferrocuda_types::{
    AllocatorConfig, DeviceIndex, DevicePtr, EventHandle, Frame, PhysHandle, PoolId, PoolKind,
    StreamHandle,
};
use std::sync::Arc;

const SMALL_SIZE: u64 = crate::rounding::SMALL_SIZE;

/// One allocation request on its way through the paths.
pub(crate) struct Request {
    /// Rounded size.
    pub(crate) size: u64,
    /// Bytes asked for.
    pub(crate) requested: u64,
    pub(crate) kind: PoolKind,
    pub(crate) stream: StreamHandle,
    /// The pool it is served from: default, or a private pool it is routed to.
    pub(crate) pool: PoolId,
    /// Where it was made, when history records stacks.
    pub(crate) frames: Option<Arc<[Frame]>>,
    /// The stream capture its stream takes part in, if any (asked only while a pool is
    /// routed to).
    pub(crate) capture: Option<u64>,
}

/// A segment taken out of the books, to be freed: its address, and where it goes back.
pub(crate) struct Released {
    pub(crate) ptr: u64,
    pub(crate) to: ReleaseTo,
}

/// Where a segment taken out of the books goes back.
pub(crate) enum ReleaseTo {
    /// `cudaFree`.
    Driver,
    /// The pool's pluggable allocator.
    Pluggable(Arc<PluggableAllocator>),
    /// A sleepable pool's segment: its pages, address range and any host copy.
    Pages(PagedSegment),
}

/// What a free reads of the block it frees, once for [`State::release_live`] and
/// [`State::free_block`] both.
#[derive(Copy, Clone)]
pub(crate) struct Freeing {
    ptr: u64,
    stream: u64,
    kind: PoolKind,
    size: u64,
    requested: u64,
}

impl Freeing {
    #[inline(always)]
    fn of(b: &Block) -> Freeing {
        Freeing {
            ptr: b.ptr,
            stream: b.stream,
            kind: b.pool,
            size: b.size,
            requested: b.requested,
        }
    }
}

/// What the allocator's lock guards.
pub(crate) struct State {
    pub(crate) device: DeviceIndex,
    pub(crate) config: AllocatorConfig,
    /// `rounding::rounds_plainly(&config)`, kept by [`State::set_config`].
    pub(crate) plain_rounding: bool,
    /// `max_split_size_mb`'s rule, kept by [`State::set_config`].
    pub(crate) oversize: OversizeRule,
    pub(crate) blocks: Blocks,
    pub(crate) pools: Pools,
    /// Events holding freed blocks back for the streams that used them.
    pub(crate) order: StreamOrder,
    pub(crate) stats: Tally,
    /// Bytes held from the driver, including segments being allocated right now.
    pub(crate) total_reserved: u64,
    pub(crate) allowed_max: Option<u64>,
    /// Segments counted in `oversize_segments`, by address.
    pub(crate) oversize_segments: rustc_hash::FxHashSet<u64>,
    /// Expandable segments: ranges, pages, unmapped pieces, spare pages.
    pub(crate) expandable: Expandable,
    pub(crate) history: History,
    /// Private pools and the routes into them.
    pub(crate) private: PrivatePools,
    /// The segments of sleepable pools.
    pub(crate) paged: PagedSegments,
}

impl State {
    /// Puts `config` in force with what is kept derived from it: plain rounding, the
    /// `max_split_size` the statistics report, and whether frees stamp pages for reclaim.
    pub(crate) fn set_config(&mut self, config: AllocatorConfig) {
        self.plain_rounding = crate::rounding::rounds_plainly(&config);
        self.oversize = OversizeRule::of(&config);
        self.stats.max_split_size = config.sizes.max_split_size.map_or(-1, |m| m as i64);
        if config.expandable.reclaim != self.config.expandable.reclaim {
            self.expandable.set_reclaim(config.expandable.reclaim);
        }
        self.config = config;
    }

    /// The handle of this device's stream `raw`.
    pub(crate) fn stream_handle(&self, raw: u64) -> StreamHandle {
        StreamHandle {
            device: self.device,
            raw,
        }
    }

    /// The other streams that used allocated block `id` (`record_stream`), taken out of
    /// it: what its free must wait for.
    pub(crate) fn take_uses(&mut self, id: usize) -> Vec<StreamHandle> {
        let b = &mut self.blocks[id];
        b.has_uses = false;
        std::mem::take(&mut b.stream_uses)
    }

    /// `free`'s bookkeeping for allocated block `id`, whose other streams' uses were taken
    /// (`waits`: there were some): no longer allocated, history and statistics told.
    /// Returns what [`State::free_block`] reads of the block, for a free that goes on to it
    /// at once ([`State::free_now`]).
    #[inline(always)]
    pub(crate) fn release_live(
        &mut self,
        id: usize,
        frames: Option<&Arc<[Frame]>>,
        waits: bool,
    ) -> Freeing {
        let b = &mut self.blocks[id];
        b.allocated = false;
        let freeing = Freeing::of(b);
        let oversize = b.oversize;
        // PyTorch's `free`: the free's own stack (context "all") takes the allocation's
        // place, and both entries of the free record it (`context ? context :
        // context_when_allocated`).
        if let Some(free_frames) = frames {
            b.frames = Some(free_frames.clone());
            b.has_frames = true;
        }
        let on_trace = b.has_frames && self.history.entries_have_frames();
        let frames = on_trace.then(|| self.blocks[id].frames.as_ref()).flatten();
        let Freeing {
            ptr,
            stream,
            requested,
            kind,
            size,
        } = freeing;
        self.history
            .record("free_requested", ptr, requested, stream, frames);
        if waits {
            self.history.mark_free_with_uses();
        }
        self.stats.release(kind, size as i64, waits);
        if oversize {
            self.stats.oversize_allocations.decrease(1);
        }
        freeing
    }

    /// `free` of allocated block `id` that waits for no other stream: [`State::release_live`]
    /// and [`State::free_block`], the block's record read once.
    #[inline(always)]
    pub(crate) fn free_now(&mut self, id: usize, frames: Option<&Arc<[Frame]>>) {
        let freeing = self.release_live(id, frames, false);
        self.free_block_as(id, freeing);
    }

    #[inline(always)]
    pub(crate) fn pool_insert(&mut self, id: usize) {
        self.pools.add(&mut self.blocks, id);
    }

    #[inline(always)]
    pub(crate) fn pool_remove(&mut self, id: usize) {
        self.pools.remove(&mut self.blocks, id);
    }

    /// Best fit on the request's stream with the oversize rules; a search of the default
    /// large pool ticks the garbage-collection clock while collection is on.
    #[inline(always)]
    pub(crate) fn take_free_block(
        &mut self,
        pool: PoolId,
        kind: PoolKind,
        stream: StreamHandle,
        size: u64,
    ) -> Option<usize> {
        // (Without short-circuits: which pool kind asks is random to the branch predictor.)
        let count = pool.is_default() & (kind == PoolKind::Large) & self.gc_enabled();
        self.pools.take(
            &mut self.blocks,
            (pool, kind, stream),
            size,
            &self.config,
            &self.oversize,
            count,
        )
    }

    pub(crate) fn should_split(&self, id: usize, size: u64) -> bool {
        let b = &self.blocks[id];
        self.split_worthwhile(b.segment.is_some(), b.pool, size, b.size - size)
    }

    /// Whether a free block cut for `size` keeps `remaining` bytes as a block of its own.
    pub(crate) fn split_worthwhile(
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
        let large = (size < self.oversize.max_split) & (remaining > SMALL_SIZE);
        (by_minimum & minimum) | (!by_minimum & large)
    }

    /// `alloc_found_block`: splits if worthwhile and hands the low part out (returned with
    /// its id).
    #[inline(always)]
    pub(crate) fn use_block(&mut self, id: usize, req: &Request) -> (usize, Allocation) {
        let split = self.should_split(id, req.size);
        self.use_block_split(id, req, split)
    }

    /// `alloc_found_block` with the split decided by the caller (`split_remainder`): free
    /// block `id`, out of its free list, is cut to `req.size` if `split`, and handed out.
    #[inline(always)]
    pub(crate) fn use_block_split(
        &mut self,
        id: usize,
        req: &Request,
        split: bool,
    ) -> (usize, Allocation) {
        let (size, requested) = (req.size, req.requested);
        let kind = self.blocks[id].pool;
        let was_split = self.blocks[id].is_split();
        // Expandable blocks are never counted as inactive splits (PyTorch's rule).
        let counted = self.blocks[id].segment.is_none();
        if split {
            let remaining = self.blocks[id].size - size;
            let rest = self.blocks.split_back(id, size);
            self.pool_insert(rest);
            if counted && was_split {
                self.stats.inactive_split_bytes.decrease(kind, size as i64);
            } else if counted {
                self.stats.inactive_split.increase(kind, 1);
                self.stats
                    .inactive_split_bytes
                    .increase(kind, remaining as i64);
            }
        } else if counted && was_split {
            self.stats.inactive_split.decrease(kind, 1);
            self.stats
                .inactive_split_bytes
                .decrease(kind, self.blocks[id].size as i64);
        }
        let rule = self.oversize;
        let b = &mut self.blocks[id];
        let (ptr, size, stream) = (b.ptr, b.size, b.stream);
        let oversize = rule.is_oversize(size);
        b.allocated = true;
        b.requested = requested;
        b.oversize = oversize;
        if req.frames.is_some() {
            // (A free block has none: `free_block` took them.)
            b.frames = req.frames.clone();
            b.has_frames = true;
        }
        let s = &mut self.stats;
        s.allocate(kind, size as i64);
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
    pub(crate) fn complete_event(&mut self, event: EventHandle, id: usize) {
        if self.order.complete(&mut self.blocks, event, id) && !self.blocks[id].allocated {
            self.free_block(id);
        }
    }

    /// `free_block`: merges with free neighbours and returns the block to its pool.
    #[inline(always)]
    pub(crate) fn free_block(&mut self, id: usize) {
        let freeing = Freeing::of(&self.blocks[id]);
        self.free_block_as(id, freeing);
    }

    /// [`State::free_block`] with the block's fields it needs already read.
    #[inline(always)]
    fn free_block_as(&mut self, id: usize, freeing: Freeing) {
        let Freeing {
            ptr,
            stream,
            kind,
            size,
            requested,
        } = freeing;
        let b = &mut self.blocks[id];
        let segment = b.segment;
        let had_frames = std::mem::take(&mut b.has_frames);
        b.requested = 0;
        let (prev, next) = (b.prev, b.next);
        // (Recorded before the merges, which record nothing; a free block has no frames.)
        let on_trace = had_frames && self.history.entries_have_frames();
        let frames = on_trace.then(|| self.blocks[id].frames.as_ref()).flatten();
        self.history
            .record("free_completed", ptr, requested, stream, frames);
        if had_frames {
            self.blocks[id].frames = None;
        }
        // The record that stays: a free block before this one absorbs it (its address is
        // already mapped to it), else this one absorbs a free block after it. Either way
        // one address leaves the map.
        // `inactive_split` moves by the net change, as PyTorch's `free_block` applies it:
        // its `allocated` and `freed` counters see one increase or one decrease.
        let (mut net_blocks, mut net_bytes) = (0i64, 0i64);
        let mut keep = id;
        let (merge_prev, merge_next) = self.merge_partners((prev, next), ptr, kind, segment);
        if let Some(p) = merge_prev {
            net_bytes -= self.absorb(p, id) as i64;
            net_blocks -= 1;
            keep = p;
        }
        if let Some(n) = merge_next {
            net_bytes -= self.absorb(keep, n) as i64;
            net_blocks -= 1;
        }
        if self.blocks[keep].is_split() {
            net_blocks += 1;
            net_bytes += self.blocks[keep].size as i64;
        }
        self.pool_insert(keep);
        let s = &mut self.stats;
        s.deactivate(kind, size as i64);
        s.requested_bytes.decrease(kind, requested as i64);
        // Expandable blocks are never counted as inactive splits (PyTorch's rule); with
        // page reclaim (not dormant) their pages are stamped instead (switching reclaim on
        // or waking it stamps every page: `Expandable::stamp_all`).
        match segment.get() {
            None => {
                s.inactive_split.change(kind, net_blocks);
                s.inactive_split_bytes.change(kind, net_bytes);
            }
            Some(segment) if self.expandable.stamping => {
                self.expandable.stamp_free(segment, ptr, size);
            }
            Some(_) => {}
        }
    }

    /// The free neighbours (of `links`, a block's `prev` and `next`) that the free of the
    /// block at `ptr` merges with (`free_block`'s `try_merge_blocks`): both, except that
    /// with `expandable_segments_small_page_bound` a small expandable block merges only
    /// inside its own page, as if each page were one of the default's 2 MiB segments.
    #[inline(always)]
    pub(crate) fn merge_partners(
        &self,
        links: (Link, Link),
        ptr: u64,
        kind: PoolKind,
        segment: Link,
    ) -> (Option<usize>, Option<usize>) {
        let (prev, next) = (
            self.blocks.mergeable(links.0),
            self.blocks.mergeable(links.1),
        );
        match segment.get() {
            Some(segment) if self.small_page_bound(kind) => (
                prev.filter(|_| !self.expandable.starts_page(segment, ptr)),
                next.filter(|&n| !self.expandable.starts_page(segment, self.blocks[n].ptr)),
            ),
            _ => (prev, next),
        }
    }

    /// Whether expandable blocks of pool `kind` stay inside their pages
    /// (`expandable_segments_small_page_bound`, small pool only): they merge only inside
    /// a page, cannot grow, and the pool grows by pages of their own.
    #[inline(always)]
    pub(crate) fn small_page_bound(&self, kind: PoolKind) -> bool {
        kind == PoolKind::Small && self.config.expandable.small_page_bound
    }

    /// `free_block`'s merge (`try_merge_blocks`): block `id` takes in `next`, the block
    /// right after it, one of them being free in the pool (it leaves the pool). Returns
    /// the size of the free one.
    #[inline(always)]
    fn absorb(&mut self, id: usize, next: usize) -> u64 {
        let free = if self.blocks.in_pool(id) { id } else { next };
        self.pool_remove(free);
        let subsumed = self.blocks[free].size;
        self.blocks.absorb_next(id, next);
        subsumed
    }

    /// Takes a whole free segment out of the books; the caller frees it
    /// ([`Engine::free_segments`](crate::engine::Engine::free_segments)).
    pub(crate) fn release_segment(&mut self, id: usize) -> Released {
        self.pool_remove(id);
        let b = &self.blocks[id];
        let (ptr, size, kind) = (b.ptr, b.size, b.pool);
        let (stream, pool) = (self.blocks[id].stream, self.blocks[id].pool_id);
        self.history.segment_freed(ptr, size, stream);
        let to = match self.private.source(pool) {
            SegmentSource::Driver => ReleaseTo::Driver,
            SegmentSource::Pluggable(a) => ReleaseTo::Pluggable(a),
            SegmentSource::Sleepable => self
                .paged
                .take(ptr)
                .map_or(ReleaseTo::Driver, ReleaseTo::Pages),
        };
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
        Released { ptr, to }
    }
    /// Whether any stream capture records into a pool now.
    pub(crate) fn capturing(&self) -> bool {
        self.private.capturing()
    }

    pub(crate) fn unmapped_insert(&mut self, id: usize) {
        self.expandable.insert_unmapped(&mut self.blocks, id);
    }

    pub(crate) fn unmapped_remove(&mut self, id: usize) {
        self.expandable.remove_unmapped(&self.blocks, id);
    }

    pub(crate) fn store_pages(&mut self, id: usize, pages: Vec<PhysHandle>) {
        self.expandable.store_pages(&self.blocks, id, pages);
    }

    pub(crate) fn take_pages(&mut self, id: usize, first: u64, last: u64) -> Vec<PhysHandle> {
        self.expandable.take_pages(&self.blocks, id, first, last)
    }

    pub(crate) fn settle_unmapped(&mut self, id: usize) -> Option<ferrocuda_types::VaRange> {
        self.expandable.settle_unmapped(&mut self.blocks, id)
    }

    /// The steps that grow the expandable range starting at block `start` to `size` bytes
    /// (free blocks taken as they are, unmapped ranges mapped a `page` at a time), with the
    /// bytes to map; each block is set aside (busy) until [`State::commit_growth`] or
    /// [`State::undo_grow`]. `None`, with nothing changed, if the range cannot grow so far.
    pub(crate) fn plan_growth(
        &mut self,
        start: usize,
        size: u64,
        page: u64,
    ) -> Option<(Vec<Grow>, u64)> {
        let mut plan = Vec::new();
        let (mut covered, mut to_map, mut cur) = (0, 0, Some(start));
        while covered < size {
            let id = cur.filter(|&i| self.blocks.growable(i))?;
            let b = &self.blocks[id];
            if self.blocks.in_pool(id) {
                plan.push(Grow::Take(id));
                covered += b.size;
            } else {
                let bytes = ((size - covered).div_ceil(page) * page).min(b.size);
                plan.push(Grow::Map(id, bytes));
                covered += bytes;
                to_map += bytes;
            }
            cur = b.next.get();
        }
        for g in &plan {
            match *g {
                Grow::Take(id) => self.pool_remove(id),
                Grow::Map(id, _) => self.unmapped_remove(id),
            }
            let (Grow::Take(id) | Grow::Map(id, _)) = *g;
            self.blocks[id].busy = true;
        }
        Some((plan, to_map))
    }

    /// Books a growth whose pages were mapped (`pages`, one list per `Grow::Map` step, in
    /// order; `created` bytes of them new): the mapped pieces and the free blocks taken
    /// become one free block, which it returns.
    pub(crate) fn commit_growth(
        &mut self,
        plan: Vec<Grow>,
        pages: Vec<Vec<PhysHandle>>,
        stream: StreamHandle,
        kind: PoolKind,
        created: u64,
    ) -> usize {
        let mut pieces = Vec::new();
        let mut handles = pages.into_iter();
        for g in plan {
            match g {
                Grow::Take(id) => pieces.push(id),
                Grow::Map(id, bytes) => {
                    let piece = if bytes < self.blocks[id].size {
                        let front = self.blocks.split_front(id, bytes);
                        self.blocks[id].busy = false;
                        self.unmapped_insert(id);
                        front
                    } else {
                        id
                    };
                    self.blocks.set_mapped(piece, true);
                    let ptr = self.blocks[piece].ptr;
                    self.store_pages(piece, handles.next().unwrap_or_default());
                    self.stats.num_device_alloc += 1;
                    self.history
                        .record("segment_map", ptr, bytes, stream.raw, None);
                    pieces.push(piece);
                }
            }
        }
        self.stats.reserved_bytes.increase(kind, created as i64);
        let first = pieces[0];
        for next in pieces.into_iter().skip(1) {
            self.blocks.absorb_next(first, next);
        }
        // PyTorch's `map_block` merges what it mapped with both free neighbours: a free
        // block right after a range mapped to its end joins too.
        // (A page-bound small pool's growth ends at a page boundary: nothing merges there.)
        let after = self.blocks.mergeable(self.blocks[first].next);
        if let Some(n) = after.filter(|_| !self.small_page_bound(kind)) {
            self.pool_remove(n);
            self.blocks.absorb_next(first, n);
        }
        self.blocks[first].busy = false;
        first
    }

    /// Cuts the whole pages (at most `wanted` of them) out of free expandable block `id`,
    /// with `safe_before` only the first run of pages stamped before that reclaim epoch:
    /// the head and tail around them go back to the free list (the tail keeps the index
    /// `id`), the pages' range is set aside for unmapping. `None` if the block holds no
    /// such page.
    pub(crate) fn cut_pages(
        &mut self,
        id: usize,
        wanted: u64,
        safe_before: Option<u64>,
    ) -> Option<UnmapJob> {
        let b = &self.blocks[id];
        let seg = self.expandable.segment_of(&self.blocks, id)?;
        let (base, page, stream) = (seg.va.base.0, seg.page, seg.stream);
        let first = base + (b.ptr - base).div_ceil(page) * page;
        let last = base + (b.ptr + b.size - base) / page * page;
        if last <= first {
            return None;
        }
        let (first, last) = match safe_before {
            Some(epoch) => self
                .expandable
                .safe_run(&self.blocks, id, first, last, epoch)?,
            None => (first, last),
        };
        let last = last.min(first.saturating_add(wanted.saturating_mul(page)));
        let (end, kind) = (b.ptr + b.size, b.pool);
        self.pool_remove(id);
        let mut mid = id;
        let head_bytes = first - self.blocks[id].ptr;
        if head_bytes > 0 {
            let head = self.blocks.split_front(id, head_bytes);
            self.pool_insert(head);
        }
        if last < end {
            mid = self.blocks.split_front(id, last - first);
            self.pool_insert(id);
        }
        self.blocks[mid].busy = true;
        let pages = self.take_pages(mid, first, last);
        Some(UnmapJob {
            block: mid,
            addr: first,
            bytes: last - first,
            page,
            pages,
            stream,
            kind,
        })
    }

    /// Puts back the blocks a growth plan set aside: taken free blocks return to their free
    /// list, holes to be mapped to the unmapped set.
    pub(crate) fn undo_grow(&mut self, plan: &[Grow]) {
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
    pub(crate) fn over_fraction(&self, bytes: u64) -> bool {
        self.allowed_max
            .is_some_and(|max| self.total_reserved.saturating_add(bytes) > max)
    }

    /// Whether garbage collection runs (PyTorch: a memory fraction and a threshold).
    pub(crate) fn gc_enabled(&self) -> bool {
        self.config.release.garbage_collection_threshold > 0.0
            && (self.allowed_max.is_some()
                || self.config.release.garbage_collection_without_fraction)
    }
}
