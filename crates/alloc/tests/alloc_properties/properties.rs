//! Random programs of alloc / free / record_stream / event completion / empty_cache /
//! config change on the fake device. After every step: no two live blocks overlap, the
//! statistics equal a recount from the blocks, reserved equals the sum of segments, and no
//! block is handed out again before the events of the streams that used it completed.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, MemsetValue, StreamFlags, StreamHandle};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::sync::Arc;

const D0: DeviceIndex = DeviceIndex(0);

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: usize },
    Free { pick: usize },
    RecordStream { pick: usize, stream: usize },
    Advance { stream: usize },
    EmptyCache,
    Configure { config: usize },
}

const CONFIGS: [&str; 7] = [
    "",
    "roundup_power2_divisions:4",
    "max_split_size_mb:24",
    "garbage_collection_threshold:0.6",
    "expandable_segments:True",
    "expandable_segments:True,max_split_size_mb:24",
    "expandable_segments:False",
];

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1u64..=4096, 4096u64..=(1 << 20), (1u64 << 20)..=(24 << 20)];
    prop_oneof![
        6 => (size, 0..3usize).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0..3usize).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (0..3usize).prop_map(|stream| Op::Advance { stream }),
        1 => Just(Op::EmptyCache),
        2 => (0..CONFIGS.len()).prop_map(|config| Op::Configure { config }),
    ]
}

struct Live {
    ptr: u64,
    size: u64,
    stream: usize,
    stream_uses: Vec<usize>,
}

/// A freed range that must not be handed out while any of `streams` has not advanced.
struct Guarded {
    ptr: u64,
    size: u64,
    streams: Vec<usize>,
}

/// One step of a program run on two allocators, with and without `thread_cache`.
#[derive(Clone, Debug)]
enum Step {
    Alloc {
        size: u64,
        stream: usize,
    },
    /// Frees the newest live allocation (what a thread cache parks).
    FreeNewest,
    Free {
        pick: usize,
    },
    RecordStream {
        pick: usize,
        stream: usize,
    },
    Advance {
        stream: usize,
    },
    EmptyCache,
    Configure {
        config: usize,
    },
    /// Reads and compares statistics and blocks (which settles every slot).
    Observe,
    ResetPeaks,
}

fn step() -> impl Strategy<Value = Step> {
    // A few sizes again and again (so blocks come back), and some random ones.
    let size = prop_oneof![
        3 => prop::sample::select(vec![512u64, 1000, 4096, 1 << 20, 3 << 20, 12 << 20, 30 << 20]),
        1 => 1u64..=(40 << 20),
    ];
    prop_oneof![
        8 => (size, 0..2usize).prop_map(|(size, stream)| Step::Alloc { size, stream }),
        5 => Just(Step::FreeNewest),
        2 => any::<usize>().prop_map(|pick| Step::Free { pick }),
        1 => (any::<usize>(), 0..2usize).prop_map(|(pick, stream)| Step::RecordStream { pick, stream }),
        1 => (0..2usize).prop_map(|stream| Step::Advance { stream }),
        1 => Just(Step::EmptyCache),
        1 => (0..CONFIGS.len()).prop_map(|config| Step::Configure { config }),
        1 => Just(Step::Observe),
        1 => Just(Step::ResetPeaks),
    ]
}

/// An allocator over its own manual-completion fake device, with two streams.
fn twin(thread_cache: bool) -> (Arc<FakeDriver>, CachingAllocator, Vec<StreamHandle>) {
    let fake = Arc::new(
        FakeDriver::builder()
            .completion(Completion::Manual)
            .capacity(1 << 30)
            .backing(false)
            .build(),
    );
    let mut config = AllocatorConfig::default();
    config.reuse.thread_cache = thread_cache;
    let a = CachingAllocator::new(fake.clone(), D0, config, Caching::On).unwrap();
    let streams = (0..2)
        .map(|_| {
            fake.stream_create(
                D0,
                StreamFlags {
                    non_blocking: true,
                    priority: 0,
                },
            )
            .unwrap()
        })
        .collect();
    (fake, a, streams)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn invariants_hold_for_random_programs(ops in proptest::collection::vec(op(), 1..160)) {
        let fake = Arc::new(FakeDriver::builder().completion(Completion::Manual).capacity(8 << 30).backing(false).build());
        let a = CachingAllocator::new(fake.clone(), D0, AllocatorConfig::default(), Caching::On).unwrap();
        let streams: Vec<StreamHandle> = (0..3)
            .map(|_| fake.stream_create(D0, StreamFlags { non_blocking: true, priority: 0 }).unwrap())
            .collect();
        let mut live: Vec<Live> = Vec::new();
        let mut guarded: Vec<Guarded> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc { size, stream } => {
                    let x = a.allocate(size, streams[stream]).unwrap();
                    for g in &guarded {
                        prop_assert!(x.ptr.0 + x.size <= g.ptr || g.ptr + g.size <= x.ptr.0,
                            "block at {:#x} reused before its streams {:?} completed", g.ptr, g.streams);
                    }
                    live.push(Live { ptr: x.ptr.0, size: x.size, stream, stream_uses: Vec::new() });
                }
                Op::Free { pick } if !live.is_empty() => {
                    let l = live.swap_remove(pick % live.len());
                    a.free(ferrocuda_types::DevicePtr(l.ptr)).unwrap();
                    if !l.stream_uses.is_empty() {
                        guarded.push(Guarded { ptr: l.ptr, size: l.size, streams: l.stream_uses });
                    }
                }
                Op::RecordStream { pick, stream } if !live.is_empty() => {
                    let i = pick % live.len();
                    let l = &mut live[i];
                    // Work on that stream that uses the block, then the record.
                    fake.memset_async(ferrocuda_types::DevicePtr(l.ptr), MemsetValue::U8(7), 1, streams[stream]).unwrap();
                    a.record_stream(ferrocuda_types::DevicePtr(l.ptr), streams[stream]).unwrap();
                    // Recording the allocation stream itself is a no-op (reuse there is ordered).
                    if stream != l.stream {
                        l.stream_uses.push(stream);
                    }
                }
                Op::Advance { stream } => {
                    fake.advance(streams[stream], None).unwrap();
                    for g in &mut guarded {
                        g.streams.retain(|s| *s != stream);
                    }
                    guarded.retain(|g| !g.streams.is_empty());
                }
                Op::EmptyCache => {
                    a.empty_cache();
                    guarded.clear(); // empty_cache waits for every outstanding event
                }
                Op::Configure { config } => a.update_config(CONFIGS[config]).unwrap(),
                _ => {}
            }
            if let Err(e) = a.check_invariants() {
                prop_assert!(false, "{}", e);
            }
        }
        let stats = a.stats();
        prop_assert_eq!(stats.allocation.all.current as usize, live.len());
    }


    /// The thread cache is invisible to a single thread: every address, every error, the
    /// statistics (peaks and cumulative counters included) and the block layout equal those
    /// of the same program without it (that is, PyTorch's).
    #[test]
    fn thread_cache_changes_nothing_a_thread_can_see(steps in proptest::collection::vec(step(), 1..300)) {
        let twins = [twin(true), twin(false)];
        // Live allocations: (address, stream) in both (addresses are equal by construction).
        let mut live: Vec<u64> = Vec::new();
        let same = |twins: &[(Arc<FakeDriver>, CachingAllocator, Vec<StreamHandle>); 2]| -> Result<(), TestCaseError> {
            prop_assert_eq!(twins[0].1.stats(), twins[1].1.stats());
            // Block ids (and so the order of `blocks`) may differ; the layout may not.
            let layout = |a: &CachingAllocator| {
                let mut b = a.blocks();
                b.sort_by_key(|b| b.ptr.0);
                b
            };
            prop_assert_eq!(layout(&twins[0].1), layout(&twins[1].1));
            Ok(())
        };
        for step in steps {
            match step {
                Step::Alloc { size, stream } => {
                    let got: Vec<_> = twins.iter().map(|(_, a, s)| a.allocate(size, s[stream]).map_err(|e| e.to_string())).collect();
                    prop_assert_eq!(&got[0], &got[1]);
                    if let Ok(x) = &got[0] {
                        live.push(x.ptr.0);
                    }
                }
                Step::FreeNewest | Step::Free { .. } if !live.is_empty() => {
                    let i = match step { Step::Free { pick } => pick % live.len(), _ => live.len() - 1 };
                    let ptr = live.remove(i);
                    for (_, a, _) in &twins {
                        a.free(ferrocuda_types::DevicePtr(ptr)).unwrap();
                    }
                }
                Step::RecordStream { pick, stream } if !live.is_empty() => {
                    let ptr = ferrocuda_types::DevicePtr(live[pick % live.len()]);
                    for (fake, a, s) in &twins {
                        fake.memset_async(ptr, MemsetValue::U8(7), 1, s[stream]).unwrap();
                        a.record_stream(ptr, s[stream]).unwrap();
                    }
                }
                Step::Advance { stream } => {
                    for (fake, _, s) in &twins {
                        fake.advance(s[stream], None).unwrap();
                    }
                }
                Step::EmptyCache => twins.iter().for_each(|(_, a, _)| a.empty_cache()),
                Step::Configure { config } => {
                    for (_, a, _) in &twins {
                        a.update_config(CONFIGS[config]).unwrap();
                    }
                }
                Step::Observe => same(&twins)?,
                Step::ResetPeaks => twins.iter().for_each(|(_, a, _)| a.reset_peak_stats()),
                _ => {}
            }
        }
        same(&twins)?;
        twins[0].1.check_invariants().map_err(TestCaseError::fail)?;
    }
}
