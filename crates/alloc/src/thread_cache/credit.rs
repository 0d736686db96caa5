//! When a block is credited (`thread_cache`): PyTorch's free of it followed by the same
//! request must hand out the same block and leave every other block and every current
//! statistic as they were. Best fit's walk past expandable candidates is run over the free
//! list as the free would leave it (`free_pools::walk`, the one best fit runs).
use super::Credit;
use crate::free_list::key;
use crate::free_pools::walk;
use crate::history::HistoryMode;
use crate::state::{Request, State};

/// The credit of live block `id`, just handed out for `req`: due when
/// PyTorch's free of it followed by the same request would hand out the same block and
/// leave every other block and every current statistic as they were, with no peak
/// passed on the way (see `thread_cache`).
pub(super) fn credit(st: &State, id: usize, req: &Request) -> Option<Credit> {
    let c = &st.config;
    if !c.reuse.thread_cache
        || c.release.garbage_collection_threshold > 0.0
        || st.history.options.mode != HistoryMode::Off
        || st.private.routing()
        || !st.order.is_quiet()
    {
        return None;
    }
    let b = &st.blocks[id];
    let expandable = b.segment.is_some();
    // (With expandable segments switched off, the search skips expandable blocks.)
    // The free must merge no free block before it...
    let (merged_before, next) = st.merge_partners((b.prev, b.next), b.ptr, b.pool, b.segment);
    if (expandable && !c.expandable.enabled) || b.size != req.size || merged_before.is_some() {
        return None;
    }
    // With reclaim, a free counts toward the segment's next mark: the credit allows only
    // the frees that make none due, and none while one is due already (every locked
    // operation would try to record it).
    let (reclaim_segment, parks) = match b.segment.get() {
        Some(segment) if st.expandable.stamping => {
            let parks = st.expandable.frees_before_mark(segment);
            if parks == 0 || st.expandable.mark_due.is_some() {
                return None;
            }
            (Some(segment), u64::from(parks))
        }
        _ => (None, u64::MAX),
    };
    // ... and merges the free block after it, if any...
    let next_size = next.map_or(0, |n| st.blocks[n].size);
    let merged = b.size + next_size;
    if st.oversize.refuses(b.size, merged) {
        return None;
    }
    // ... best fit must choose the merged block, over the free list as the free leaves it
    // (its free neighbour gone into it), PyTorch's walk past expandable candidates that
    // could grow by more included ...
    if !best_fit_after_free_is_merged(st, id, next, merged) {
        return None;
    }
    // ... and split the same remainder off again.
    if next.is_some() && !st.split_worthwhile(expandable, b.pool, b.size, next_size) {
        return None;
    }
    // How `inactive_split` moves, by PyTorch's net changes: (the count moves, the bytes that
    // move, rise of the count and of the bytes between the free and the search).
    // Expandable blocks never count. Merging a free block behind and staying split is a net
    // rise of the bytes only: the merge's decrease and the split's increase cancel out.
    let (inactive, inactive_bytes, rise) = match next {
        _ if expandable => (false, 0, (0, 0)),
        None if b.is_split() => (true, b.size, (1, b.size)),
        None => (false, 0, (0, 0)),
        Some(n) if b.prev.is_some() || st.blocks[n].next.is_some() => (false, b.size, (0, b.size)),
        Some(_) => (true, next_size, (0, 0)),
    };
    let s = &st.stats;
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
        reclaim_segment,
        parks,
    })
}

/// Whether best fit, for a request of block `id`'s size, would choose the block its free
/// makes (`merged` bytes at its address, `next` merged in) over the free list as the free
/// leaves it (`free_pools::walk`; with expandable segments off only ordinary blocks serve).
/// Best fit has just chosen block `id`, so an ordinary candidate before the merged block is
/// one freed by another thread while the slow path waited for the driver (lock released);
/// an expandable one is often the block before a segment's unmapped tail, which the walk
/// passes over for the merged block when that could grow to less.
fn best_fit_after_free_is_merged(st: &State, id: usize, next: Option<usize>, merged: u64) -> bool {
    let (b, c) = (&st.blocks[id], &st.config);
    let tail_only = c.expandable.reclaim;
    // (Best fit counts no growth for blocks that stay inside their pages.)
    let page_bound = st.small_page_bound(b.pool);
    let growth = |r: usize| {
        if page_bound {
            0
        } else {
            st.blocks.growth(r, tail_only)
        }
    };
    let next_key = next.map(|n| key(st.blocks[n].size, st.blocks[n].ptr));
    let mut others = st
        .pools
        .list(b.pool_id, b.stream, b.pool)
        .into_iter()
        .flat_map(|list| list.range_from(key(b.size, 0)))
        .filter(|&(k, r)| {
            Some(k) != next_key && (c.expandable.enabled || st.blocks[r].segment.is_none())
        })
        .map(|(k, r)| (k, st.blocks[r].size, growth(r)))
        .peekable();
    // (What follows the merged block is what follows its last piece.)
    let merged_key = key(merged, b.ptr);
    let merged_growth = growth(next.unwrap_or(id));
    let mut merged_entry = Some((merged_key, merged, merged_growth));
    let mut candidates = std::iter::from_fn(|| match merged_entry {
        Some(m) if others.peek().is_none_or(|o| o.0 > m.0) => merged_entry.take(),
        _ => others.next(),
    });
    candidates.next().is_some_and(|first| {
        let (chosen, ..) = walk(
            first,
            |_| candidates.next(),
            |&(_, size, growth)| (size, growth),
        );
        chosen == merged_key
    })
}

/// Which blocks are credited, seen from inside the crate (a credit is not observable
/// through the public API, only its exactness is: `alloc_scenarios` and
/// `expandable_walk_credit` compare programs with and without `thread_cache`).
#[cfg(all(test, not(loom)))]
mod tests {
    use crate::{Caching, CachingAllocator};
    use ferrocuda_driver::FakeDriver;
    use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
    use std::sync::Arc;

    type TestResult = Result<(), Box<dyn std::error::Error>>;
    const STREAM: StreamHandle = StreamHandle::legacy(DeviceIndex(0));
    const MIB: u64 = 1 << 20;

    fn allocator(config: &str) -> Result<CachingAllocator, Box<dyn std::error::Error>> {
        Ok(CachingAllocator::new(
            Arc::new(FakeDriver::default()),
            DeviceIndex(0),
            AllocatorConfig::parse(config)?,
            Caching::On,
        )?)
    }

    /// Allocates `bytes` and uses the credit that came with it once (freed and taken back),
    /// so that credits are not granted less often for going unused.
    fn allocate_used(a: &CachingAllocator, bytes: u64) -> Result<u64, Box<dyn std::error::Error>> {
        let first = a.allocate(bytes, STREAM)?.ptr;
        a.free(first)?;
        let again = a.allocate(bytes, STREAM)?.ptr;
        assert_eq!(again, first);
        Ok(again.0)
    }

    /// Six 1 MiB blocks in the small pool's expandable segment; the second and third freed
    /// (one 2 MiB run) and the sixth (the block before the unmapped tail, which best fit
    /// passes over for a block that could grow to less). The next 1 MiB request splits the run
    /// and is handed its front. Returns the allocator, that block and whether it was credited.
    fn split_past_the_frontier(
        config: &str,
    ) -> Result<(CachingAllocator, u64, bool), Box<dyn std::error::Error>> {
        let a = allocator(config)?;
        let p: Vec<u64> = (0..6)
            .map(|_| allocate_used(&a, MIB))
            .collect::<Result<_, _>>()?;
        for i in [5, 1, 2] {
            a.free(DevicePtr(p[i]))?;
        }
        let x = a.allocate(MIB, STREAM)?.ptr.0;
        assert_eq!(x, p[1], "best fit passes the frontier block for the run");
        let credited = a.engine.cache.credits() == 1;
        Ok((a, x, credited))
    }

    #[test]
    fn a_block_split_from_a_run_past_the_frontier_is_credited() -> TestResult {
        for config in [
            "expandable_segments:True",
            "expandable_segments:True,expandable_segments_reclaim:True",
            "ferrocuda_recommended:True",
        ] {
            let (a, x, credited) = split_past_the_frontier(config)?;
            assert!(
                credited,
                "{config}: PyTorch's free and search would hand it out again"
            );
            let (reference, y, _) =
                split_past_the_frontier(&format!("{config},thread_cache:False"))?;
            assert_eq!(x, y);
            for (allocator, block) in [(&a, x), (&reference, y)] {
                allocator.free(DevicePtr(block))?;
                let again = allocator.allocate(MIB, STREAM)?.ptr.0;
                assert_eq!(again, block, "{config}: the same block comes back");
            }
            assert_eq!(a.stats().to_map(), reference.stats().to_map(), "{config}");
            a.check_invariants()?;
            reference.check_invariants()?;
        }
        Ok(())
    }
}
