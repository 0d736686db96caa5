use super::*;

#[derive(Clone, Copy, Debug)]
enum TOp {
    Alloc(u64, usize),
    Free(usize),
    /// Free live block `pick` and ask for the same bytes on the same stream at once.
    Churn(usize, u8),
    Write(usize),
    Drain,
    AdvanceStream(usize),
    EmptyCache,
    Reclaim(bool),
    Stats,
    /// Another thread frees live block `pick` while the next growth is inside the driver
    /// (a `VmCreate`); then `bytes` are asked for and the block got is churned `k` times.
    GrowWithFree(u64, usize, u8),
}

fn gen_tops(seed: u64, n: usize, toggles: bool) -> Vec<TOp> {
    let mut r = Rng(seed.wrapping_mul(0xA24BAED4963EE407) | 1);
    (0..n)
        .map(|_| match r.below(100) {
            0..=29 => {
                let bytes = match r.below(5) {
                    0 => (1 + r.below(1024)) * 1024,
                    1 | 2 => (1 + r.below(6)) * 2 * MIB,
                    _ => (1 + r.below(24)) * MIB - 512 * r.below(2),
                };
                TOp::Alloc(bytes, r.below(2) as usize)
            }
            30..=49 => TOp::Free(r.next() as usize),
            50..=74 => TOp::Churn(r.next() as usize, 1 + r.below(6) as u8),
            75..=82 => TOp::Write(r.next() as usize),
            83..=86 => TOp::Drain,
            87..=89 => TOp::AdvanceStream(r.below(2) as usize),
            90..=91 => TOp::EmptyCache,
            92..=94 if toggles => TOp::Reclaim(r.below(2) == 0),
            _ => TOp::Stats,
        })
        .collect()
}

fn gen_grow_tops(seed: u64, n: usize) -> Vec<TOp> {
    let mut r = Rng(seed.wrapping_mul(0x9FB21C651E98DF25) | 1);
    let mut ops = gen_tops(seed, n, false);
    for op in ops.iter_mut() {
        if r.below(3) == 0 {
            let bytes = (1 + r.below(12)) * MIB * [1, 2][r.below(2) as usize];
            *op = TOp::GrowWithFree(bytes, r.next() as usize, 1 + r.below(3) as u8);
        }
    }
    ops
}

struct Side {
    fake: Arc<FakeDriver>,
    a: Arc<CachingAllocator>,
    streams: Vec<StreamHandle>,
    live: Vec<Allocation>,
}

impl Side {
    fn with_capacity(capacity: u64, conf: &str, completion: Completion) -> Side {
        let (fake, a) = setup(capacity, conf, completion);
        let a = Arc::new(a);
        let streams = vec![LEGACY, new_stream(&fake).unwrap()];
        Side {
            fake,
            a,
            streams,
            live: Vec::new(),
        }
    }
    fn alloc(&mut self, bytes: u64, s: StreamHandle) -> Option<u64> {
        let x = self.a.allocate(bytes, s).ok()?;
        self.fake
            .memset_async(x.ptr, MemsetValue::U8(1), 1, s)
            .unwrap();
        self.live.push(x);
        Some(x.ptr.0)
    }
    fn step(&mut self, op: TOp) -> Vec<Option<u64>> {
        let n = self.live.len();
        let mut got = Vec::new();
        match op {
            TOp::Alloc(b, s) => got.push(self.alloc(b, self.streams[s])),
            TOp::Free(p) if n > 0 => {
                let x = self.live.swap_remove(p % n);
                self.a.free(x.ptr).unwrap();
            }
            TOp::Churn(p, k) if n > 0 => {
                let x = self.live.swap_remove(p % n);
                self.a.free(x.ptr).unwrap();
                for _ in 0..k {
                    let y = self.a.allocate(x.requested, x.stream).unwrap();
                    self.fake
                        .memset_async(y.ptr, MemsetValue::U8(2), 1, y.stream)
                        .unwrap();
                    got.push(Some(y.ptr.0));
                    self.a.free(y.ptr).unwrap();
                }
                got.push(self.alloc(x.requested, x.stream));
            }
            TOp::Write(p) if n > 0 => {
                let x = self.live[p % n];
                self.fake
                    .memset_async(x.ptr, MemsetValue::U8(3), 1, x.stream)
                    .unwrap();
            }
            TOp::Drain => {
                self.fake.advance_all();
            }
            TOp::AdvanceStream(s) => {
                self.fake.advance(self.streams[s], None).unwrap();
            }
            TOp::EmptyCache => self.a.empty_cache(),
            TOp::Reclaim(on) => self
                .a
                .update_config(&format!("expandable_segments_reclaim:{}", py(on)))
                .unwrap(),
            TOp::Stats => {}
            TOp::GrowWithFree(bytes, p, k) if n > 0 => {
                use std::sync::atomic::{AtomicU8, Ordering};
                let victim = self.live.swap_remove(p % n);
                let state = Arc::new(AtomicU8::new(0)); // 0 pending, 1 fired, 2 cancelled
                let (a2, st2) = (self.a.clone(), state.clone());
                self.fake.before_next(Call::VmCreate, move || {
                    if st2
                        .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                    {
                        std::thread::spawn(move || a2.free(victim.ptr).unwrap())
                            .join()
                            .unwrap();
                    }
                });
                match self.a.allocate(bytes, LEGACY) {
                    Ok(x) => {
                        got.push(Some(x.ptr.0));
                        let mut cur = x;
                        for _ in 0..k {
                            self.a.free(cur.ptr).unwrap();
                            cur = self.a.allocate(bytes, LEGACY).unwrap();
                            got.push(Some(cur.ptr.0));
                        }
                        self.live.push(cur);
                    }
                    Err(_) => got.push(None),
                }
                if state
                    .compare_exchange(0, 2, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    self.a.free(victim.ptr).unwrap();
                }
                got.push(Some(u64::from(state.load(Ordering::SeqCst))));
            }
            _ => {}
        }
        got
    }
}

fn run_tc(conf: &str, completion: Completion, ops: &[TOp]) -> R<u64> {
    run_tc_with(conf, completion, ops, true)
}

fn run_tc_with(conf: &str, completion: Completion, ops: &[TOp], compare_stats: bool) -> R<u64> {
    run_tc_cap(16 * GIB, conf, completion, ops, compare_stats)
}

fn run_tc_cap(
    capacity: u64,
    conf: &str,
    completion: Completion,
    ops: &[TOp],
    compare_stats: bool,
) -> R<u64> {
    let mut tc = Side::with_capacity(capacity, &format!("{conf},thread_cache:True"), completion);
    let mut sl = Side::with_capacity(capacity, &format!("{conf},thread_cache:False"), completion);
    let mut allocs = 0;
    for (i, &op) in ops.iter().enumerate() {
        let (g1, g2) = (tc.step(op), sl.step(op));
        allocs += g1.len() as u64;
        if g1 != g2 {
            return Err(format!(
                "step {i} {op:?}: thread cache {g1:x?} vs single lock {g2:x?}"
            ));
        }
        if compare_stats
            && matches!(op, TOp::Stats)
            && let Some(d) = common::stats_diff(&tc.a, &sl.a)
        {
            return Err(format!("step {i}: stats differ: {d}"));
        }
    }
    if compare_stats && let Some(d) = common::stats_diff(&tc.a, &sl.a) {
        return Err(format!("at the end: stats differ: {d}"));
    }
    // (blocks() lists segments in slab order, which may differ: compare by address.)
    let (mut b1, mut b2) = (tc.a.blocks(), sl.a.blocks());
    b1.sort_by_key(|b| b.ptr.0);
    b2.sort_by_key(|b| b.ptr.0);
    if compare_stats && b1 != b2 {
        let first = b1.iter().zip(&b2).find(|(x, y)| x != y);
        return Err(format!(
            "at the end: blocks differ ({} vs {} blocks); first: tc {:?} vs lock {:?}",
            b1.len(),
            b2.len(),
            first.map(|f| f.0),
            first.map(|f| f.1)
        ));
    }
    tc.a.check_invariants()?;
    sl.a.check_invariants()?;
    for s in [&tc, &sl] {
        s.fake
            .device_synchronize(D0)
            .map_err(|e| format!("sticky: {e:?}"))?;
    }
    Ok(allocs)
}

fn tc_seeds(
    conf: &str,
    completion: Completion,
    toggles: bool,
    seeds: std::ops::Range<u64>,
    len: usize,
) {
    let seeds = scaled(seeds);
    let mut total = 0;
    for seed in seeds {
        let ops = gen_tops(seed, len, toggles);
        match run_tc(conf, completion, &ops) {
            Ok(n) => total += n,
            Err(e) => {
                let min = shrink(&ops, |o| run_tc(conf, completion, o).is_err());
                let why = run_tc(conf, completion, &min).unwrap_err();
                panic!(
                    "{conf} {completion:?} seed {seed}: {e}\nminimal ({} ops): {min:?}\n=> {why}",
                    min.len()
                );
            }
        }
    }
    eprintln!("{conf} {completion:?}: {total} allocations compared");
}

#[test]
fn thread_cache_matches_single_lock_reclaim_eager() {
    tc_seeds(RECLAIM, Completion::Eager, false, 0..60, 200);
}

#[test]
fn thread_cache_matches_single_lock_reclaim_eager_toggles() {
    tc_seeds(RECLAIM, Completion::Eager, true, 100..160, 200);
}

#[test]
fn thread_cache_matches_single_lock_plain_eager() {
    tc_seeds(PLAIN, Completion::Eager, false, 200..240, 200);
}

#[test]
fn thread_cache_matches_single_lock_reclaim_manual() {
    tc_seeds(RECLAIM, Completion::Manual, true, 300..360, 200);
}

/// Hand-made: frees the thread cache takes back without the lock count toward a segment's
/// next reclaim mark, and the free that makes it due takes the lock, so under a lagging
/// device both allocators record the same marks and a later growth moves the same pages
/// (before the fix the thread cache recorded none here and mapped new pages).
#[test]
fn thread_cache_frees_make_marks_due_as_the_single_lock_does() {
    let run = |tc: bool| {
        let (fake, a) = setup(
            80 * GIB,
            &format!("{RECLAIM},thread_cache:{}", py(tc)),
            Completion::Manual,
        );
        let s = LEGACY;
        let x_a = a.allocate(10 * MIB, s).unwrap();
        let x_b = a.allocate(10 * MIB, s).unwrap();
        let x_c = a.allocate(4 * MIB, s).unwrap();
        let _d = a.allocate(2 * MIB, s).unwrap();
        fake.advance_all();
        fake.memset_async(x_a.ptr, MemsetValue::U8(1), 1, s)
            .unwrap();
        a.free(x_a.ptr).unwrap();
        a.free(x_c.ptr).unwrap();
        for _ in 0..20 {
            let y = a.allocate(4 * MIB, s).unwrap();
            a.free(y.ptr).unwrap();
        }
        fake.advance_all();
        fake.memset_async(x_b.ptr, MemsetValue::U8(2), 1, s)
            .unwrap();
        let r0 = stat(&a, "reserved_bytes.all.current");
        let _g = a.allocate(12 * MIB, s).unwrap();
        let grown = stat(&a, "reserved_bytes.all.current") - r0;
        fake.device_synchronize(D0).unwrap();
        a.check_invariants().unwrap();
        (grown, fake.calls(Call::EventRecord))
    };
    let (tc, sl) = (run(true), run(false));
    assert_eq!(
        tc, sl,
        "(new reserved bytes, event records): thread cache {tc:?} vs single lock {sl:?}"
    );
}

/// Pointers only (statistics aside), lagging device: do the mark-timing differences ever
/// change what is handed out?
#[test]
fn thread_cache_pointers_reclaim_manual() {
    let conf = RECLAIM;
    for seed in 300..400 {
        let ops = gen_tops(seed, 200, true);
        if let Err(e) = run_tc_with(conf, Completion::Manual, &ops, false) {
            let f = |o: &[TOp]| run_tc_with(conf, Completion::Manual, o, false).is_err();
            let min = shrink(&ops, f);
            let why = run_tc_with(conf, Completion::Manual, &min, false).unwrap_err();
            panic!(
                "seed {seed}: {e}\nminimal ({} ops): {min:?}\n=> {why}",
                min.len()
            );
        }
    }
}

/// Hand-made: the credit's rival check under reclaim (`tail_only`). Another thread frees R
/// while X's growth is inside the driver (lock released). After X's free, best fit judges
/// X by X + its 6 MiB tail (12 MiB) and R (8 MiB, before a 4 MiB hole between mapped
/// blocks) as an ordinary 8 MiB block: R wins, so X must not be credited. (Under PyTorch's
/// rule R would count as 12 MiB, not less than X's 12, and X would win.) 64 MiB device: a 72 MiB range.
fn credit_rival_case(conf: &str, tc: bool) -> (u64, u64, u64) {
    let (fake, a) = setup(
        64 * MIB,
        &format!("{conf},thread_cache:{}", py(tc)),
        Completion::Eager,
    );
    let a = Arc::new(a);
    let s = LEGACY;
    let _p = a.allocate(2 * MIB, s).unwrap();
    let r2 = a.allocate(12 * MIB, s).unwrap();
    let _q = a.allocate(46 * MIB, s).unwrap();
    a.free(r2.ptr).unwrap();
    a.empty_cache(); // [2, 14) unmapped
    let r = a.allocate(8 * MIB, s).unwrap(); // [2, 10); hole [10, 14)
    assert_eq!(r.ptr.0, r2.ptr.0);
    // A used credit first (the throttle grants fewer after unused ones).
    for _ in 0..4 {
        let z = a.allocate(512, s).unwrap();
        a.free(z.ptr).unwrap();
    }
    let a2 = a.clone();
    fake.before_next(Call::VmCreate, move || {
        std::thread::spawn(move || a2.free(r.ptr).unwrap())
            .join()
            .unwrap();
    });
    let x = a.allocate(6 * MIB, s).unwrap(); // grows at [60, 66); tail [66, 72)
    a.free(x.ptr).unwrap();
    let y = a.allocate(6 * MIB, s).unwrap();
    a.check_invariants().unwrap();
    (
        x.ptr.0 - r.ptr.0,
        y.ptr.0 - r.ptr.0,
        stat(&a, "reserved_bytes.all.current") as u64,
    )
}

#[test]
fn credit_rival_freed_during_growth() {
    for conf in [RECLAIM, PLAIN] {
        let (tc, sl) = (
            credit_rival_case(conf, true),
            credit_rival_case(conf, false),
        );
        eprintln!("{conf}: (x - r, y - r, reserved) tc {tc:?} lock {sl:?}");
        assert_eq!(tc, sl, "{conf}: thread cache vs single lock");
    }
    // Under reclaim R (ordinary 8 MiB) beats X (6 + 4 tail); under PyTorch's rule X wins.
    assert_eq!(credit_rival_case(RECLAIM, false).1, 0);
    assert_eq!(credit_rival_case(PLAIN, false).1, 58 * MIB);
}

/// Random programs where another thread frees a block while a growth is inside the driver
/// (the credit's rival check), on small devices (short tails), eager completion.
#[test]
fn thread_cache_matches_single_lock_frees_during_growth() {
    for (conf, cap) in [
        (RECLAIM, 64 * MIB),
        (RECLAIM, 160 * MIB),
        (PLAIN, 96 * MIB),
        (RECLAIM, 4 * GIB),
    ] {
        let mut fired = 0;
        for seed in scaled(0..50) {
            let ops = gen_grow_tops(seed, 150);
            let run = |o: &[TOp]| run_tc_cap(cap, conf, Completion::Eager, o, true);
            if let Err(e) = run(&ops) {
                let min = shrink(&ops, |o| run(o).is_err());
                let why = run(&min).unwrap_err();
                panic!(
                    "{conf} cap {cap} seed {seed}: {e}\nminimal ({} ops): {min:?}\n=> {why}",
                    min.len()
                );
            }
            fired += ops
                .iter()
                .filter(|o| matches!(o, TOp::GrowWithFree(..)))
                .count();
        }
        eprintln!("{conf} cap {} MiB: {fired} grow-with-free ops", cap / MIB);
    }
}

/// Reclaim off, lagging device: no marks, so the thread cache must match exactly.
#[test]
fn thread_cache_matches_single_lock_plain_manual() {
    tc_seeds(PLAIN, Completion::Manual, false, 700..760, 200);
}
