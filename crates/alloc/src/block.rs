//! Block records: every piece of device memory the allocator knows, in a slab with 32-bit
//! neighbour links, found by address. Splitting a block and merging neighbours happen
//! here; which list a free block sits in is the free pools' business (`free_pools`).
use crate::address_map::AddressMap;
use ferrocuda_types::{DevicePtr, Frame, PoolId, PoolKind, StreamHandle};
use std::sync::Arc;

/// A live allocation handed out by [`CachingAllocator::allocate`](crate::CachingAllocator::allocate).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Its address (null for a zero-byte request).
    pub ptr: DevicePtr,
    /// Bytes usable (the rounded size).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// The stream it was allocated on.
    pub stream: StreamHandle,
}

/// A block of the allocator as tests and snapshots see it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Address.
    pub ptr: DevicePtr,
    /// Size in bytes.
    pub size: u64,
    /// Requested bytes (allocated blocks).
    pub requested: u64,
    /// Pool.
    pub pool: PoolKind,
    /// Allocated to a user.
    pub allocated: bool,
    /// Freed but waiting for events on other streams.
    pub pending_events: bool,
    /// Address of the segment it was carved from.
    pub segment: DevicePtr,
    /// Its allocation stream.
    pub stream: StreamHandle,
    /// Backed by device memory (false only for unmapped ranges of expandable segments).
    pub mapped: bool,
    /// Part of an expandable segment.
    pub expandable: bool,
    /// The pool it belongs to.
    pub pool_id: PoolId,
}

/// Slab slots added at a time.
const SLAB_CHUNK: usize = 64;

/// A block whose free lists were not looked up yet.
pub(crate) const NO_LIST: u32 = u32::MAX;

/// A block index, or none: an `Option<usize>` in four bytes, so that a block's hot fields
/// fit one cache line.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Link(u32);

impl Link {
    pub(crate) const NONE: Link = Link(u32::MAX);

    #[inline]
    pub(crate) fn get(self) -> Option<usize> {
        (self != Link::NONE).then_some(self.0 as usize)
    }

    pub(crate) fn is_some(self) -> bool {
        self != Link::NONE
    }

    pub(crate) fn is_none(self) -> bool {
        self == Link::NONE
    }
}

impl From<Option<usize>> for Link {
    #[inline]
    fn from(id: Option<usize>) -> Link {
        // Block indices stay far below u32::MAX (that many blocks would take 512 GiB).
        id.map_or(Link::NONE, |i| Link(i as u32))
    }
}

/// A block of device memory. What allocation and free touch comes first and fills one
/// cache line (the type is aligned to it); the rest, used by streams, events, history and
/// expandable segments, lies in the next line, so a churn of blocks keeps only the first
/// lines in the processor's nearest cache.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub(crate) struct Block {
    pub(crate) ptr: u64,
    pub(crate) size: u64,
    pub(crate) requested: u64,
    pub(crate) gc_base: u64,
    /// The stream's raw handle (its device is the allocator's).
    pub(crate) stream: u64,
    pub(crate) prev: Link,
    pub(crate) next: Link,
    /// The expandable segment it belongs to, if any.
    pub(crate) segment: Link,
    /// Its free lists' index in the free pools ([`NO_LIST`] until first looked up); a
    /// block's pool and stream, and so this index, change only with `cross_stream_reuse`.
    pub(crate) list: u32,
    pub(crate) pool: PoolKind,
    pub(crate) allocated: bool,
    /// Counted in `oversize_allocations` when handed out (the limit may change later).
    pub(crate) oversize: bool,
    /// The slab slot is free.
    pub(crate) vacant: bool,
    /// `stream_uses` is not empty.
    pub(crate) has_uses: bool,
    /// `frames` is set.
    pub(crate) has_frames: bool,
    /// The next block is an unmapped range (this one, if expandable and free, could grow
    /// into it): best fit asks it of every expandable candidate, and the answer lies in
    /// the candidate's own first line instead of its neighbour's record. Kept by
    /// [`Blocks`] wherever links or `mapped` change.
    pub(crate) before_unmapped: bool,
    // ---- the second cache line ----
    pub(crate) event_count: u32,
    /// Backed by device memory (always, except unmapped ranges of expandable segments).
    /// Written through [`Blocks::set_mapped`], which keeps the neighbour's
    /// `before_unmapped`.
    pub(crate) mapped: bool,
    /// Taken out of the free or unmapped sets while the driver works on it, unlocked.
    pub(crate) busy: bool,
    pub(crate) stream_uses: Vec<StreamHandle>,
    /// Where it was allocated, when history records stacks.
    pub(crate) frames: Option<Arc<[Frame]>>,
    /// The memory pool (default, or a graph's private pool).
    pub(crate) pool_id: PoolId,
}

// The hot fields fill the first cache line exactly; the cold ones the second.
const _: () = assert!(std::mem::offset_of!(Block, event_count) == 64);
const _: () = assert!(std::mem::size_of::<Block>() == 128);

/// What a new free block is made of: the rest of its record starts empty.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Piece {
    pub(crate) ptr: u64,
    pub(crate) size: u64,
    /// The stream's raw handle.
    pub(crate) stream: u64,
    pub(crate) pool: PoolKind,
    pub(crate) mapped: bool,
    /// The expandable segment it lies in, if any.
    pub(crate) segment: Link,
    pub(crate) pool_id: PoolId,
}

impl Block {
    /// A free, unlinked block (not yet in any free list).
    pub(crate) fn new(piece: Piece) -> Block {
        let mut b = Block::vacant();
        b.reset(piece);
        b
    }

    /// Makes this record what [`Block::new`] gives, field by field: a split writes its new
    /// piece into a vacant slot this way, where building a record and moving it in costs
    /// a copy of both lines and the old record's drop.
    #[inline(always)]
    pub(crate) fn reset(&mut self, piece: Piece) {
        let Piece {
            ptr,
            size,
            stream,
            pool,
            mapped,
            segment,
            pool_id,
        } = piece;
        self.ptr = ptr;
        self.size = size;
        self.requested = 0;
        self.gc_base = 0;
        self.stream = stream;
        self.prev = Link::NONE;
        self.next = Link::NONE;
        self.segment = segment;
        self.list = NO_LIST;
        self.pool = pool;
        self.allocated = false;
        self.oversize = false;
        self.vacant = false;
        self.has_uses = false;
        self.has_frames = false;
        self.before_unmapped = false;
        self.event_count = 0;
        self.mapped = mapped;
        self.busy = false;
        // (Emptied, its capacity kept for the slot's next use.)
        self.stream_uses.clear();
        self.frames = None;
        self.pool_id = pool_id;
    }

    /// An unused slab slot.
    fn vacant() -> Block {
        Block {
            ptr: 0,
            size: 0,
            requested: 0,
            gc_base: 0,
            stream: 0,
            prev: Link::NONE,
            next: Link::NONE,
            segment: Link::NONE,
            list: NO_LIST,
            pool: PoolKind::Small,
            allocated: false,
            oversize: false,
            vacant: true,
            has_uses: false,
            has_frames: false,
            before_unmapped: false,
            event_count: 0,
            mapped: false,
            busy: false,
            stream_uses: Vec::new(),
            frames: None,
            pool_id: PoolId::DEFAULT,
        }
    }

    pub(crate) fn is_split(&self) -> bool {
        self.prev.is_some() | self.next.is_some()
    }

    /// A whole ordinary segment (not split, not expandable): what `cudaFree` can take back.
    pub(crate) fn is_whole_segment(&self) -> bool {
        self.segment.is_none() && !self.is_split()
    }
}

/// Entries of [`Blocks`]' table of recent frees (a power of two).
const RECENT: usize = 4096;

/// The entry of [`Blocks`]' table of recent frees for an address (a multiplicative hash:
/// the table's bits from the top of the product).
#[inline(always)]
fn recent_entry(ptr: u64) -> usize {
    (ptr.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - RECENT.trailing_zeros())) as usize
}

/// Every block, by index (a slab: indices stay valid while a block lives) and by address.
/// Reads go through the slice (`blocks[id]`, `blocks.iter()`).
#[derive(Debug)]
pub(crate) struct Blocks {
    slab: Vec<Block>,
    vacant: Vec<usize>,
    /// Every block by address (allocated or not): an allocation that takes a whole free
    /// block, or a free that merges nothing, changes nothing here.
    by_addr: AddressMap,
    /// `free`'s first guess: per entry, the block last freed at an address hashing to it
    /// (a block is mostly reused whole, at the same address, by the same record). A guess
    /// is taken only if that record is allocated at that very address, which one block at
    /// most is; otherwise (overwritten, vacated, split, not allocated) the address map
    /// answers, and its answer becomes the entry. A hit saves the hash table's probe.
    /// Written on a miss only (four frees in five hit in the mixed churn), not on every
    /// allocation (19 in 20): with threads contending, an entry written per allocation
    /// moves its cache line to each lock holder's core (8-thread pairs ran 4-8% slower on
    /// an H200 host in one A/B). Entries hold the low 16 bits of a block's index: half the
    /// table's cache footprint, and a truncated index past 65 535 is only a wrong guess,
    /// which the check turns away.
    recent: Box<[u16; RECENT]>,
    /// Per slab slot, whether the block is in a free list, kept beside the records rather
    /// than in them: a free asks it of both neighbours ([`Blocks::mergeable`]), and a dense
    /// byte per block stays in the nearest cache where the neighbours' records (a line
    /// each, at random) mostly do not; the records are then read only for the one merge
    /// in ten that happens (a mixed churn's first-level data misses fell from 3.1 to 2.4
    /// per operation).
    in_pool: Vec<bool>,
}

impl Default for Blocks {
    fn default() -> Blocks {
        Blocks {
            slab: Vec::new(),
            vacant: Vec::new(),
            by_addr: AddressMap::default(),
            recent: Box::new([u16::MAX; RECENT]),
            in_pool: Vec::new(),
        }
    }
}

impl std::ops::Deref for Blocks {
    type Target = [Block];
    fn deref(&self) -> &[Block] {
        &self.slab
    }
}

impl std::ops::DerefMut for Blocks {
    fn deref_mut(&mut self) -> &mut [Block] {
        &mut self.slab
    }
}

impl Blocks {
    /// Stores `b`, returning its index; its address now names it.
    pub(crate) fn insert(&mut self, b: Block) -> usize {
        let id = self.vacant_slot();
        self.in_pool[id] = false;
        self.slab[id] = b;
        let slab = &self.slab;
        self.by_addr.insert(id, |i| slab[i].ptr);
        id
    }

    /// A vacant slot's index (the slab grows when none is left).
    #[inline(always)]
    fn vacant_slot(&mut self) -> usize {
        match self.vacant.pop() {
            Some(id) => id,
            None => {
                // Slots are added in chunks, so that a split rarely finds none spare (which
                // splits do is random to the branch predictor).
                let first = self.slab.len();
                self.slab.resize_with(first + SLAB_CHUNK, Block::vacant);
                self.in_pool.resize(first + SLAB_CHUNK, false);
                self.vacant.extend((first + 1..first + SLAB_CHUNK).rev());
                first
            }
        }
    }

    /// Forgets block `id` (its address too, unless a block that absorbed it owns it now).
    pub(crate) fn vacate(&mut self, id: usize) {
        self.by_addr.remove(self.slab[id].ptr, id);
        self.vacate_record(id);
    }

    /// Frees a block's slab slot (its address is no longer mapped to it).
    fn vacate_record(&mut self, id: usize) {
        self.slab[id].vacant = true;
        self.vacant.push(id);
    }

    /// The block at `ptr`, if any.
    pub(crate) fn at(&self, ptr: u64) -> Option<usize> {
        self.by_addr.get(ptr, |i| self.slab[i].ptr)
    }

    /// The allocated block at `ptr`, if any.
    pub(crate) fn allocated_at(&self, ptr: u64) -> Option<usize> {
        self.by_addr
            .get(ptr, |i| self.slab[i].ptr)
            .filter(|&id| self.slab[id].allocated)
    }

    /// [`allocated_at`](Self::allocated_at) for `free`: the table of recent frees asked
    /// first, and told the answer when it guessed wrong.
    #[inline(always)]
    pub(crate) fn allocated_at_to_free(&mut self, ptr: u64) -> Option<usize> {
        let entry = recent_entry(ptr);
        let guess = self.recent[entry] as usize;
        if let Some(b) = self.slab.get(guess)
            && b.ptr == ptr
            && b.allocated
            && !b.vacant
        {
            return Some(guess);
        }
        let id = self.allocated_at(ptr)?;
        // (Truncated past 65 535: see `recent`.)
        self.recent[entry] = id as u16;
        Some(id)
    }

    /// A new free block over `size` bytes at `offset` into block `of`, in a vacant slot,
    /// of the same stream, pools, segment and mapping; unlinked and out of the address map.
    #[inline(always)]
    fn piece_of(&mut self, of: usize, offset: u64, size: u64) -> usize {
        let new = self.vacant_slot();
        let b = &self.slab[of];
        let (list, piece) = (
            b.list,
            Piece {
                ptr: b.ptr + offset,
                size,
                stream: b.stream,
                pool: b.pool,
                mapped: b.mapped,
                segment: b.segment,
                pool_id: b.pool_id,
            },
        );
        let record = &mut self.slab[new];
        record.reset(piece);
        record.list = list;
        self.in_pool[new] = false;
        new
    }

    /// Cuts the first `bytes` of block `id` off into a new block, which it returns.
    pub(crate) fn split_front(&mut self, id: usize, bytes: u64) -> usize {
        let new = self.piece_of(id, 0, bytes);
        let b = &self.slab[id];
        let (prev, mapped) = (b.prev, b.mapped);
        let front = &mut self.slab[new];
        front.prev = prev;
        front.next = Link::from(Some(id));
        front.before_unmapped = !mapped;
        if let Some(p) = prev.get() {
            self.slab[p].next = Link::from(Some(new));
        }
        let b = &mut self.slab[id];
        // The front piece takes the address; the rest enters the map under its new one.
        self.by_addr.hand_over(b.ptr, id, new);
        b.ptr += bytes;
        b.size -= bytes;
        b.prev = Link::from(Some(new));
        let slab = &self.slab;
        self.by_addr.insert_new(id, |i| slab[i].ptr);
        new
    }

    /// Cuts block `id` to its first `bytes`; the rest becomes a new block, which it returns.
    /// Only the new block's address is added to the address map, without a search: it lies
    /// inside block `id`, so no other block starts there (the hot path's split).
    pub(crate) fn split_back(&mut self, id: usize, bytes: u64) -> usize {
        let new = self.piece_of(id, bytes, self.slab[id].size - bytes);
        let b = &self.slab[id];
        let (next, before_unmapped) = (b.next, b.before_unmapped);
        let back = &mut self.slab[new];
        back.prev = Link::from(Some(id));
        back.next = next;
        back.before_unmapped = before_unmapped;
        let slab = &self.slab;
        self.by_addr.insert_new(new, |i| slab[i].ptr);
        if let Some(n) = next.get() {
            self.slab[n].prev = Link::from(Some(new));
        }
        let b = &mut self.slab[id];
        b.size = bytes;
        b.next = Link::from(Some(new));
        b.before_unmapped = !b.mapped;
        new
    }

    /// Merges `next` (which must follow `id` directly) into `id`.
    pub(crate) fn absorb_next(&mut self, id: usize, next: usize) {
        let n = &self.slab[next];
        let (n_ptr, n_size, after, before_unmapped) = (n.ptr, n.size, n.next, n.before_unmapped);
        let b = &mut self.slab[id];
        b.size += n_size;
        b.next = after;
        b.before_unmapped = before_unmapped;
        if let Some(a) = after.get() {
            self.slab[a].prev = Link::from(Some(id));
        }
        self.by_addr.remove(n_ptr, next);
        self.vacate_record(next);
    }

    /// Maps or unmaps block `id`'s range (as the allocator sees it), keeping its
    /// predecessor's `before_unmapped`.
    pub(crate) fn set_mapped(&mut self, id: usize, mapped: bool) {
        self.slab[id].mapped = mapped;
        if let Some(p) = self.slab[id].prev.get() {
            self.slab[p].before_unmapped = !mapped;
        }
    }

    /// The bytes best fit counts block `id` able to grow by: the unmapped range after it,
    /// if one is (its record says whether, so a mapped neighbour's record is never read).
    /// With `tail_only` (`expandable_segments_reclaim`), only a range that runs to the end
    /// of its segment counts: the holes page reclaim cuts between mapped blocks are a few
    /// pages, and counting them made best fit walk past the blocks before them on one
    /// search in nine of a steady churn (one in 160 without reclaim).
    #[inline(always)]
    pub(crate) fn growth(&self, id: usize, tail_only: bool) -> u64 {
        let b = &self.slab[id];
        match b.next.get() {
            Some(n) if b.before_unmapped && !(tail_only && self.slab[n].next.is_some()) => {
                self.slab[n].size
            }
            _ => 0,
        }
    }

    /// The neighbour `link`, if it is free in a pool (a merge candidate).
    #[inline(always)]
    pub(crate) fn mergeable(&self, link: Link) -> Option<usize> {
        link.get().filter(|&n| self.in_pool[n])
    }

    /// Whether block `id` is in a free list.
    #[inline(always)]
    pub(crate) fn in_pool(&self, id: usize) -> bool {
        self.in_pool[id]
    }

    /// Marks block `id` as in a free list or out of it (the free pools' business).
    #[inline(always)]
    pub(crate) fn set_in_pool(&mut self, id: usize, in_pool: bool) {
        self.in_pool[id] = in_pool;
    }

    /// Free or unmapped, and not being worked on: block `id` can become part of a growing
    /// expandable range.
    pub(crate) fn growable(&self, id: usize) -> bool {
        let b = &self.slab[id];
        self.in_pool[id] || (!b.mapped && !b.busy)
    }

    /// Every live block is found by its address and no address names a dead one.
    pub(crate) fn check_addresses(&self) -> Result<(), String> {
        let alive = self.slab.iter().filter(|b| !b.vacant).count();
        let misplaced = self.slab.iter().enumerate().find(|&(id, b)| {
            !b.vacant && self.by_addr.get(b.ptr, |i| self.slab[i].ptr) != Some(id)
        });
        if let Some((id, b)) = misplaced {
            return Err(format!(
                "block {id} at {:#x} is not found by its address",
                b.ptr
            ));
        }
        let stale = self.slab.iter().enumerate().find(|(_, b)| {
            !b.vacant && b.before_unmapped != b.next.get().is_some_and(|n| !self.slab[n].mapped)
        });
        if let Some((id, _)) = stale {
            return Err(format!(
                "block {id}'s before_unmapped disagrees with its next block"
            ));
        }
        if let Some(id) = self
            .by_addr
            .ids()
            .find(|&id| self.slab.get(id).is_none_or(|b| b.vacant))
        {
            return Err(format!("the address map names block {id}, which is gone"));
        }
        if self.by_addr.len() != alive {
            return Err(format!(
                "{} addresses mapped for {alive} blocks",
                self.by_addr.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(ptr: u64) -> Piece {
        Piece {
            ptr,
            size: 512,
            stream: 0,
            pool: PoolKind::Large,
            mapped: true,
            segment: Link::NONE,
            pool_id: PoolId::DEFAULT,
        }
    }

    /// Blocks whose indices do not fit the table's 16 bits are found all the same, on the
    /// first lookup (the address map) and on later ones (a truncated guess turned away).
    #[test]
    fn indices_past_the_tables_width_are_found() {
        let mut blocks = Blocks::default();
        let ptr = |i: usize| (i as u64 + 1) * 512;
        let ids: Vec<usize> = (0..70_000)
            .map(|i| {
                let id = blocks.insert(Block::new(piece(ptr(i))));
                blocks[id].allocated = true;
                id
            })
            .collect();
        assert!(ids.iter().any(|&id| id > usize::from(u16::MAX)));
        for _ in 0..2 {
            for (i, &id) in ids.iter().enumerate().step_by(3) {
                assert_eq!(blocks.allocated_at_to_free(ptr(i)), Some(id));
            }
        }
    }

    /// `free`'s lookup answers as a scan of the records does, whether the table of recent
    /// frees guesses right or its entry was overwritten for another address, names a block
    /// not allocated now, or a slot vacated (and perhaps reused).
    #[test]
    fn allocated_at_answers_as_a_scan_whatever_the_guess() {
        let mut blocks = Blocks::default();
        let mut seed = 11u64;
        // Addresses in use (each by one record at most); more blocks than table entries.
        let mut records: Vec<(u64, usize)> = Vec::new();
        let mut retired: Vec<u64> = Vec::new();
        for step in 0..40_000u64 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let pick = (seed >> 33) as usize;
            match seed >> 61 {
                // A new block, allocated at once (a retired address again, now and then).
                0..=2 => {
                    let ptr = match retired.pop() {
                        Some(p) if seed & 1 == 0 => p,
                        _ => (step + 1) * 1536,
                    };
                    let id = blocks.insert(Block::new(piece(ptr)));
                    blocks[id].allocated = true;
                    records.push((ptr, id));
                }
                // A block freed, or allocated again.
                3..=5 if !records.is_empty() => {
                    let (_, id) = records[pick % records.len()];
                    blocks[id].allocated = !blocks[id].allocated;
                }
                // A record vacated, free or (as when its segment goes) not; its slot is
                // reused by the next insert.
                _ if !records.is_empty() => {
                    let at = pick % records.len();
                    let (ptr, id) = records[at];
                    if !blocks[id].allocated || seed & 4 == 0 {
                        blocks.vacate(id);
                        records.swap_remove(at);
                        retired.push(ptr);
                    }
                }
                _ => {}
            }
            let probe = match records.get(pick % records.len().max(1)) {
                Some(&(ptr, _)) if seed & 2 == 0 => ptr,
                _ => (pick as u64 % (step + 2)) * 1536,
            };
            let scan = blocks
                .iter()
                .position(|b| !b.vacant && b.allocated && b.ptr == probe);
            assert_eq!(blocks.allocated_at(probe), scan, "step {step}, {probe:#x}");
            // (Asked again at once, the table's guess is the answer it was just told.)
            for _ in 0..2 {
                let found = blocks.allocated_at_to_free(probe);
                assert_eq!(found, scan, "step {step}, {probe:#x}");
            }
        }
        assert!(
            blocks.len() > RECENT,
            "more blocks than the table has entries"
        );
    }
}
