//! Threads at once, with no order between them, each on a stream of its own: a thread's
//! requests only ever see its own stream's expandable segments (a large device, so nothing
//! runs out, no `empty_cache`, no reclaim), so what each thread is handed, as an offset
//! into its own segment of each pool, is the same whatever the interleaving — and the same
//! as the single-lock path running the threads' programs one after another. The threads
//! contend for the lock (requests served by the lock holder, slots settled by other
//! threads while their owners reuse parked blocks), and their programs keep freeing blocks
//! into runs and the frontier and asking for the same bytes again.
use crate::common::{GIB, LEGACY, MIB};
use crate::harness::*;
use crate::random_single::{Sizes, size};
use ferrocuda_alloc::{Allocation, CachingAllocator};
use ferrocuda_driver::fake::Completion;
use ferrocuda_types::{PoolKind, StreamHandle};
use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};

#[derive(Clone, Copy, Debug)]
enum TOp {
    Alloc(u64),
    AllocChurn(u64, u8),
    Free(usize),
    Churn(usize, u8),
    ChurnLast(u8),
}

fn program(seed: u64, n: usize, sizes: Sizes) -> Vec<TOp> {
    let mut r = Rng::new(seed ^ 0xC0C0_2222);
    (0..n)
        .map(|_| {
            let k = 1 + r.below(3) as u8;
            match r.below(100) {
                0..=19 => TOp::Alloc(size(&mut r, sizes)),
                20..=39 => TOp::AllocChurn(size(&mut r, sizes), k),
                40..=64 => TOp::Free(r.next() as usize),
                65..=79 => TOp::Churn(r.next() as usize, k),
                _ => TOp::ChurnLast(k),
            }
        })
        .collect()
}

/// A pointer as (pool, offset into the thread's segment of that pool): the first block a
/// stream gets in a pool starts its segment.
#[derive(Default)]
struct Bases(BTreeMap<bool, u64>);

impl Bases {
    fn rel(&mut self, x: &Allocation) -> String {
        let kind = if x.size <= MIB {
            PoolKind::Small
        } else {
            PoolKind::Large
        };
        let base = *self.0.entry(kind == PoolKind::Small).or_insert(x.ptr.0);
        format!("{kind:?}+{:#x}/{}", x.ptr.0 - base, x.size)
    }
}

/// Runs one thread's program on `a` and `stream`; returns what it was handed, relative to
/// its segments.
fn run_thread(a: &CachingAllocator, stream: StreamHandle, ops: &[TOp]) -> Vec<String> {
    let mut bases = Bases::default();
    let mut out = Vec::new();
    let mut live: Vec<Allocation> = Vec::new();
    let mut last: Option<u64> = None;
    let mut alloc = |bytes: u64, out: &mut Vec<String>, bases: &mut Bases| -> Allocation {
        let x = a
            .allocate(bytes, stream)
            .unwrap_or_else(|e| panic!("allocate({bytes}): {e}"));
        out.push(bases.rel(&x));
        x
    };
    for op in ops {
        let n = live.len();
        let churn = |x: Allocation,
                     k: u8,
                     out: &mut Vec<String>,
                     bases: &mut Bases,
                     alloc: &mut dyn FnMut(u64, &mut Vec<String>, &mut Bases) -> Allocation|
         -> Allocation {
            a.free(x.ptr).unwrap();
            let mut y = alloc(x.requested, out, bases);
            for _ in 0..k {
                a.free(y.ptr).unwrap();
                y = alloc(x.requested, out, bases);
            }
            y
        };
        let kept = match *op {
            TOp::Alloc(b) => Some(alloc(b, &mut out, &mut bases)),
            TOp::AllocChurn(b, k) => {
                let mut y = alloc(b, &mut out, &mut bases);
                for _ in 0..k {
                    a.free(y.ptr).unwrap();
                    y = alloc(b, &mut out, &mut bases);
                }
                Some(y)
            }
            TOp::Free(p) if n > 0 => {
                a.free(live.swap_remove(p % n).ptr).unwrap();
                None
            }
            TOp::Churn(p, k) if n > 0 => {
                let x = live.swap_remove(p % n);
                Some(churn(x, k, &mut out, &mut bases, &mut alloc))
            }
            TOp::ChurnLast(k) if n > 0 => {
                let i = last
                    .and_then(|p| live.iter().position(|x| x.ptr.0 == p))
                    .unwrap_or(n - 1);
                let x = live.swap_remove(i);
                Some(churn(x, k, &mut out, &mut bases, &mut alloc))
            }
            _ => None,
        };
        if let Some(x) = kept {
            last = Some(x.ptr.0);
            live.push(x);
        }
        // Keep the live set bounded.
        if live.len() > 20 {
            a.free(live.swap_remove(0).ptr).unwrap();
        }
    }
    out
}

/// The statistics without peaks (which depend on the interleaving).
fn no_peaks(a: &CachingAllocator) -> BTreeMap<String, i64> {
    a.stats()
        .to_map()
        .into_iter()
        .filter(|(k, _)| !k.contains("peak"))
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn check(conf: &str, threads: usize, seeds: std::ops::Range<u64>, len: usize, sizes: Sizes) {
    for seed in seeds {
        let programs: Vec<Vec<TOp>> = (0..threads)
            .map(|t| program(seed * 31 + t as u64, len, sizes))
            .collect();
        // The reference: the programs one after another, single lock.
        let case = Case::new(conf, 80 * GIB, Completion::Eager, threads + 1);
        let rf = Side::new(&case, false);
        let want: Vec<Vec<String>> = programs
            .iter()
            .enumerate()
            .map(|(t, p)| run_thread(&rf.a, rf.streams[t + 1], p))
            .collect();
        for tc_on in [true, false] {
            let side = Side::new(&case, tc_on);
            let barrier = Arc::new(Barrier::new(threads));
            let got: Vec<Vec<String>> = std::thread::scope(|s| {
                let handles: Vec<_> = programs
                    .iter()
                    .enumerate()
                    .map(|(t, p)| {
                        let (a, stream, barrier) = (&side.a, side.streams[t + 1], barrier.clone());
                        s.spawn(move || {
                            barrier.wait();
                            run_thread(a, stream, p)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| panic!("a thread panicked")))
                    .collect()
            });
            for t in 0..threads {
                if got[t] != want[t] {
                    let i = got[t]
                        .iter()
                        .zip(&want[t])
                        .position(|(x, y)| x != y)
                        .unwrap_or(got[t].len().min(want[t].len()));
                    panic!(
                        "{conf}, seed {seed}, thread {t} (thread_cache {tc_on}): allocation {i} \
                         differs: concurrent {:?} vs one after another {:?}",
                        got[t].get(i),
                        want[t].get(i)
                    );
                }
            }
            assert_eq!(
                no_peaks(&side.a),
                no_peaks(&rf.a),
                "{conf}, seed {seed} (thread_cache {tc_on}): statistics"
            );
            side.a.check_invariants().unwrap();
            let _ = LEGACY;
        }
    }
}

#[test]
fn concurrent_threads_own_streams_small_pool() {
    check(
        "expandable_segments:True",
        4,
        seeds(1, 4),
        2500,
        Sizes::Even,
    );
}

#[test]
fn concurrent_threads_own_streams_mixed_2mib_pages() {
    check(
        "expandable_segments:True,expandable_segments_page_mb:2",
        3,
        seeds(100, 4),
        2500,
        Sizes::Mixed,
    );
}

#[test]
fn concurrent_threads_own_streams_large_pool() {
    check(
        "expandable_segments:True",
        2,
        seeds(200, 4),
        2500,
        Sizes::Large,
    );
}
