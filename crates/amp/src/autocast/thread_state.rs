//! Where a thread's autocast state lives, and how guards change and restore it.
//!
//! The state (per device kind: enabled and dtype; the cache flag; inference mode; the scope
//! depth) is one thread-local `Cell`, read in one access on the hot path. Every guard
//! records itself on a per-thread stack: its id, the state it found, and what it changed
//! ([`Change`]). Dropping the guard on top restores the state it found and pops it: the
//! common path, one comparison more than a plain restore. Dropping one below the top
//! removes it and re-applies the changes of the guards above it, oldest first, to the state
//! *it* found, updating what each of them found on the way (the rule is in the docs of
//! [`state`](super::state)).
use std::cell::{Cell, RefCell};

use super::cache;
use super::state::{AmpState, Change, Frame};

/// The thread's state: the current frame and the number of live scopes.
#[derive(Copy, Clone, Debug)]
pub(super) struct ThreadState {
    pub(super) frame: Frame,
    pub(super) nesting: u32,
}

/// A live guard: its id, the frame it found, what it changed.
#[derive(Copy, Clone, Debug)]
struct Entry {
    id: u64,
    found: Frame,
    change: Change,
}

/// The live guards of a thread, oldest first.
#[derive(Debug)]
struct GuardStack {
    entries: Vec<Entry>,
    next_id: u64,
}

thread_local! {
    /// Bumped by every change of this thread's state ([`thread_state_version`]).
    static VERSION: Cell<u64> = const { Cell::new(0) };
    static THREAD: Cell<ThreadState> = const {
        Cell::new(ThreadState {
            frame: Frame { amp: AmpState::NEW_THREAD, inference_mode: false },
            nesting: 0,
        })
    };
    static GUARDS: RefCell<GuardStack> = const {
        RefCell::new(GuardStack { entries: Vec::new(), next_id: 0 })
    };
}

/// This thread's state.
#[inline]
pub(super) fn current() -> ThreadState {
    THREAD.with(Cell::get)
}

fn update<R>(f: impl FnOnce(&mut ThreadState) -> R) -> R {
    VERSION.with(|v| v.set(v.get().wrapping_add(1)));
    THREAD.with(|cell| {
        let mut t = cell.get();
        let r = f(&mut t);
        cell.set(t);
        r
    })
}

/// A number that changes whenever this thread's autocast state may have changed: a reader
/// that keeps what it derived from [`AmpState::current`] with the number it read first may
/// reuse it while the number is unchanged (the guards of a graph cache do, every call).
pub fn thread_state_version() -> u64 {
    VERSION.with(Cell::get)
}

/// Applies `change` for a new guard and records it; returns the guard's id. A scope
/// ([`Change::is_scope`]) counts in the nesting depth.
pub(super) fn push(change: Change) -> u64 {
    let found = update(|t| {
        let found = t.frame;
        change.apply(&mut t.frame);
        if change.is_scope() {
            t.nesting = t.nesting.saturating_add(1);
        }
        found
    });
    // Unrecorded only while the thread is being torn down: nothing restores it then.
    GUARDS
        .try_with(|g| {
            let mut g = g.borrow_mut();
            let id = g.next_id;
            g.next_id = g.next_id.wrapping_add(1);
            g.entries.push(Entry { id, found, change });
            id
        })
        .unwrap_or(u64::MAX)
}

/// Removes guard `id` and sets the state to what the live guards make it (see the module
/// docs). When the last scope goes, clears this thread's weight-cast caches first, as
/// `autocast.__exit__` does before restoring.
pub(super) fn pop(id: u64) {
    let removed = GUARDS.try_with(|g| {
        let entries = &mut g.borrow_mut().entries;
        // The common, in-order case: the guard on top restores what it found.
        if entries.last().is_some_and(|e| e.id == id) {
            return entries.pop().map(|e| (e.found, e.change.is_scope()));
        }
        let at = entries.iter().rposition(|e| e.id == id)?;
        let gone = entries.remove(at);
        let mut frame = gone.found;
        for e in &mut entries[at..] {
            e.found = frame;
            e.change.apply(&mut frame);
        }
        Some((frame, gone.change.is_scope()))
    });
    let Ok(Some((frame, scope))) = removed else {
        return;
    };
    let last_scope = update(|t| {
        if scope {
            t.nesting = t.nesting.saturating_sub(1);
        }
        let last = scope && t.nesting == 0;
        if !last {
            t.frame = frame;
        }
        last
    });
    if last_scope {
        cache::clear_thread_caches();
        update(|t| t.frame = frame);
    }
}
