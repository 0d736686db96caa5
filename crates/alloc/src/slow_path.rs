//! What `DeviceCachingAllocator::malloc` (c10/cuda/CUDACachingAllocator.cpp) does when
//! best fit finds nothing: garbage collection, taking over another stream's segment
//! (`cross_stream_reuse`), a new segment or expandable range, the oversize release, the
//! release of the whole cache and a last, counted retry, then out of memory. It finds a
//! block; handing it out is the allocator's.
use crate::block::{Block, Link, NO_LIST, Piece};
use crate::engine::{Engine, Guard};
use crate::error::AllocError;
use crate::free_pools::FreeKey;
use crate::private_pools::{SegmentSource, Wakefulness};
use crate::rounding::allocation_size;
use crate::state::{Request, State};
use ferrocuda_driver::DriverError;
use ferrocuda_types::{DevicePtr, PoolId, PoolKind, StreamHandle};

impl Engine {
    /// What `DeviceCachingAllocator::malloc` (c10/cuda/CUDACachingAllocator.cpp) does when
    /// best fit finds nothing: garbage collection (with a memory fraction), a new segment,
    /// the oversize release (`release_available_cached_blocks`) and a new segment, then
    /// `release_cached_blocks` (every event waited for, every cached segment of the default
    /// pool and of unretained private pools freed) and a last, counted retry. The
    /// ferrocuda-only keys `garbage_collection_without_fraction`, `cross_stream_reuse`,
    /// `oom_search_after_sync` and `oom_release_partial` add their steps.
    pub(crate) fn slow_path<'a>(
        &'a self,
        mut st: Guard<'a>,
        req: &Request,
    ) -> Result<(Guard<'a>, usize), AllocError> {
        let Request {
            size,
            kind,
            stream,
            pool,
            ..
        } = *req;
        let segment = allocation_size(size, &st.config);
        // While a capture is underway nothing may be freed or synchronized: only new memory.
        let capturing = st.capturing();
        if st.gc_enabled() && !capturing {
            let limit = st.allowed_max.unwrap_or(self.device_total);
            st = self.garbage_collect(st, limit);
        }
        if st.config.reuse.cross_stream_reuse
            && !capturing
            && let Some(id) = self.take_from_other_stream(&mut st, pool, kind, stream, size)?
        {
            return Ok((st, id));
        }
        let (s, found) = self.grow(st, req, segment)?;
        st = s;
        if let Some(id) = found {
            return Ok((st, id));
        }
        // The oversize release touches the default pool only: PyTorch's also frees blocks
        // of a private pool being recorded to (pytorch#159594).
        if st.config.sizes.max_split_size.is_some() && pool.is_default() && !capturing {
            let (s, enough) = self.release_oversize(st, size, kind, stream);
            st = s;
            if enough || st.config.release.oom_release_partial {
                let (s, found) = self.grow(st, req, segment)?;
                st = s;
                if let Some(id) = found {
                    return Ok((st, id));
                }
            }
        }
        if capturing {
            // No synchronization and no cudaFree while a capture is underway.
            st.stats.num_ooms += 1;
            drop(st);
            return Err(self.oom_report(segment, size, false, stream));
        }
        if st.config.release.oom_search_after_sync {
            // The block needed may be one that other streams' events held back (PyTorch
            // never looks again: pytorch#189504).
            st = self.synchronize_events(st);
            if let Some(id) = st.take_free_block(pool, kind, stream, size) {
                return Ok((st, id));
            }
        }
        if st.config.release.oom_release_partial {
            // As much cached memory as the request needs, largest segments first.
            st = self.release_cached(st, Some(segment));
            let (s, found) = self.grow(st, req, segment)?;
            st = s;
            if let Some(id) = found {
                return Ok((st, id));
            }
        }
        st = self.release_cached(self.synchronize_events(st), None);
        st.stats.num_alloc_retries += 1;
        let (s, found) = self.grow(st, req, segment)?;
        st = s;
        if let Some(id) = found {
            return Ok((st, id));
        }
        st.stats.num_ooms += 1;
        drop(st);
        Err(self.oom_report(segment, size, false, stream))
    }

    /// `alloc_block`: more device memory for `req`: a mapped expandable range when
    /// expandable segments are on, else a new `segment`-byte segment.
    pub(crate) fn grow<'a>(
        &'a self,
        st: Guard<'a>,
        req: &Request,
        segment: u64,
    ) -> Result<(Guard<'a>, Option<usize>), AllocError> {
        // `alloc_block` checks the memory fraction against the allocation size, with
        // expandable segments too (they then map what the request needs, which may be less
        // or, with 20 MiB pages, more).
        if st.over_fraction(segment) {
            return self.refuse_over_fraction(st, segment);
        }
        // Private (graph) pools use plain segments.
        if st.config.expandable.enabled && req.pool.is_default() {
            self.alloc_expandable(st, req.size, req.kind, req.stream)
        } else {
            self.alloc_segment(st, segment, req)
        }
    }

    /// `alloc_block`: a new segment from the driver, outside the lock (the memory fraction
    /// was checked). `Ok(None)` when the device has no room.
    pub(crate) fn alloc_segment<'a>(
        &'a self,
        mut st: Guard<'a>,
        bytes: u64,
        req: &Request,
    ) -> Result<(Guard<'a>, Option<usize>), AllocError> {
        let (pool, kind, stream) = (req.pool, req.kind, req.stream);
        st.total_reserved += bytes;
        // `cudaMallocMaybeCapturing`: the capturing thread's device allocations run in
        // relaxed mode (legal, and not part of the graph); other threads' do not, so that
        // they invalidate a GLOBAL capture as they do in PyTorch.
        let relax = req.capture.is_some() || st.private.captured_by_this_thread();
        // `allocPrimitive`: a pool made with an allocator takes its segments from it.
        let source = st.private.source(pool);
        drop(st);
        let relaxed = relax.then(|| self.relaxed_capture());
        let mut paged = None;
        let result = match &source {
            // A null segment is `cudaErrorMemoryAllocation` there: out of memory.
            SegmentSource::Pluggable(a) => match a.malloc(bytes, self.device, stream) {
                DevicePtr(0) => Err(DriverError::OUT_OF_MEMORY),
                ptr => Ok(ptr),
            },
            SegmentSource::Driver => self.driver.malloc(self.device, bytes),
            SegmentSource::Sleepable => {
                crate::sleep::pages::map_segment(&*self.driver, self.device, bytes, pool).map(|s| {
                    let ptr = s.base();
                    paged = Some(s);
                    ptr
                })
            }
        };
        drop(relaxed);
        let mut st = self.lock();
        match result {
            Ok(ptr) => {
                if let Some(segment) = paged {
                    // A sleep that began while the lock was released did not see this
                    // segment: it goes back, and the request is refused as the pool's are.
                    if st.private.wakefulness(pool) != Wakefulness::Awake {
                        st.total_reserved -= bytes;
                        drop(st);
                        crate::sleep::pages::give_back(&*self.driver, segment);
                        return Err(crate::SleepError::Asleep(pool).into());
                    }
                    st.paged.insert(segment);
                }
                let id = st.blocks.insert(Block::new(Piece {
                    ptr: ptr.0,
                    size: bytes,
                    stream: stream.raw,
                    pool: kind,
                    mapped: true,
                    segment: Link::NONE,
                    pool_id: pool,
                }));
                let oversize = st.oversize.is_oversize(bytes);
                if oversize {
                    st.oversize_segments.insert(ptr.0);
                    st.stats.oversize_segments.increase(1);
                }
                st.history
                    .segment_allocated(ptr.0, bytes, stream.raw, req.frames.as_ref());
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
                Err(e.into())
            }
        }
    }

    /// `cross_stream_reuse`: the smallest whole free segment of the request's pool, cached by
    /// another stream, that fits
    /// (oversize rules apply), moved to `stream`, which is made to wait for the work its old
    /// stream enqueued so far. Only whole segments move, so a segment never mixes streams.
    pub(crate) fn take_from_other_stream(
        &self,
        st: &mut State,
        pool: PoolId,
        kind: PoolKind,
        stream: StreamHandle,
        size: u64,
    ) -> Result<Option<usize>, AllocError> {
        let fits = |k: &FreeKey| k.size >= size && !st.oversize.refuses(size, k.size);
        let best = st
            .pools
            .keys_of(kind)
            .filter(|k| {
                k.pool == pool
                    && k.stream != stream.raw
                    && fits(k)
                    && st.blocks[k.id].is_whole_segment()
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
}
