//! Cross-thread differential test: the default allocator (with its per-thread front end,
//! `thread_cache`) against the single-lock reference (`thread_cache:False`), on random
//! causally ordered scripts run by 2–4 live worker threads.
//!
//! A driver thread hands each step to one worker through a channel and waits for its
//! reply before handing out the next step, so consecutive steps are ordered by
//! happens-before edges even when they run on different threads: the result PyTorch's
//! allocator (one lock, no per-thread state) gives is fully determined by the script. Each
//! worker runs its step on both allocators, each on its own fake device of the same
//! capacity. The fake device hands out addresses deterministically (a bump allocator from
//! the same base), so pointers are compared exactly, with errors and — at every `stats`
//! step, after every step in half of the scripts, and at the end — the full `DeviceStats`.
//!
//! Reading the statistics settles every thread's cached block, so comparing them after
//! every step would hide what the front end does between reads: half of the scripts
//! compare them only where the script reads them.
//!
//! Environment: `FERROCUDA_DIFF_CASES` (number of scripts, default 10 000),
//! `FERROCUDA_DIFF_SEED` (base seed; script `i` uses `seed + i`), `FERROCUDA_DIFF_ONLY`
//! (run one script by its seed, printing every step).
#![forbid(unsafe_code)]
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::audit;

use audit::{MIB, Rng, new_stream, setup};
use ferrocuda_alloc::{AllocError, CachingAllocator};
use ferrocuda_driver::FakeDriver;
use ferrocuda_types::{DevicePtr, DeviceStats, StreamHandle};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Duration;

/// The allocator under test and the reference.
const CONFIGS: [&str; 2] = ["", "thread_cache:False"];

/// One step of a script: which worker runs which operation.
#[derive(Clone, Debug)]
struct Step {
    thread: usize,
    op: Op,
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: u64,
        stream: usize,
    },
    /// Frees the live allocation at this index (of the script's live list).
    Free {
        pick: usize,
    },
    RecordStream {
        pick: usize,
        stream: usize,
    },
    EmptyCache,
    ResetPeak,
    Stats,
}

/// What an operation gave, on one allocator.
#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    Alloc(Result<(DevicePtr, u64, u64), String>),
    Done(Result<(), String>),
    Stats(Box<DeviceStats>),
}

/// One allocator on its own fake device, with the script's streams.
struct Side {
    _fake: Arc<FakeDriver>,
    alloc: CachingAllocator,
    streams: Vec<StreamHandle>,
}

/// A step as a worker runs it: the pointers of both sides resolved.
enum Job {
    Alloc { size: u64, stream: usize },
    Free([DevicePtr; 2]),
    RecordStream([DevicePtr; 2], usize),
    EmptyCache,
    ResetPeak,
    Stats,
}

fn err(e: AllocError) -> String {
    e.to_string()
}

fn run_job(side: &Side, job: &Job, which: usize) -> Outcome {
    let a = &side.alloc;
    match job {
        Job::Alloc { size, stream } => Outcome::Alloc(
            a.allocate(*size, side.streams[*stream])
                .map(|x| (x.ptr, x.size, x.requested))
                .map_err(err),
        ),
        Job::Free(p) => Outcome::Done(a.free(p[which]).map_err(err)),
        Job::RecordStream(p, s) => {
            Outcome::Done(a.record_stream(p[which], side.streams[*s]).map_err(err))
        }
        Job::EmptyCache => {
            a.empty_cache();
            Outcome::Done(Ok(()))
        }
        Job::ResetPeak => {
            a.reset_peak_stats();
            Outcome::Done(Ok(()))
        }
        Job::Stats => Outcome::Stats(Box::new(a.stats())),
    }
}

fn worker(sides: Arc<[Side; 2]>, jobs: Receiver<Job>, replies: Sender<[Outcome; 2]>) {
    while let Ok(job) = jobs.recv() {
        let out = [run_job(&sides[0], &job, 0), run_job(&sides[1], &job, 1)];
        if replies.send(out).is_err() {
            return;
        }
    }
}

/// How a script is run.
struct Shape {
    capacity: u64,
    threads: usize,
    streams: usize,
    /// Compare the statistics after every step (which settles every thread's cache).
    stats_every_step: bool,
}

/// The first difference found in a script.
#[derive(Debug)]
struct Difference {
    steps: Vec<Step>,
    /// Where it showed: "pointer", "error", "stats", "stats at the end", "invariants",
    /// "worker".
    kind: &'static str,
    what: String,
}

/// The live allocations of a script: (pointer on each side, size).
type Live = Vec<([DevicePtr; 2], u64)>;

/// Runs a script whose steps come from `next` (given the live allocations, `None` ends
/// it) and returns the first difference between the two allocators.
fn run_script(
    shape: &Shape,
    mut next: impl FnMut(&Live) -> Option<Step>,
    trace: bool,
) -> Result<(), Difference> {
    let sides: Arc<[Side; 2]> = Arc::new(CONFIGS.map(|config| {
        let (fake, alloc) = setup(shape.capacity, config);
        let streams = (0..shape.streams)
            .map(|i| {
                if i == 0 {
                    audit::LEGACY
                } else {
                    new_stream(&fake)
                }
            })
            .collect();
        Side {
            _fake: fake,
            alloc,
            streams,
        }
    }));
    let (reply_tx, reply_rx) = channel();
    let mut senders = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..shape.threads {
        let (tx, rx) = channel();
        let (s, r) = (sides.clone(), reply_tx.clone());
        senders.push(tx);
        handles.push(std::thread::spawn(move || worker(s, rx, r)));
    }
    let mut live: Live = Vec::new();
    let mut steps = Vec::new();
    let mut result = Ok(());
    let differ = |steps: &Vec<Step>, kind: &'static str, what: String| {
        Err(Difference {
            steps: steps.clone(),
            kind,
            what,
        })
    };
    while let Some(step) = next(&live) {
        steps.push(step.clone());
        let job = match step.op {
            Op::Alloc { size, stream } => Job::Alloc { size, stream },
            Op::Free { pick } => Job::Free(live.swap_remove(pick % live.len()).0),
            Op::RecordStream { pick, stream } => {
                Job::RecordStream(live[pick % live.len()].0, stream)
            }
            Op::EmptyCache => Job::EmptyCache,
            Op::ResetPeak => Job::ResetPeak,
            Op::Stats => Job::Stats,
        };
        if senders[step.thread].send(job).is_err() {
            result = differ(&steps, "worker", "a worker stopped".into());
            break;
        }
        let Ok([x, y]) = reply_rx.recv_timeout(Duration::from_secs(60)) else {
            panic!("no reply in 60 s (a deadlock?) after {steps:#?}");
        };
        if trace {
            eprintln!("{step:?}\n  default:   {x:?}\n  reference: {y:?}");
        }
        if x != y {
            let kind = match (&x, &y) {
                (Outcome::Alloc(Ok(_)), Outcome::Alloc(Ok(_))) => "pointer",
                (Outcome::Stats(_), _) => "stats",
                _ => "error",
            };
            let what = match (&x, &y) {
                (Outcome::Stats(a), Outcome::Stats(b)) => stats_difference(a, b),
                _ => format!("default: {x:?}\nreference: {y:?}"),
            };
            result = differ(&steps, kind, what);
            break;
        }
        if let Outcome::Alloc(Ok((p, size, _))) = x
            && let Outcome::Alloc(Ok((q, _, _))) = y
        {
            live.push(([p, q], size));
        }
        if shape.stats_every_step {
            let (x, y) = (sides[0].alloc.stats(), sides[1].alloc.stats());
            if x != y {
                result = differ(&steps, "stats", stats_difference(&x, &y));
                break;
            }
        }
    }
    drop(senders);
    for h in handles {
        if h.join().is_err() {
            result = result.and(differ(&steps, "worker", "a worker panicked".into()));
        }
    }
    if result.is_ok() {
        // Every worker has exited: its cached block must be back in the books.
        let (x, y) = (sides[0].alloc.stats(), sides[1].alloc.stats());
        if x != y {
            result = differ(
                &steps,
                "stats at the end",
                format!("at the end: {}", stats_difference(&x, &y)),
            );
        }
    }
    for (side, config) in sides.iter().zip(CONFIGS) {
        if let Err(e) = side.alloc.check_invariants() {
            result = result.and(differ(
                &steps,
                "invariants",
                format!("{config:?} invariants: {e}"),
            ));
        }
    }
    result
}

/// The statistics that differ, by PyTorch key.
fn stats_difference(x: &DeviceStats, y: &DeviceStats) -> String {
    let (mx, my) = (x.to_map(), y.to_map());
    let diffs: Vec<String> = mx
        .iter()
        .filter(|(k, v)| my.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: default {v}, reference {:?}", my.get(k)))
        .collect();
    format!("statistics differ: {}", diffs.join("; "))
}

/// A random script's shape and step generator.
fn random_script(seed: u64) -> (Shape, impl FnMut(&Live) -> Option<Step>) {
    let mut rng = Rng::new(seed);
    let capacity = [64 * MIB, 256 * MIB, 80 << 30][rng.below(3)];
    let shape = Shape {
        capacity,
        threads: rng.range(2, 4) as usize,
        streams: rng.range(2, 3) as usize,
        stats_every_step: rng.chance(50),
    };
    let (threads, streams) = (shape.threads, shape.streams);
    let len = rng.range(6, 40);
    let mut sizes: Vec<u64> = Vec::new();
    let mut made = 0;
    let next = move |live: &Live| {
        if made == len {
            return None;
        }
        made += 1;
        let thread = rng.below(threads);
        let roll = rng.below(100);
        let op = if live.is_empty() || roll < 40 {
            let size = match rng.below(10) {
                0..=2 if !sizes.is_empty() => sizes[rng.below(sizes.len())],
                0..=3 => rng.range(1, 64 << 10),
                4..=5 => rng.range(64 << 10, MIB),
                6..=8 => rng.range(MIB + 1, 32 * MIB),
                _ => rng.range(capacity / 4, capacity),
            };
            sizes.push(size);
            Op::Alloc {
                size,
                stream: rng.below(streams),
            }
        } else if roll < 72 {
            Op::Free {
                pick: rng.below(live.len()),
            }
        } else if roll < 80 {
            Op::RecordStream {
                pick: rng.below(live.len()),
                stream: rng.below(streams),
            }
        } else if roll < 85 {
            Op::EmptyCache
        } else if roll < 89 {
            Op::ResetPeak
        } else {
            Op::Stats
        };
        Some(Step { thread, op })
    };
    (shape, next)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn random_cross_thread_scripts_match_the_single_lock_reference() {
    let base = env_u64("FERROCUDA_DIFF_SEED").unwrap_or(0x5EED_0000);
    let (first, count, trace) = match env_u64("FERROCUDA_DIFF_ONLY") {
        Some(seed) => (seed, 1, true),
        None => (
            base,
            env_u64("FERROCUDA_DIFF_CASES").unwrap_or(10_000),
            false,
        ),
    };
    let started = std::time::Instant::now();
    let mut failures: Vec<(u64, Difference)> = Vec::new();
    // By kind of first difference, and whether the script compared stats at every step.
    let mut kinds: std::collections::BTreeMap<(&str, bool), usize> = Default::default();
    let mut every_step = 0;
    for seed in first..first + count {
        let (shape, next) = random_script(seed);
        every_step += usize::from(shape.stats_every_step);
        if let Err(d) = run_script(&shape, next, trace) {
            *kinds.entry((d.kind, shape.stats_every_step)).or_default() += 1;
            failures.push((seed, d));
        }
    }
    let rate = failures.len() as f64 / count as f64;
    let summary = format!(
        "{count} scripts ({every_step} with stats compared at every step) in {:.1?}: {} differ \
         ({:.2}%); by (first difference, stats every step): {kinds:?}",
        started.elapsed(),
        failures.len(),
        100.0 * rate
    );
    eprintln!("{summary}");
    if failures.is_empty() {
        return;
    }
    // The shortest failing script of each kind of first difference.
    let mut shortest: std::collections::BTreeMap<&str, &(u64, Difference)> = Default::default();
    for f in &failures {
        let e = shortest.entry(f.1.kind).or_insert(f);
        if f.1.steps.len() < e.1.steps.len() {
            *e = f;
        }
    }
    let examples: Vec<String> = shortest
        .values()
        .map(|(seed, d)| {
            format!(
                "--- {}: seed {seed} (FERROCUDA_DIFF_ONLY={seed}), {} steps:\n{:?}\n{}",
                d.kind,
                d.steps.len(),
                d.steps,
                d.what
            )
        })
        .collect();
    panic!(
        "differences from the single-lock reference: {summary}\n{}\nSeeds of the first \
         failures: {:?}",
        examples.join("\n"),
        failures.iter().take(20).map(|(s, _)| s).collect::<Vec<_>>()
    );
}

/// Runs a fixed script on 2 workers of an 80 GiB device (statistics compared after every
/// step if `stats_every_step`) and returns the first difference.
fn fixed(steps: Vec<Step>, stats_every_step: bool) -> Result<(), Difference> {
    let shape = Shape {
        capacity: 80 << 30,
        threads: 2,
        streams: 2,
        stats_every_step,
    };
    let mut it = steps.into_iter();
    run_script(&shape, move |_| it.next(), false)
}

/// PyTorch: thread A allocates and frees 1 MiB on stream S; thread B then allocates 1 MiB
/// on S and gets A's block (free merged it back into its 2 MiB segment; best fit returns
/// the segment's lowest address). The reference gives that; so must the default.
#[test]
fn a_block_freed_by_one_thread_is_reused_by_the_next_thread() {
    for stream in [0, 1] {
        for every in [false, true] {
            let alloc = |thread| Step {
                thread,
                op: Op::Alloc { size: MIB, stream },
            };
            let free = |thread| Step {
                thread,
                op: Op::Free { pick: 0 },
            };
            let r = fixed(vec![alloc(0), free(0), alloc(1)], every);
            if let Err(d) = r {
                panic!(
                    "stream {stream}, stats every step {every}: {}\n{:#?}",
                    d.what, d.steps
                );
            }
        }
    }
    // And directly, on the default configuration alone.
    let (fake, a) = setup(80 << 30, "");
    let s = new_stream(&fake);
    let first = std::thread::scope(|sc| {
        sc.spawn(|| {
            let x = a.allocate(MIB, s)?;
            a.free(x.ptr)?;
            Ok::<_, AllocError>(x.ptr)
        })
        .join()
    });
    let first = first
        .unwrap_or_else(|_| panic!("thread A panicked"))
        .unwrap_or_else(|e| panic!("{e}"));
    let second = std::thread::scope(|sc| sc.spawn(|| a.allocate(MIB, s)).join());
    let second = second
        .unwrap_or_else(|_| panic!("thread B panicked"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second.ptr, first, "thread B must get thread A's block");
}

/// The same hand-over with the free on the other thread, then an allocation back on the
/// first thread, for each pool (small, 1–10 MiB, oversize-free large).
#[test]
fn frees_by_another_thread_are_reused_in_pytorch_order() {
    for size in [4096, MIB, 5 * MIB, 30 * MIB] {
        let steps = vec![
            Step {
                thread: 0,
                op: Op::Alloc { size, stream: 1 },
            },
            Step {
                thread: 1,
                op: Op::Free { pick: 0 },
            },
            Step {
                thread: 0,
                op: Op::Alloc { size, stream: 1 },
            },
            Step {
                thread: 1,
                op: Op::Alloc { size, stream: 1 },
            },
            Step {
                thread: 0,
                op: Op::Free { pick: 0 },
            },
            Step {
                thread: 1,
                op: Op::Alloc { size, stream: 1 },
            },
            Step {
                thread: 1,
                op: Op::Stats,
            },
        ];
        if let Err(d) = fixed(steps, false) {
            panic!("size {size}: {}\n{:#?}", d.what, d.steps);
        }
    }
}

/// Eight threads at once, no order between them: each allocates and frees random sizes on
/// one stream, keeping up to four blocks live, after a warm-up that leaves enough cached
/// segments for every request (so no driver call, made outside the lock, can reorder
/// segments). The history records every operation in the order the lock saw them (and
/// with history on, no thread-cache credit is granted); replayed one by one on the
/// single-lock reference, it gives the same pointer at every allocation, then the same
/// statistics and segments. A scheme that lets threads skip or share the lock must keep
/// this true.
#[test]
fn concurrent_threads_match_the_single_lock_reference_in_the_order_the_lock_saw() {
    let (fake, ours) = setup(80 << 30, "");
    let stream = new_stream(&fake);
    ours.record_memory_history(
        ferrocuda_alloc::history::HistoryOptions::parse(Some("all"), None, 1 << 20)
            .unwrap_or_else(|e| panic!("{e}")),
    );
    let made = warm_up_and_hammer(&ours, stream);
    let (segments, trace) = ours.snapshot();
    let grown = trace.iter().filter(|e| e.action == "segment_alloc").count();
    assert_eq!(grown, WARM_SEGMENTS, "a request missed the warmed-up cache");
    let (ref_fake, reference) = setup(80 << 30, "thread_cache:False");
    let ref_stream = new_stream(&ref_fake);
    assert_eq!(
        ref_stream.raw, stream.raw,
        "the fake devices' streams differ"
    );
    let mut allocations = 0;
    for (i, e) in trace.iter().enumerate() {
        match e.action.as_str() {
            "alloc" => {
                let got = reference
                    .allocate(e.size, ref_stream)
                    .unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(got.ptr.0, e.addr, "allocation {i} of the trace: {e:?}");
                allocations += 1;
            }
            "free_requested" => reference
                .free(DevicePtr(e.addr))
                .unwrap_or_else(|e| panic!("{e}")),
            _ => {}
        }
    }
    assert_eq!(allocations, made, "the trace lost operations");
    assert_eq!(ours.stats(), reference.stats());
    assert_eq!(segments, reference.snapshot().0);
}

/// The same without history, where the thread cache's credits are granted too: every
/// operation is counted, and nothing is left allocated or lost.
#[test]
fn concurrent_threads_lose_no_operation_with_the_thread_cache_on() {
    let (fake, ours) = setup(80 << 30, "");
    let stream = new_stream(&fake);
    let made = warm_up_and_hammer(&ours, stream) as i64;
    let stats = ours.stats();
    assert_eq!(stats.allocation.all.allocated, made);
    assert_eq!(stats.allocation.all.freed, made);
    assert_eq!(stats.allocated_bytes.all.current, 0);
    assert_eq!(
        stats.allocated_bytes.all.allocated,
        stats.allocated_bytes.all.freed
    );
    assert_eq!(stats.segment.all.allocated, WARM_SEGMENTS as i64);
    ours.empty_cache();
    assert_eq!(ours.stats().reserved_bytes.all.current, 0);
}

/// Segments the warm-up of [`warm_up_and_hammer`] leaves: 48 small ones of 2 MiB and 40
/// large ones of 20 MiB, enough for any four live blocks per thread.
const WARM_SEGMENTS: usize = 48 + 40;

/// Warms `a` up, then runs 8 threads of 3 000 random operations each on `stream`, every
/// block freed at the end. Returns the allocations made, warm-up included.
fn warm_up_and_hammer(a: &CachingAllocator, stream: StreamHandle) -> usize {
    const SIZES: [u64; 7] = [512, 1000, 4096, 65_536, MIB, 2 * MIB, 6 * MIB];
    let warm: Vec<_> = (0..96)
        .map(|_| MIB)
        .chain((0..40).map(|_| 20 * MIB))
        .map(|bytes| a.allocate(bytes, stream).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let warmed = warm.len();
    for x in warm {
        a.free(x.ptr).unwrap_or_else(|e| panic!("{e}"));
    }
    let thread = |seed: u64| {
        let mut rng = Rng::new(seed);
        let mut live = Vec::new();
        let mut made = 0;
        for _ in 0..3000 {
            if live.len() == 4 || (!live.is_empty() && rng.chance(50)) {
                let x: DevicePtr = live.swap_remove(rng.below(live.len()));
                a.free(x).unwrap_or_else(|e| panic!("{e}"));
            } else {
                let bytes = SIZES[rng.below(SIZES.len())];
                let x = a.allocate(bytes, stream).unwrap_or_else(|e| panic!("{e}"));
                live.push(x.ptr);
                made += 1;
            }
        }
        for x in live {
            a.free(x).unwrap_or_else(|e| panic!("{e}"));
        }
        made
    };
    let made: usize = std::thread::scope(|s| {
        let threads: Vec<_> = (0..8)
            .map(|t| s.spawn(move || thread(0xC0B1_0000 + t)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| panic!("a thread panicked")))
            .sum()
    });
    warmed + made
}
