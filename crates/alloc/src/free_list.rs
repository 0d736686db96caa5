//! Free blocks of one (pool, stream), ordered by (size, address): PyTorch's best-fit order.
//!
//! Keys pack size and address into one `u128`, so a comparison is a single integer compare.
//! Blocks are binned by size, four bins per power of two (bins follow size order, so walking
//! them in order walks the keys in order), with a bitmap of the non-empty bins: an insert or
//! removal touches one short bin, and a search skips empty bins with a bit scan. A bin is a
//! vector sorted in descending order (the best fit is usually its last entry), where a short
//! search and move beat a B-tree's node walk; past
//! [`SPILL`] blocks it moves into a `BTreeMap`, so huge caches (trace replays) stay
//! logarithmic. It moves back below [`UNSPILL`], with hysteresis so a bin at the edge does
//! not flap.
use std::collections::BTreeMap;

const SPILL: usize = 128;
/// Below this length a bin takes a new entry by stepping it down from the end.
const SHORT: usize = 16;
const UNSPILL: usize = 32;
/// Bins: four per power of two from 512 bytes up to 2^63 (bin 0 stays empty).
const BINS: usize = 1 + 4 * 55;

/// The key of a free block: size in the high half, address in the low half.
#[inline]
pub(crate) fn key(size: u64, ptr: u64) -> u128 {
    (u128::from(size) << 64) | u128::from(ptr)
}

/// The size part of a key.
#[inline]
pub(crate) fn key_size(k: u128) -> u64 {
    (k >> 64) as u64
}

/// The bin of a size: non-decreasing in the size. Sizes below 512 (search bounds only:
/// every block is at least that) share 512's bin, so no branch is needed.
#[inline]
fn bin(size: u64) -> usize {
    let size = size.max(512);
    let log = 63 - size.leading_zeros() as usize;
    let quarter = ((size >> (log - 2)) & 3) as usize;
    1 + (log - 9) * 4 + quarter
}

/// Free blocks of one (pool, stream).
#[derive(Debug)]
pub(crate) struct FreeList {
    /// A fixed-size array: bin indices are provably in range, so reaching one needs no
    /// bounds check. Held in place, not boxed: a bin's header is then one load from the
    /// list, not two dependent ones.
    bins: [Bin; BINS],
    /// Bit `i` set: bin `i` is not empty.
    occupied: [u64; BINS.div_ceil(64)],
    len: usize,
}

impl Default for FreeList {
    fn default() -> Self {
        FreeList {
            bins: std::array::from_fn(|_| Bin::default()),
            occupied: [0; BINS.div_ceil(64)],
            len: 0,
        }
    }
}

/// A free block a search found, with where it sits, so that taking it needs no second
/// search.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Found {
    pub key: u128,
    pub id: usize,
    bin: usize,
    /// Its index in its bin's vector (`None`: look it up by key).
    index: Option<usize>,
}

/// Entries of a [`FreeList`] with a key of at least a bound, in key order.
pub(crate) struct Entries<'a> {
    list: &'a FreeList,
    bin: usize,
    inner: BinEntries<'a>,
}

impl Iterator for Entries<'_> {
    type Item = (u128, usize);

    #[inline]
    fn next(&mut self) -> Option<(u128, usize)> {
        loop {
            if let Some(entry) = self.inner.next() {
                return Some(entry);
            }
            self.bin = self.list.next_occupied(self.bin + 1)?;
            self.inner = self.list.bins[self.bin].range_from(0);
        }
    }
}

impl FreeList {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The first non-empty bin at or after `from`.
    #[inline]
    fn next_occupied(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        let mut bits = *self.occupied.get(word)? & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            bits = *self.occupied.get(word)?;
        }
    }

    #[inline(always)]
    pub(crate) fn insert(&mut self, k: u128, id: usize) {
        let b = bin(key_size(k));
        self.bins[b].insert(k, id);
        self.occupied[b / 64] |= 1 << (b % 64);
        self.len += 1;
    }

    pub(crate) fn remove(&mut self, k: u128) -> bool {
        let b = bin(key_size(k));
        let removed = self.bins[b].remove(k);
        if removed {
            self.removed_from(b);
        }
        removed
    }

    /// Takes out what [`first_from`](Self::first_from) found, the list unchanged since.
    #[inline(always)]
    pub(crate) fn remove_found(&mut self, f: Found) {
        match f.index {
            Some(i) => {
                let small = &mut self.bins[f.bin].small;
                // The best fit is usually the last (smallest) entry.
                if i + 1 == small.len() {
                    small.pop();
                } else {
                    small.remove(i);
                }
                // (A bin found with an index is a vector: its emptiness is the vector's.)
                let emptied = small.is_empty();
                self.len -= 1;
                self.clear_if_emptied(f.bin, emptied);
            }
            None => {
                self.remove(f.key);
            }
        }
    }

    #[inline(always)]
    fn removed_from(&mut self, b: usize) {
        self.len -= 1;
        let emptied = self.bins[b].len() == 0;
        self.clear_if_emptied(b, emptied);
    }

    /// Clears bin `b`'s bit if it `emptied`, without a branch (which bin empties is random).
    #[inline(always)]
    fn clear_if_emptied(&mut self, b: usize, emptied: bool) {
        self.occupied[b / 64] &= !(u64::from(emptied) << (b % 64));
    }

    /// The entry with the smallest key of at least `k`.
    #[inline(always)]
    pub(crate) fn first_from(&self, k: u128) -> Option<Found> {
        let (mut b, mut bound) = (bin(key_size(k)), k);
        loop {
            if let Some((key, id, index)) = self.bins[b].first_from(bound) {
                return Some(Found {
                    key,
                    id,
                    bin: b,
                    index,
                });
            }
            b = self.next_occupied(b + 1)?;
            bound = 0;
        }
    }

    /// Entries with a key of at least `k`, in order.
    #[inline]
    pub(crate) fn range_from(&self, k: u128) -> Entries<'_> {
        let b = bin(key_size(k));
        Entries {
            list: self,
            bin: b,
            inner: self.bins[b].range_from(k),
        }
    }

    /// The entry right after `found` in key order (`found` by [`first_from`](Self::first_from)
    /// or by this, the list unchanged since), with where it sits: best fit's walk over the
    /// candidates after an expandable block takes one step at a time, and usually none or
    /// one, so it needs no iterator.
    #[inline]
    pub(crate) fn next_after(&self, found: &Found) -> Option<Found> {
        let bin = &self.bins[found.bin];
        let in_bin = match (found.index, &bin.large) {
            // A short bin is in descending order: the next key is the entry before.
            (Some(i), None) => i
                .checked_sub(1)
                .and_then(|j| bin.small.get(j).map(|&(key, id)| (key, id, Some(j)))),
            _ => bin.first_from(found.key.checked_add(1)?),
        };
        let (b, (key, id, index)) = match in_bin {
            Some(entry) => (found.bin, entry),
            None => {
                let b = self.next_occupied(found.bin + 1)?;
                (b, self.bins[b].first_from(0)?)
            }
        };
        Some(Found {
            key,
            id,
            bin: b,
            index,
        })
    }

    pub(crate) fn iter(&self) -> Entries<'_> {
        self.range_from(0)
    }
}

/// One bin: a vector sorted in descending order (the best fit, the smallest key, is usually
/// the last entry, taken without moving the others), or a B-tree when long.
#[derive(Debug, Default)]
struct Bin {
    small: Vec<(u128, usize)>,
    /// Boxed: a bin is then 32 bytes, and no bin header straddles two cache lines (one at
    /// 48 bytes in two did, and a search reads headers at random).
    #[expect(
        clippy::box_collection,
        reason = "the box is what keeps the header at 32 bytes"
    )]
    large: Option<Box<BTreeMap<u128, usize>>>,
}

/// Entries of a [`Bin`] in key order, whichever representation holds them (a concrete
/// type, so the best-fit search does not allocate).
enum BinEntries<'a> {
    Small(std::iter::Rev<std::slice::Iter<'a, (u128, usize)>>),
    Large(std::collections::btree_map::Range<'a, u128, usize>),
}

impl Iterator for BinEntries<'_> {
    type Item = (u128, usize);

    #[inline]
    fn next(&mut self) -> Option<(u128, usize)> {
        match self {
            BinEntries::Small(it) => it.next().copied(),
            BinEntries::Large(it) => it.next().map(|(k, id)| (*k, *id)),
        }
    }
}

impl Bin {
    fn len(&self) -> usize {
        self.large
            .as_ref()
            .map_or(self.small.len(), |map| map.len())
    }

    /// Inlined into the free paths for a short bin (the usual case); a long or spilled bin
    /// takes [`Bin::insert_long`].
    #[inline(always)]
    fn insert(&mut self, k: u128, id: usize) {
        if self.large.is_some() || self.small.len() >= SHORT {
            return self.insert_long(k, id);
        }
        // Bins are mostly a handful long: shift the smaller entries up one and drop the new
        // entry into the gap (no binary search, no memmove call).
        self.small.push((k, id));
        let entries = self.small.as_mut_slice();
        let mut i = entries.len() - 1;
        while i > 0 && entries[i - 1].0 < k {
            entries[i] = entries[i - 1];
            i -= 1;
        }
        entries[i] = (k, id);
    }

    #[inline(never)]
    fn insert_long(&mut self, k: u128, id: usize) {
        if let Some(map) = self.large.as_mut() {
            map.insert(k, id);
            return;
        }
        let at = self.small.partition_point(|(x, _)| *x > k);
        self.small.insert(at, (k, id));
        if self.small.len() > SPILL {
            self.large = Some(Box::new(self.small.drain(..).collect()));
        }
    }

    /// Inlined for a short bin, as [`Bin::insert`]: a merge takes its neighbour out of a
    /// bin of a handful of entries.
    #[inline(always)]
    fn remove(&mut self, k: u128) -> bool {
        if self.large.is_some() || self.small.len() > SHORT {
            return self.remove_long(k);
        }
        // From the end (the smallest keys): the last entry is taken out and carried toward
        // the front, each entry it passes moving one place back, until the one in hand is
        // `k`. No binary search, no memmove call.
        let Some(mut carried) = self.small.pop() else {
            return false;
        };
        let mut i = self.small.len();
        while carried.0 != k {
            if i == 0 {
                // Not here: every entry has moved one place back and the first is in
                // hand; it goes back in front.
                self.small.insert(0, carried);
                return false;
            }
            i -= 1;
            std::mem::swap(&mut self.small[i], &mut carried);
        }
        true
    }

    #[inline(never)]
    fn remove_long(&mut self, k: u128) -> bool {
        if let Some(map) = self.large.as_mut() {
            let removed = map.remove(&k).is_some();
            if map.len() < UNSPILL {
                self.small = std::mem::take(map).into_iter().rev().collect();
                self.large = None;
            }
            return removed;
        }
        match self.small.binary_search_by(|(x, _)| k.cmp(x)) {
            Ok(i) => {
                self.small.remove(i);
                true
            }
            Err(_) => false,
        }
    }

    /// The smallest entry with a key of at least `k`, with its index in the vector.
    #[inline]
    fn first_from(&self, k: u128) -> Option<(u128, usize, Option<usize>)> {
        match &self.large {
            Some(map) => map.range(k..).next().map(|(k, id)| (*k, *id, None)),
            None => {
                // The smallest entry (the last) fits whenever `k` is the bin's lower bound.
                let last = self.small.len().checked_sub(1)?;
                let at = if self.small[last].0 >= k {
                    last
                } else {
                    self.small
                        .partition_point(|(x, _)| *x >= k)
                        .checked_sub(1)?
                };
                let (key, id) = self.small[at];
                Some((key, id, Some(at)))
            }
        }
    }

    /// Entries with a key of at least `k`, in order.
    #[inline]
    fn range_from(&self, k: u128) -> BinEntries<'_> {
        match &self.large {
            Some(map) => BinEntries::Large(map.range(k..)),
            None => {
                let at = self.small.partition_point(|(x, _)| *x >= k);
                BinEntries::Small(self.small[..at].iter().rev())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_in_both_representations() {
        let mut f = FreeList::default();
        let mut model = BTreeMap::new();
        let mut seed = 7u64;
        for step in 0..5000usize {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Sizes below 512 crowd one bin (past the spill); the others spread over many.
            let size = if seed.is_multiple_of(2) {
                seed >> 56
            } else {
                (seed >> 30) & ((1 << 34) - 1)
            };
            let k = key(size, (seed >> 20) & 0xfff);
            let probe = key((seed >> 31) & ((1 << 34) - 1), 0);
            if seed.is_multiple_of(3) && !model.is_empty() {
                let victim = *model
                    .keys()
                    .nth((seed as usize >> 8) % model.len())
                    .unwrap_or(&0);
                assert_eq!(f.remove(victim), model.remove(&victim).is_some());
            } else if seed.is_multiple_of(5) {
                // The best-fit way: find the first at or after a bound, take it out.
                let found = f.first_from(probe);
                let want = model.range(probe..).next().map(|(k, v)| (*k, *v));
                assert_eq!(found.map(|x| (x.key, x.id)), want);
                if let Some(x) = &found {
                    // Three steps of `next_after`, as best fit walks.
                    let steps: Vec<(u128, usize)> =
                        std::iter::successors(f.next_after(x), |y| f.next_after(y))
                            .take(3)
                            .map(|y| (y.key, y.id))
                            .collect();
                    assert_eq!(
                        steps,
                        model
                            .range(x.key + 1..)
                            .take(3)
                            .map(|(k, v)| (*k, *v))
                            .collect::<Vec<_>>()
                    );
                }
                if let Some(x) = found {
                    f.remove_found(x);
                    model.remove(&x.key);
                }
            } else if let std::collections::btree_map::Entry::Vacant(e) = model.entry(k) {
                e.insert(step);
                f.insert(k, step);
            }
            assert_eq!(f.len(), model.len());
            assert_eq!(
                f.range_from(probe).take(3).collect::<Vec<_>>(),
                model
                    .range(probe..)
                    .take(3)
                    .map(|(k, v)| (*k, *v))
                    .collect::<Vec<_>>()
            );
        }
        assert!(f.bins[1].large.is_some(), "the crowded bin spilled");
        assert_eq!(
            f.iter().collect::<Vec<_>>(),
            model.into_iter().collect::<Vec<_>>()
        );
    }

    /// A short bin gives up any one of its entries, wherever it sits, and keeps the others
    /// in order; a key it does not hold (below, between or above its keys) is refused and
    /// leaves it as it was.
    #[test]
    fn a_short_bin_removes_from_any_place_and_refuses_absent_keys() {
        let keys: Vec<u128> = (1..=5).map(|i| key(4096, i * 1024)).collect();
        let filled = || {
            let mut b = Bin::default();
            for (id, &k) in keys.iter().enumerate() {
                b.insert(k, id);
            }
            b
        };
        let entries = |b: &Bin| b.range_from(0).collect::<Vec<_>>();
        let all: Vec<(u128, usize)> = keys.iter().copied().zip(0..).collect();
        for (id, &k) in keys.iter().enumerate() {
            let mut b = filled();
            assert!(b.remove(k));
            let rest: Vec<_> = all.iter().copied().filter(|&(_, i)| i != id).collect();
            assert_eq!(entries(&b), rest);
        }
        for absent in [key(4096, 0), key(4096, 1536), key(4096, 9 * 1024)] {
            let mut b = filled();
            assert!(!b.remove(absent));
            assert_eq!(entries(&b), all);
        }
        assert!(!Bin::default().remove(keys[0]));
    }
}
