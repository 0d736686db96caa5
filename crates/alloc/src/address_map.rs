//! Where a block is found by its address: `free(ptr)`'s lookup, and the map that splitting
//! and merging keep.
//!
//! A hash table of 4-byte slab indices whose keys live in the blocks themselves (each
//! entry is hashed by its block's `ptr`). A lookup by address compares the candidate's
//! record, which the caller reads next anyway; a table a quarter the size of one holding
//! (address, index) pairs keeps more of it in the nearest caches. Changes name the block
//! they concern, so no address is compared: removal finds the entry holding that index,
//! and a split's new piece, whose address lies inside the block it was cut from, is
//! inserted without searching for it first.
//!
//! The table knows no block type: the caller passes how an index's address is read
//! (`address(id)`, the record's `ptr`). The invariant it relies on, kept by
//! [`Blocks`](crate::block::Blocks), the only writer of a block's `ptr`: every entry names a
//! live block and was hashed by that block's current address (a block's address changes
//! only while it is out of the table).
use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;
use std::hash::BuildHasher;

#[derive(Debug, Default)]
pub(crate) struct AddressMap {
    table: HashTable<u32>,
}

#[inline(always)]
fn hash(ptr: u64) -> u64 {
    FxBuildHasher.hash_one(ptr)
}

/// Block indices stay far below `u32::MAX` (that many blocks would take 512 GiB).
#[inline(always)]
fn entry(id: usize) -> u32 {
    id as u32
}

impl AddressMap {
    /// The index entered under `ptr`, if any.
    #[inline(always)]
    pub(crate) fn get(&self, ptr: u64, address: impl Fn(usize) -> u64) -> Option<usize> {
        self.table
            .find(hash(ptr), |&e| address(e as usize) == ptr)
            .map(|&e| e as usize)
    }

    /// Enters `id` under its address `address(id)`, which no other entry holds.
    #[inline(always)]
    pub(crate) fn insert_new(&mut self, id: usize, address: impl Fn(usize) -> u64) {
        self.table
            .insert_unique(hash(address(id)), entry(id), |&e| hash(address(e as usize)));
    }

    /// Enters `id` under its address, taking the entry of an index that had the same
    /// address, if one does.
    pub(crate) fn insert(&mut self, id: usize, address: impl Fn(usize) -> u64) {
        let ptr = address(id);
        match self
            .table
            .find_mut(hash(ptr), |&e| address(e as usize) == ptr)
        {
            Some(e) => *e = entry(id),
            None => self.insert_new(id, address),
        }
    }

    /// Removes `id`'s entry under `ptr` (its address when it was entered). Whether there
    /// was one.
    #[inline(always)]
    pub(crate) fn remove(&mut self, ptr: u64, id: usize) -> bool {
        match self.table.find_entry(hash(ptr), |&e| e == entry(id)) {
            Ok(found) => {
                found.remove();
                true
            }
            Err(_) => false,
        }
    }

    /// Hands `ptr`'s entry from index `from` to `to` (which now starts there).
    pub(crate) fn hand_over(&mut self, ptr: u64, from: usize, to: usize) {
        if let Some(e) = self.table.find_mut(hash(ptr), |&e| e == entry(from)) {
            *e = entry(to);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// The indices of every entry.
    pub(crate) fn ids(&self) -> impl Iterator<Item = usize> + '_ {
        self.table.iter().map(|&e| e as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Random additions, removals, address hand-overs (a split's front piece) and
    /// replacements, through several growths of the table, answer every lookup as a
    /// `BTreeMap` from address to index does. `addresses[id]` plays the block records.
    #[test]
    fn lookups_follow_a_model_map() {
        let (mut map, mut addresses, mut model) =
            (AddressMap::default(), Vec::<u64>::new(), BTreeMap::new());
        let mut seed = 3u64;
        for step in 0..20_000u64 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Addresses from a small range, so that lookups often hit and sometimes miss.
            let ptr = ((seed >> 33) % 4096) * 512;
            let live: Vec<(u64, usize)> = model.iter().map(|(&p, &i)| (p, i)).collect();
            let pick = live.get((seed >> 20) as usize % live.len().max(1)).copied();
            match (seed >> 60, pick) {
                (0..=7, _) if !model.contains_key(&ptr) => {
                    addresses.push(ptr);
                    let id = addresses.len() - 1;
                    map.insert_new(id, |i| addresses[i]);
                    model.insert(ptr, id);
                }
                (8..=11, Some((p, id))) => {
                    assert!(map.remove(p, id));
                    assert!(!map.remove(p, id), "removed twice");
                    model.remove(&p);
                }
                (12 | 13, Some((p, id))) if !model.contains_key(&(p + 256)) => {
                    // A front piece takes the address; the block moves on by 256 bytes.
                    addresses.push(p);
                    let front = addresses.len() - 1;
                    map.hand_over(p, id, front);
                    addresses[id] = p + 256;
                    map.insert_new(id, |i| addresses[i]);
                    model.insert(p, front);
                    model.insert(p + 256, id);
                }
                (14 | 15, Some((p, _))) => {
                    // A new block at a taken address takes its entry.
                    addresses.push(p);
                    let id = addresses.len() - 1;
                    map.insert(id, |i| addresses[i]);
                    model.insert(p, id);
                }
                _ => {}
            }
            assert_eq!(
                map.get(ptr, |i| addresses[i]),
                model.get(&ptr).copied(),
                "step {step}"
            );
            assert_eq!(map.len(), model.len());
        }
        let mut ids: Vec<usize> = map.ids().collect();
        ids.sort_unstable();
        let mut want: Vec<usize> = model.values().copied().collect();
        want.sort_unstable();
        assert_eq!(ids, want);
        assert!(model.len() > 1000, "the table grew through several sizes");
    }
}
