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
//! (a hand-over, or just a race lost) sees every free parked before it. With page reclaim a
//! free also counts toward its segment's next reclaim mark: a credit allows only the parks
//! that make no mark due (the one that would takes the lock), and settling adds the reuses
//! to the count, so marks are recorded where the single-lock path records them.
use crate::block::Allocation;
use crate::combining::{CHUNK, Publication};
use crate::state::{Request, State};
use crate::tally::Tally;
use ferrocuda_types::PoolKind;
use std::cell::RefCell;
use std::sync::Arc;
use sync::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, LockedCell, Ordering};

mod credit;
use credit::credit;

/// The atomics of the slot protocol: the standard ones, or `loom`'s under `--cfg loom`,
/// where `tests::loom_model` checks the protocol under every interleaving loom explores.
mod sync {
    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{
        AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering,
    };
    #[cfg(loom)]
    pub(crate) use loom::thread::yield_now;
    #[cfg(not(loom))]
    pub(crate) use std::sync::atomic::{
        AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering,
    };
    #[cfg(not(loom))]
    pub(crate) use std::thread::yield_now;

    /// A value read and written only with the allocator's lock held (the cell itself needs
    /// no lock then, but the type system does not know it).
    #[derive(Debug, Default)]
    pub(crate) struct LockedCell<T> {
        #[cfg(not(loom))]
        cell: parking_lot::Mutex<T>,
        #[cfg(loom)]
        cell: loom::sync::Mutex<T>,
    }

    impl<T: Copy> LockedCell<T> {
        pub(crate) fn new(value: T) -> LockedCell<T> {
            LockedCell {
                #[cfg(not(loom))]
                cell: parking_lot::Mutex::new(value),
                #[cfg(loom)]
                cell: loom::sync::Mutex::new(value),
            }
        }

        pub(crate) fn get(&self) -> T {
            #[cfg(not(loom))]
            let value = *self.cell.lock();
            #[cfg(loom)]
            let value = *self.cell.lock().unwrap_or_else(|e| e.into_inner());
            value
        }

        pub(crate) fn set(&self, value: T) {
            #[cfg(not(loom))]
            let mut cell = self.cell.lock();
            #[cfg(loom)]
            let mut cell = self.cell.lock().unwrap_or_else(|e| e.into_inner());
            *cell = value;
        }
    }
}

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
    /// The free and the search move `inactive_split` up and down by one.
    pub inactive: bool,
    /// And `inactive_split_bytes` by this much (PyTorch applies each net change once).
    pub inactive_bytes: u64,
    /// With `expandable_segments_reclaim`, the block's expandable segment, whose count of
    /// frees toward the next reclaim mark the reuses join when folded.
    pub reclaim_segment: Option<usize>,
    /// How many times the block may be parked without the lock: with reclaim, one fewer
    /// than the frees left before a mark falls due on its segment, so that the free that
    /// makes it due takes the lock, as it does on the single-lock path (`u64::MAX`: no
    /// limit).
    pub parks: u64,
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
    /// The parks the credit allows ([`Credit::parks`]): while the slot is held, the parks
    /// made so far are its reuses.
    park_limit: AtomicU64,
    /// The whole credit, for folding reuses into the statistics (read and written under the
    /// allocator's lock; the fields a reuse needs are copied into the atomics above).
    credit: LockedCell<Option<Credit>>,
    /// The current credit was used (under the allocator's lock).
    used: AtomicBool,
    /// The owner thread has exited; the allocator settles and drops the slot.
    pub orphaned: AtomicBool,
    /// The allocator is gone; the owner's table drops the slot.
    pub retired: AtomicBool,
    /// What the allocator shares with its slots.
    shared: Arc<Shared>,
    /// The thread's request waiting for the lock holder (`combining`).
    pub publication: Publication,
}

impl Credit {
    /// Adds `reuses` reuses to the cumulative statistics.
    fn fold(&self, stats: &mut Tally, reuses: u64) {
        let n = reuses as i64;
        let kind = self.kind;
        stats.cycle_allocations(kind, n, self.size as i64);
        stats.requested_bytes.cycle(kind, n * self.requested as i64);
        if self.oversize {
            stats.oversize_allocations.cycle(n);
        }
        if self.inactive {
            stats.inactive_split.cycle(kind, n);
        }
        stats
            .inactive_split_bytes
            .cycle(kind, n * self.inactive_bytes as i64);
    }
}

impl Slot {
    fn new(shared: &Arc<Shared>) -> Slot {
        Slot {
            state: AtomicU8::new(IDLE),
            block: AtomicUsize::new(0),
            ptr: AtomicU64::new(0),
            stream: AtomicU64::new(0),
            requested: AtomicU64::new(0),
            size: AtomicU64::new(0),
            reuses: AtomicU64::new(0),
            park_limit: AtomicU64::new(0),
            credit: LockedCell::new(None),
            used: AtomicBool::new(false),
            orphaned: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            shared: shared.clone(),
            publication: Publication::default(),
        }
    }

    /// Folds the reuses so far into `stats` (with the allocator's lock held and the slot
    /// seized); returns the credit and how many reuses were folded.
    pub(crate) fn fold_into(&self, stats: &mut Tally) -> Option<(Credit, u64)> {
        let reuses = self.reuses.swap(0, Ordering::Relaxed);
        let credit = self.credit.get()?;
        if reuses > 0 {
            self.used.store(true, Ordering::Relaxed);
            credit.fold(stats, reuses);
        }
        Some((credit, reuses))
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
        self.park_limit.store(credit.parks, Ordering::Relaxed);
        self.credit.set(Some(credit));
        self.shared.credits.fetch_add(1, Ordering::Relaxed);
        self.state.store(HELD, Ordering::Release);
    }

    /// Moves the slot from `HELD` or `PARKED` to `BUSY`, waiting out a short `BUSY` of the
    /// owner. Returns the state it left, or `None` when the slot is idle.
    pub(crate) fn seize(&self) -> Option<u8> {
        loop {
            match self.state.load(Ordering::Acquire) {
                IDLE => return None,
                BUSY => sync::yield_now(),
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

    /// The owner's lock-free free: parks `ptr` if it is the held block and the credit
    /// allows another park (else the caller takes the lock, which settles the slot first).
    #[inline]
    pub(crate) fn park(&self, ptr: u64) -> bool {
        self.ptr.load(Ordering::Relaxed) == ptr
            && self.reuses.load(Ordering::Relaxed) < self.park_limit.load(Ordering::Relaxed)
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
            let slot = Arc::new(Slot::new(shared));
            slots.0.push((allocator, slot.clone()));
            Some(slot)
        })
        .ok()
        .flatten()
}

/// A process-unique allocator id (ids are never reused, so a stale slot never matches).
pub(crate) fn next_allocator_id() -> u64 {
    // (Outside the model: a static needs the standard atomic.)
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Every thread's slot in one allocator, kept under the allocator's lock.
#[derive(Debug, Default)]
pub(crate) struct Registry(Vec<Arc<Slot>>);

impl Registry {
    /// The slots, [`CHUNK`] at a time.
    pub(crate) fn chunks(&self) -> std::slice::Chunks<'_, Arc<Slot>> {
        self.0.chunks(CHUNK)
    }

    /// How many slots there are.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// The allocator is gone: each owner's table drops its slot.
    pub(crate) fn retire(&self) {
        for slot in &self.0 {
            slot.retired.store(true, Ordering::Release);
        }
    }
}

/// One allocator's side of the protocol: its key in the threads' slot tables and what it
/// shares with its slots.
#[derive(Debug)]
pub(crate) struct ThreadCache {
    id: u64,
    shared: Arc<Shared>,
    /// The `thread_cache` key: with it off, credits are never granted (`credit` reads the
    /// configuration) and no request is served by another thread (`combining`).
    enabled: std::sync::atomic::AtomicBool,
}

impl ThreadCache {
    pub(crate) fn new(enabled: bool) -> ThreadCache {
        ThreadCache {
            id: next_allocator_id(),
            shared: Arc::new(Shared::default()),
            enabled: std::sync::atomic::AtomicBool::new(enabled),
        }
    }

    /// Whether the `thread_cache` key is on.
    #[inline(always)]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Follows a change of the `thread_cache` key (with the allocator's lock held).
    pub(crate) fn enable(&self, on: bool) {
        self.enabled.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs `f` on the calling thread's slot, if it has one.
    #[inline]
    pub(crate) fn own_slot<R>(&self, f: impl FnOnce(&Slot) -> R) -> Option<R> {
        with_slot(self.id, f)
    }

    /// Gives the calling thread a slot if it has none (with the allocator's lock held).
    pub(crate) fn register_own(&self, registry: &mut Registry) {
        if with_slot(self.id, |_| ()).is_none()
            && let Some(slot) = register(self.id, &self.shared)
        {
            registry.0.push(slot);
        }
    }

    /// Whether any slot holds a block (if the calling thread's does, this is true: its own
    /// grant counted it, and only taking the block out of the slot uncounts it).
    #[inline]
    fn outstanding(&self) -> bool {
        self.shared.credits.load(Ordering::Acquire) > 0
    }

    /// Credits outstanding (zero right after [`ThreadCache::settle_all`]).
    pub(crate) fn credits(&self) -> usize {
        self.shared.credits.load(Ordering::Acquire)
    }

    /// The owner's lock-free allocation: the block it parked, if its credit covers
    /// (`bytes`, `stream`). With no credit outstanding, no slot can hold a block.
    #[inline]
    pub(crate) fn reuse(&self, bytes: u64, stream: u64) -> Option<(u64, u64)> {
        if !self.outstanding() {
            return None;
        }
        with_slot(self.id, |s| s.reuse(bytes, stream)).flatten()
    }

    /// The owner's lock-free free: parks `ptr` if it is the block its slot holds.
    #[inline]
    pub(crate) fn park(&self, ptr: u64) -> bool {
        self.outstanding() && with_slot(self.id, |slot| slot.park(ptr)) == Some(true)
    }

    /// Whether taking the lock must settle slots first (read with the lock held: exact,
    /// since credits are granted and ended with it held).
    #[inline(always)]
    pub(crate) fn needs_settling(&self) -> bool {
        self.shared.credits.load(Ordering::Relaxed) > 0
            || self.shared.orphans.load(Ordering::Acquire) > 0
    }

    /// Settles every slot (parked blocks are freed for real, every credit ends) and forgets
    /// the slots of exited threads. Every locked operation does this first.
    pub(crate) fn settle_all(&self, st: &mut State, registry: &mut Registry) {
        self.shared.orphans.store(0, Ordering::Release);
        for slot in &registry.0 {
            settle(st, slot);
        }
        registry.0.retain(|s| !s.orphaned.load(Ordering::Acquire));
    }

    /// After block `id` was handed out for `req` as `allocation`: credits it to the calling
    /// thread's slot where one is due (the slot made at the thread's first credit).
    #[inline(always)]
    pub(crate) fn grant(
        &self,
        st: &mut State,
        registry: &mut Registry,
        id: usize,
        req: &Request,
        allocation: &Allocation,
    ) {
        if !self.shared.wants_credit() {
            return;
        }
        let Some(credit) = credit(st, id, req) else {
            return;
        };
        let (ptr, stream) = (allocation.ptr.0, allocation.stream.raw);
        let granted = with_slot(self.id, |slot| {
            // The slot is idle (the operation began by settling it), unless it took the
            // lock more than once on the way.
            settle(st, slot);
            slot.grant(id, ptr, stream, credit);
        });
        if granted.is_none()
            && let Some(slot) = register(self.id, &self.shared)
        {
            slot.grant(id, ptr, stream, credit);
            registry.0.push(slot);
        }
    }
}

/// Folds a slot's reuses into the statistics, frees its parked block for real and ends
/// its credit.
fn settle(st: &mut State, slot: &Slot) {
    let Some(was) = slot.seize() else {
        return;
    };
    // Each reuse followed a free made without the lock: with reclaim, one toward the
    // segment's next mark (never the one that makes it due: `Credit::parks`).
    if let Some((credit, reuses)) = slot.fold_into(&mut st.stats)
        && let Some(segment) = credit.reclaim_segment
    {
        st.expandable.count_frees(segment, reuses);
    }
    slot.end_credit();
    if was == PARKED {
        let id = slot.block.load(Ordering::Relaxed);
        // A credited block has no other stream's uses: freeing it needs no event.
        debug_assert!(!st.blocks[id].has_uses);
        st.free_now(id, None);
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    //! The slot protocol under every interleaving `loom` explores: the owner thread frees
    //! its credited block (park) and asks for it again (reuse) without the lock, while
    //! another thread's locked operation settles the slot (seize, fold, end the credit,
    //! free a parked block for real). Run with
    //! `RUSTFLAGS="--cfg loom" cargo test -p ferrocuda-alloc --lib loom_model --release`
    //! (`cargo xtask loom`).
    use super::*;
    use loom::sync::Mutex;
    use loom::thread;

    const PTR: u64 = 0x1000;
    const BYTES: u64 = 512;
    const STREAM: u64 = 7;

    fn credit() -> Credit {
        Credit {
            kind: PoolKind::Small,
            size: BYTES,
            requested: BYTES,
            oversize: false,
            inactive: false,
            inactive_bytes: 0,
            reclaim_segment: None,
            parks: u64::MAX,
        }
    }

    /// What the owner did: each reuse it got, and whether it still holds the block at the
    /// end (as allocated memory the allocator's books must count).
    #[derive(Debug, Default)]
    struct Owner {
        reuses: u64,
        holds: bool,
        parked_last: bool,
    }

    /// The owner frees and reallocates `rounds` times; each lock-free step that fails
    /// stands for the same step through the allocator's lock (which settles first, so
    /// the slot is idle then and the books see the operation directly).
    fn owner(slot: &Slot, rounds: usize) -> Owner {
        let mut me = Owner {
            holds: true,
            ..Owner::default()
        };
        for _ in 0..rounds {
            if !me.holds {
                break;
            }
            if slot.park(PTR) {
                me.holds = false;
                me.parked_last = true;
                match slot.reuse(BYTES, STREAM) {
                    Some((ptr, size)) => {
                        assert_eq!((ptr, size), (PTR, BYTES));
                        me.reuses += 1;
                        me.holds = true;
                        me.parked_last = false;
                    }
                    // Settled meanwhile: the parked block was freed for real.
                    None => break,
                }
            } else {
                // Settled before the free: this free goes through the lock.
                me.holds = false;
                me.parked_last = false;
                break;
            }
        }
        me
    }

    /// The settling side of a locked operation: what it saw and folded.
    #[derive(Debug, Default)]
    struct Settled {
        seized: Option<u8>,
        folded: i64,
        freed_parked: bool,
    }

    fn settle_once(slot: &Slot, lock: &Mutex<Tally>) -> Settled {
        let mut stats = lock.lock().unwrap_or_else(|e| e.into_inner());
        let before = stats.snapshot().allocation.all.allocated;
        let seized = slot.seize();
        if seized.is_some() {
            slot.fold_into(&mut stats);
            slot.end_credit();
        }
        Settled {
            seized,
            folded: stats.snapshot().allocation.all.allocated - before,
            freed_parked: seized == Some(PARKED),
        }
    }

    fn granted_slot() -> (Arc<Shared>, Arc<Slot>) {
        let shared = Arc::new(Shared::default());
        let slot = Arc::new(Slot::new(&shared));
        slot.grant(3, PTR, STREAM, credit());
        (shared, slot)
    }

    /// Exactly one side ends up with the block; every reuse is folded exactly once; the
    /// credit ends and the slot is idle.
    #[test]
    fn a_settle_racing_the_owner_keeps_one_owner_and_every_reuse() {
        loom::model(|| {
            let (shared, slot) = granted_slot();
            let lock = Arc::new(Mutex::new(Tally::default()));
            let settler = {
                let (slot, lock) = (slot.clone(), lock.clone());
                thread::spawn(move || settle_once(&slot, &lock))
            };
            let me = owner(&slot, 2);
            let settled = settler.join().expect("settler");
            // The owner's last lock-free operation may come after the settle: a later
            // locked operation settles again (here, directly).
            let late = settle_once(&slot, &lock);
            let folded = settled.folded + late.folded;
            assert_eq!(folded, me.reuses as i64, "{me:?} {settled:?} {late:?}");
            let freed = settled.freed_parked || late.freed_parked;
            assert!(
                !(me.holds && freed),
                "both hold the block: {me:?} {settled:?}"
            );
            if me.parked_last {
                assert!(freed, "a parked block was never freed: {me:?} {settled:?}");
            }
            assert_eq!(slot.state.load(Ordering::Acquire), IDLE);
            assert_eq!(shared.credits.load(Ordering::Acquire), 0);
            assert_eq!(slot.reuses.load(Ordering::Acquire), 0);
        });
    }

    /// Two locked operations (serialised by the lock) and the owner: the credit ends once.
    #[test]
    fn two_settles_end_the_credit_once() {
        loom::model(|| {
            let (shared, slot) = granted_slot();
            let lock = Arc::new(Mutex::new(Tally::default()));
            let settlers: Vec<_> = (0..2)
                .map(|_| {
                    let (slot, lock) = (slot.clone(), lock.clone());
                    thread::spawn(move || settle_once(&slot, &lock))
                })
                .collect();
            let me = owner(&slot, 1);
            let seized: Vec<Settled> = settlers
                .into_iter()
                .map(|t| t.join().expect("settler"))
                .collect();
            let late = settle_once(&slot, &lock);
            let ends = seized
                .iter()
                .chain([&late])
                .filter(|s| s.seized.is_some())
                .count();
            assert!(ends >= 1, "{me:?}");
            assert_eq!(shared.credits.load(Ordering::Acquire), 0);
            assert_eq!(slot.state.load(Ordering::Acquire), IDLE);
        });
    }
}
