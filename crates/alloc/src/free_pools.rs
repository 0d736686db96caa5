//! The free pools: free blocks per (memory pool, stream), small and large, ordered by
//! (size, address) as PyTorch's `BlockPool::blocks` set, and the searches over them (best
//! fit, and the oversize rule of `max_split_size_mb`, written once here).
use crate::block::{Blocks, NO_LIST};
use crate::free_list::{Found, FreeList, key, key_size};
use ferrocuda_types::{AllocatorConfig, ExpandableConfig, PoolId, PoolKind, StreamHandle};
use rustc_hash::FxHashMap;

/// A free block as the slow paths see it. The free lists order blocks per stream by
/// (size, address), which with the stream is PyTorch's (stream, size, address) order.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct FreeKey {
    pub(crate) pool: PoolId,
    pub(crate) stream: u64,
    pub(crate) size: u64,
    pub(crate) ptr: u64,
    pub(crate) id: usize,
}

/// PyTorch's oversize rule (`get_free_block`): a request below `max_split_size` never takes
/// a block at or above it, and one above it takes a block at most
/// `max_non_split_rounding` larger. Derived from the configuration when it is put in force
/// (`State::set_config`), so the hot path reads two integers and no `Option`.
#[derive(Copy, Clone, Debug)]
pub(crate) struct OversizeRule {
    /// `max_split_size`, or `u64::MAX` without one (no block is that large).
    pub(crate) max_split: u64,
    max_non_split_rounding: u64,
}

impl OversizeRule {
    pub(crate) fn of(config: &AllocatorConfig) -> OversizeRule {
        OversizeRule {
            max_split: config.sizes.max_split_size.unwrap_or(u64::MAX),
            max_non_split_rounding: config.sizes.max_non_split_rounding,
        }
    }

    /// Whether a free block of `found` bytes is refused to a request of rounded `size`.
    #[inline(always)]
    pub(crate) fn refuses(&self, size: u64, found: u64) -> bool {
        let max_split = self.max_split;
        (size < max_split && found >= max_split)
            || (size >= max_split && found >= size.saturating_add(self.max_non_split_rounding))
    }

    /// Whether a block of `size` bytes is oversize (at or above `max_split_size`).
    #[inline(always)]
    pub(crate) fn is_oversize(&self, size: u64) -> bool {
        size >= self.max_split
    }
}

/// PyTorch's walk past expandable candidates (`get_free_block` with expandable segments):
/// from the `first` candidate (in key order), on to the `next` while the best so far can
/// grow and the next could grow to less. `size_and_growth` gives a candidate's size and
/// the growth best fit counts ([`Blocks::growth`]). Best fit walks the free list; the
/// thread cache's credit check walks the list as a free would leave it.
#[inline(always)]
pub(crate) fn walk<T>(
    first: T,
    mut next: impl FnMut(&T) -> Option<T>,
    size_and_growth: impl Fn(&T) -> (u64, u64),
) -> T {
    let mut best = first;
    let (size, mut growth) = size_and_growth(&best);
    let mut best_to = size + growth;
    while growth > 0 {
        let Some(candidate) = next(&best) else { break };
        let (size, candidate_growth) = size_and_growth(&candidate);
        let to = size + candidate_growth;
        if to >= best_to {
            break;
        }
        (best, best_to, growth) = (candidate, to, candidate_growth);
    }
    best
}

/// Free lists per stream, small and large pool. The last one used is looked at first; the
/// others are found by a hash of (pool, stream), so a request costs the same with 10 or
/// 100 000 streams.
/// Walks over every free block visit only the lists that hold some, so that they cost
/// what they inspect, however many streams hold nothing.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    /// The (pool, stream) of each index.
    streams: Vec<(PoolId, u64)>,
    /// The free lists, small and large, of index `i` at `2 i` and `2 i + 1`: one flat
    /// vector, so that reaching a list is a shift and one bounds check.
    lists: Vec<FreeList>,
    positions: FxHashMap<(PoolId, u64), usize>,
    /// Indices of the non-empty lists, per pool kind (iterated in creation order). A bit
    /// each: a list of a stream that allocates its one block and frees it again turns empty
    /// and back on every pair, where a tree set's insert and removal cost more than the
    /// rest of the request.
    occupied: [ListBits; 2],
    /// The (pool, stream) used last and its index: most requests come from it.
    last_key: (PoolId, u64),
    last: usize,
    /// PyTorch's `get_free_blocks_call_count` of the default large pool, the only pool
    /// whose blocks garbage collection frees: a block's age is this clock's advance since
    /// it was freed.
    pub(crate) gc_clock: u64,
}

/// One bit per free list, grown when a list is made, so that marking one on the hot path
/// is a word's read and write (a general bit set checks its length and grows there, in a
/// call of its own).
#[derive(Debug, Default)]
struct ListBits {
    words: Vec<u64>,
}

impl ListBits {
    /// Room for list `i`'s bit.
    fn make_room(&mut self, i: usize) {
        let words = i / 64 + 1;
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
    }

    #[inline(always)]
    fn set(&mut self, i: usize, on: bool) {
        if let Some(word) = self.words.get_mut(i / 64) {
            let bit = 1u64 << (i % 64);
            *word = (*word & !bit) | (u64::from(on) << (i % 64));
        }
    }

    /// The lists whose bit is set, in index order.
    fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &bits)| {
            std::iter::successors((bits != 0).then_some(bits), |&b| {
                let rest = b & (b - 1);
                (rest != 0).then_some(rest)
            })
            .map(move |b| w * 64 + b.trailing_zeros() as usize)
        })
    }
}

/// Where the `kind` list of index `i` sits in [`Pools::lists`].
#[inline(always)]
fn slot(i: usize, kind: PoolKind) -> usize {
    2 * i + kind.index()
}

impl Pools {
    #[inline(always)]
    fn position(&self, pool: PoolId, stream: u64) -> Option<usize> {
        // (Compared without a branch per field: which stream asks is random.)
        let (last_pool, last_stream) = self.last_key;
        if last_pool.same(pool) & (last_stream == stream) && self.last < self.streams.len() {
            return Some(self.last);
        }
        self.positions.get(&(pool, stream)).copied()
    }

    /// The free list of (`pool`, `stream`, `kind`), if one was ever made.
    #[inline(always)]
    pub(crate) fn list(&self, pool: PoolId, stream: u64, kind: PoolKind) -> Option<&FreeList> {
        let i = self.position(pool, stream)?;
        self.lists.get(slot(i, kind))
    }

    /// The index of the lists of (pool, stream), made if new. Indices never change.
    fn index(&mut self, pool: PoolId, stream: u64) -> u32 {
        let i = match self.position(pool, stream) {
            Some(i) => i,
            None => {
                self.streams.push((pool, stream));
                self.lists
                    .resize_with(self.lists.len() + 2, FreeList::default);
                let i = self.streams.len() - 1;
                self.positions.insert((pool, stream), i);
                self.occupied.iter_mut().for_each(|o| o.make_room(i));
                i
            }
        };
        self.last = i;
        self.last_key = (pool, stream);
        // Few (pool, stream) pairs exist: far fewer than u32::MAX.
        i as u32
    }

    fn at(&mut self, index: u32, kind: PoolKind) -> &mut FreeList {
        &mut self.lists[slot(index as usize, kind)]
    }

    /// Notes that list (`index`, `kind`), which a block just left, may have become empty.
    #[inline(always)]
    fn removed(&mut self, index: u32, kind: PoolKind, left: usize) {
        if left == 0 {
            self.occupied[kind.index()].set(index as usize, false);
        }
    }

    /// Puts free block `id` into its list (`BlockPool::insert_into_blocks`), stamping its
    /// age.
    #[inline(always)]
    pub(crate) fn add(&mut self, blocks: &mut Blocks, id: usize) {
        blocks.set_in_pool(id, true);
        let b = &mut blocks[id];
        b.gc_base = self.gc_clock;
        if b.list == NO_LIST {
            b.list = self.index(b.pool_id, b.stream);
        }
        let (index, kind) = (b.list, b.pool);
        let list = self.at(index, kind);
        list.insert(key(b.size, b.ptr), id);
        if list.len() == 1 {
            self.occupied[kind.index()].set(index as usize, true);
        }
    }

    /// Takes block `id` out of its list.
    #[inline(always)]
    pub(crate) fn remove(&mut self, blocks: &mut Blocks, id: usize) {
        blocks.set_in_pool(id, false);
        let b = &blocks[id];
        let (list, kind) = (b.list, b.pool);
        let list_of = self.at(list, kind);
        list_of.remove(key(b.size, b.ptr));
        let left = list_of.len();
        self.removed(list, kind, left);
    }

    /// The best-fit free block of `stream` for `size` (`get_free_block`'s `lower_bound`),
    /// with expandable blocks judged by what they can grow to: a block at the mapped
    /// frontier could grow by the unmapped range after it, so an interior block that fits
    /// wins over it (with `expandable_segments_reclaim`, only growth into a segment's
    /// unmapped tail counts: [`Blocks::growth`]). With expandable segments switched off,
    /// only ordinary blocks serve.
    #[inline(always)]
    fn best_fit(
        &self,
        blocks: &Blocks,
        at: (PoolId, PoolKind, StreamHandle),
        size: u64,
        expandable: &ExpandableConfig,
    ) -> Option<Found> {
        let (pool, kind, stream) = at;
        let list = self.list(pool, stream.raw, kind)?;
        let first = list.first_from(key(size, 0))?;
        // An ordinary block, or with expandable segments on an expandable one that cannot
        // grow (a mapped block follows it, or its pool's blocks stay inside their pages):
        // every later candidate is at least as large, so none can be preferred.
        let b = &blocks[first.id];
        let page_bound = expandable.small_page_bound && kind == PoolKind::Small;
        if b.segment.is_none() || (expandable.enabled && (!b.before_unmapped || page_bound)) {
            return Some(first);
        }
        if !expandable.enabled {
            return std::iter::successors(list.next_after(&first), |f| list.next_after(f))
                .find(|f| blocks[f.id].segment.is_none());
        }
        // PyTorch's walk: on to the next candidate while the best so far is expandable and
        // the candidate could grow to less. Only a best that can grow (an unmapped range
        // follows it, so it is expandable) goes on: every later candidate is at least the
        // size of one that cannot.
        // Alone in its list, the block before the unmapped tail is the only candidate.
        if list.len() == 1 {
            return Some(first);
        }
        let tail_only = expandable.reclaim;
        Some(walk(
            first,
            |f| list.next_after(f),
            |f| (blocks[f.id].size, blocks.growth(f.id, tail_only)),
        ))
    }

    /// `get_free_block`: best fit on the request's stream under the oversize rule, taken
    /// out of its list. `count_search` ticks the garbage-collection clock.
    #[inline(always)]
    pub(crate) fn take(
        &mut self,
        blocks: &mut Blocks,
        at: (PoolId, PoolKind, StreamHandle),
        size: u64,
        config: &AllocatorConfig,
        oversize: &OversizeRule,
        count_search: bool,
    ) -> Option<usize> {
        self.gc_clock += u64::from(count_search);
        let best = self.best_fit(blocks, at, size, &config.expandable)?;
        if oversize.refuses(size, key_size(best.key)) {
            return None;
        }
        blocks.set_in_pool(best.id, false);
        let b = &blocks[best.id];
        let (list, kind) = (b.list, b.pool);
        let list_of = self.at(list, kind);
        list_of.remove_found(best);
        let left = list_of.len();
        self.removed(list, kind, left);
        Some(best.id)
    }

    /// Every free block of pool `kind`, stream by stream.
    pub(crate) fn keys_of(&self, kind: PoolKind) -> impl Iterator<Item = FreeKey> + '_ {
        self.occupied[kind.index()]
            .iter()
            .map(move |i| (self.streams[i], &self.lists[slot(i, kind)]))
            .flat_map(move |((pool, stream), list)| {
                list.iter().map(move |(k, id)| FreeKey {
                    pool,
                    stream,
                    size: key_size(k),
                    ptr: k as u64,
                    id,
                })
            })
    }

    /// Every free block.
    pub(crate) fn keys(&self) -> impl Iterator<Item = FreeKey> + '_ {
        self.keys_of(PoolKind::Small)
            .chain(self.keys_of(PoolKind::Large))
    }

    /// How many free blocks the lists hold.
    pub(crate) fn len(&self) -> usize {
        self.lists.iter().map(FreeList::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::ListBits;
    use std::collections::BTreeSet;

    /// Bits set and cleared at random over several words, made room for as lists are,
    /// list in index order what a `BTreeSet` holds.
    #[test]
    fn list_bits_follow_a_model_set() {
        let (mut bits, mut model) = (ListBits::default(), BTreeSet::new());
        let mut made = 0;
        let mut seed = 9u64;
        for _ in 0..5000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if made < 300 && seed.is_multiple_of(5) {
                bits.make_room(made);
                made += 1;
            }
            if made == 0 {
                continue;
            }
            let i = (seed >> 33) as usize % made;
            let on = (seed >> 20).is_multiple_of(2);
            bits.set(i, on);
            if on {
                model.insert(i);
            } else {
                model.remove(&i);
            }
            assert_eq!(
                bits.iter().collect::<Vec<_>>(),
                model.iter().copied().collect::<Vec<_>>()
            );
        }
        assert!(made > 200 && model.len() > 50, "several words in use");
    }
}
