//! What the tests share: programs of operations, run on an allocator with its thread cache
//! and on the single-lock reference side by side; a model of best fit read from `blocks()`
//! that says which case of the credit's walk each free+allocate pair met; shrinking.
use crate::common::{D0, LEGACY, MIB, new_stream, setup};
use ferrocuda_alloc::{Allocation, BlockInfo, CachingAllocator};
use ferrocuda_driver::{Call, Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{DevicePtr, MemsetValue, PoolId, StreamHandle};
use std::collections::BTreeMap;
use std::sync::Arc;

pub(crate) use crate::common::{Rng, stats_diff};

/// `PROBE_SCALE` (default 1).
pub(crate) fn scale() -> u64 {
    std::env::var("PROBE_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// `n` seeds from `base`, `PROBE_SCALE` times as many.
pub(crate) fn seeds(base: u64, n: u64) -> std::ops::Range<u64> {
    base..base + n * scale()
}

/// One operation of a program, with live blocks named by index (modulo the live count), so
/// that any subsequence of a program is a program (for shrinking).
#[derive(Clone, Debug)]
pub(crate) enum Op {
    /// Allocates and keeps the block.
    Alloc {
        bytes: u64,
        stream: usize,
    },
    /// Allocates, then frees and allocates the same bytes on the same stream `k` times (the
    /// thread cache's case), keeping the last block.
    AllocChurn {
        bytes: u64,
        stream: usize,
        k: u8,
    },
    Free {
        pick: usize,
    },
    /// Frees a live block, then allocates its bytes on its stream, frees again and
    /// allocates again (`k` pairs), keeping the last block.
    Churn {
        pick: usize,
        k: u8,
    },
    /// [`Op::Churn`] of the block allocated last (the one a credit can be on).
    ChurnLast {
        k: u8,
    },
    /// Frees the block allocated last (parked, if it has a credit).
    FreeLast,
    /// Frees a live block and allocates other bytes on its stream.
    FreeRealloc {
        pick: usize,
        bytes: u64,
    },
    /// Writes a byte of a live block on its stream.
    Write {
        pick: usize,
    },
    /// `record_stream` on another stream, a write there, then the free.
    RecordFree {
        pick: usize,
        stream: usize,
    },
    Advance {
        stream: usize,
    },
    Drain,
    EmptyCache,
    /// `update_config`, on both sides.
    Config(&'static str),
    /// `thread_cache:True/False` at run time, on the thread-cache side only.
    ThreadCache(bool),
    Fraction(f64),
    /// `reset_peak_stats` (peaks at the current values: a credit must then pass none) or,
    /// with `true`, `reset_accumulated_stats` too.
    ResetStats(bool),
    /// Compare `stats()` and `blocks()` here.
    Stats,
    /// Another thread frees live block `pick` while this thread's request for `bytes` is
    /// inside the driver call `HOOKS[call]` (the allocator's lock released); the block got
    /// is then freed and asked for again `k` times. (Not freed during the request when it
    /// makes no such call: then freed after it.) With `churn` > 0 the other thread then
    /// also allocates `churn` bytes on the same stream, frees them, asks again and frees
    /// (its own credit, granted and used while this thread is inside the driver).
    GrowWithFree {
        bytes: u64,
        stream: usize,
        pick: usize,
        k: u8,
        call: usize,
        churn: u64,
    },
    /// [`Op::GrowWithFree`] (during a `VmMap`) of a live block followed by an unmapped
    /// range (before a hole or its segment's tail), found on the reference's `blocks()`.
    GrowWithFreeBeforeHole {
        bytes: u64,
        stream: usize,
        pick: usize,
        k: u8,
        churn: u64,
    },
}

/// The driver calls [`Op::GrowWithFree`] frees during.
pub(crate) const HOOKS: [Call; 4] = [Call::VmMap, Call::VmCreate, Call::VmReserve, Call::Malloc];

/// An operation with its blocks resolved to pointers: what both sides run.
#[derive(Clone, Debug)]
pub(crate) enum Conc {
    Alloc {
        bytes: u64,
        stream: StreamHandle,
    },
    AllocChurn {
        bytes: u64,
        stream: StreamHandle,
        k: u8,
    },
    Free(DevicePtr),
    Churn {
        ptr: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
        k: u8,
    },
    FreeRealloc {
        ptr: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    },
    Write(DevicePtr, StreamHandle),
    RecordFree(DevicePtr, StreamHandle),
    Advance(StreamHandle),
    Drain,
    EmptyCache,
    Config(&'static str),
    ThreadCache(bool),
    Fraction(f64),
    ResetStats(bool),
    Stats,
    GrowWithFree {
        bytes: u64,
        stream: StreamHandle,
        victim: DevicePtr,
        k: u8,
        call: usize,
        churn: u64,
    },
}

/// How a program runs: the configuration both sides share (the thread-cache side adds
/// `thread_cache:True`, the reference `thread_cache:False`), the device and its streams.
#[derive(Clone, Debug)]
pub(crate) struct Case {
    pub conf: String,
    pub capacity: u64,
    pub completion: Completion,
    pub streams: usize,
}

impl Case {
    pub(crate) fn new(conf: &str, capacity: u64, completion: Completion, streams: usize) -> Case {
        Case {
            conf: conf.to_string(),
            capacity,
            completion,
            streams,
        }
    }
}

/// One allocator on its own fake device.
#[derive(Clone)]
pub(crate) struct Side {
    pub fake: Arc<FakeDriver>,
    pub a: Arc<CachingAllocator>,
    pub streams: Vec<StreamHandle>,
    pub tc: bool,
}

impl Side {
    /// The thread-cache side and the reference (`thread_cache:False`) of `case`, with the
    /// same streams.
    pub(crate) fn pair(case: &Case) -> (Side, Side) {
        let (tc, rf) = (Side::new(case, true), Side::new(case, false));
        assert_eq!(tc.streams, rf.streams, "the fake devices' streams differ");
        (tc, rf)
    }

    pub(crate) fn new(case: &Case, tc: bool) -> Side {
        let conf = if case.conf.is_empty() {
            format!("thread_cache:{}", py(tc))
        } else {
            format!("{},thread_cache:{}", case.conf, py(tc))
        };
        let (fake, a) = setup(case.capacity, &conf, case.completion);
        let mut streams = vec![LEGACY];
        for _ in 1..case.streams {
            streams.push(new_stream(&fake).unwrap());
        }
        Side {
            fake,
            a: Arc::new(a),
            streams,
            tc,
        }
    }
}

pub(crate) fn py(on: bool) -> &'static str {
    if on { "True" } else { "False" }
}

/// The live blocks of a program (the same on both sides while they agree) and the block
/// allocated last.
#[derive(Default)]
pub(crate) struct Live {
    pub blocks: Vec<Allocation>,
    pub last: Option<DevicePtr>,
}

impl Live {
    fn take(&mut self, pick: usize) -> Option<Allocation> {
        let n = self.blocks.len();
        (n > 0).then(|| self.blocks.swap_remove(pick % n))
    }
    fn take_last(&mut self) -> Option<Allocation> {
        let i = self
            .last
            .and_then(|p| self.blocks.iter().position(|b| b.ptr == p))
            .or(self.blocks.len().checked_sub(1))?;
        Some(self.blocks.swap_remove(i))
    }
    pub(crate) fn keep(&mut self, x: Allocation) {
        self.last = Some(x.ptr);
        self.blocks.push(x);
    }
}

/// Resolves `op` against the live blocks (taking out the ones it frees).
pub(crate) fn resolve(op: &Op, live: &mut Live, streams: &[StreamHandle]) -> Option<Conc> {
    let s = |i: usize| streams[i % streams.len()];
    Some(match *op {
        Op::Alloc { bytes, stream } => Conc::Alloc {
            bytes,
            stream: s(stream),
        },
        Op::AllocChurn { bytes, stream, k } => Conc::AllocChurn {
            bytes,
            stream: s(stream),
            k,
        },
        Op::Free { pick } => Conc::Free(live.take(pick)?.ptr),
        Op::FreeLast => Conc::Free(live.take_last()?.ptr),
        Op::Churn { pick, k } => {
            let x = live.take(pick)?;
            Conc::Churn {
                ptr: x.ptr,
                bytes: x.requested,
                stream: x.stream,
                k,
            }
        }
        Op::ChurnLast { k } => {
            let x = live.take_last()?;
            Conc::Churn {
                ptr: x.ptr,
                bytes: x.requested,
                stream: x.stream,
                k,
            }
        }
        Op::FreeRealloc { pick, bytes } => {
            let x = live.take(pick)?;
            Conc::FreeRealloc {
                ptr: x.ptr,
                bytes,
                stream: x.stream,
            }
        }
        Op::Write { pick } => {
            let n = live.blocks.len();
            let x = live.blocks.get(pick % n.max(1))?;
            Conc::Write(x.ptr, x.stream)
        }
        Op::RecordFree { pick, stream } => {
            let x = live.take(pick)?;
            let i = streams.iter().position(|t| *t == x.stream).unwrap_or(0);
            // Another stream than the block's own, when there is one.
            let other = streams[(i + 1 + stream % streams.len().max(2)) % streams.len()];
            if other == x.stream {
                Conc::Free(x.ptr)
            } else {
                Conc::RecordFree(x.ptr, other)
            }
        }
        Op::Advance { stream } => Conc::Advance(s(stream)),
        Op::Drain => Conc::Drain,
        Op::EmptyCache => Conc::EmptyCache,
        Op::Config(c) => Conc::Config(c),
        Op::ThreadCache(on) => Conc::ThreadCache(on),
        Op::Fraction(f) => Conc::Fraction(f),
        Op::Stats => Conc::Stats,
        Op::ResetStats(all) => Conc::ResetStats(all),
        // (Needs the reference's blocks: `resolve_on`.)
        Op::GrowWithFreeBeforeHole { pick, .. } => Conc::Free(live.take(pick)?.ptr),
        Op::GrowWithFree {
            bytes,
            stream,
            pick,
            k,
            call,
            churn,
        } => Conc::GrowWithFree {
            bytes,
            stream: s(stream),
            victim: live.take(pick)?.ptr,
            k,
            call: call % HOOKS.len(),
            churn,
        },
    })
}

/// [`resolve`], with the blocks [`Op::GrowWithFreeBeforeHole`] picks from read on `rf`
/// (the reference: reading its blocks changes nothing).
pub(crate) fn resolve_on(op: &Op, live: &mut Live, rf: &Side) -> Option<Conc> {
    let Op::GrowWithFreeBeforeHole {
        bytes,
        stream,
        pick,
        k,
        churn,
    } = *op
    else {
        return resolve(op, live, &rf.streams);
    };
    let blocks = sorted_blocks(&rf.a);
    let is_live = |p: u64| live.blocks.iter().any(|x| x.ptr.0 == p);
    // Live blocks before a hole (an unmapped range with a mapped block after it in its
    // segment), or before a segment's unmapped tail.
    let before = |hole: bool| -> Vec<usize> {
        (0..blocks.len().saturating_sub(1))
            .filter(|&i| {
                let (b, n) = (&blocks[i], &blocks[i + 1]);
                let more = blocks.get(i + 2).is_some_and(|m| m.segment == n.segment);
                b.allocated && !n.mapped && b.segment == n.segment && more == hole
            })
            .filter(|&i| is_live(blocks[i].ptr.0))
            .collect()
    };
    let mut cands = before(true);
    // A request that grows fills the lowest unmapped range that fits, usually the first
    // hole: a block before a later one keeps its room to grow (by PyTorch's rule) after
    // the request, and so competes with the request's block.
    if cands.len() > 1 && pick % 3 != 0 {
        cands.remove(0);
    }
    if cands.is_empty() || pick % 5 == 0 {
        cands = before(false);
    }
    let Some(&at) = cands.get(pick % cands.len().max(1)) else {
        let victim = live.take(pick)?;
        return Some(Conc::GrowWithFree {
            bytes,
            stream: rf.streams[stream % rf.streams.len()],
            victim: victim.ptr,
            k,
            call: 0,
            churn,
        });
    };
    let v = &blocks[at];
    // A request the victim could serve but no free block of its pool and stream can (so it
    // grows, and the victim is freed while it maps pages), where there is such a size.
    let largest_free = blocks
        .iter()
        .filter(|b| b.mapped && !b.allocated && b.pool == v.pool && b.stream == v.stream)
        .map(|b| b.size)
        .max()
        .unwrap_or(0);
    let bytes = if largest_free + 512 <= v.size {
        let (lo, hi) = (largest_free / 512 + 1, v.size / 512);
        512 * (lo + (pick as u64 >> 8) % (hi - lo + 1))
    } else {
        bytes
    };
    let i = live.blocks.iter().position(|x| x.ptr == v.ptr)?;
    let victim = live.blocks.swap_remove(i);
    Some(Conc::GrowWithFree {
        bytes,
        stream: victim.stream,
        victim: victim.ptr,
        k,
        call: 0,
        churn,
    })
}

/// What one side's run of an operation gave: one entry per allocation and free, and the
/// block it leaves live, if any.
pub(crate) type Outcome = (Vec<String>, Option<Allocation>);

fn alloc(
    side: &Side,
    bytes: u64,
    stream: StreamHandle,
    got: &mut Vec<String>,
) -> Option<Allocation> {
    match side.a.allocate(bytes, stream) {
        Ok(x) => {
            got.push(format!("a{:#x}+{}", x.ptr.0, x.size));
            if x.ptr.0 != 0 {
                side.fake
                    .memset_async(x.ptr, MemsetValue::U8(7), 1, stream)
                    .unwrap();
            }
            Some(x)
        }
        Err(e) => {
            got.push(format!("E {e}"));
            None
        }
    }
}

fn free(side: &Side, ptr: DevicePtr, got: &mut Vec<String>) {
    if let Err(e) = side.a.free(ptr) {
        got.push(format!("free {:#x}: {e}", ptr.0));
    }
}

/// Runs `c` on `side`. `credit_case` is called with the block whose credit the operation
/// goes on to use (the allocation followed by a free and the same request), right after
/// it was handed out.
pub(crate) fn run_conc(side: &Side, c: &Conc, mut credit_case: impl FnMut(&Allocation)) -> Outcome {
    let mut got = Vec::new();
    let kept = match *c {
        Conc::Alloc { bytes, stream } => alloc(side, bytes, stream, &mut got),
        Conc::AllocChurn { bytes, stream, k } => {
            let mut x = alloc(side, bytes, stream, &mut got);
            if k > 0
                && let Some(y) = &x
            {
                credit_case(y);
            }
            for _ in 0..k {
                let Some(y) = x.take() else { break };
                free(side, y.ptr, &mut got);
                x = alloc(side, bytes, stream, &mut got);
            }
            x
        }
        Conc::Free(p) => {
            free(side, p, &mut got);
            None
        }
        Conc::Churn {
            ptr,
            bytes,
            stream,
            k,
        } => {
            free(side, ptr, &mut got);
            let mut x = alloc(side, bytes, stream, &mut got);
            if k > 0
                && let Some(y) = &x
            {
                credit_case(y);
            }
            for _ in 0..k {
                let Some(y) = x.take() else { break };
                free(side, y.ptr, &mut got);
                x = alloc(side, bytes, stream, &mut got);
            }
            x
        }
        Conc::FreeRealloc { ptr, bytes, stream } => {
            free(side, ptr, &mut got);
            alloc(side, bytes, stream, &mut got)
        }
        Conc::Write(p, s) => {
            side.fake.memset_async(p, MemsetValue::U8(3), 1, s).unwrap();
            None
        }
        Conc::RecordFree(p, s) => {
            if let Err(e) = side.a.record_stream(p, s) {
                got.push(format!("record {e}"));
            }
            side.fake.memset_async(p, MemsetValue::U8(9), 1, s).unwrap();
            free(side, p, &mut got);
            None
        }
        Conc::Advance(s) => {
            side.fake.advance(s, None).unwrap();
            None
        }
        Conc::Drain => {
            side.fake.advance_all();
            None
        }
        Conc::EmptyCache => {
            side.a.empty_cache();
            None
        }
        Conc::Config(s) => {
            if let Err(e) = side.a.update_config(s) {
                got.push(format!("config {e}"));
            }
            None
        }
        Conc::ThreadCache(on) => {
            // (The reference re-parses too, keeping its cache off: a re-parse resets
            // `max_split_size_mb` and the other resettable options, as PyTorch's does.)
            side.a
                .update_config(&format!("thread_cache:{}", py(on && side.tc)))
                .unwrap();
            None
        }
        Conc::Fraction(f) => {
            side.a.set_memory_fraction(f).unwrap();
            None
        }
        Conc::Stats => None,
        Conc::ResetStats(all) => {
            side.a.reset_peak_stats();
            if all {
                side.a.reset_accumulated_stats();
            }
            None
        }
        Conc::GrowWithFree {
            bytes,
            stream,
            victim,
            k,
            call,
            churn,
        } => {
            use std::sync::atomic::{AtomicU8, Ordering};
            // 0 pending, 1 fired, 2 cancelled.
            let state = Arc::new(AtomicU8::new(0));
            let other_got = Arc::new(std::sync::Mutex::new(Vec::new()));
            let (a2, st2, og2) = (side.a.clone(), state.clone(), other_got.clone());
            side.fake.before_next(HOOKS[call], move || {
                if st2
                    .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    let (tx, rx) = std::sync::mpsc::channel();
                    std::thread::spawn(move || {
                        let mut out = Vec::new();
                        if let Err(e) = a2.free(victim) {
                            out.push(format!("other free: {e}"));
                        }
                        if churn > 0 {
                            for _ in 0..2 {
                                match a2.allocate(churn, stream) {
                                    Ok(y) => {
                                        out.push(format!("other a{:#x}+{}", y.ptr.0, y.size));
                                        a2.free(y.ptr).unwrap();
                                    }
                                    Err(e) => out.push(format!("other E {e}")),
                                }
                            }
                        }
                        tx.send(out).ok();
                    });
                    let out = rx
                        .recv_timeout(std::time::Duration::from_secs(20))
                        .unwrap_or_else(|_| vec!["the other thread hung".to_string()]);
                    og2.lock().unwrap().extend(out);
                }
            });
            let mut x = alloc(side, bytes, stream, &mut got);
            if k > 0
                && let Some(y) = &x
            {
                credit_case(y);
            }
            for _ in 0..k {
                let Some(y) = x.take() else { break };
                free(side, y.ptr, &mut got);
                x = alloc(side, bytes, stream, &mut got);
            }
            if state
                .compare_exchange(0, 2, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                free(side, victim, &mut got);
            }
            got.push(format!("hook state {}", state.load(Ordering::SeqCst)));
            got.extend(other_got.lock().unwrap().drain(..));
            x
        }
    };
    (got, kept)
}

/// `blocks()` by address (segments are listed in slab order, which may differ).
pub(crate) fn sorted_blocks(a: &CachingAllocator) -> Vec<BlockInfo> {
    let mut b = a.blocks();
    b.sort_by_key(|b| b.ptr.0);
    b
}

/// Statistics and blocks equal, or what differs first.
pub(crate) fn compare_state(tc: &CachingAllocator, rf: &CachingAllocator) -> Result<(), String> {
    if let Some(d) = stats_diff(tc, rf) {
        return Err(format!("stats differ: {d}"));
    }
    let (b1, b2) = (sorted_blocks(tc), sorted_blocks(rf));
    if b1 != b2 {
        let first = b1.iter().zip(&b2).find(|(x, y)| x != y);
        return Err(format!(
            "blocks differ ({} vs {}); first: tc {:?} vs lock {:?}",
            b1.len(),
            b2.len(),
            first.map(|f| f.0),
            first.map(|f| f.1)
        ));
    }
    Ok(())
}

/// Final checks on both sides.
pub(crate) fn finish(tc: &Side, rf: &Side) -> Result<(), String> {
    compare_state(&tc.a, &rf.a).map_err(|e| format!("at the end: {e}"))?;
    for s in [tc, rf] {
        s.a.check_invariants()
            .map_err(|e| format!("invariants (tc {}): {e}", s.tc))?;
        s.fake
            .device_synchronize(D0)
            .map_err(|e| format!("sticky error: {e:?}"))?;
    }
    Ok(())
}

/// Counts of the cases the credit's walk met (by the model, on the reference).
#[derive(Default, Debug)]
pub(crate) struct Coverage(pub BTreeMap<String, u64>);

impl Coverage {
    pub(crate) fn add(&mut self, label: String) {
        *self.0.entry(label).or_default() += 1;
    }
    /// Pairs where the walk passed at least one candidate and chose the merged block: the
    /// case the change credits.
    pub(crate) fn walked_to_merged(&self) -> u64 {
        self.0
            .iter()
            .filter(|(k, _)| k.contains("chosen after passing"))
            .map(|(_, v)| v)
            .sum()
    }
    pub(crate) fn report(&self, what: &str) {
        eprintln!("{what}: credit cases by the model:");
        for (k, v) in &self.0 {
            eprintln!("    {v:>7}  {k}");
        }
    }
}

/// Which case of the credit check a free of block `y` followed by the same request meets,
/// from `blocks` (the reference's, right after `y` was handed out): PyTorch's free (merge
/// with a free block after it) and `get_free_block`'s walk, with `tail_only` the reclaim
/// rule (only a segment's unmapped tail is room to grow).
pub(crate) fn classify(
    blocks: &[BlockInfo],
    y: &Allocation,
    expandable_on: bool,
    tail_only: bool,
) -> String {
    let mut b = blocks.to_vec();
    b.sort_by_key(|b| b.ptr.0);
    let Some(i) = b.iter().position(|x| x.ptr == y.ptr && x.allocated) else {
        return "block not found".into();
    };
    let kind = if b[i].expandable { "exp" } else { "ord" };
    let same = |j: usize, k: usize| b.get(k).is_some_and(|x| x.segment == b[j].segment);
    let free = |j: usize| b[j].mapped && !b[j].allocated && !b[j].pending_events;
    if i > 0 && same(i, i - 1) && free(i - 1) {
        return format!("{kind}: free block before it (no credit)");
    }
    let next = (same(i, i + 1) && free(i + 1)).then_some(i + 1);
    let grow = |j: usize| -> u64 {
        match b.get(j + 1) {
            Some(n) if same(j, j + 1) && !n.mapped => {
                let last = !same(j, j + 2);
                if tail_only && !last { 0 } else { n.size }
            }
            _ => 0,
        }
    };
    let merged = b[i].size + next.map_or(0, |n| b[n].size);
    let m_grow = grow(next.unwrap_or(i));
    // (size, ptr, expandable size, grows, is the merged block)
    let mut cands: Vec<(u64, u64, u64, bool, bool)> = (0..b.len())
        .filter(|&j| {
            j != i
                && Some(j) != next
                && free(j)
                && b[j].stream == b[i].stream
                && b[j].pool == b[i].pool
                && b[j].pool_id == PoolId::DEFAULT
                && b[j].size >= b[i].size
                && (expandable_on || !b[j].expandable)
        })
        .map(|j| {
            let g = grow(j);
            (b[j].size, b[j].ptr.0, b[j].size + g, g > 0, false)
        })
        .collect();
    cands.push((merged, b[i].ptr.0, merged + m_grow, m_grow > 0, true));
    cands.sort_by_key(|c| (c.0, c.1));
    let mut best = 0;
    while cands[best].3 && best + 1 < cands.len() && cands[best + 1].2 < cands[best].2 {
        best += 1;
    }
    let merged_at = cands.iter().position(|c| c.4).unwrap_or(0);
    let m_note = match (next.is_some(), m_grow > 0) {
        (false, false) => "alone",
        (false, true) => "alone, itself the frontier",
        (true, false) => "with its free neighbour",
        (true, true) => "with its free neighbour, the frontier",
    };
    if cands[best].4 {
        if best == 0 {
            let more = if cands.len() > 1 {
                ", others after it"
            } else {
                ""
            };
            format!("{kind}: merged block ({m_note}) first{more}")
        } else {
            let first = cands[0];
            let rel = match first.0.cmp(&merged) {
                std::cmp::Ordering::Less => "smaller",
                std::cmp::Ordering::Equal => "equal",
                std::cmp::Ordering::Greater => "larger",
            };
            format!(
                "{kind}: merged block ({m_note}) chosen after passing {} (first {rel}, first grows: {})",
                best.min(3),
                first.3
            )
        }
    } else if merged_at < best {
        format!("{kind}: walk passes the merged block ({m_note}) (no credit)")
    } else {
        format!("{kind}: another block comes first (no credit)")
    }
}

/// The label of `y`'s credit case, from `side` (the reference).
/// With reclaim on, notes where PyTorch's rule (holes count as room to grow) would decide
/// the credit the other way: the states where the credit must use reclaim's rule.
pub(crate) fn classify_on(side: &Side, y: &Allocation) -> String {
    let conf = side.a.config();
    let blocks = side.a.blocks();
    let (on, reclaim) = (conf.expandable.enabled, conf.expandable.reclaim);
    let label = classify(&blocks, y, on, reclaim);
    if reclaim {
        let other = classify(&blocks, y, on, false);
        let credit = |l: &str| !l.contains("no credit");
        if credit(&label) != credit(&other) {
            return format!("{label} [PyTorch's rule: {other}]");
        }
    }
    label
}

/// Runs `ops` on both sides, comparing every allocation's outcome; `stats_every_step`
/// compares statistics and blocks after every step (else where the program says, and at
/// the end). Counts the credit cases met into `cov`.
pub(crate) fn run_program(
    case: &Case,
    ops: &[Op],
    stats_every_step: bool,
    cov: &mut Coverage,
) -> Result<u64, String> {
    let (tc, rf) = Side::pair(case);
    let mut live = Live::default();
    let mut allocations = 0;
    for (i, op) in ops.iter().enumerate() {
        let Some(c) = resolve_on(op, &mut live, &rf) else {
            continue;
        };
        let (g1, _) = run_conc(&tc, &c, |_| {});
        let (g2, kept) = run_conc(&rf, &c, |y| cov.add(classify_on(&rf, y)));
        allocations += g1.len() as u64;
        if g1 != g2 {
            return Err(format!(
                "step {i} {op:?} = {c:?}: thread cache {g1:?} vs single lock {g2:?}"
            ));
        }
        if let Some(x) = kept {
            live.keep(x);
        }
        if stats_every_step || matches!(op, Op::Stats) {
            compare_state(&tc.a, &rf.a).map_err(|e| format!("after step {i} {op:?}: {e}"))?;
        }
    }
    finish(&tc, &rf)?;
    Ok(allocations)
}

/// Greedy shrink: drops one operation at a time (then halves, for speed on long programs)
/// while the program still fails, within `budget`.
pub(crate) fn shrink<T: Clone>(
    ops: &[T],
    fails: impl Fn(&[T]) -> bool,
    budget: std::time::Duration,
) -> Vec<T> {
    let start = std::time::Instant::now();
    let mut cur = ops.to_vec();
    // Chunks first.
    let mut chunk = cur.len() / 2;
    while chunk >= 1 && start.elapsed() < budget {
        let mut i = 0;
        while i + chunk <= cur.len() && start.elapsed() < budget {
            let mut cand = cur.clone();
            cand.drain(i..i + chunk);
            if fails(&cand) {
                cur = cand;
            } else {
                i += chunk;
            }
        }
        chunk /= 2;
    }
    cur
}

/// Runs programs `gen(seed)` for every seed; on a failure shrinks it and panics with the
/// seed, the first differing step and the shrunk program. Returns the coverage.
pub(crate) fn check_seeds(
    name: &str,
    case: &Case,
    seeds: std::ops::Range<u64>,
    stats_every_step: impl Fn(u64) -> bool,
    generate: impl Fn(u64) -> Vec<Op>,
) -> Coverage {
    let mut cov = Coverage::default();
    let mut allocations = 0;
    for seed in seeds {
        let ops = generate(seed);
        let every = stats_every_step(seed);
        match run_program(case, &ops, every, &mut cov) {
            Ok(n) => allocations += n,
            Err(e) => {
                let fails =
                    |o: &[Op]| run_program(case, o, every, &mut Coverage::default()).is_err();
                let min = shrink(&ops, fails, std::time::Duration::from_secs(60));
                let why = run_program(case, &min, every, &mut Coverage::default())
                    .err()
                    .unwrap_or_default();
                panic!(
                    "{name}: {case:?}, seed {seed} (stats every step: {every}): {e}\n\
                     shrunk to {} ops: {min:#?}\n=> {why}",
                    min.len()
                );
            }
        }
    }
    eprintln!("{name}: {case:?}: {allocations} allocations compared");
    cov
}

/// Sizes by pool, for generators.
pub(crate) const SMALL: [u64; 9] = [
    512,
    4096,
    65_536,
    256 * 1024,
    512 * 1024,
    512 * 1024,
    MIB - 512,
    MIB,
    MIB,
];
pub(crate) const LARGE: [u64; 12] = [
    MIB + 1,
    2 * MIB,
    2 * MIB,
    3 * MIB,
    4 * MIB,
    4 * MIB,
    6 * MIB,
    8 * MIB,
    10 * MIB,
    14 * MIB,
    20 * MIB,
    24 * MIB,
];
