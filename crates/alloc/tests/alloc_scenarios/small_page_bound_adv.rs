//! `expandable_segments_small_page_bound`, attacked from outside (written by a helper asked
//! to break it):
//! - differential: random programs (mostly small requests, some large, frees, churns,
//!   `record_stream`, `empty_cache`, memory fractions, run-time toggles of the key, of
//!   expandable segments and of page reclaim, three streams, small devices that run out of
//!   memory, eager and lagging devices) run with `thread_cache:True` and `thread_cache:False`,
//!   and on three threads handing blocks to each other against one thread: the same pointers
//!   and errors, statistics at every step, the same blocks and snapshot at the end, and
//!   `check_invariants` after every step;
//! - model: with the key on, no small expandable block spans a 2 MiB page (counted from
//!   its segment's base) and no two free small blocks side by side lie in one page;
//! - hand-made edges: best fit ignores growth room in the small pool, toggling the key
//!   over free blocks that already span pages, `empty_cache` then reuse, the OOM paths of
//!   `ferrocuda_recommended`, a memory fraction, and the key's parse errors.
//!
//! `PROBE_SCALE=N` runs N times as many random programs.
#![allow(clippy::unwrap_used, clippy::panic)]
use crate::Rng;
use crate::common;
use crate::reclaim_switch::{scaled, shrink};
use common::{D0, GIB, LEGACY, MIB, new_stream, setup, stat};
use ferrocuda_alloc::{AllocError, Allocation, AsyncAllocator, BlockInfo, CachingAllocator};
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{AllocatorConfig, MemsetValue, PoolKind, StreamHandle};
use std::sync::{Arc, mpsc};

const KIB: u64 = 1024;
const PAGE: u64 = 2 * MIB;
const RECOMMENDED: &str = "ferrocuda_recommended:True";
const BOUND: &str = "expandable_segments:True,expandable_segments_small_page_bound:True";

type R<T> = Result<T, String>;

#[derive(Clone, Copy, Debug)]
enum Key {
    Bound,
    Expandable,
    Reclaim,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    /// Allocate on stream `s`, from thread `t`.
    Alloc(u64, usize, usize),
    /// Free live block `pick` from thread `t`.
    Free(usize, usize),
    /// From thread `t`: free live block `pick`, then `k` times ask for its bytes and free
    /// them again, and keep a last one.
    Churn(usize, u8, usize),
    /// Use live block `pick` on another stream (`record_stream`), then free it.
    FreeElsewhere(usize),
    Drain,
    Advance(usize),
    EmptyCache,
    Toggle(Key, bool),
    /// A memory fraction in percent (100: none).
    Fraction(u8),
    Stats,
}

fn small_bytes(r: &mut Rng) -> u64 {
    match r.below(6) {
        0 => 512 * KIB,
        1 => MIB,
        2 => 768 * KIB,
        3 => (1 + r.below(64)) * 512,
        _ => (1 + r.below(2048)) * 512,
    }
}

fn gen_ops(seed: u64, n: usize, threads: usize, toggles: bool) -> Vec<Op> {
    gen_ops_with(seed, n, threads, toggles, 85)
}

/// `small_pct`: how many requests in a hundred are small (up to 1 MiB).
fn gen_ops_with(seed: u64, n: usize, threads: usize, toggles: bool, small_pct: u64) -> Vec<Op> {
    let mut r = Rng::new(seed ^ 0x5A11_9A6E);
    let t = |r: &mut Rng| r.below(threads as u64) as usize;
    // One program in three keeps more blocks live (half its frees become requests), so
    // that small devices fill up.
    let dense = seed.is_multiple_of(3);
    (0..n)
        .map(|_| match r.below(100) {
            x if x <= 29 || (dense && x <= 49 && r.pct(50)) => {
                let bytes = if r.pct(small_pct) {
                    small_bytes(&mut r)
                } else {
                    MIB + 1 + r.below(24 * MIB)
                };
                Op::Alloc(bytes, r.below(3) as usize, t(&mut r))
            }
            30..=49 => Op::Free(r.next() as usize, t(&mut r)),
            50..=69 => Op::Churn(r.next() as usize, 1 + r.below(4) as u8, t(&mut r)),
            70..=73 => Op::FreeElsewhere(r.next() as usize),
            74..=78 => Op::Drain,
            79..=82 => Op::Advance(r.below(3) as usize),
            83..=85 => Op::EmptyCache,
            86..=92 if toggles => {
                let key = r.pick(&[Key::Bound, Key::Bound, Key::Expandable, Key::Reclaim]);
                Op::Toggle(key, r.pct(60))
            }
            93..=94 if toggles => Op::Fraction(r.pick(&[100, 100, 50, 80])),
            _ => Op::Stats,
        })
        .collect()
}

/// Worker threads that run closures one at a time, in the caller's order.
struct Workers {
    tx: Vec<mpsc::Sender<Box<dyn FnOnce() + Send>>>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Workers {
    fn new(n: usize) -> Workers {
        let mut tx = Vec::new();
        let mut handles = Vec::new();
        for _ in 0..n {
            let (t, rx) = mpsc::channel::<Box<dyn FnOnce() + Send>>();
            tx.push(t);
            handles.push(std::thread::spawn(move || {
                while let Ok(f) = rx.recv() {
                    f();
                }
            }));
        }
        Workers { tx, handles }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.tx.clear();
        for h in self.handles.drain(..) {
            h.join().unwrap();
        }
    }
}

struct Side {
    fake: Arc<FakeDriver>,
    a: Arc<CachingAllocator>,
    streams: Vec<StreamHandle>,
    live: Vec<Allocation>,
    workers: Option<Workers>,
}

fn outcome(r: Result<Allocation, ferrocuda_alloc::AllocError>) -> String {
    match r {
        Ok(x) => format!("{:#x}+{:#x}", x.ptr.0, x.size),
        Err(e) => format!("error: {e}"),
    }
}

impl Side {
    fn new(capacity: u64, conf: &str, completion: Completion, threads: usize) -> Side {
        let (fake, a) = setup(capacity, conf, completion);
        let streams = vec![
            LEGACY,
            new_stream(&fake).unwrap(),
            new_stream(&fake).unwrap(),
        ];
        Side {
            fake,
            a: Arc::new(a),
            streams,
            live: Vec::new(),
            workers: (threads > 1).then(|| Workers::new(threads)),
        }
    }

    /// Runs `f` on worker `t` (or here, with no workers) and waits for it.
    fn on<T: Send + 'static>(
        &self,
        t: usize,
        f: impl FnOnce(&CachingAllocator) -> T + Send + 'static,
    ) -> T {
        let a = self.a.clone();
        match &self.workers {
            None => f(&a),
            Some(w) => {
                let (rtx, rrx) = mpsc::channel();
                w.tx[t % w.tx.len()]
                    .send(Box::new(move || rtx.send(f(&a)).unwrap()))
                    .unwrap();
                rrx.recv().unwrap()
            }
        }
    }

    fn touch(&self, x: &Allocation, s: StreamHandle) {
        self.fake
            .memset_async(x.ptr, MemsetValue::U8(7), 1, s)
            .unwrap();
    }

    fn step(&mut self, op: Op) -> R<Vec<String>> {
        let n = self.live.len();
        let mut got = Vec::new();
        match op {
            Op::Alloc(bytes, s, t) => {
                let s = self.streams[s];
                let r = self.on(t, move |a| a.allocate(bytes, s));
                if let Ok(x) = r {
                    self.touch(&x, s);
                    self.live.push(x);
                }
                got.push(outcome(r));
            }
            Op::Free(p, t) if n > 0 => {
                let x = self.live.swap_remove(p % n);
                self.on(t, move |a| a.free(x.ptr))
                    .map_err(|e| format!("free: {e}"))?;
            }
            Op::Churn(p, k, t) if n > 0 => {
                let x = self.live.swap_remove(p % n);
                let (outs, kept) = self.on(t, move |a| {
                    let mut outs = Vec::new();
                    a.free(x.ptr).unwrap();
                    for i in 0..=k {
                        match a.allocate(x.requested, x.stream) {
                            Ok(y) => {
                                outs.push(outcome(Ok(y)));
                                if i == k {
                                    return (outs, Some(y));
                                }
                                a.free(y.ptr).unwrap();
                            }
                            Err(e) => {
                                outs.push(outcome(Err(e)));
                                break;
                            }
                        }
                    }
                    (outs, None)
                });
                got.extend(outs);
                if let Some(y) = kept {
                    self.touch(&y, y.stream);
                    self.live.push(y);
                }
            }
            Op::FreeElsewhere(p) if n > 0 => {
                let x = self.live.swap_remove(p % n);
                let other = *self.streams.iter().find(|&&s| s != x.stream).unwrap();
                self.a
                    .record_stream(x.ptr, other)
                    .map_err(|e| format!("record_stream: {e}"))?;
                self.touch(&x, other);
                self.a.free(x.ptr).map_err(|e| format!("free: {e}"))?;
            }
            Op::Drain => {
                self.fake.advance_all();
            }
            Op::Advance(s) => {
                self.fake.advance(self.streams[s], None).unwrap();
            }
            Op::EmptyCache => self.on(0, |a| a.empty_cache()),
            Op::Toggle(key, on) => {
                let name = match key {
                    Key::Bound => "expandable_segments_small_page_bound",
                    Key::Expandable => "expandable_segments",
                    Key::Reclaim => "expandable_segments_reclaim",
                };
                let v = if on { "True" } else { "False" };
                self.a
                    .update_config(&format!("{name}:{v}"))
                    .map_err(|e| format!("update_config: {e}"))?;
            }
            Op::Fraction(pct) => {
                self.a
                    .set_memory_fraction(f64::from(pct) / 100.0)
                    .map_err(|e| format!("fraction: {e}"))?;
            }
            _ => {}
        }
        Ok(got)
    }

    fn finish(&self) -> R<()> {
        self.a.check_invariants()?;
        self.fake
            .device_synchronize(D0)
            .map_err(|e| format!("sticky error: {e:?}"))
    }
}

fn sorted_blocks(a: &CachingAllocator) -> Vec<BlockInfo> {
    let mut b = a.blocks();
    b.sort_by_key(|b| b.ptr.0);
    b
}

/// How the two sides of a differential run differ.
#[derive(Clone, Copy)]
struct Pair<'a> {
    conf_a: &'a str,
    conf_b: &'a str,
    threads_a: usize,
    threads_b: usize,
    capacity: u64,
    completion: Completion,
    /// Compare statistics and check invariants after every step (this settles the thread
    /// cache each time); otherwise at `Op::Stats` and at the end only.
    every_step: bool,
}

fn diff(p: Pair<'_>, ops: &[Op]) -> R<()> {
    diff_counted(p, ops).map(|_| ())
}

/// [`diff`], counting the requests served and refused.
fn diff_counted(p: Pair<'_>, ops: &[Op]) -> R<(usize, usize)> {
    let (mut served, mut refused) = (0, 0);
    let mut x = Side::new(p.capacity, p.conf_a, p.completion, p.threads_a);
    let mut y = Side::new(p.capacity, p.conf_b, p.completion, p.threads_b);
    for (i, &op) in ops.iter().enumerate() {
        let (gx, gy) = (x.step(op)?, y.step(op)?);
        if gx != gy {
            return Err(format!("step {i} {op:?}: {gx:?} vs {gy:?}"));
        }
        refused += gx.iter().filter(|g| g.starts_with("error")).count();
        served += gx.iter().filter(|g| !g.starts_with("error")).count();
        if p.every_step || matches!(op, Op::Stats) {
            if let Some(d) = common::stats_diff(&x.a, &y.a) {
                return Err(format!("step {i} {op:?}: stats differ: {d}"));
            }
            x.a.check_invariants()
                .map_err(|e| format!("step {i} {op:?}: A: {e}"))?;
            y.a.check_invariants()
                .map_err(|e| format!("step {i} {op:?}: B: {e}"))?;
        }
    }
    if let Some(d) = common::stats_diff(&x.a, &y.a) {
        return Err(format!("at the end: stats differ: {d}"));
    }
    let (bx, by) = (sorted_blocks(&x.a), sorted_blocks(&y.a));
    if bx != by {
        let first = bx.iter().zip(&by).find(|(u, v)| u != v);
        return Err(format!(
            "at the end: blocks differ ({} vs {}); first {first:?}",
            bx.len(),
            by.len()
        ));
    }
    let (sx, sy) = (x.a.snapshot().0, y.a.snapshot().0);
    if sx != sy {
        return Err("at the end: snapshots differ".into());
    }
    x.finish()?;
    y.finish()?;
    Ok((served, refused))
}

fn diff_seeds(p: Pair<'_>, seeds: std::ops::Range<u64>, len: usize, toggles: bool) {
    diff_seeds_with(p, seeds, len, toggles, 85);
}

fn diff_seeds_with(
    p: Pair<'_>,
    seeds: std::ops::Range<u64>,
    len: usize,
    toggles: bool,
    small_pct: u64,
) {
    let threads = p.threads_a.max(p.threads_b).max(1);
    let (mut served, mut refused) = (0, 0);
    for seed in scaled(seeds) {
        let ops = gen_ops_with(seed, len, threads, toggles, small_pct);
        match diff_counted(p, &ops) {
            Ok((s, r)) => {
                served += s;
                refused += r;
            }
            Err(e) => {
                let min = shrink(&ops, |o| diff(p, o).is_err());
                let why = diff(p, &min).unwrap_err();
                panic!(
                    "{} vs {} (cap {} MiB, {:?}) seed {seed}: {e}\nminimal ({} ops): {min:?}\n=> {why}",
                    p.conf_a,
                    p.conf_b,
                    p.capacity / MIB,
                    p.completion,
                    min.len()
                );
            }
        }
    }
    eprintln!(
        "{} vs {}: {served} requests served, {refused} refused",
        p.conf_a, p.conf_b
    );
}

fn run_tc_vs_lock(
    conf: &str,
    capacity: u64,
    completion: Completion,
    every_step: bool,
    seeds: std::ops::Range<u64>,
) {
    let (a, b) = (
        format!("{conf},thread_cache:True"),
        format!("{conf},thread_cache:False"),
    );
    let p = Pair {
        conf_a: &a,
        conf_b: &b,
        threads_a: 1,
        threads_b: 1,
        capacity,
        completion,
        every_step,
    };
    diff_seeds(p, seeds, 200, true);
}

#[test]
fn thread_cache_matches_single_lock_recommended_manual_every_step() {
    run_tc_vs_lock(RECOMMENDED, 96 * MIB, Completion::Manual, true, 0..25);
}

#[test]
fn thread_cache_matches_single_lock_recommended_manual_at_stats() {
    run_tc_vs_lock(RECOMMENDED, 96 * MIB, Completion::Manual, false, 100..140);
}

#[test]
fn thread_cache_matches_single_lock_recommended_eager_large_device() {
    run_tc_vs_lock(RECOMMENDED, 8 * GIB, Completion::Eager, false, 200..240);
}

#[test]
fn thread_cache_matches_single_lock_bound_without_reclaim() {
    run_tc_vs_lock(BOUND, 160 * MIB, Completion::Manual, false, 300..340);
    run_tc_vs_lock(BOUND, 64 * MIB, Completion::Eager, true, 340..360);
}

/// Three worker threads hand blocks to each other (each op on a chosen thread, one at a
/// time) against the same program on one thread: thread cache slots are per thread, the
/// results may not be.
#[test]
fn threads_handing_blocks_over_match_one_thread() {
    for (conf, cap, completion, seeds) in [
        (RECOMMENDED, 96 * MIB, Completion::Manual, 400..415),
        (BOUND, 8 * GIB, Completion::Eager, 420..435),
    ] {
        let p = Pair {
            conf_a: conf,
            conf_b: conf,
            threads_a: 3,
            threads_b: 1,
            capacity: cap,
            completion,
            every_step: false,
        };
        diff_seeds(p, seeds, 150, true);
        let lock = format!("{conf},thread_cache:False");
        let p = Pair { conf_b: &lock, ..p };
        diff_seeds(p, 450..460, 150, true);
    }
}

/// The key touches the small pool only: programs of large requests (toggling the key too)
/// give the same pointers, statistics and snapshots with it on and off.
#[test]
fn the_large_pool_does_not_see_the_key() {
    let off = format!("{RECOMMENDED},expandable_segments_small_page_bound:False");
    for (cap, completion, seeds) in [
        (96 * MIB, Completion::Manual, 600..630),
        (8 * GIB, Completion::Eager, 630..650),
    ] {
        let p = Pair {
            conf_a: RECOMMENDED,
            conf_b: &off,
            threads_a: 1,
            threads_b: 1,
            capacity: cap,
            completion,
            every_step: true,
        };
        diff_seeds_with(p, seeds, 200, true, 0);
    }
}

// ---- model -------------------------------------------------------------------------------

/// With the key on: no mapped small expandable block spans a page boundary, and no two
/// adjacent mapped small free blocks share a page.
fn page_model(a: &CachingAllocator) -> R<()> {
    let blocks = a.blocks();
    let small = |b: &BlockInfo| b.pool == PoolKind::Small && b.expandable && b.mapped;
    for b in blocks.iter().filter(|b| small(b)) {
        let off = b.ptr.0 - b.segment.0;
        if off / PAGE != (off + b.size - 1) / PAGE {
            return Err(format!(
                "small block {:#x} (+{:#x}) at offset {off:#x} spans a page boundary",
                b.ptr.0, b.size
            ));
        }
    }
    let free = |b: &BlockInfo| !b.allocated && !b.pending_events;
    for w in blocks.windows(2) {
        let (x, y) = (&w[0], &w[1]);
        if x.segment == y.segment
            && small(x)
            && small(y)
            && free(x)
            && free(y)
            && x.ptr.0 + x.size == y.ptr.0
            && (x.ptr.0 - x.segment.0) / PAGE == (y.ptr.0 - y.segment.0) / PAGE
        {
            return Err(format!(
                "free small blocks {:#x} (+{:#x}) and {:#x} (+{:#x}) share a page unmerged",
                x.ptr.0, x.size, y.ptr.0, y.size
            ));
        }
    }
    Ok(())
}

fn model_run(conf: &str, capacity: u64, completion: Completion, ops: &[Op]) -> R<()> {
    let mut s = Side::new(capacity, conf, completion, 1);
    for (i, &op) in ops.iter().enumerate() {
        s.step(op)?;
        s.a.check_invariants()
            .map_err(|e| format!("step {i} {op:?}: {e}"))?;
        page_model(&s.a).map_err(|e| format!("step {i} {op:?}: {e}"))?;
    }
    s.finish()
}

#[test]
fn small_blocks_stay_in_their_pages_and_merge_inside_them() {
    for (conf, cap, completion, seeds) in [
        (RECOMMENDED, 96 * MIB, Completion::Manual, 500..540),
        (RECOMMENDED, 8 * GIB, Completion::Eager, 540..570),
        (BOUND, 64 * MIB, Completion::Manual, 570..600),
    ] {
        for seed in scaled(seeds) {
            // Toggles of expandable segments and reclaim, never of the key.
            let ops: Vec<Op> = gen_ops(seed, 200, 1, true)
                .into_iter()
                .filter(|o| !matches!(o, Op::Toggle(Key::Bound, _)))
                .collect();
            if let Err(e) = model_run(conf, cap, completion, &ops) {
                let min = shrink(&ops, |o| model_run(conf, cap, completion, o).is_err());
                let why = model_run(conf, cap, completion, &min).unwrap_err();
                panic!(
                    "{conf} seed {seed}: {e}\nminimal ({} ops): {min:?}\n=> {why}",
                    min.len()
                );
            }
        }
    }
}

// ---- hand-made edges ---------------------------------------------------------------------

fn small_layout(a: &CachingAllocator) -> Vec<(u64, u64, bool)> {
    let blocks = a.blocks();
    blocks
        .iter()
        .filter(|b| b.pool == PoolKind::Small && b.expandable && b.mapped)
        .map(|b| (b.ptr.0 - b.segment.0, b.size, b.allocated))
        .collect()
}

/// Page 0: a free 768 KiB block B, then 1280 KiB in use; page 1: 1.5 MiB in use, then a
/// free 512 KiB block A before the unmapped tail. A 512 KiB request: PyTorch's walk passes
/// A (it could grow) for B; with the key nothing grows, so A, the best fit, serves.
#[test]
fn best_fit_ignores_growth_room_in_the_small_pool() -> common::TestResult {
    for (conf, want_a) in [(BOUND, true), ("expandable_segments:True", false)] {
        for tc in ["True", "False"] {
            let (_fake, a) = setup(
                8 * GIB,
                &format!("{conf},thread_cache:{tc}"),
                Completion::Eager,
            );
            let b = a.allocate(768 * KIB, LEGACY)?;
            let _k1 = a.allocate(MIB, LEGACY)?;
            let _k2 = a.allocate(256 * KIB, LEGACY)?;
            let _k3 = a.allocate(MIB, LEGACY)?;
            let _k4 = a.allocate(512 * KIB, LEGACY)?;
            let x = a.allocate(512 * KIB, LEGACY)?;
            assert_eq!(
                x.ptr.0,
                b.ptr.0 + 2 * PAGE - 512 * KIB,
                "{conf}: A ends page 1"
            );
            a.free(b.ptr)?;
            a.free(x.ptr)?;
            let got = a.allocate(512 * KIB, LEGACY)?;
            let want = if want_a { x.ptr.0 } else { b.ptr.0 };
            assert_eq!(got.ptr.0, want, "{conf} thread_cache:{tc}");
            a.check_invariants()?;
        }
    }
    Ok(())
}

/// Outcome of [`switching_the_key_on_over_blocks_that_span_pages`]: the offsets handed out,
/// and the small pool's layout with the key on and after it is switched off again.
type SwitchOutcome = (Vec<u64>, Vec<(u64, u64, bool)>, Vec<(u64, u64, bool)>);

/// The key off: 1 MiB blocks at 1 and 2 MiB are freed and merge across the page boundary
/// into a free 2 MiB block spanning it. The key switched on, blocks cut from that block may
/// still span the boundary (the key applies to later frees and growths): a 512 KiB request
/// takes [1, 1.5) MiB and a 1 MiB one [1.5, 2.5) MiB. Their frees start no page, so they
/// merge back into [1, 3) MiB; switched off again, everything merges into one 4 MiB block.
/// The thread cache agrees with the single lock throughout.
#[test]
fn switching_the_key_on_over_blocks_that_span_pages() -> common::TestResult {
    let run = |tc: &str| -> Result<SwitchOutcome, Box<dyn std::error::Error>> {
        let (_fake, a) = setup(
            8 * GIB,
            &format!("expandable_segments:True,thread_cache:{tc}"),
            Completion::Eager,
        );
        let p: Vec<_> = (0..4)
            .map(|_| a.allocate(MIB, LEGACY))
            .collect::<Result<_, _>>()?;
        a.free(p[1].ptr)?;
        a.free(p[2].ptr)?; // merged: [1 MiB, 3 MiB) spans the boundary at 2 MiB
        a.update_config("expandable_segments_small_page_bound:True")?;
        let mut seen = Vec::new();
        // Takes the front of the spanning block: [1, 2) MiB; the rest [2, 3) MiB is free.
        let x = a.allocate(512 * KIB, LEGACY)?;
        seen.push(x.ptr.0 - p[0].ptr.0);
        let y = a.allocate(MIB, LEGACY)?;
        seen.push(y.ptr.0 - p[0].ptr.0);
        for _ in 0..3 {
            a.free(x.ptr)?;
            let z = a.allocate(512 * KIB, LEGACY)?;
            seen.push(z.ptr.0 - p[0].ptr.0);
            assert_eq!(z.ptr, x.ptr);
        }
        a.free(y.ptr)?;
        a.free(x.ptr)?;
        a.check_invariants()?;
        let layout = small_layout(&a);
        a.update_config("expandable_segments_small_page_bound:False")?;
        a.free(p[0].ptr)?;
        a.free(p[3].ptr)?;
        a.check_invariants()?;
        Ok((seen, layout, small_layout(&a)))
    };
    let cached = run("True")?;
    let locked = run("False")?;
    assert_eq!(cached.0, locked.0);
    assert_eq!(cached.1, locked.1);
    assert_eq!(cached.2, locked.2);
    assert_eq!(cached.0, vec![MIB, 3 * MIB / 2, MIB, MIB, MIB]);
    assert_eq!(
        cached.1,
        vec![(0, MIB, true), (MIB, 2 * MIB, false), (3 * MIB, MIB, true)]
    );
    // Switched off again, everything merges into one free 4 MiB run.
    assert_eq!(cached.2, vec![(0, 4 * MIB, false)]);
    Ok(())
}

/// Six 768 KiB blocks fill three pages two by two (each page keeps 512 KiB free). Freeing
/// the first of pages 0 and 1 and both of page 2 leaves page 2 whole: `empty_cache` unmaps
/// it and nothing else. Four 1 MiB requests fit no free block: they map page 2 again, then
/// page 3, each holding two. The figures match the single lock.
#[test]
fn empty_cache_then_reuse_maps_whole_pages() -> common::TestResult {
    let run = |tc: &str| -> Result<_, Box<dyn std::error::Error>> {
        let (fake, a) = setup(
            8 * GIB,
            &format!("{RECOMMENDED},thread_cache:{tc}"),
            Completion::Eager,
        );
        let xs: Vec<_> = (0..6)
            .map(|_| a.allocate(768 * KIB, LEGACY))
            .collect::<Result<_, _>>()?;
        assert_eq!(xs[2].ptr.0, xs[0].ptr.0 + PAGE);
        for i in [0, 2, 4, 5] {
            a.free(xs[i].ptr)?;
        }
        a.empty_cache();
        let before = stat(&a, "reserved_bytes.small_pool.current");
        assert_eq!(
            before,
            2 * PAGE as i64,
            "page 2 unmapped, pages 0 and 1 kept"
        );
        let ys: Vec<_> = (0..4)
            .map(|_| a.allocate(MIB, LEGACY).map(|y| y.ptr.0 - xs[0].ptr.0))
            .collect::<Result<_, _>>()?;
        assert_eq!(ys, vec![4 * MIB, 5 * MIB, 6 * MIB, 7 * MIB]);
        assert_eq!(
            stat(&a, "reserved_bytes.small_pool.current"),
            4 * PAGE as i64
        );
        page_model(&a)?;
        a.check_invariants()?;
        let (free, total) = fake.mem_get_info(D0)?;
        assert_eq!(
            total - free,
            stat(&a, "reserved_bytes.all.current") as u64,
            "reserved bytes are the device's used bytes"
        );
        Ok((before, ys, a.stats().to_map(), a.snapshot().0))
    };
    let cached = run("True")?;
    let locked = run("False")?;
    assert_eq!(cached, locked);
    Ok(())
}

/// A 64 MiB device filled with 1 MiB small blocks and large blocks, then freed in a
/// pattern that leaves half-pages free: with `ferrocuda_recommended` (the OOM retry
/// releases partially and searches after a sync) a large request either fits or fails the
/// same way with the thread cache and without, and small pages stay whole.
#[test]
fn oom_paths_of_the_recommended_set_match_the_single_lock() -> common::TestResult {
    let run = |tc: &str| -> Result<_, Box<dyn std::error::Error>> {
        let (fake, a) = setup(
            64 * MIB,
            &format!("{RECOMMENDED},thread_cache:{tc}"),
            Completion::Manual,
        );
        let s1 = new_stream(&fake)?;
        let mut small = Vec::new();
        while let Ok(x) = a.allocate(MIB, LEGACY) {
            fake.memset_async(x.ptr, MemsetValue::U8(1), 1, LEGACY)?;
            small.push(x);
            if small.len() == 40 {
                break;
            }
        }
        let mut out = vec![small.len() as u64];
        for x in small.iter().step_by(2) {
            a.free(x.ptr)?;
        }
        // Half of every page is free, none whole: a large request must come from the rest.
        for bytes in [8 * MIB, 16 * MIB, 30 * MIB] {
            out.push(match a.allocate(bytes, s1) {
                Ok(x) => x.ptr.0,
                Err(_) => 0,
            });
            page_model(&a)?;
            a.check_invariants()?;
        }
        fake.advance_all();
        for x in small.iter().skip(1).step_by(2) {
            a.free(x.ptr)?;
        }
        out.push(match a.allocate(30 * MIB, s1) {
            Ok(x) => x.ptr.0,
            Err(_) => 0,
        });
        page_model(&a)?;
        a.check_invariants()?;
        Ok((out, a.stats().to_map(), a.snapshot().0))
    };
    let cached = run("True")?;
    let locked = run("False")?;
    assert_eq!(cached.0, locked.0);
    assert_eq!(cached.1, locked.1);
    assert_eq!(cached.2, locked.2);
    Ok(())
}

/// A memory fraction of a quarter of a 64 MiB device: small pages up to the limit, then
/// OOM; freeing one page's blocks lets exactly one more page's worth in.
#[test]
fn a_memory_fraction_bounds_the_small_pages() -> common::TestResult {
    let (_fake, a) = setup(64 * MIB, BOUND, Completion::Eager);
    a.set_memory_fraction(0.25)?;
    let mut xs = Vec::new();
    while let Ok(x) = a.allocate(MIB, LEGACY) {
        xs.push(x);
        assert!(xs.len() <= 16, "the fraction is not enforced");
    }
    assert_eq!(xs.len(), 16, "16 MiB of 1 MiB blocks under the fraction");
    assert_eq!(stat(&a, "reserved_bytes.all.current"), 16 * MIB as i64);
    page_model(&a)?;
    a.free(xs[3].ptr)?;
    a.free(xs[4].ptr)?; // different pages: neither page is whole
    assert!(a.allocate(MIB, LEGACY).is_ok());
    assert!(a.allocate(MIB, LEGACY).is_ok());
    assert!(a.allocate(MIB, LEGACY).is_err());
    page_model(&a)?;
    a.check_invariants()?;
    Ok(())
}

#[test]
fn the_key_takes_booleans_only_and_not_beside_the_async_backend() {
    for good in [
        "expandable_segments_small_page_bound:True",
        "expandable_segments_small_page_bound:False",
        "expandable_segments:True,expandable_segments_small_page_bound:True",
    ] {
        assert!(AllocatorConfig::parse(good).is_ok(), "{good}");
    }
    for bad in [
        "expandable_segments_small_page_bound:1",
        "expandable_segments_small_page_bound:true",
        "expandable_segments_small_page_bound:",
        "expandable_segments_small_page_bound:Yes",
    ] {
        assert!(AllocatorConfig::parse(bad).is_err(), "{bad}");
    }
    let (_fake, a) = setup(8 * GIB, BOUND, Completion::Eager);
    let before = a.config();
    assert!(
        a.update_config("expandable_segments_small_page_bound:1")
            .is_err()
    );
    assert_eq!(a.config(), before, "a rejected update changes nothing");
    let asynced = "backend:cudaMallocAsync,expandable_segments_small_page_bound:True";
    let refused = AllocatorConfig::parse(asynced).map_or(true, |c| {
        matches!(
            AsyncAllocator::from_config(Arc::new(FakeDriver::default()), &c),
            Err(AllocError::AsyncFerrocudaOnly { key }) if key == "expandable_segments_small_page_bound"
        )
    });
    assert!(refused, "{asynced} is accepted");
    let b = AsyncAllocator::from_config(
        Arc::new(FakeDriver::default()),
        &AllocatorConfig::parse("backend:cudaMallocAsync").unwrap(),
    )
    .unwrap();
    assert!(
        b.update_config(asynced).is_err(),
        "an update with the key is accepted"
    );
}
