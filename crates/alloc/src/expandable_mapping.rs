//! Growing and shrinking expandable segments with the driver (PyTorch's
//! `ExpandableSegment::map`/`unmap` and `try_allocate_expandable_block`): reserving a
//! range, mapping pages transactionally, unmapping free pages (all of them, or the ones
//! `expandable_segments_reclaim` moves), with the lock released around every driver call.
use crate::block::{Block, Link, Piece};
use crate::engine::{Engine, Guard};
use crate::error::AllocError;
use crate::expandable::{ExpandableSegment, Grow, Unmap, UnmapJob};
use crate::reclaim_clock::MARKS_KEPT;
use crate::state::State;
use ferrocuda_driver::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr, PhysHandle, PoolId, PoolKind, StreamHandle};

impl Engine {
    /// The page of a new expandable segment of `kind`: 2 MiB small; large,
    /// `expandable_segments_page_mb` or else the large segment size; it must be a multiple of the driver's granularity (queried, not assumed).
    pub(crate) fn page_size(&self, st: &State, kind: PoolKind) -> Result<u64, AllocError> {
        let page = match kind {
            PoolKind::Small => crate::rounding::SMALL_BUFFER,
            PoolKind::Large => st
                .config
                .expandable
                .page
                .unwrap_or(st.config.sizes.large_segment_size),
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
    pub(crate) fn new_segment<'a>(
        &'a self,
        st: Guard<'a>,
        kind: PoolKind,
        stream: StreamHandle,
        page: u64,
    ) -> Result<Guard<'a>, AllocError> {
        let cap = self.device_total + self.device_total / 8;
        let want = match st.config.expandable.reserve {
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
        let segment = st
            .expandable
            .add(ExpandableSegment::new(va, bytes, page, stream));
        let id = st.blocks.insert(Block::new(Piece {
            ptr: va.base.0,
            size: bytes,
            stream: stream.raw,
            pool: kind,
            mapped: false,
            segment: Link::from(Some(segment)),
            pool_id: PoolId::DEFAULT,
        }));
        st.unmapped_insert(id);
        Ok(st)
    }

    /// `try_allocate_expandable_block`: finds (or reserves) room for `size` bytes in this
    /// stream's expandable segments, maps what is missing, and returns the range as one
    /// free block. Mapping is transactional: if any page fails, the pages mapped by this
    /// call are unmapped and released, and the segment is as it was (PyTorch #188008).
    pub(crate) fn alloc_expandable<'a>(
        &'a self,
        mut st: Guard<'a>,
        size: u64,
        kind: PoolKind,
        stream: StreamHandle,
    ) -> Result<(Guard<'a>, Option<usize>), AllocError> {
        let page_bound = st.small_page_bound(kind);
        let start = match st
            .expandable
            .find(&st.blocks, (stream, kind), size, page_bound)
        {
            Some(s) => s,
            None => {
                let page = self.page_size(&st, kind)?;
                st = self.new_segment(st, kind, stream, page)?;
                match st
                    .expandable
                    .find(&st.blocks, (stream, kind), size, page_bound)
                {
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
        let Some((plan, to_map)) = st.plan_growth(start, size, page) else {
            return Ok((st, None));
        };
        // `expandable_segments_reclaim`: free whole pages elsewhere in this stream's ranges
        // whose last use has run (`reclaim_clock`) are unmapped and mapped here instead of
        // new memory.
        let pages = to_map / page;
        let spare_now = st.expandable.spare_count(kind, page);
        // While a capture is underway no event may be queried: only new pages then. That
        // includes a capture of the growing stream the allocator was not told of (a query
        // of the stream would invalidate it).
        if st.config.expandable.reclaim
            && pages > spare_now
            && !st.capturing()
            && !self.any_capturing(&[stream])
        {
            st.expandable.wake();
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
        let reuse = st.expandable.take_spare(kind, page, pages);
        let created = to_map - reuse.len() as u64 * page;
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
        // Held until the pages are recorded, so that a peer added meanwhile sees them.
        let peers = self.peers.read();
        let (mapped, spare_back) = self.map_pages(&jobs, page, reuse, &peers);
        let mut st = self.lock();
        st.expandable.put_spare(kind, page, spare_back);
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
        let first = st.commit_growth(plan, handles, stream, kind, created);
        drop(peers);
        Ok((st, Some(first)))
    }

    /// Maps `bytes` at each address, a page at a time, then grants access to this device
    /// and to each of `peers` (PyTorch's `ExpandableSegment::map`). All or nothing.
    /// Returns the pages mapped per job (or the error), and the spare pages not used (all
    /// of them after a failure: a rollback unmaps them again).
    pub(crate) fn map_pages(
        &self,
        jobs: &[(u64, u64)],
        page: u64,
        mut spare: Vec<PhysHandle>,
        peers: &[DeviceIndex],
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
            let granted = std::iter::once(&self.device)
                .chain(peers)
                .try_for_each(|&dev| d.vm_set_access(dev, DevicePtr(addr), bytes));
            if let Err(e) = granted {
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
    /// stay mapped). The driver's unmap does not wait for queued work: `Unmap::All` waits
    /// for each segment's stream first. A reclaim takes pages whose last free a completed
    /// mark covers (`reclaim_clock`), all of them if the stream is found idle; if they are
    /// too few, it waits for an older mark, one
    /// with work queued behind it (so the device does not run dry), and takes the pages
    /// that mark covers. Segments left entirely unmapped give their range back.
    pub(crate) fn release_expandable<'a>(&'a self, mut st: Guard<'a>, scope: Unmap) -> Guard<'a> {
        let mut wanted = match scope {
            Unmap::All => u64::MAX,
            Unmap::Reclaim { pages, .. } => pages,
        };
        let mut jobs: Vec<UnmapJob> = Vec::new();
        match scope {
            Unmap::All => cut_free_pages(&mut st, scope, None, &mut wanted, &mut jobs),
            Unmap::Reclaim { stream, .. } => {
                // Reclaim's own queries, marks and waits, which PyTorch never makes, break
                // no capture elsewhere: a global capture on any thread, or this thread's
                // own on another stream, would count them as unsafe calls.
                let _relaxed = self.relaxed_capture();
                let safe_before = self.known_safe_epoch(&mut st, stream);
                cut_free_pages(&mut st, scope, Some(safe_before), &mut wanted, &mut jobs);
                if wanted > 0
                    && let Some(event) = st.expandable.clock.mark_to_wait_for(stream)
                {
                    drop(st);
                    let _ = self.driver.event_synchronize(event);
                    st = self.lock();
                    let safe_before = self.settle_marks(&mut st, stream);
                    cut_free_pages(&mut st, scope, Some(safe_before), &mut wanted, &mut jobs);
                }
            }
        }
        if jobs.is_empty() {
            return match scope {
                Unmap::All => self.destroy_spare_pages(st),
                Unmap::Reclaim { .. } => st,
            };
        }
        drop(st);
        let mut synced: Vec<StreamHandle> = Vec::new();
        for job in &jobs {
            if matches!(scope, Unmap::All) && !synced.contains(&job.stream) {
                let _ = self.driver.stream_synchronize(job.stream);
                synced.push(job.stream);
            }
            let _ = self
                .driver
                .vm_unmap(self.device, DevicePtr(job.addr), job.bytes);
            if matches!(scope, Unmap::All) {
                for h in &job.pages {
                    let _ = self.driver.vm_destroy(*h);
                }
            }
        }
        let mut st = self.lock();
        let mut ranges = Vec::new();
        for job in jobs {
            let (kind, bytes) = (job.kind, job.bytes);
            st.history
                .record("segment_unmap", job.addr, bytes, job.stream.raw, None);
            if matches!(scope, Unmap::All) {
                st.stats.reserved_bytes.decrease(kind, bytes as i64);
                st.stats.num_device_free += 1;
                st.total_reserved -= bytes;
            } else {
                // Kept for remapping: still physical memory, still reserved.
                st.expandable.put_spare(kind, job.page, job.pages);
            }
            ranges.extend(st.settle_unmapped(job.block));
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

    /// The epoch before which `stream`'s freed pages are known to have run their last use,
    /// without waiting: every page so far if the stream is idle; else what its completed
    /// marks show, after recording a new mark for the next reclaim.
    fn known_safe_epoch(&self, st: &mut State, stream: StreamHandle) -> u64 {
        self.settle_if_idle(st, stream).unwrap_or_else(|| {
            self.record_mark(st, stream);
            self.settle_marks(st, stream)
        })
    }

    /// If `stream` has run everything queued on it (a query, not a wait): every page
    /// stamped so far is safe, its marks' events go back to the pool, and the epoch before
    /// which pages are safe is returned.
    fn settle_if_idle(&self, st: &mut State, stream: StreamHandle) -> Option<u64> {
        if !self.driver.stream_query(stream).unwrap_or(false) {
            return None;
        }
        let (done, safe_before) = st.expandable.clock.idle(stream);
        st.order.give_back_all(done);
        Some(safe_before)
    }

    /// Settles `stream`'s reclaim marks: returns the epoch before which its pages' last use
    /// has run.
    fn settle_marks(&self, st: &mut State, stream: StreamHandle) -> u64 {
        let (done, safe_before) = st.expandable.clock.settle(&*self.driver, stream);
        st.order.give_back_all(done);
        safe_before
    }

    /// Records a reclaim mark on `stream`, if it takes one (an event that cannot be made or
    /// recorded only means fewer pages known safe). At [`MARKS_KEPT`] outstanding marks the
    /// completed ones are settled first, and if as many are left, the oldest one's event
    /// is recorded again (see `reclaim_clock`).
    fn record_mark(&self, st: &mut State, stream: StreamHandle) {
        if st.expandable.mark_due == Some(stream) {
            st.expandable.mark_due = None;
        }
        if st.expandable.clock.outstanding(stream) >= MARKS_KEPT {
            self.settle_marks(st, stream);
        }
        let event = if st.expandable.clock.outstanding(stream) >= MARKS_KEPT {
            st.expandable.clock.take_oldest(stream)
        } else {
            st.order.event(&*self.driver, self.device).ok()
        };
        if let Some(event) = event {
            match self.driver.event_record(event, stream) {
                Ok(()) => st.expandable.clock.marked(stream, event),
                Err(_) => st.order.give_back(event),
            }
        }
    }

    /// Records the reclaim mark that frees made due (`expandable_segments_reclaim` only; it
    /// stays due while a capture is underway, where the event would join the graph). Every
    /// locked operation asks; one in many frees of a segment makes one due.
    #[inline(always)]
    pub(crate) fn record_due_mark(&self, st: &mut State) {
        if st.expandable.mark_due.is_some() {
            self.record_due_mark_now(st);
        }
    }

    /// [`Engine::record_due_mark`] with one due. A stream found idle needs none: every page
    /// stamped so far is safe; nor does an allocator whose reclaim falls dormant with it. A
    /// stream in a capture the allocator was not told of keeps its mark due: a query would
    /// invalidate the capture, an event would join its graph.
    #[cold]
    fn record_due_mark_now(&self, st: &mut State) {
        if st.capturing() {
            return;
        }
        if let Some(stream) = st.expandable.mark_due.take()
            && st.config.expandable.reclaim
        {
            if self.any_capturing(&[stream]) {
                st.expandable.mark_due = Some(stream);
                return;
            }
            let frees = st.expandable.clock.frees_per_mark();
            if st.expandable.fall_dormant(frees) {
                return;
            }
            // As a reclaim's (`release_expandable`): no capture elsewhere is broken.
            let _relaxed = self.relaxed_capture();
            let idle = self.settle_if_idle(st, stream).is_some();
            st.expandable.clock.adapt(idle);
            if !idle {
                self.record_mark(st, stream);
            }
        }
    }

    /// Gives the spare pages of `expandable_segments_reclaim` back to the driver.
    pub(crate) fn destroy_spare_pages<'a>(&'a self, mut st: Guard<'a>) -> Guard<'a> {
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

/// Cuts whole free pages (up to `wanted`, counted down) out of the free expandable blocks
/// `scope` names, with `safe_before` only pages stamped before that reclaim epoch.
fn cut_free_pages(
    st: &mut State,
    scope: Unmap,
    safe_before: Option<u64>,
    wanted: &mut u64,
    jobs: &mut Vec<UnmapJob>,
) {
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
    for id in candidates {
        // A block may hold several runs of safe pages; after a cut, `id` is the tail left
        // in the pool, or the cut itself when no tail was left.
        while *wanted > 0
            && st.blocks.in_pool(id)
            && let Some(job) = st.cut_pages(id, *wanted, safe_before)
        {
            *wanted -= job.bytes / job.page;
            jobs.push(job);
        }
    }
}
