//! The address space of expandable segments (PyTorch's `ExpandableSegment`,
//! c10/cuda/CUDACachingAllocator.cpp): one reserved range per (stream, pool), mapped page
//! by page as it grows. This type owns the ranges, their pages, the unmapped pieces (as
//! blocks that are not mapped) and the spare pages of `expandable_segments_reclaim`; the
//! driver calls that map and unmap are the allocator's.
use crate::block::Blocks;
use crate::reclaim_clock::{DORMANT_AFTER, ReclaimClock};
use ferrocuda_types::{PhysHandle, PoolKind, StreamHandle, VaRange};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// One reserved address range of a (stream, pool) and the physical page mapped at each
/// page of it.
pub(crate) struct ExpandableSegment {
    pub(crate) va: VaRange,
    /// The page size it was made with (it keeps it when the configuration changes).
    pub(crate) page: u64,
    pub(crate) handles: Vec<Option<PhysHandle>>,
    /// Per page, the reclaim epoch of the last free that covered it (0: none since it was
    /// mapped): see `reclaim_clock`.
    pub(crate) freed: Vec<u64>,
    /// Frees since a reclaim mark was last due on this segment.
    pub(crate) frees_since_mark: u32,
    pub(crate) stream: StreamHandle,
    /// `log2(page)` for the usual power-of-two page: every free stamps its pages, and a
    /// shift is not a division (tens of cycles on the hot path).
    page_shift: Option<u32>,
}

impl ExpandableSegment {
    /// A segment of `bytes` over the reserved range `va`, nothing mapped yet.
    pub(crate) fn new(
        va: VaRange,
        bytes: u64,
        page: u64,
        stream: StreamHandle,
    ) -> ExpandableSegment {
        let pages = (bytes / page) as usize;
        ExpandableSegment {
            va,
            page,
            handles: vec![None; pages],
            freed: vec![0; pages],
            frees_since_mark: 0,
            stream,
            page_shift: page.is_power_of_two().then(|| page.trailing_zeros()),
        }
    }

    /// The index of the page that holds `addr` (an address inside this segment).
    #[inline]
    pub(crate) fn page_index(&self, addr: u64) -> usize {
        self.page_span(addr, 1).0
    }

    /// The indices of the first and the last page that `bytes` (at least 1) at `addr`
    /// touch, with one look at how pages are sized.
    #[inline(always)]
    fn page_span(&self, addr: u64, bytes: u64) -> (usize, usize) {
        let (first, last) = (addr - self.va.base.0, addr + bytes - 1 - self.va.base.0);
        let (first, last) = match self.page_shift {
            Some(shift) => (first >> shift, last >> shift),
            None => (first / self.page, last / self.page),
        };
        (first as usize, last as usize)
    }
}

/// One step of growing an expandable range: a free mapped block to take as it is, or the
/// first `bytes` of an unmapped range to map.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Grow {
    Take(usize),
    Map(usize, u64),
}

/// Which free expandable pages to unmap.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Unmap {
    /// All of them, releasing the physical memory (`empty_cache`, the OOM path).
    All,
    /// Up to `pages` pages of `page` bytes of one (stream, pool), kept as spare pages to
    /// map again elsewhere.
    Reclaim {
        stream: StreamHandle,
        kind: PoolKind,
        pages: u64,
        page: u64,
    },
}

/// Whole free pages cut out of a free block to be unmapped: `block` spans
/// [`addr`, `addr + bytes`) and is set aside (busy) until they are.
pub(crate) struct UnmapJob {
    pub(crate) block: usize,
    pub(crate) addr: u64,
    pub(crate) bytes: u64,
    pub(crate) page: u64,
    /// The physical pages mapped there, taken out of the segment.
    pub(crate) pages: Vec<PhysHandle>,
    pub(crate) stream: StreamHandle,
    pub(crate) kind: PoolKind,
}

#[derive(Default)]
pub(crate) struct Expandable {
    /// The segments (a slab; `None` once destroyed).
    segments: Vec<Option<ExpandableSegment>>,
    /// Unmapped ranges per (stream, pool), by address.
    unmapped: FxHashMap<(u64, u8), BTreeMap<u64, usize>>,
    /// Physical pages unmapped by `expandable_segments_reclaim`, waiting to be mapped again,
    /// per pool (small pages, large pages), with their size. They still count as reserved.
    pub(crate) spare_pages: [Vec<(PhysHandle, u64)>; 2],
    /// When free pages may be unmapped without a synchronization.
    pub(crate) clock: ReclaimClock,
    /// A stream whose frees want a reclaim mark recorded (see [`ReclaimClock::frees_per_mark`]).
    pub(crate) mark_due: Option<StreamHandle>,
    /// Whether frees stamp their pages and count toward marks: page reclaim is on and not
    /// dormant (see `reclaim_clock`: after [`DORMANT_AFTER`] frees without a reclaim, until
    /// the next one).
    pub(crate) stamping: bool,
    /// Frees counted toward marks since the last reclaim, at the marks that fell due.
    quiet_frees: u64,
}

impl Expandable {
    /// Adds a segment, returning its index (what its blocks' `segment` link names).
    pub(crate) fn add(&mut self, segment: ExpandableSegment) -> usize {
        self.segments.push(Some(segment));
        self.segments.len() - 1
    }

    /// The segment that block `id` lies in, if it is expandable.
    pub(crate) fn segment_of(&self, blocks: &Blocks, id: usize) -> Option<&ExpandableSegment> {
        let seg = blocks[id].segment.get()?;
        self.segments.get(seg)?.as_ref()
    }

    fn segment_of_mut(&mut self, blocks: &Blocks, id: usize) -> Option<&mut ExpandableSegment> {
        let seg = blocks[id].segment.get()?;
        self.segments.get_mut(seg)?.as_mut()
    }

    /// Whether `addr`, inside segment `segment`, is where one of its pages starts.
    #[inline(always)]
    pub(crate) fn starts_page(&self, segment: usize, addr: u64) -> bool {
        self.segments
            .get(segment)
            .and_then(Option::as_ref)
            .is_some_and(|s| (addr - s.va.base.0).is_multiple_of(s.page))
    }

    /// Every mapped run of pages, as `(address, bytes)`, across all segments.
    pub(crate) fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for s in self.segments.iter().flatten() {
            let mut run: Option<(u64, u64)> = None;
            for (i, h) in s.handles.iter().enumerate() {
                match (h, run.as_mut()) {
                    (Some(_), Some((_, bytes))) => *bytes += s.page,
                    (Some(_), None) => run = Some((s.va.base.0 + i as u64 * s.page, s.page)),
                    (None, _) => runs.extend(run.take()),
                }
            }
            runs.extend(run);
        }
        runs
    }

    /// The page size of the expandable segment that block `id` lies in.
    pub(crate) fn page_of(&self, blocks: &Blocks, id: usize) -> Option<u64> {
        self.segment_of(blocks, id).map(|s| s.page)
    }

    /// Notes the pages just mapped at block `id` (which starts on a page).
    pub(crate) fn store_pages(&mut self, blocks: &Blocks, id: usize, pages: Vec<PhysHandle>) {
        let ptr = blocks[id].ptr;
        if let Some(segment) = self.segment_of_mut(blocks, id) {
            let first = segment.page_index(ptr);
            for (slot, h) in segment.handles[first..].iter_mut().zip(pages) {
                *slot = Some(h);
            }
        }
    }

    /// Stamps the pages that a freed block covers (`size` bytes at `ptr` in `segment`),
    /// partial ones too, with the reclaim clock's epoch, and counts the free towards the
    /// segment's next mark (`expandable_segments_reclaim` only: switched on later, it
    /// begins with [`stamp_all`](Self::stamp_all)).
    ///
    /// Every free of an expandable block comes here, so the usual case is short: the first
    /// and last page are two stores, the same page or not; a block over more than two pages
    /// takes [`stamp_pages`](Self::stamp_pages) for the ones between.
    #[inline(always)]
    pub(crate) fn stamp_free(&mut self, segment: usize, ptr: u64, size: u64) {
        let (stamp, frees_per_mark) = (self.clock.epoch(), self.clock.frees_per_mark());
        let Some(Some(segment)) = self.segments.get_mut(segment) else {
            return;
        };
        let (from, last) = segment.page_span(ptr, size);
        if let Some(pages) = segment.freed.get_mut(from..=last) {
            // The first and the last page are stamped whether or not they are one (which
            // is random to the branch predictor); pages between them, out of line.
            if let Some(first) = pages.first_mut() {
                *first = stamp;
            }
            if let Some(end) = pages.last_mut() {
                *end = stamp;
            }
            if pages.len() > 2
                && let Some(between) = pages.get_mut(1..pages.len() - 1)
            {
                Self::stamp_pages(between, stamp);
            }
        }
        segment.frees_since_mark += 1;
        if segment.frees_since_mark >= frees_per_mark {
            segment.frees_since_mark = 0;
            self.mark_due = Some(segment.stream);
        }
    }

    /// How many more frees `segment` takes before a reclaim mark falls due, not counting
    /// the one that makes it due (see `thread_cache`'s credits).
    pub(crate) fn frees_before_mark(&self, segment: usize) -> u32 {
        let frees_per_mark = self.clock.frees_per_mark();
        self.segments
            .get(segment)
            .and_then(Option::as_ref)
            .map_or(0, |s| frees_per_mark.saturating_sub(s.frees_since_mark + 1))
    }

    /// Counts `n` frees of `segment` made without the lock (a credited block's, taken back
    /// by its thread), fewer than [`frees_before_mark`](Self::frees_before_mark) said.
    pub(crate) fn count_frees(&mut self, segment: usize, n: u64) {
        if let Some(Some(s)) = self.segments.get_mut(segment) {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            s.frees_since_mark = s.frees_since_mark.saturating_add(n);
        }
    }

    /// Puts `expandable_segments_reclaim` in force: switched on, every page is stamped
    /// ([`stamp_all`](Self::stamp_all)) and frees stamp theirs from now on.
    pub(crate) fn set_reclaim(&mut self, on: bool) {
        if on && !self.stamping {
            self.stamp_all();
        }
        self.stamping = on;
        self.quiet_frees = 0;
    }

    /// A reclaim is about to read the stamps: a dormant allocator stamps every page first
    /// (as switching reclaim on does) and frees stamp theirs again.
    pub(crate) fn wake(&mut self) {
        self.set_reclaim(true);
    }

    /// A mark fell due after `frees` frees of a segment: counts them toward dormancy.
    /// Returns whether page reclaim has now fallen dormant (frees stop stamping and
    /// counting; no mark is recorded).
    pub(crate) fn fall_dormant(&mut self, frees: u32) -> bool {
        self.quiet_frees += u64::from(frees);
        if self.quiet_frees < DORMANT_AFTER {
            return false;
        }
        self.stamping = false;
        true
    }

    /// Stamps every page of every segment with the reclaim clock's epoch, when
    /// `expandable_segments_reclaim` is switched on or wakes: frees made meanwhile stamped
    /// nothing, so no page is known safe before a mark recorded from now on has completed
    /// (or its stream is found idle).
    pub(crate) fn stamp_all(&mut self) {
        let stamp = self.clock.epoch();
        for segment in self.segments.iter_mut().flatten() {
            segment.freed.fill(stamp);
        }
    }

    /// Stamps the pages between a freed block's first and last (out of line: most blocks
    /// lie within one or two pages).
    #[inline(never)]
    fn stamp_pages(pages: &mut [u64], stamp: u64) {
        pages.fill(stamp);
    }

    /// The first run of pages inside [`first`, `last`) (page-aligned addresses of block
    /// `id`'s segment) stamped before `safe_before`, as addresses, if any.
    pub(crate) fn safe_run(
        &self,
        blocks: &Blocks,
        id: usize,
        first: u64,
        last: u64,
        safe_before: u64,
    ) -> Option<(u64, u64)> {
        let segment = self.segment_of(blocks, id)?;
        let page = segment.page;
        let stamps = &segment.freed[segment.page_index(first)..segment.page_index(last)];
        let start = stamps.iter().position(|&s| s < safe_before)?;
        let len = stamps[start..]
            .iter()
            .position(|&s| s >= safe_before)
            .unwrap_or(stamps.len() - start);
        let at = first + start as u64 * page;
        Some((at, at + len as u64 * page))
    }

    /// Takes the pages mapped over [`first`, `last`) of block `id`'s segment out of it.
    pub(crate) fn take_pages(
        &mut self,
        blocks: &Blocks,
        id: usize,
        first: u64,
        last: u64,
    ) -> Vec<PhysHandle> {
        let Some(segment) = self.segment_of_mut(blocks, id) else {
            return Vec::new();
        };
        let (from, to) = (segment.page_index(first), segment.page_index(last));
        segment.handles[from..to]
            .iter_mut()
            .filter_map(Option::take)
            .collect()
    }

    fn unmapped_key(blocks: &Blocks, id: usize) -> ((u64, u8), u64) {
        let b = &blocks[id];
        ((b.stream, b.pool.index() as u8), b.ptr)
    }

    /// Puts unmapped block `id` into the unmapped set.
    pub(crate) fn insert_unmapped(&mut self, blocks: &mut Blocks, id: usize) {
        let (set, ptr) = Self::unmapped_key(blocks, id);
        blocks[id].busy = false;
        self.unmapped.entry(set).or_default().insert(ptr, id);
    }

    /// Takes unmapped block `id` out of the unmapped set.
    pub(crate) fn remove_unmapped(&mut self, blocks: &Blocks, id: usize) {
        let (set, ptr) = Self::unmapped_key(blocks, id);
        if let Some(m) = self.unmapped.get_mut(&set) {
            m.remove(&ptr);
        }
    }

    /// `find_expandable_block`: the first place, in address order, from which free and
    /// unmapped blocks of this stream's segments cover `size`: an unmapped range, or the
    /// free block just before it (unless `page_bound`: then growth starts at a page of its
    /// own, `expandable_segments_small_page_bound`).
    pub(crate) fn find(
        &self,
        blocks: &Blocks,
        (stream, kind): (StreamHandle, PoolKind),
        size: u64,
        page_bound: bool,
    ) -> Option<usize> {
        let set = self.unmapped.get(&(stream.raw, kind.index() as u8))?;
        for &u in set.values() {
            let start = match blocks[u].prev.get() {
                Some(p) if blocks.in_pool(p) && !page_bound => p,
                _ => u,
            };
            let (mut covered, mut cur) = (0, Some(start));
            while let Some(id) = cur.filter(|&i| blocks.growable(i)) {
                covered += blocks[id].size;
                if covered >= size {
                    return Some(start);
                }
                cur = blocks[id].next.get();
            }
        }
        None
    }

    /// Records a range that was just unmapped: merged with unmapped neighbours, back in the
    /// unmapped set. Returns the segment's reservation if the segment is now entirely
    /// unmapped (it is then destroyed, and the caller gives the range back).
    pub(crate) fn settle_unmapped(&mut self, blocks: &mut Blocks, id: usize) -> Option<VaRange> {
        blocks.set_mapped(id, false);
        blocks[id].busy = false;
        if let Some(p) = blocks[id]
            .prev
            .get()
            .filter(|&p| !blocks[p].mapped && !blocks[p].busy)
        {
            self.remove_unmapped(blocks, p);
            blocks.absorb_next(p, id);
            return self.settle_unmapped_at(blocks, p);
        }
        self.settle_unmapped_at(blocks, id)
    }

    fn settle_unmapped_at(&mut self, blocks: &mut Blocks, id: usize) -> Option<VaRange> {
        if let Some(n) = blocks[id]
            .next
            .get()
            .filter(|&n| !blocks[n].mapped && !blocks[n].busy)
        {
            self.remove_unmapped(blocks, n);
            blocks.absorb_next(id, n);
        }
        let b = &blocks[id];
        if b.prev.is_none() && b.next.is_none() {
            let seg = b
                .segment
                .get()
                .and_then(|s| self.segments.get_mut(s))
                .and_then(Option::take);
            blocks.vacate(id);
            return seg.map(|s| s.va);
        }
        self.insert_unmapped(blocks, id);
        None
    }

    /// How many spare pages of `page` bytes pool `kind` has.
    pub(crate) fn spare_count(&self, kind: PoolKind, page: u64) -> u64 {
        self.spare_pages[kind.index()]
            .iter()
            .filter(|(_, p)| *p == page)
            .count() as u64
    }

    /// Takes up to `pages` spare pages of `page` bytes of pool `kind`.
    pub(crate) fn take_spare(&mut self, kind: PoolKind, page: u64, pages: u64) -> Vec<PhysHandle> {
        let mut taken = Vec::new();
        self.spare_pages[kind.index()].retain(|&(h, p)| {
            let take = p == page && (taken.len() as u64) < pages;
            if take {
                taken.push(h);
            }
            !take
        });
        taken
    }

    /// Puts pages of `page` bytes of pool `kind` (back) among the spare ones.
    pub(crate) fn put_spare(&mut self, kind: PoolKind, page: u64, pages: Vec<PhysHandle>) {
        self.spare_pages[kind.index()].extend(pages.into_iter().map(|h| (h, page)));
    }

    /// Bytes of spare pages of pool `kind`.
    pub(crate) fn spare_bytes(&self, kind: PoolKind) -> u64 {
        self.spare_pages[kind.index()].iter().map(|(_, p)| p).sum()
    }
}
