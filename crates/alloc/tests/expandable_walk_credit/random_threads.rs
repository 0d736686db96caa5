//! Random programs run by 2-4 worker threads on the thread-cache side, one step at a time:
//! the driver hands each step to its worker through a channel and waits for the reply, so
//! consecutive steps are ordered by happens-before even across threads. The reference
//! (`thread_cache:False`) runs the same steps in that order on the driver thread. Workers
//! often keep the turn for a while (their own free+allocate pairs, credits used), and hand
//! blocks over: a block one thread parked is asked for by another, a block one thread holds
//! a credit on is freed by another.
use crate::common::MIB;
use crate::harness::*;
use crate::random_single::{Gen, Sizes, gen_op, size};
use ferrocuda_driver::fake::Completion;
use std::sync::mpsc::channel;

#[derive(Clone, Debug)]
struct Step {
    thread: usize,
    op: Op,
}

fn gen_steps(seed: u64, threads: usize, g: &Gen) -> Vec<Step> {
    let mut r = Rng::new(seed ^ 0x7423_AD00);
    let mut steps = Vec::with_capacity(g.len);
    let mut thread = 0;
    while steps.len() < g.len {
        if !r.pct(65) {
            thread = r.below(threads as u64) as usize;
        }
        if r.pct(8) {
            // A hand-over: this thread allocates and uses its credit, frees the block
            // (parked), and another thread asks for the same bytes on the same stream.
            let bytes = size(&mut r, g.sizes);
            let stream = r.below(4) as usize;
            let other = (thread + 1 + r.below(threads as u64 - 1) as usize) % threads;
            steps.push(Step {
                thread,
                op: Op::AllocChurn {
                    bytes,
                    stream,
                    k: 1 + r.below(2) as u8,
                },
            });
            steps.push(Step {
                thread,
                op: Op::FreeLast,
            });
            steps.push(Step {
                thread: other,
                op: Op::AllocChurn {
                    bytes,
                    stream,
                    k: r.below(2) as u8,
                },
            });
            // And back: the first thread asks again.
            if r.pct(50) {
                steps.push(Step {
                    thread,
                    op: Op::AllocChurn {
                        bytes,
                        stream,
                        k: 1,
                    },
                });
            }
            continue;
        }
        steps.push(Step {
            thread,
            op: gen_op(&mut r, g),
        });
    }
    steps
}

/// Runs `steps`: step `i` on worker `steps[i].thread` of the thread-cache side, then on the
/// reference; the same outcomes at every step, statistics and blocks compared where the
/// program reads them (or after every step) and at the end.
fn run_threads(
    case: &Case,
    threads: usize,
    steps: &[Step],
    stats_every_step: bool,
    cov: &mut Coverage,
) -> Result<u64, String> {
    let (tc, rf) = Side::pair(case);
    let mut live = Live::default();
    // The block each thread allocated last.
    let mut last = vec![None; threads];
    let mut allocations = 0;
    std::thread::scope(|s| {
        let (reply_tx, reply_rx) = channel::<Outcome>();
        let mut senders = Vec::new();
        for _ in 0..threads {
            let (tx, rx) = channel::<Conc>();
            senders.push(tx);
            let (side, reply) = (tc.clone(), reply_tx.clone());
            s.spawn(move || {
                while let Ok(c) = rx.recv() {
                    let out = run_conc(&side, &c, |_| {});
                    if reply.send(out).is_err() {
                        break;
                    }
                }
            });
        }
        let result = (|| {
            for (i, step) in steps.iter().enumerate() {
                let t = step.thread % threads;
                if matches!(step.op, Op::ChurnLast { .. } | Op::FreeLast) {
                    live.last = last[t];
                }
                let Some(c) = resolve_on(&step.op, &mut live, &rf) else {
                    continue;
                };
                senders[t]
                    .send(c.clone())
                    .map_err(|_| format!("step {i}: worker {t} is gone"))?;
                let (g1, _) = reply_rx
                    .recv()
                    .map_err(|_| format!("step {i}: worker {t} panicked"))?;
                let (g2, kept) = run_conc(&rf, &c, |y| cov.add(classify_on(&rf, y)));
                allocations += g1.len() as u64;
                if g1 != g2 {
                    return Err(format!(
                        "step {i} thread {t} {:?} = {c:?}: thread cache {g1:?} vs single lock {g2:?}",
                        step.op
                    ));
                }
                if let Some(x) = kept {
                    live.keep(x);
                    last[t] = Some(x.ptr);
                }
                if stats_every_step || matches!(step.op, Op::Stats) {
                    compare_state(&tc.a, &rf.a)
                        .map_err(|e| format!("after step {i} thread {t} {:?}: {e}", step.op))?;
                }
            }
            Ok(())
        })();
        drop(senders);
        result
    })?;
    finish(&tc, &rf)?;
    Ok(allocations)
}

fn check_threads(name: &str, case: Case, threads: usize, base: u64, n: u64, g: Gen) -> u64 {
    let mut cov = Coverage::default();
    let mut allocations = 0;
    for seed in seeds(base, n) {
        let steps = gen_steps(seed, threads, &g);
        let every = seed % 4 == 1;
        match run_threads(&case, threads, &steps, every, &mut cov) {
            Ok(a) => allocations += a,
            Err(e) => {
                let fails = |s: &[Step]| {
                    run_threads(&case, threads, s, every, &mut Coverage::default()).is_err()
                };
                let min = shrink(&steps, fails, std::time::Duration::from_secs(60));
                let why = run_threads(&case, threads, &min, every, &mut Coverage::default())
                    .err()
                    .unwrap_or_default();
                panic!(
                    "{name}: {case:?}, {threads} threads, seed {seed} (stats every step: {every}): {e}\n\
                     shrunk to {} steps: {min:#?}\n=> {why}",
                    min.len()
                );
            }
        }
    }
    eprintln!("{name}: {case:?}, {threads} threads: {allocations} allocations compared");
    cov.report(name);
    cov.walked_to_merged()
}

#[test]
fn two_threads_small_pool_even_sizes() {
    let hit = check_threads(
        "threads2_even",
        Case::new("expandable_segments:True", 48 * MIB, Completion::Eager, 1),
        2,
        1,
        20,
        Gen::new(Sizes::Even, 220),
    );
    assert!(hit > 0);
}

#[test]
fn three_threads_mixed_two_streams() {
    check_threads(
        "threads3_mixed",
        Case::new(
            "expandable_segments:True,expandable_segments_page_mb:2",
            160 * MIB,
            Completion::Eager,
            2,
        ),
        3,
        100,
        15,
        Gen::new(Sizes::Mixed, 220),
    );
}

#[test]
fn four_threads_reclaim_lagging() {
    check_threads(
        "threads4_reclaim",
        Case::new(
            "expandable_segments:True,expandable_segments_page_mb:2,expandable_segments_reclaim:True",
            96 * MIB,
            Completion::Manual,
            2,
        ),
        4,
        200,
        15,
        Gen::new(Sizes::Mixed, 200),
    );
}

#[test]
fn threads_with_toggles_and_small_reservations() {
    let g = Gen {
        toggles: &[
            "expandable_segments:False",
            "expandable_segments:True",
            "expandable_segments:True",
            "expandable_segments_reclaim:True",
            "expandable_segments_reclaim:False",
            "expandable_segments_small_page_bound:True",
            "expandable_segments_small_page_bound:False",
            "max_split_size_mb:20",
            "max_split_size_mb:100",
        ],
        tc_toggles: true,
        ..Gen::new(Sizes::Even, 200)
    };
    for (conf, base) in [
        (
            "expandable_segments:True,expandable_segments_page_mb:2,expandable_segments_reserve:0.1",
            300,
        ),
        ("ferrocuda_recommended:True", 330),
    ] {
        check_threads(
            "threads_toggles",
            Case::new(conf, 64 * MIB, Completion::Eager, 2),
            3,
            base,
            10,
            g,
        );
    }
}
