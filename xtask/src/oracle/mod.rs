//! `cargo xtask alloc-oracle [DIR]`: PyTorch's caching allocator as an oracle.
//!
//! DIR (default `tests/data/oracle`) holds programs of allocator operations and what
//! PyTorch did with them, step by step (`torch_alloc_oracle.py`, or `oracle_batch.py` with
//! event observations). Each program runs through ferrocuda's `CachingAllocator` on a fake
//! device that hands out PyTorch's segment addresses in PyTorch's order (address mode), has
//! PyTorch's device memory, configuration, fraction and streams; every allocation's segment
//! and offset (or out of memory) and every `memory_stats()` key PyTorch reported must be
//! equal. The first difference of a program is printed with the operations before it;
//! any difference fails the command.
//!
//! An event whose completion PyTorch saw happen during an allocation call is ambiguous:
//! it counts as pending first, and as complete if that moves the first difference later
//! (at most [`MAX_RUNS`] runs a program). The counts are printed.
mod format;
mod run;

/// Programs that differ for a reason outside the allocator's rules, each with the reason.
/// A program here must differ (one that has become equal fails the command, so the list
/// only shrinks); every other program must be equal.
const KNOWN: &[(&str, &str)] = &[(
    "seed-37",
    "when events of two streams complete in one call, PyTorch's process_events frees their \
     blocks in the iteration order of its ska::flat_hash_map keyed by stream id, which the \
     recording does not give (visiting the streams in ascending order makes this program \
     equal and seed-43 differ); the first difference is the peak of inactive_split_bytes, \
     4 KiB apart",
)];

use format::Case;
use run::{Choice, Difference, Run};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Runs of one program while trying ambiguous completions the other way.
const MAX_RUNS: usize = 16;
/// Ambiguous completions tried for one difference, nearest first.
const CANDIDATES: usize = 4;
/// Operations shown before a difference.
const CONTEXT: usize = 8;

/// Checks every program of `dir` against PyTorch's results: any difference fails.
pub(crate) fn alloc_oracle(dir: &Path) -> Result<(), String> {
    let cases = format::read_dir(dir).map_err(|e| e.to_string())?;
    let (mut failed, mut known, mut now_equal) = (Vec::new(), Vec::new(), Vec::new());
    let mut totals = Totals::default();
    let mut keys = BTreeSet::new();
    for case in &cases {
        let (run, chosen) = check(case);
        totals.add(case, &run, chosen);
        keys.extend(case.outcome.steps.iter().flat_map(|s| match s {
            format::Step::Stats(m) => m.keys().cloned().collect(),
            _ => Vec::new(),
        }));
        let reason = KNOWN.iter().find(|(n, _)| *n == case.name).map(|(_, r)| *r);
        let verdict = match (&run.difference, reason) {
            (None, None) => "equal",
            (None, Some(_)) => {
                now_equal.push(case.name.as_str());
                "EQUAL NOW"
            }
            (Some(_), Some(r)) => {
                known.push(format!("{}: {r}", case.name));
                "known"
            }
            (Some(_), None) => {
                failed.push(case.name.as_str());
                "DIFFERS"
            }
        };
        print_line(case, &run, chosen, verdict);
        if let Some(d) = &run.difference {
            print_difference(case, d);
        }
        if let Some(d) = run
            .stopped
            .as_ref()
            .filter(|s| Some(*s) != run.difference.as_ref())
        {
            print_difference(case, d);
        }
    }
    print_summary(&cases, &keys, &totals);
    for k in &known {
        println!("known difference, {k}");
    }
    let mut problems = Vec::new();
    if !failed.is_empty() {
        problems.push(format!(
            "{} of {} programs differ from PyTorch: {}",
            failed.len(),
            cases.len(),
            failed.join(", ")
        ));
    }
    if !now_equal.is_empty() {
        problems.push(format!(
            "now equal, take them off KNOWN in xtask/src/oracle/mod.rs: {}",
            now_equal.join(", ")
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// Sums over the programs.
#[derive(Default)]
struct Totals {
    ops: usize,
    allocs: usize,
    stats_steps: usize,
    events: usize,
    ambiguous: usize,
    taken: usize,
    record_skipped: usize,
}

impl Totals {
    fn add(&mut self, case: &Case, run: &Run, chosen: usize) {
        self.ops += case.program.ops.len();
        self.allocs += run.allocs;
        self.stats_steps += run.stats_steps;
        self.events += run.events;
        self.ambiguous += run.ambiguous.len();
        self.taken += chosen;
        let has_record =
            (case.program.ops.iter()).any(|o| matches!(o, format::Op::RecordStream { .. }));
        self.record_skipped += usize::from(has_record && !case.outcome.record_stream_applied);
    }
}

fn print_line(case: &Case, run: &Run, chosen: usize, verdict: &str) {
    let stopped = match run.stopped.as_ref().and_then(|d| d.step) {
        Some(i) => format!(", stopped at step {i}"),
        None => String::new(),
    };
    println!(
        "{:10} {verdict:9} {} ops, {} allocations ({} OOM), {} stats steps ({} differ), {} \
         events ({} ambiguous, {chosen} taken as complete){stopped}",
        case.name,
        case.program.ops.len(),
        run.allocs,
        run.ooms,
        run.stats_steps,
        run.differing_stats,
        run.events,
        run.ambiguous.len()
    );
}

/// Runs `case`; on a difference (in placements or statistics), takes ambiguous completions
/// before it as complete, nearest first, keeping one when the first difference moves later. Returns the last run and how
/// many ambiguous completions it takes as complete.
fn check(case: &Case) -> (Run, usize) {
    let mut chosen: BTreeSet<Choice> = BTreeSet::new();
    let mut best = run::run(case, &chosen);
    let mut runs = 1;
    // The first difference, in placements or statistics: a completion PyTorch may have
    // seen earlier changes when a block merged, and so the statistics too.
    while let Some(at) = best.difference.as_ref().map(|d| d.step) {
        let candidates: Vec<Choice> = best
            .ambiguous
            .iter()
            .rev()
            .filter(|c| Some(c.1) <= at && !chosen.contains(c))
            .take(CANDIDATES)
            .copied()
            .collect();
        let mut better = None;
        for c in candidates {
            if runs == MAX_RUNS {
                break;
            }
            runs += 1;
            let mut with = chosen.clone();
            with.insert(c);
            let r = run::run(case, &with);
            if r.difference.as_ref().is_none_or(|d| d.step > at) {
                better = Some((with, r));
                break;
            }
        }
        match better {
            Some((with, r)) => (chosen, best) = (with, r),
            None => break,
        }
    }
    let n = chosen.len();
    (best, n)
}

fn print_difference(case: &Case, d: &Difference) {
    let p = &case.program;
    let fraction = p.fraction.map_or("none".to_owned(), |f| f.to_string());
    println!(
        "  program {} (conf {:?}, fraction {fraction}, {} streams; PyTorch {}):",
        case.name, p.conf, p.streams, case.outcome.torch
    );
    match d.step {
        None => println!("  before the first step"),
        Some(i) => {
            let op = p
                .ops
                .get(i)
                .map_or("the end".to_owned(), ToString::to_string);
            println!("  first difference at step {i}, {op}");
            println!("  the operations before it:");
            for (j, op) in p
                .ops
                .iter()
                .enumerate()
                .take(i)
                .skip(i.saturating_sub(CONTEXT))
            {
                println!("    {j:5} {op}");
            }
        }
    }
    println!("  ours:    {}", d.ours);
    println!("  PyTorch: {}", d.theirs);
    if d.timing_dependent {
        println!(
            "  timing-dependent: this result has no event observations and events recorded by \
             cross-stream frees were pending; ours completed each before the next allocation, \
             PyTorch's completed whenever the GPU got there (oracle_batch.py records when)"
        );
    }
}

fn print_summary(cases: &[Case], keys: &BTreeSet<String>, t: &Totals) {
    let mut confs: BTreeMap<&str, usize> = BTreeMap::new();
    for c in cases {
        *confs.entry(c.program.conf.as_str()).or_default() += 1;
    }
    let torch: BTreeSet<&str> = cases.iter().map(|c| c.outcome.torch.as_str()).collect();
    println!(
        "{} programs, {} operations, {} allocations, {} statistics steps, {} cross-stream events \
         ({} ambiguous, {} taken as complete); PyTorch {}",
        cases.len(),
        t.ops,
        t.allocs,
        t.stats_steps,
        t.events,
        t.ambiguous,
        t.taken,
        torch.into_iter().collect::<Vec<_>>().join(", ")
    );
    for (conf, n) in confs {
        println!("  {n:3} x conf {conf:?}");
    }
    if t.record_skipped > 0 {
        println!(
            "{} programs have record_stream operations that never reached PyTorch's allocator \
             (torch_alloc_oracle.py's record() builds a DataPtr without the allocator's \
             deleter): ours skips them too",
            t.record_skipped
        );
    }
    if keys.is_empty() {
        println!("no statistics step was compared");
        return;
    }
    let ours: BTreeSet<String> = ferrocuda_types::DeviceStats::default()
        .to_map()
        .into_keys()
        .collect();
    let only_ours: Vec<&str> = ours.difference(keys).map(String::as_str).collect();
    println!(
        "every one of the {} statistics keys PyTorch reported was compared; ferrocuda's own \
         keys that PyTorch does not report (not compared): {}",
        keys.len(),
        if only_ours.is_empty() {
            "none".to_owned()
        } else {
            only_ours.join(", ")
        }
    );
}

#[cfg(test)]
mod tests {
    use super::format::{Obs, Op, Outcome, Placement, Program, Step};
    use super::*;

    const MIB: u64 = 1 << 20;

    fn placed(offset: u64, obs: Obs) -> Step {
        let p = Placement {
            seg: 0,
            offset,
            seg_bytes: 20 * MIB,
        };
        Step::Alloc(Ok(Some(p)), obs)
    }

    /// A block of stream 1 used on the busy stream 0 and freed; then two 4 MiB requests on
    /// stream 1, at the offsets PyTorch gave them, with what it saw of the event.
    fn case(steps: [Step; 2], record_stream_applied: bool) -> Case {
        let alloc = |id| Op::Alloc {
            id,
            bytes: 4 * MIB,
            stream: 1,
        };
        let [a, b] = steps;
        Case {
            name: "events".into(),
            program: Program {
                conf: String::new(),
                fraction: None,
                streams: 2,
                ops: vec![
                    alloc(0),
                    Op::Busy {
                        stream: 0,
                        micros: 200,
                    },
                    Op::RecordStream { id: 0, stream: 0 },
                    Op::Free { id: 0 },
                    alloc(1),
                    alloc(2),
                ],
            },
            outcome: Outcome {
                torch: "test".into(),
                device_bytes: 80 << 30,
                segments: vec![0x7f00_0000_0000],
                steps: vec![
                    placed(0, Obs::default()),
                    Step::Nothing,
                    Step::Nothing,
                    Step::Nothing,
                    a,
                    b,
                ],
                observed: true,
                record_stream_applied,
            },
        }
    }

    fn done() -> Obs {
        Obs {
            done: vec![(3, 0)],
            maybe: Vec::new(),
        }
    }

    #[test]
    fn an_event_stays_pending_until_pytorch_saw_it_complete() {
        let pending_then_done = case([placed(4 * MIB, Obs::default()), placed(0, done())], true);
        let (run, taken) = check(&pending_then_done);
        assert_eq!((run.difference, run.events, taken), (None, 1, 0));
        // PyTorch reused the block although the file says its event was still pending.
        let never_done = case(
            [placed(4 * MIB, Obs::default()), placed(0, Obs::default())],
            true,
        );
        let d = check(&never_done).0.difference;
        assert_eq!(d.as_ref().and_then(|d| d.step), Some(5), "{d:?}");
        assert!(d.is_some_and(|d| d.ours.contains("offset 8388608")));
    }

    #[test]
    fn an_ambiguous_completion_is_tried_both_ways() {
        let maybe = Obs {
            done: Vec::new(),
            maybe: vec![(3, 0)],
        };
        let seen_complete = case([placed(0, maybe), placed(4 * MIB, done())], true);
        let (run, taken) = check(&seen_complete);
        assert_eq!((run.difference, run.ambiguous.len(), taken), (None, 1, 1));
    }

    #[test]
    fn record_stream_that_never_reached_pytorch_is_skipped() {
        let unapplied = case(
            [placed(0, Obs::default()), placed(4 * MIB, Obs::default())],
            false,
        );
        let (run, _) = check(&unapplied);
        assert_eq!((run.difference, run.events), (None, 0));
    }
}
