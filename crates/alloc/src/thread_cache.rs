//! The per-thread front end (`thread_cache`): each thread has one slot per allocator holding
//! the block it allocated last. Freeing that block parks it in the slot; the thread's next
//! request for the same (bytes, stream) takes it back with one compare-and-swap and no lock.
//!
//! Why this is exact: a slot is credited, under the allocator's lock, only when PyTorch's
//! `free` of the block followed by its best-fit search for the same request would hand out
//! the very same block and leave every other block as it was (no neighbour merged in front,
//! a merged remainder split off again, no better-fitting free block, no intermediate
//! statistic above its peak). A reuse then changes nothing but cumulative counters, which
//! the credit records and which are folded into the statistics when the slot is settled.
//! Every operation that takes the allocator's lock, of any thread, settles every slot first
//! (parked blocks are freed for real, credits end). So at most one thread holds a credit at
//! a time, the one whose locked operation came last, and its lock-free operations are a
//! sequence that no other thread's operation interleaves: each of them is what the
//! single-lock path would do at that point. Another thread's operation that comes later
//! (a hand-over, or just a race lost) sees every free parked before it.
use crate::tally::Tally;
use ferrocuda_types::PoolKind;
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// No credited block.
pub(crate) const IDLE: u8 = 0;
/// The user holds the credited block.
pub(crate) const HELD: u8 = 1;
/// The user freed the credited block; the allocator has not been told yet.
pub(crate) const PARKED: u8 = 2;
/// Someone is reading or changing the slot (a few instructions, never across a lock).
pub(crate) const BUSY: u8 = 3;

/// What one reuse of a credited block adds to the cumulative statistics (`allocated` and
/// `freed` alike): computed when the credit is granted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Credit {
    pub kind: PoolKind,
    /// Block size (allocation, active and allocated bytes).
    pub size: u64,
    /// Requested bytes; a reuse must ask for exactly these.
    pub requested: u64,
    /// Counted in `oversize_allocations`.
    pub oversize: bool,
    /// The free and the search split and merge: `inactive_split` rises and falls once.
    pub inactive: bool,
    /// And `inactive_split_bytes` by this much.
    pub inactive_bytes: u64,
}

/// What an allocator and its threads' slots share.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Slots whose thread exited, waiting to be settled.
    pub orphans: AtomicUsize,
    /// Slots holding a block (held or parked). At zero no thread can have a block to take
    /// back, and requests skip the look at the thread's slots.
    pub credits: AtomicUsize,
    /// Credits in a row that ended unused, and credit-worthy requests since: when credits
    /// go unused they are granted less often (down to one request in 1024), so a churn of
    /// mixed sizes does not pay for them. Changed under the allocator's lock.
    misses: AtomicU32,
    ticks: AtomicU32,
}

impl Shared {
    /// Whether the block a request is handed should be considered for a credit (with the
    /// allocator's lock held).
    pub(crate) fn wants_credit(&self) -> bool {
        let misses = self.misses.load(Ordering::Relaxed);
        if misses < 2 {
            return true;
        }
        let ticks = self.ticks.load(Ordering::Relaxed).wrapping_add(1);
        self.ticks.store(ticks, Ordering::Relaxed);
        ticks.is_multiple_of(1 << (misses - 1).min(10))
    }
}

/// One thread's slot in one allocator. The owner thread changes `state` with
/// compare-and-swap; everything else is written either by the owner while it holds the
/// allocator's lock (granting a credit) or by whoever moved `state` to [`BUSY`].
#[derive(Debug)]
pub(crate) struct Slot {
    pub state: AtomicU8,
    /// The credited block's id and address.
    pub block: AtomicUsize,
    pub ptr: AtomicU64,
    pub stream: AtomicU64,
    pub requested: AtomicU64,
    pub size: AtomicU64,
    /// Reuses since the credit was granted or last folded into the statistics.
    pub reuses: AtomicU64,
    /// The whole credit, for folding reuses into the statistics (read and written under the
    /// allocator's lock; the fields a reuse needs are copied into the atomics above).
    credit: parking_lot::Mutex<Option<Credit>>,
    /// The current credit was used (under the allocator's lock).
    used: AtomicBool,
    /// The owner thread has exited; the allocator settles and drops the slot.
    pub orphaned: AtomicBool,
    /// The allocator is gone; the owner's table drops the slot.
    pub retired: AtomicBool,
    /// What the allocator shares with its slots.
    shared: Arc<Shared>,
}

impl Credit {
    /// Adds `reuses` reuses to the cumulative statistics.
    fn fold(&self, stats: &mut Tally, reuses: u64) {
        let n = reuses as i64;
        let kind = self.kind;
        stats.allocation.cycle(kind, n);
        stats.active.cycle(kind, n);
        stats.allocated_bytes.cycle(kind, n * self.size as i64);
        stats.active_bytes.cycle(kind, n * self.size as i64);
        stats.requested_bytes.cycle(kind, n * self.requested as i64);
        if self.oversize {
            stats.oversize_allocations.cycle(n);
        }
        if self.inactive {
            stats.inactive_split.cycle(kind, n);
            stats
                .inactive_split_bytes
                .cycle(kind, n * self.inactive_bytes as i64);
        }
    }
}

impl Slot {
    /// Folds the reuses so far into `stats` (with the allocator's lock held and the slot
    /// seized).
    pub(crate) fn fold_into(&self, stats: &mut Tally) {
        let reuses = self.reuses.swap(0, Ordering::Relaxed);
        if reuses > 0
            && let Some(credit) = *self.credit.lock()
        {
            self.used.store(true, Ordering::Relaxed);
            credit.fold(stats, reuses);
        }
    }

    /// Ends the credit (folded already; with the allocator's lock held, the slot seized),
    /// noting whether it was used.
    pub(crate) fn end_credit(&self) {
        let misses = &self.shared.misses;
        if self.used.swap(false, Ordering::Relaxed) {
            misses.store(0, Ordering::Relaxed);
        } else {
            misses.store(
                misses.load(Ordering::Relaxed).saturating_add(1),
                Ordering::Relaxed,
            );
        }
        self.state.store(IDLE, Ordering::Release);
        self.shared.credits.fetch_sub(1, Ordering::Release);
    }

    /// Credits `ptr` to the slot (with the allocator's lock held, by the owner thread, with
    /// the slot [`IDLE`]).
    pub(crate) fn grant(&self, block: usize, ptr: u64, stream: u64, credit: Credit) {
        self.block.store(block, Ordering::Relaxed);
        self.ptr.store(ptr, Ordering::Relaxed);
        self.stream.store(stream, Ordering::Relaxed);
        self.requested.store(credit.requested, Ordering::Relaxed);
        self.size.store(credit.size, Ordering::Relaxed);
        *self.credit.lock() = Some(credit);
        self.shared.credits.fetch_add(1, Ordering::Relaxed);
        self.state.store(HELD, Ordering::Release);
    }

    /// Moves the slot from `HELD` or `PARKED` to `BUSY`, waiting out a short `BUSY` of the
    /// owner. Returns the state it left, or `None` when the slot is idle.
    pub(crate) fn seize(&self) -> Option<u8> {
        loop {
            match self.state.load(Ordering::Acquire) {
                IDLE => return None,
                BUSY => std::thread::yield_now(),
                s => {
                    if self
                        .state
                        .compare_exchange(s, BUSY, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                    {
                        return Some(s);
                    }
                }
            }
        }
    }

    /// The owner's lock-free free: parks `ptr` if it is the held block (else the caller
    /// takes the lock, which settles the slot first).
    #[inline]
    pub(crate) fn park(&self, ptr: u64) -> bool {
        self.ptr.load(Ordering::Relaxed) == ptr
            && self
                .state
                .compare_exchange(HELD, PARKED, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    /// The owner's lock-free allocation: the parked block's address and size, if the
    /// request is the one its credit was granted for.
    #[inline]
    pub(crate) fn reuse(&self, bytes: u64, stream: u64) -> Option<(u64, u64)> {
        if self.requested.load(Ordering::Relaxed) != bytes
            || self.stream.load(Ordering::Relaxed) != stream
            || self
                .state
                .compare_exchange(PARKED, BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return None;
        }
        let reuses = self.reuses.load(Ordering::Relaxed);
        self.reuses.store(reuses + 1, Ordering::Relaxed);
        self.state.store(HELD, Ordering::Release);
        Some((
            self.ptr.load(Ordering::Relaxed),
            self.size.load(Ordering::Relaxed),
        ))
    }
}

/// The calling thread's slots, one per allocator it used, keyed by allocator id.
struct Slots(Vec<(u64, Arc<Slot>)>);

impl Drop for Slots {
    fn drop(&mut self) {
        for (_, slot) in &self.0 {
            slot.orphaned.store(true, Ordering::Release);
            slot.shared.orphans.fetch_add(1, Ordering::AcqRel);
        }
    }
}

thread_local! {
    static SLOTS: RefCell<Slots> = const { RefCell::new(Slots(Vec::new())) };
}

/// Runs `f` on the calling thread's slot for `allocator`, if it has one (and the thread is
/// not exiting).
#[inline]
pub(crate) fn with_slot<R>(allocator: u64, f: impl FnOnce(&Slot) -> R) -> Option<R> {
    SLOTS
        .try_with(|s| {
            let slots = s.try_borrow().ok()?;
            let (_, slot) = slots.0.iter().find(|(id, _)| *id == allocator)?;
            Some(f(slot))
        })
        .ok()
        .flatten()
}

/// A new slot for the calling thread in `allocator` (which has none), for the allocator's
/// registry. `None` while the thread is exiting.
pub(crate) fn register(allocator: u64, shared: &Arc<Shared>) -> Option<Arc<Slot>> {
    SLOTS
        .try_with(|s| {
            let mut slots = s.try_borrow_mut().ok()?;
            slots.0.retain(|(_, s)| !s.retired.load(Ordering::Acquire));
            let slot = Arc::new(Slot {
                state: AtomicU8::new(IDLE),
                block: AtomicUsize::new(0),
                ptr: AtomicU64::new(0),
                stream: AtomicU64::new(0),
                requested: AtomicU64::new(0),
                size: AtomicU64::new(0),
                reuses: AtomicU64::new(0),
                credit: parking_lot::Mutex::new(None),
                used: AtomicBool::new(false),
                orphaned: AtomicBool::new(false),
                retired: AtomicBool::new(false),
                shared: shared.clone(),
            });
            slots.0.push((allocator, slot.clone()));
            Some(slot)
        })
        .ok()
        .flatten()
}

/// A process-unique allocator id (ids are never reused, so a stale slot never matches).
pub(crate) fn next_allocator_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
