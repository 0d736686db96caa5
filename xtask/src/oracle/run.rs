//! One program through ferrocuda's allocator on the fake device in address mode, compared
//! with PyTorch's result step by step.
//!
//! Events: the fake device runs in manual mode, so an event the allocator records when it
//! frees a block used by other streams stays pending until this module completes it. With
//! observations (`oracle_batch.py`), before each allocation the events PyTorch had seen
//! complete are completed (an ambiguous one only when the caller says so); without them,
//! every event completes before the next allocation, and a difference after a
//! cross-stream free is reported as timing-dependent.
//!
//! record_stream: a result made by `torch_alloc_oracle.py` never reached PyTorch's
//! allocator with it (its `record()` builds a DataPtr without the allocator's deleter,
//! which `recordStream` ignores), so ours skips it too; `oracle_batch.py`'s results say
//! `"record_stream": "applied"`.
use super::format::{Case, Op, Placement, Step, Token};
use ferrocuda_alloc::{AllocError, Caching, CachingAllocator};
use ferrocuda_driver::fake::{AddressPlan, WhenUnusable};
use ferrocuda_driver::{Completion, Driver, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamFlags, StreamHandle};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

const DEV: DeviceIndex = DeviceIndex(0);

/// An ambiguous event completion: the token, at the allocation step where it was ambiguous.
pub(crate) type Choice = (Token, usize);

/// The first step where ours and PyTorch's differ.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Difference {
    /// The step (`None`: before the first, when setting up).
    pub(crate) step: Option<usize>,
    pub(crate) ours: String,
    pub(crate) theirs: String,
    /// Events were pending whose completion PyTorch's file does not tell.
    pub(crate) timing_dependent: bool,
}

/// What one run found.
#[derive(Clone, Debug, Default)]
pub(crate) struct Run {
    pub(crate) difference: Option<Difference>,
    /// Statistics steps that differ (the run goes on past them).
    pub(crate) differing_stats: usize,
    /// A difference other than in statistics, where the run stopped.
    pub(crate) stopped: Option<Difference>,
    /// Ambiguous completions met before the run stopped (or the end).
    pub(crate) ambiguous: Vec<Choice>,
    pub(crate) allocs: usize,
    pub(crate) ooms: usize,
    pub(crate) stats_steps: usize,
    pub(crate) keys_compared: usize,
    pub(crate) events: usize,
}

struct Live {
    ptr: DevicePtr,
    stream: usize,
    uses: BTreeSet<usize>,
}

/// What ours did with an allocation, in the result's terms.
#[derive(Clone, Debug, PartialEq)]
enum Ours {
    Placed(Placement),
    /// Succeeded where PyTorch's file records no placement (expandable segments).
    Succeeded,
    Oom,
    Failed(String),
}

struct Sim<'a> {
    case: &'a Case,
    complete_now: &'a BTreeSet<Choice>,
    fake: Arc<FakeDriver>,
    alloc: CachingAllocator,
    streams: Vec<StreamHandle>,
    live: HashMap<u64, Live>,
    /// Our new segments' addresses in order, and each address's latest index.
    segs: Vec<u64>,
    seg_of: HashMap<u64, usize>,
    /// Events recorded per stream, in order, and those complete.
    created: Vec<Vec<Token>>,
    complete: HashSet<Token>,
    run: Run,
}

/// Runs `case` through ferrocuda; `complete_now` lists the ambiguous completions to take
/// as complete (the others stay pending at their step).
pub(crate) fn run(case: &Case, complete_now: &BTreeSet<Choice>) -> Run {
    let mut sim = match Sim::new(case, complete_now) {
        Ok(sim) => sim,
        Err(why) => {
            return Run {
                difference: Some(Difference {
                    step: None,
                    ours: why,
                    theirs: format!("PyTorch {} ran it", case.outcome.torch),
                    timing_dependent: false,
                }),
                ..Run::default()
            };
        }
    };
    for (i, (op, theirs)) in case.program.ops.iter().zip(&case.outcome.steps).enumerate() {
        if let Err((ours, theirs)) = sim.step(i, op, theirs) {
            let timing_dependent = !case.outcome.observed && sim.run.events > 0;
            let d = Difference {
                step: Some(i),
                ours,
                theirs,
                timing_dependent,
            };
            sim.run.difference.get_or_insert(d.clone());
            // Reading statistics changes nothing: the run goes on to find more.
            if *op == Op::Stats {
                sim.run.differing_stats += 1;
            } else {
                sim.run.stopped = Some(d);
                return sim.run;
            }
        }
    }
    if let Err(e) = sim.alloc.check_invariants() {
        sim.run.difference.get_or_insert(Difference {
            step: Some(case.program.ops.len()),
            ours: format!("books broken at the end: {e}"),
            theirs: "-".into(),
            timing_dependent: false,
        });
    }
    sim.run
}

impl<'a> Sim<'a> {
    fn new(case: &'a Case, complete_now: &'a BTreeSet<Choice>) -> Result<Self, String> {
        let config = AllocatorConfig::parse(&case.program.conf)
            .map_err(|e| format!("refuses the configuration: {e}"))?;
        let mut builder = FakeDriver::builder()
            .capacity(case.outcome.device_bytes)
            .completion(Completion::Manual)
            .backing(false);
        if !config.expandable.enabled {
            let plan = AddressPlan::new(case.outcome.segments.clone(), WhenUnusable::Fail)
                .map_err(|e| format!("cannot use PyTorch's segment addresses: {e}"))?;
            builder = builder.address_plan(DEV, plan);
        }
        let fake = Arc::new(builder.build());
        let alloc = CachingAllocator::new(fake.clone(), DEV, config, Caching::On)
            .map_err(|e| format!("cannot make an allocator: {e}"))?;
        if let Some(f) = case.program.fraction {
            alloc
                .set_memory_fraction(f)
                .map_err(|e| format!("refuses the fraction: {e}"))?;
        }
        let mut streams = vec![StreamHandle::legacy(DEV)];
        for _ in 1..case.program.streams {
            let flags = StreamFlags {
                non_blocking: true,
                priority: 0,
            };
            let s = fake
                .stream_create(DEV, flags)
                .map_err(|e| format!("cannot make a stream: {e}"))?;
            streams.push(s);
        }
        Ok(Sim {
            case,
            complete_now,
            created: vec![Vec::new(); streams.len()],
            fake,
            alloc,
            streams,
            live: HashMap::new(),
            segs: Vec::new(),
            seg_of: HashMap::new(),
            complete: HashSet::new(),
            run: Run::default(),
        })
    }

    /// Does step `i`; `Err((ours, theirs))` on a difference.
    fn step(&mut self, i: usize, op: &Op, theirs: &Step) -> Result<(), (String, String)> {
        let failed =
            |what: &str, e: &dyn std::fmt::Display| (format!("{what} failed: {e}"), "-".to_owned());
        match (op, theirs) {
            (&Op::Alloc { id, bytes, stream }, Step::Alloc(theirs, obs)) => {
                let outcome = &self.case.outcome;
                // Without record_stream there are no events: observations name none.
                if outcome.observed && outcome.record_stream_applied {
                    self.complete.extend(&obs.done);
                    for &t in &obs.maybe {
                        self.run.ambiguous.push((t, i));
                        if self.complete_now.contains(&(t, i)) {
                            self.complete.insert(t);
                        }
                    }
                    self.settle_events()
                        .map_err(|e| failed("completing events", &e))?;
                } else {
                    self.fake.advance_all();
                }
                self.allocate(id, bytes, stream, theirs)?;
            }
            (&Op::Free { id }, _) => {
                if let Some(b) = self.live.remove(&id) {
                    self.free(i, b)?;
                }
            }
            (&Op::RecordStream { id, stream }, _) => {
                let applied = self.case.outcome.record_stream_applied;
                if let Some(b) = self.live.get_mut(&id).filter(|_| applied) {
                    let handle = self.streams[stream];
                    self.alloc
                        .record_stream(b.ptr, handle)
                        .map_err(|e| failed("record_stream", &e))?;
                    if stream != b.stream {
                        b.uses.insert(stream);
                    }
                }
            }
            (Op::Busy { .. }, _) => {}
            (Op::Sync, _) => self
                .fake
                .device_synchronize(DEV)
                .map_err(|e| failed("synchronize", &e))?,
            (Op::EmptyCache, _) => self.alloc.empty_cache(),
            (Op::ResetPeak, _) => self.alloc.reset_peak_stats(),
            (Op::ResetAccumulated, _) => self.alloc.reset_accumulated_stats(),
            (Op::Stats, Step::Stats(theirs)) => self.compare_stats(theirs)?,
            // `format::check_pairing` lets no other pair through.
            (Op::Alloc { .. } | Op::Stats, _) => {}
        }
        Ok(())
    }

    /// Completes, on each stream, every event up to the last one known complete.
    fn settle_events(&mut self) -> Result<(), ferrocuda_driver::DriverError> {
        for (s, tokens) in self.created.iter().enumerate() {
            let done = tokens
                .iter()
                .rposition(|t| self.complete.contains(t))
                .map_or(0, |p| p + 1);
            let want_pending = tokens.len() - done;
            let pending = self.fake.pending(self.streams[s])?;
            if pending > want_pending {
                self.fake
                    .advance(self.streams[s], Some(pending - want_pending))?;
            }
        }
        Ok(())
    }

    fn allocate(
        &mut self,
        id: u64,
        bytes: u64,
        stream: usize,
        theirs: &Result<Option<Placement>, ()>,
    ) -> Result<(), (String, String)> {
        self.run.allocs += 1;
        let before = self.alloc.stats().num_device_alloc;
        let ours = match self.alloc.allocate(bytes, self.streams[stream]) {
            Ok(a) => {
                let new_segment = self.alloc.stats().num_device_alloc != before;
                let placed = match theirs {
                    Ok(None) => Ours::Succeeded,
                    _ => self.placement(a.ptr, new_segment),
                };
                self.live.insert(
                    id,
                    Live {
                        ptr: a.ptr,
                        stream,
                        uses: BTreeSet::new(),
                    },
                );
                placed
            }
            Err(AllocError::OutOfMemory(_)) => Ours::Oom,
            Err(e) => Ours::Failed(e.to_string()),
        };
        let equal = match (&ours, theirs) {
            (Ours::Oom, Err(())) | (Ours::Succeeded, Ok(None)) => true,
            (Ours::Placed(p), Ok(Some(q))) => p == q,
            _ => false,
        };
        if ours == Ours::Oom {
            self.run.ooms += 1;
        }
        if equal {
            return Ok(());
        }
        let theirs = match theirs {
            Err(()) => "out of memory".to_owned(),
            Ok(None) => "success (no placement recorded: expandable segments)".to_owned(),
            Ok(Some(p)) => describe(p),
        };
        let ours = match ours {
            Ours::Placed(p) => describe(&p),
            Ours::Succeeded => "success".to_owned(),
            Ours::Oom => "out of memory".to_owned(),
            Ours::Failed(e) => format!("error: {e}"),
        };
        Err((ours, theirs))
    }

    /// Where `ptr` landed: its segment's index in our order of new segments, the offset,
    /// and the segment's size.
    fn placement(&mut self, ptr: DevicePtr, new_segment: bool) -> Ours {
        let blocks = self.alloc.blocks();
        let Some(base) = blocks.iter().find(|b| b.ptr == ptr).map(|b| b.segment) else {
            return Ours::Failed(format!("no block at {ptr} after allocating it"));
        };
        if new_segment {
            self.segs.push(base.0);
            self.seg_of.insert(base.0, self.segs.len() - 1);
        }
        let Some(&seg) = self.seg_of.get(&base.0) else {
            return Ours::Failed(format!("{ptr} lies in a segment at {base} never seen made"));
        };
        let seg_bytes = blocks
            .iter()
            .filter(|b| b.segment == base)
            .map(|b| b.size)
            .sum();
        Ours::Placed(Placement {
            seg,
            offset: ptr.0 - base.0,
            seg_bytes,
        })
    }

    /// Frees `b` at step `i`; PyTorch records one event on each other stream that used it.
    fn free(&mut self, i: usize, b: Live) -> Result<(), (String, String)> {
        let pending = |sim: &Self, s: usize| sim.fake.pending(sim.streams[s]).unwrap_or(0);
        let before: Vec<usize> = b.uses.iter().map(|&s| pending(self, s)).collect();
        if let Err(e) = self.alloc.free(b.ptr) {
            return Err((format!("free failed: {e}"), "-".to_owned()));
        }
        for (&s, was) in b.uses.iter().zip(before) {
            let now = pending(self, s);
            if now != was + 1 {
                let ours = format!("{} events recorded on stream {s}", now as i64 - was as i64);
                return Err((ours, format!("one event recorded on stream {s}")));
            }
            self.created[s].push((i, s));
            self.run.events += 1;
        }
        Ok(())
    }

    fn compare_stats(&mut self, theirs: &BTreeMap<String, i64>) -> Result<(), (String, String)> {
        self.run.stats_steps += 1;
        let ours = self.alloc.stats().to_map();
        let mut differ = Vec::new();
        for (key, &want) in theirs {
            self.run.keys_compared += 1;
            match ours.get(key) {
                Some(&have) if have == want => {}
                Some(&have) => differ.push((key.as_str(), have.to_string(), want)),
                None => differ.push((key.as_str(), "missing".to_owned(), want)),
            }
        }
        if differ.is_empty() {
            return Ok(());
        }
        let n = differ.len();
        let list = |pick: &dyn Fn(&(&str, String, i64)) -> String| {
            let shown: Vec<String> = differ.iter().take(6).map(pick).collect();
            let more = if n > 6 {
                format!(" and {} more", n - 6)
            } else {
                String::new()
            };
            format!("{}{more}", shown.join(", "))
        };
        Err((
            format!(
                "statistics: {}",
                list(&|(k, have, _)| format!("{k} = {have}"))
            ),
            format!(
                "statistics: {}",
                list(&|(k, _, want)| format!("{k} = {want}"))
            ),
        ))
    }
}

fn describe(p: &Placement) -> String {
    format!(
        "segment {} offset {} (segment of {} bytes)",
        p.seg, p.offset, p.seg_bytes
    )
}
