//! Giving cached memory back to the driver: `release_cached_blocks` (all of it, or with
//! `oom_release_partial` as much as a request needs), `release_available_cached_blocks`
//! (the oversize release), `garbage_collect_cached_blocks`, and everything when the
//! allocator is dropped. Which pools each may touch is the private pools' rule.
use crate::engine::{Engine, Guard};
use crate::expandable::Unmap;
use crate::free_list::{key, key_size};
use crate::free_pools::FreeKey;
use crate::state::State;
use ferrocuda_types::{PoolId, PoolKind, StreamHandle};

impl Engine {
    /// Releases whole free segments: all of them (`None`) or, largest first, until
    /// `Some(bytes)` are released.
    pub(crate) fn release_cached<'a>(
        &'a self,
        mut st: Guard<'a>,
        enough: Option<u64>,
    ) -> Guard<'a> {
        let mut candidates = releasable_segments(&st, |_| true);
        candidates.sort_by_key(|k| std::cmp::Reverse(k.size));
        let mut freed = 0;
        let mut segments = Vec::new();
        for k in candidates {
            if enough.is_some_and(|e| freed >= e) {
                break;
            }
            freed += k.size;
            segments.push(st.release_segment(k.id));
        }
        let st = self.free_segments(st, segments);
        if enough.is_some_and(|e| freed >= e) {
            return st;
        }
        self.release_expandable(st, Unmap::All)
    }

    /// `release_cached_blocks(mempool_id)` for a private pool (`emptyCache(mempool_id)`, what
    /// a `MemPool` does when it goes): the whole free segments of `pool` if nobody holds it,
    /// nothing else, and no event waited for.
    pub(crate) fn release_pool_cached<'a>(&'a self, mut st: Guard<'a>, pool: PoolId) -> Guard<'a> {
        let segments = releasable_segments(&st, |p| p == pool)
            .into_iter()
            .map(|k| st.release_segment(k.id))
            .collect();
        self.free_segments(st, segments)
    }

    /// `release_available_cached_blocks`, with `max_split_size` (M) set, for a request of
    /// rounded `size` in the default pool: the smallest free block of this stream of at
    /// least `max(size, M)` is freed if it is an ordinary one; else this stream's blocks
    /// below that, largest first, while they are oversize, until as many bytes are freed
    /// (expandable ones are passed over). Returns whether enough was freed; what was freed
    /// stays freed either way.
    pub(crate) fn release_oversize<'a>(
        &'a self,
        mut st: Guard<'a>,
        size: u64,
        kind: PoolKind,
        stream: StreamHandle,
    ) -> (Guard<'a>, bool) {
        let Some(m) = st.config.sizes.max_split_size else {
            return (st, false);
        };
        let wanted = size.max(m);
        let Some(list) = st.pools.list(PoolId::DEFAULT, stream.raw, kind) else {
            return (st, false);
        };
        // Only whole segments: a free block over the limit can still be a piece of a
        // segment split under an earlier, larger `max_split_size_mb`, and PyTorch's
        // `release_block` would free the segment under its live neighbours.
        let whole = |id: usize| st.blocks[id].is_whole_segment();
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
        let segments = chosen
            .into_iter()
            .map(|id| st.release_segment(id))
            .collect();
        (self.free_segments(st, segments), enough)
    }

    /// `garbage_collect_cached_blocks`: once more than `garbage_collection_threshold` of
    /// `limit` is reserved, frees whole free segments of the default large pool whose age
    /// (searches of that pool since the block was freed) is at least the average, round
    /// after round, until the excess is reclaimed or a round frees nothing. Expandable
    /// blocks count in the average but are never freed, as in PyTorch.
    pub(crate) fn garbage_collect<'a>(&'a self, mut st: Guard<'a>, limit: u64) -> Guard<'a> {
        let threshold = (st.config.release.garbage_collection_threshold * limit as f64) as u64;
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
        let mut segments = Vec::new();
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
                    segments.push(st.release_segment(id));
                } else {
                    kept.push((id, age));
                }
            }
            candidates = kept;
        }
        self.free_segments(st, segments)
    }

    /// What `Drop` does: waits for outstanding events, ends every private pool's retention,
    /// frees every free segment and page and destroys the spare events.
    pub(crate) fn give_back_everything(&self) {
        let mut st = self.lock();
        st.private.forget_users();
        let mut st = self.release_cached(self.synchronize_events(st), None);
        let mut events = st.order.take_spare();
        events.extend(st.expandable.clock.take_events());
        drop(st);
        for e in events {
            let _ = self.driver.event_destroy(e);
        }
    }
}

/// The whole free segments of the pools `which` picks that may be given back now.
fn releasable_segments(st: &State, which: impl Fn(PoolId) -> bool) -> Vec<FreeKey> {
    st.pools
        .keys()
        .filter(|k| {
            which(k.pool) && st.blocks[k.id].is_whole_segment() && st.private.releasable(k.pool)
        })
        .collect()
}
