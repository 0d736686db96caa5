//! Free blocks of one (pool, stream), ordered by (size, address): PyTorch's best-fit order.
//!
//! Keys pack size and address into one `u128`, so a comparison is a single integer compare.
//! A few dozen free blocks (the common case) live in a sorted vector, where a binary search
//! and a short memmove beat a B-tree's node walk; past [`SPILL`] blocks the list moves into
//! a `BTreeMap`, so huge caches (trace replays) stay logarithmic. It moves back below
//! [`UNSPILL`], with hysteresis so a list at the edge does not flap.
use std::collections::BTreeMap;

const SPILL: usize = 128;
const UNSPILL: usize = 32;

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

#[derive(Debug, Default)]
pub(crate) struct FreeList {
    small: Vec<(u128, usize)>,
    large: Option<BTreeMap<u128, usize>>,
}

/// Entries of a [`FreeList`] in key order, whichever representation holds them (a concrete
/// type, so the best-fit search does not allocate).
pub(crate) enum Entries<'a> {
    Small(std::slice::Iter<'a, (u128, usize)>),
    Large(std::collections::btree_map::Range<'a, u128, usize>),
}

impl Iterator for Entries<'_> {
    type Item = (u128, usize);

    #[inline]
    fn next(&mut self) -> Option<(u128, usize)> {
        match self {
            Entries::Small(it) => it.next().copied(),
            Entries::Large(it) => it.next().map(|(k, id)| (*k, *id)),
        }
    }
}

impl FreeList {
    pub(crate) fn len(&self) -> usize {
        self.large.as_ref().map_or(self.small.len(), BTreeMap::len)
    }

    pub(crate) fn insert(&mut self, k: u128, id: usize) {
        if let Some(map) = self.large.as_mut() {
            map.insert(k, id);
            return;
        }
        let at = self.small.partition_point(|(x, _)| *x < k);
        self.small.insert(at, (k, id));
        if self.small.len() > SPILL {
            self.large = Some(self.small.drain(..).collect());
        }
    }

    pub(crate) fn remove(&mut self, k: u128) -> bool {
        if let Some(map) = self.large.as_mut() {
            let removed = map.remove(&k).is_some();
            if map.len() < UNSPILL {
                self.small = std::mem::take(map).into_iter().collect();
                self.large = None;
            }
            return removed;
        }
        match self.small.binary_search_by(|(x, _)| x.cmp(&k)) {
            Ok(i) => {
                self.small.remove(i);
                true
            }
            Err(_) => false,
        }
    }

    /// Entries with a key of at least `k`, in order.
    #[inline]
    pub(crate) fn range_from(&self, k: u128) -> Entries<'_> {
        match &self.large {
            Some(map) => Entries::Large(map.range(k..)),
            None => {
                let at = self.small.partition_point(|(x, _)| *x < k);
                Entries::Small(self.small[at..].iter())
            }
        }
    }

    pub(crate) fn iter(&self) -> Entries<'_> {
        self.range_from(0)
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
            let k = key(seed >> 52, (seed >> 20) & 0xfff);
            if seed.is_multiple_of(3) && !model.is_empty() {
                let victim = *model
                    .keys()
                    .nth((seed as usize >> 8) % model.len())
                    .unwrap_or(&0);
                assert_eq!(f.remove(victim), model.remove(&victim).is_some());
            } else if let std::collections::btree_map::Entry::Vacant(e) = model.entry(k) {
                e.insert(step);
                f.insert(k, step);
            }
            assert_eq!(f.len(), model.len());
            let probe = key(seed >> 54, 0);
            assert_eq!(
                f.range_from(probe).next(),
                model.range(probe..).next().map(|(k, v)| (*k, *v))
            );
        }
        assert!(
            f.iter()
                .map(|(k, _)| k)
                .collect::<Vec<_>>()
                .windows(2)
                .all(|w| w[0] < w[1])
        );
    }
}
