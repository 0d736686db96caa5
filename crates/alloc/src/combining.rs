//! Contended requests served by the thread holding the lock (flat combining): a thread
//! that finds the allocator's lock taken publishes its request in its slot and spins on it;
//! the thread that takes the lock next serves every published request before its own, in
//! passes over the slots, while requests keep coming.
//!
//! What is published: an allocation the cache can serve and a free with no other
//! stream's uses, the two operations of a pair. Anything else (a best fit that finds
//! nothing, a free that needs events, a pointer the allocator does not know) is answered
//! "serve it yourself", and the thread runs its request through the lock as usual.
//!
//! Why this is exact: a published request is served with the lock held, after it was
//! published and before its thread returns, by the steps the thread would run itself
//! (`Engine::request`, best fit, `use_block`; `free_now`). The results
//! are those of PyTorch's one mutex for the order in which the lock holder served them,
//! which is a real-time order of the requests. Only requests with no part tied to their
//! thread are published: no stack to record, no pool routed to (a route may depend on the
//! calling thread), no garbage-collection clock (a request answered "yourself" would
//! count its search twice). Served requests earn no thread-cache credit: a credit belongs
//! to the thread whose operation came last under the lock, and the serving thread settles
//! every slot when it takes the lock and serves before its own operation, which may earn
//! one. `crates/alloc/tests/alloc_diff.rs` replays eight unordered threads' operations, in
//! the order the lock saw them, on the single-lock path.
//!
//! Why it is fast: what an operation costs when threads contend is the allocator's state
//! (block records, free lists, statistics) moving to the core of the thread that takes the
//! lock. Waiters look at the lock rarely ([`LOOK_EVERY`]), so the thread that held it last
//! usually takes it again for its next operation, serves the waiters from its own cache,
//! and, between their requests, reuses its own parked block without the lock (its
//! thread-cache credit). On an H200 host with 8 threads of 1 MiB pairs on one stream this
//! took a pair from 392 to 64 ns, and every percentile of an operation's latency down
//! (mean 8.6 to 1.4 µs, p99 52 to 12 µs, p99.99 301 to 92 µs; with 2 threads the same or
//! lower): waiting for a thread that serves in batches is shorter than queueing for a lock
//! that every operation hands to another core. `thread_cache:False` turns it off with the
//! credits.
use crate::engine::{Engine, Guard, Locked};
use crate::state::State;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// A slot with nothing published.
const EMPTY: u8 = 0;
/// An allocation waits: `arg` bytes on stream `stream`.
const ALLOC: u8 = 1;
/// A free waits: `arg` is the pointer.
const FREE: u8 = 2;
/// Served: the allocation is `ptr`, `size` bytes, or the free is done.
const SERVED: u8 = 3;
/// Not served: the thread runs the request itself, through the lock.
const YOURSELF: u8 = 4;

/// A waiting thread looks at the lock once in this many spins (`spin_loop` hints, each
/// after a look at its own slot). Rarely: a waiter that takes the lock as soon as it is
/// free between two operations of the thread that just held it moves the allocator's state
/// to its own core, and that move, not the lock, is what an operation costs under
/// contention. On an H200 host, 8 threads of 1 MiB pairs (`benches/alloc.rs`): every 16
/// spins 343 ns per pair, every 64 161 ns, every 256 64 ns, every 1 024 41 ns, with the
/// worst latencies growing past 256 (`docs/measurements/h200_2026-11-29g/`).
const LOOK_EVERY: u32 = 256;
/// Spins before a waiting thread takes the lock the blocking way (and serves the published
/// requests itself): the thread holding the lock may have been descheduled.
const SPINS: u32 = 4 * LOOK_EVERY;
/// Passes over the slots one lock hold makes at most (another one only while the last
/// found requests).
const PASSES: usize = 4;
/// Slots whose states a pass reads before serving any.
pub(crate) const CHUNK: usize = 16;

/// A request a thread publishes.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Op {
    Alloc { bytes: u64, stream: u64 },
    Free { ptr: u64 },
}

/// How a published request ended.
pub(crate) enum Combined<'a> {
    /// Served: an allocation's block (for a free, nothing to read).
    Served { ptr: u64, size: u64 },
    /// The calling thread holds the lock and runs the request itself.
    Locked(Guard<'a>),
}

/// One thread's published request and its answer. The owner writes the request and then
/// `state` (release); the lock holder reads `state` (acquire), serves, writes the answer
/// and then `state` (release). On its own cache lines: the owner spins on it.
#[repr(align(128))]
#[derive(Debug, Default)]
pub(crate) struct Publication {
    state: AtomicU8,
    arg: AtomicU64,
    stream: AtomicU64,
    ptr: AtomicU64,
    size: AtomicU64,
}

impl Publication {
    fn publish(&self, op: Op) {
        let state = match op {
            Op::Alloc { bytes, stream } => {
                self.arg.store(bytes, Ordering::Relaxed);
                self.stream.store(stream, Ordering::Relaxed);
                ALLOC
            }
            Op::Free { ptr } => {
                self.arg.store(ptr, Ordering::Relaxed);
                FREE
            }
        };
        self.state.store(state, Ordering::Release);
    }

    fn answer(&self, state: u8, ptr: u64, size: u64) {
        self.ptr.store(ptr, Ordering::Relaxed);
        self.size.store(size, Ordering::Relaxed);
        self.state.store(state, Ordering::Release);
    }

    /// The answer, if the request has one (the slot is empty again then).
    fn take_answer(&self) -> Option<u8> {
        let state = self.state.load(Ordering::Acquire);
        (state >= SERVED).then(|| {
            self.state.store(EMPTY, Ordering::Relaxed);
            state
        })
    }
}

impl Engine {
    /// The lock for `op`, or `op` served by the thread holding it: the lock is taken
    /// without waiting if it is free; otherwise `op` is published and served by whichever
    /// thread holds the lock next (this one, if it gets there first). A thread with no slot
    /// yet takes the lock the blocking way and gets one.
    #[inline(always)]
    pub(crate) fn lock_or_combine(&self, op: Op) -> Combined<'_> {
        if let Some(mut g) = self.try_lock() {
            // (Before the caller's own request, which may earn a credit: a credit's
            // operation must be the last one under the lock.)
            self.serve_published(&mut g);
            return Combined::Locked(g);
        }
        self.publish_or_lock(op)
    }

    /// [`Engine::lock_or_combine`] with the lock taken: `op` published and waited for, or,
    /// for a thread with no slot yet, the lock taken the blocking way and a slot made.
    #[cold]
    fn publish_or_lock(&self, op: Op) -> Combined<'_> {
        self.cache
            .own_slot(|slot| self.wait_served(&slot.publication, op))
            .unwrap_or_else(|| {
                let mut g = self.lock_serving();
                self.cache.register_own(&mut g.slots);
                Combined::Locked(g)
            })
    }

    /// Publishes `op` and waits for its answer, serving every published request if the
    /// lock comes free first.
    fn wait_served(&self, mine: &Publication, op: Op) -> Combined<'_> {
        mine.publish(op);
        let mut spins = 0;
        let mut held = loop {
            if let Some(answer) = mine.take_answer() {
                return self.answered(mine, answer, None);
            }
            if spins >= SPINS {
                break self.lock();
            }
            if spins % LOOK_EVERY == 0
                && let Some(g) = self.try_lock()
            {
                break g;
            }
            spins += 1;
            std::hint::spin_loop();
        };
        self.serve_published(&mut held);
        // (Its slot is in the registry, so a pass served it, unless another thread did.)
        self.serve(&mut held.state, mine);
        let answer = mine.take_answer().unwrap_or(YOURSELF);
        self.answered(mine, answer, Some(held))
    }

    /// What `answer` means for the waiting thread (holding the lock if `held`).
    fn answered<'a>(
        &'a self,
        mine: &Publication,
        answer: u8,
        held: Option<Guard<'a>>,
    ) -> Combined<'a> {
        if answer == SERVED {
            return Combined::Served {
                ptr: mine.ptr.load(Ordering::Relaxed),
                size: mine.size.load(Ordering::Relaxed),
            };
        }
        Combined::Locked(held.unwrap_or_else(|| self.lock_serving()))
    }

    /// The lock, taken the blocking way, with what was published served (before the
    /// caller's own request, as in [`Engine::lock_or_combine`]).
    fn lock_serving(&self) -> Guard<'_> {
        let mut g = self.lock();
        self.serve_published(&mut g);
        g
    }

    /// Serves every request published in a slot, in the slots' order, pass after pass
    /// while the last pass found some (with the lock held).
    #[inline(always)]
    fn serve_published(&self, held: &mut Guard<'_>) {
        // (Alone, a thread has no one to serve: the churn of one thread pays one compare.)
        if held.slots.len() > 1 {
            self.serve_slots(held);
        }
    }

    /// [`Engine::serve_published`] with more than one slot. Each pass reads every slot's
    /// state first, in a loop of independent loads (the slots' lines come from other
    /// cores' caches at once), serves the requests it found, and only then writes their
    /// answers, together: a store to a line another core reads waits for that line, and
    /// stores leave the core in order, so an answer written after each request would hold
    /// up every store of the next one.
    fn serve_slots(&self, held: &mut Guard<'_>) {
        let Locked { state, slots } = &mut **held;
        for _ in 0..PASSES {
            let mut served = 0;
            for chunk in slots.chunks() {
                let mut states = [EMPTY; CHUNK];
                for (s, slot) in states.iter_mut().zip(chunk) {
                    *s = slot.publication.state.load(Ordering::Acquire);
                }
                let mut answers = [(EMPTY, 0, 0); CHUNK];
                for ((&s, answer), slot) in states.iter().zip(&mut answers).zip(chunk) {
                    if let Some(a) = self.execute(state, s, &slot.publication) {
                        *answer = a;
                        served += 1;
                    }
                }
                for (&(s, ptr, size), slot) in answers.iter().zip(chunk) {
                    if s != EMPTY {
                        slot.publication.answer(s, ptr, size);
                    }
                }
            }
            if served == 0 {
                break;
            }
        }
    }

    /// Serves `p`'s request, if one waits there (with the lock held). Returns whether one did.
    fn serve(&self, st: &mut State, p: &Publication) -> bool {
        let Some((answer, ptr, size)) = self.execute(st, p.state.load(Ordering::Acquire), p) else {
            return false;
        };
        p.answer(answer, ptr, size);
        true
    }

    /// The answer to `p`'s request, if its state (`published`) says one waits there.
    #[inline(always)]
    fn execute(&self, st: &mut State, published: u8, p: &Publication) -> Option<(u8, u64, u64)> {
        match published {
            ALLOC => Some(self.serve_alloc(
                st,
                p.arg.load(Ordering::Relaxed),
                p.stream.load(Ordering::Relaxed),
            )),
            FREE => Some(self.serve_free(st, p.arg.load(Ordering::Relaxed))),
            _ => None,
        }
    }

    /// A published allocation: `allocate`'s best fit under the lock, if it finds a block.
    #[inline(always)]
    fn serve_alloc(&self, st: &mut State, bytes: u64, stream: u64) -> (u8, u64, u64) {
        if st.private.routing() || st.gc_enabled() {
            return (YOURSELF, 0, 0);
        }
        let stream = st.stream_handle(stream);
        let req = self.request(st, bytes, stream, None, None);
        match st.take_free_block(req.pool, req.kind, stream, req.size) {
            Some(id) => {
                let (_, allocation) = st.use_block(id, &req);
                (SERVED, allocation.ptr.0, allocation.size)
            }
            None => (YOURSELF, 0, 0),
        }
    }

    /// A published free: `free` under the lock, for a live block no other stream used.
    #[inline(always)]
    fn serve_free(&self, st: &mut State, ptr: u64) -> (u8, u64, u64) {
        match st.blocks.allocated_at_to_free(ptr) {
            Some(id) if !st.blocks[id].has_uses => {
                st.free_now(id, None);
                self.record_due_mark(st);
                (SERVED, 0, 0)
            }
            _ => (YOURSELF, 0, 0),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{Caching, CachingAllocator};
    use ferrocuda_driver::FakeDriver;
    use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
    use std::sync::Arc;
    use std::sync::mpsc::{Receiver, Sender, channel};

    type TestResult = Result<(), Box<dyn std::error::Error>>;
    const D0: DeviceIndex = DeviceIndex(0);
    const STREAM: StreamHandle = StreamHandle::legacy(D0);

    /// One step: allocate bytes, or free a pointer; the reply is the pointer or the error.
    #[derive(Copy, Clone, Debug)]
    enum Step {
        Alloc(u64),
        Free(u64),
    }

    fn run(a: &CachingAllocator, step: Step) -> Result<u64, String> {
        match step {
            Step::Alloc(bytes) => a.allocate(bytes, STREAM).map(|x| x.ptr.0),
            Step::Free(ptr) => a.free(DevicePtr(ptr)).map(|()| 0),
        }
        .map_err(|e| e.to_string())
    }

    /// A thread that runs the steps it is sent on `a`.
    fn worker(a: &Arc<CachingAllocator>) -> (Sender<Step>, Receiver<Result<u64, String>>) {
        let (steps, inbox) = channel::<Step>();
        let (outbox, replies) = channel();
        let a = a.clone();
        std::thread::spawn(move || {
            for step in inbox {
                if outbox.send(run(&a, step)).is_err() {
                    return;
                }
            }
        });
        (steps, replies)
    }

    fn allocator(config: &str) -> Result<Arc<CachingAllocator>, Box<dyn std::error::Error>> {
        Ok(Arc::new(CachingAllocator::new(
            Arc::new(FakeDriver::default()),
            D0,
            AllocatorConfig::parse(config)?,
            Caching::On,
        )?))
    }

    /// Requests published while another thread holds the lock are served by it, in the
    /// order of their slots, exactly as the single-lock path serves the same requests in
    /// that order: the same pointers, the same errors and statistics. Those it cannot
    /// serve (a new segment, an unknown pointer) come back to their threads, which run them
    /// after it.
    #[test]
    fn published_requests_are_served_as_the_single_lock_path_would_in_slot_order() -> TestResult {
        let ours = allocator("")?;
        let reference = allocator("thread_cache:False")?;
        let both = |step: Step| -> Result<u64, String> {
            let got = run(&ours, step);
            assert_eq!(got, run(&reference, step), "{step:?}");
            got
        };
        // A layout with free blocks of several sizes in two small and one large segment.
        let live: Vec<u64> = [512, 4096, 100_000, 512, 3 << 20, 1 << 20]
            .iter()
            .map(|&b| both(Step::Alloc(b)))
            .collect::<Result<_, _>>()?;
        both(Step::Free(live[1]))?;
        both(Step::Free(live[4]))?;
        // Each worker gets its slot: its first request finds the lock taken and no slot,
        // takes the lock the blocking way and registers.
        let workers: Vec<_> = (0..6).map(|_| worker(&ours)).collect();
        for (i, (steps, replies)) in workers.iter().enumerate() {
            let held = ours.engine.lock();
            let step = Step::Alloc(256 + i as u64);
            steps.send(step)?;
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(held);
            assert_eq!(replies.recv()?, run(&reference, step));
        }
        let steps = [
            Step::Alloc(4000),
            Step::Free(live[0]),
            Step::Alloc(2 << 20),
            Step::Alloc(64 << 20),
            Step::Free(0xdead_0000),
            Step::Free(live[5]),
        ];
        let mut held = ours.engine.lock();
        for ((sender, _), step) in workers.iter().zip(steps) {
            sender.send(step)?;
        }
        let published = |g: &Guard<'_>| {
            g.slots
                .chunks()
                .flatten()
                .filter(|s| matches!(s.publication.state.load(Ordering::Acquire), ALLOC | FREE))
                .map(|s| s.publication.arg.load(Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        while published(&held).len() < steps.len() {
            std::thread::yield_now();
        }
        let order = published(&held);
        let step_of = |arg: u64| {
            steps
                .iter()
                .position(|s| matches!(*s, Step::Alloc(x) | Step::Free(x) if x == arg))
        };
        ours.engine.serve_published(&mut held);
        // Which requests the lock holder served: an answer still in its slot says, and a
        // thread that already took its answer has replied (served) or waits for the lock
        // (sent back), which is held here.
        let mut got: Vec<Option<Result<u64, String>>> = vec![None; steps.len()];
        let mut served = Vec::new();
        let slots: Vec<(u64, u8)> = held
            .slots
            .chunks()
            .flatten()
            .map(|s| {
                let p = &s.publication;
                (
                    p.arg.load(Ordering::Relaxed),
                    p.state.load(Ordering::Acquire),
                )
            })
            .collect();
        for (arg, state) in slots {
            let Some(i) = step_of(arg) else { continue };
            match state {
                SERVED => served.push(i),
                YOURSELF => {}
                EMPTY => {
                    let wait = std::time::Duration::from_secs(2);
                    if let Ok(reply) = workers[i].1.recv_timeout(wait) {
                        got[i] = Some(reply);
                        served.push(i);
                    }
                }
                other => panic!("step {i} not answered: {other}"),
            }
        }
        served.sort_unstable();
        assert_eq!(served, [0, 1, 2, 5], "served by the lock holder");
        drop(held);
        for (i, (_, replies)) in workers.iter().enumerate() {
            if got[i].is_none() {
                got[i] = Some(replies.recv()?);
            }
        }
        let got: Vec<_> = got.into_iter().flatten().collect();
        // The reference: the served requests in slot order, then the two sent back.
        let mut expected: Vec<Option<Result<u64, String>>> = vec![None; steps.len()];
        for i in order.iter().filter_map(|&arg| step_of(arg)) {
            if served.contains(&i) {
                expected[i] = Some(run(&reference, steps[i]));
            }
        }
        for i in [3, 4] {
            expected[i] = Some(run(&reference, steps[i]));
        }
        let expected: Vec<_> = expected.into_iter().flatten().collect();
        assert_eq!(got, expected);
        assert!(
            got[4].as_ref().is_err_and(|e| e.contains("invalid")),
            "{got:?}"
        );
        assert_eq!(ours.stats(), reference.stats());
        assert_eq!(ours.snapshot().0, reference.snapshot().0);
        Ok(())
    }
}
