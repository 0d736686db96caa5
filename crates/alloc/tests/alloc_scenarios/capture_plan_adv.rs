//! Adversarial tests of the graph-memory planner, written from its contract: the plan's
//! `reserved_after` equals a real private pool's reserved bytes after every capture, for
//! any program (boundary, zero, tiny and huge sizes, several streams, cross-stream use),
//! under any configuration, whatever else the allocator does around the captures (a busy
//! default pool, another pool, a thread cache, `empty_cache`, memory pressure, garbage
//! collection); and `record_requests` / `from_trace` / `plan_pool` at their edges.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::Rng;
use crate::common::audit::try_setup;
use crate::common::{GIB, LEGACY, MIB, TestResult, new_stream};

use ferrocuda_alloc::{AfterCapture, CachingAllocator, CaptureRequests, Route, plan_pool};
use ferrocuda_driver::FakeDriver;
use ferrocuda_driver::fake::Completion;
use ferrocuda_types::{AllocatorConfig, DevicePtr, PoolId, StreamHandle};
use std::sync::Arc;

mod edges;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// An allocator over a fake device that keeps no bytes (huge segments cost nothing).
fn setup(capacity: u64, conf: &str, completion: Completion) -> (Arc<FakeDriver>, CachingAllocator) {
    try_setup(capacity, conf, completion).unwrap_or_else(|e| panic!("{conf:?}: {e}"))
}

/// The scenarios' generator, seeded as this file's programs were first written.
fn seeded(seed: u64) -> Rng {
    Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
}

#[derive(Clone, Copy, Debug)]
enum Step {
    Alloc {
        bytes: u64,
        stream: usize,
    },
    Free {
        nth: usize,
    },
    /// `record_stream` of the `nth` live block on stream `stream`.
    Use {
        nth: usize,
        stream: usize,
    },
}

/// Sizes at the allocator's boundaries as well as ordinary ones.
const EDGES: [u64; 18] = [
    0,
    1,
    512,
    513,
    MIB - 1,
    MIB,
    MIB + 1,
    2 * MIB,
    10 * MIB - 1,
    10 * MIB,
    10 * MIB + 1,
    20 * MIB,
    20 * MIB + 1,
    40 * MIB,
    64 * MIB,
    64 * MIB + 1,
    200 * MIB,
    GIB,
];

fn size(rng: &mut Rng, huge: bool) -> u64 {
    match rng.below(20) {
        0 => 0,
        1..=2 => 1 + rng.below(512),
        3..=5 => EDGES[rng.below(EDGES.len() as u64) as usize],
        6 => 2 * MIB * (1 + rng.below(40)),
        7..=9 => 1 + rng.below(MIB),
        10..=15 => MIB + rng.below(12 * MIB),
        16..=18 => 8 * MIB + rng.below(120 * MIB),
        _ if huge => GIB + rng.below(2 * GIB),
        _ => 100 * MIB + rng.below(300 * MIB),
    }
}

/// Up to `captures` captures on `streams` streams (no cross-stream uses: a pool routed
/// outside a capture, as these are run, frees such blocks when their events complete, where
/// a capture waits for its end; the driver-capture test below covers them).
fn program(rng: &mut Rng, captures: usize, streams: usize) -> Vec<Vec<Step>> {
    let huge = rng.below(4) == 0;
    (0..captures)
        .map(|_| {
            (0..3 + rng.below(50))
                .map(|_| match rng.below(8) {
                    0..=2 => Step::Free {
                        nth: rng.below(64) as usize,
                    },
                    _ => Step::Alloc {
                        bytes: size(rng, huge),
                        stream: rng.below(streams as u64) as usize,
                    },
                })
                .collect()
        })
        .collect()
}

/// Runs steps; returns the live blocks (pointer, bytes as allocated).
fn run_steps(
    a: &CachingAllocator,
    streams: &[StreamHandle],
    steps: &[Step],
    allocated: &mut u64,
    peak: &mut u64,
) -> Res<Vec<(DevicePtr, u64)>> {
    let mut live: Vec<(DevicePtr, u64)> = Vec::new();
    for step in steps {
        match *step {
            Step::Alloc { bytes, stream } => {
                let b = a.allocate(bytes, streams[stream])?;
                *allocated += b.size;
                *peak = (*peak).max(*allocated);
                live.push((b.ptr, b.size));
            }
            Step::Free { nth } if !live.is_empty() => {
                let (p, n) = live.remove(nth % live.len());
                *allocated -= n;
                a.free(p)?;
            }
            Step::Use { nth, stream } if !live.is_empty() => {
                let (p, _) = live[nth % live.len()];
                if p.0 != 0 {
                    a.record_stream(p, streams[stream])?;
                }
            }
            Step::Free { .. } | Step::Use { .. } => {}
        }
    }
    Ok(live)
}

struct Real {
    reserved: Vec<u64>,
    segments: Vec<u64>,
    peak: u64,
}

/// The program captured for real into one pool; `between(a, i)` runs after capture `i`.
fn captured(
    a: &CachingAllocator,
    streams: &[StreamHandle],
    captures: &[Vec<Step>],
    after: AfterCapture,
    between: &mut dyn FnMut(&CachingAllocator, usize) -> TestResult,
) -> Res<Real> {
    let pool = PoolId::for_capture();
    let (mut allocated, mut peak) = (0, 0);
    let mut reserved = Vec::new();
    for (i, steps) in captures.iter().enumerate() {
        a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
        let left = run_steps(a, streams, steps, &mut allocated, &mut peak)?;
        a.end_allocate_to_pool(pool)?;
        if after == AfterCapture::FreeOutputs {
            for (p, n) in left {
                allocated -= n;
                a.free(p)?;
            }
        }
        reserved.push(a.pool_reserved_bytes(pool));
        between(a, i)?;
    }
    let mut segments: Vec<u64> = a
        .snapshot()
        .0
        .iter()
        .filter(|s| s.segment_pool_id == (pool.0, pool.1))
        .map(|s| s.total_size)
        .collect();
    segments.sort_unstable();
    Ok(Real {
        reserved,
        segments,
        peak,
    })
}

/// The program run eagerly, each capture's requests recorded; outputs dropped after each.
fn warm_up(
    a: &CachingAllocator,
    streams: &[StreamHandle],
    captures: &[Vec<Step>],
) -> Res<Vec<CaptureRequests>> {
    let mut recorded = Vec::new();
    for steps in captures {
        let (mut x, mut y) = (0, 0);
        let (left, requests) =
            a.record_requests(streams, || run_steps(a, streams, steps, &mut x, &mut y));
        for (p, _) in left? {
            a.free(p)?;
        }
        recorded.push(requests);
    }
    Ok(recorded)
}

/// Leaves the default pool busy: some blocks held, more cached, on every stream.
fn busy(a: &CachingAllocator, streams: &[StreamHandle], rng: &mut Rng) -> TestResult {
    let mut blocks = Vec::new();
    for i in 0..24 {
        blocks.push(
            a.allocate(size(rng, false), streams[i % streams.len()])?
                .ptr,
        );
    }
    for (i, p) in blocks.into_iter().enumerate() {
        if i % 3 != 0 {
            a.free(p)?;
        }
    }
    Ok(())
}

/// Every configuration here parses; each changes rounding, segment sizes, reuse or release.
const CONFIGS: [&str; 20] = [
    "",
    "max_split_size_mb:20",
    "max_split_size_mb:64",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:1",
    "roundup_power2_divisions:[256:2,>:8]",
    "roundup_power2_divisions:[64:8,256:4,1024:2,>:1]",
    "expandable_segments:True",
    "ferrocuda_recommended:True",
    "thread_cache:False",
    "cross_stream_reuse:True",
    "oom_release_partial:True,oom_search_after_sync:True",
    "garbage_collection_threshold:0.5",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    "garbage_collection_threshold:0.5,garbage_collection_without_fraction:True",
    "large_segment_size_mb:32",
    "max_split_size_mb:30,max_non_split_rounding_mb:60",
    "pinned_use_cuda_host_register:True,pinned_num_register_threads:8,release_lock_on_cudamalloc:True",
    "expandable_segments:True,expandable_segments_page_mb:4,max_split_size_mb:100",
    "roundup_power2_divisions:[128:16,>:2],max_split_size_mb:24,cross_stream_reuse:True",
];

/// One seeded differential case; panics with the seed on a mismatch.
fn differential(seed: u64, completion: Completion) -> TestResult {
    let mut rng = seeded(seed);
    let conf = CONFIGS[(seed % CONFIGS.len() as u64) as usize];
    let after = if (seed / 7).is_multiple_of(2) {
        AfterCapture::KeepOutputs
    } else {
        AfterCapture::FreeOutputs
    };
    let nstreams = 1 + rng.below(3) as usize;
    let count = 1 + rng.below(6) as usize;
    let captures = program(&mut rng, count, nstreams);
    let (fake, a) = setup(512 * GIB, conf, completion);
    let mut streams: Vec<StreamHandle> = Vec::new();
    for i in 0..nstreams {
        // The legacy stream as one of them, now and then.
        streams.push(if i == 1 && seed.is_multiple_of(3) {
            LEGACY
        } else {
            new_stream(&fake)?
        });
    }
    busy(&a, &streams, &mut rng)?;
    let recorded = warm_up(&a, &streams, &captures)?;
    let real = captured(&a, &streams, &captures, after, &mut |_, _| Ok(()))?;
    let plan = plan_pool(&AllocatorConfig::parse(conf)?, &recorded, after)?;
    let what = format!("seed {seed}, config {conf:?}, {after:?}, {nstreams} streams");
    assert_eq!(plan.reserved_after, real.reserved, "{what}: reserved after");
    assert_eq!(
        plan.reserved_bytes,
        *real.reserved.last().unwrap(),
        "{what}"
    );
    let mut planned_segments = plan.segments.clone();
    planned_segments.sort_unstable();
    assert_eq!(planned_segments, real.segments, "{what}: segments");
    assert_eq!(plan.peak_allocated_bytes, real.peak, "{what}: peak");
    a.check_invariants()?;
    Ok(())
}

/// 400 seeded programs over 20 configurations, boundary/zero/tiny/huge sizes, one to three
/// streams (the legacy one among them), both output policies.
#[test]
fn plan_equals_pool_over_every_configuration_and_size_class() -> TestResult {
    for seed in 1..=400u64 {
        differential(seed, Completion::Eager)?;
    }
    Ok(())
}

/// The same under manual completion (no stream work ever completes by itself).
#[test]
fn plan_equals_pool_under_manual_completion() -> TestResult {
    for seed in 1001..=1200u64 {
        differential(seed, Completion::Manual)?;
    }
    Ok(())
}

/// Small blocks freed by this thread just before a capture (the thread cache parks them)
/// must not serve the capture's requests of the same size and stream, and a block the
/// capture frees must not serve the default pool's next same-size request afterwards.
#[test]
fn the_thread_cache_never_crosses_a_pool_boundary() -> TestResult {
    for conf in ["", "thread_cache:True"] {
        let (fake, a) = setup(8 * GIB, conf, Completion::Eager);
        let s = [new_stream(&fake)?];
        let make = |a: &CachingAllocator| -> Res<Vec<(DevicePtr, u64)>> {
            let x = a.allocate(4096, s[0])?;
            a.free(x.ptr)?;
            let y = a.allocate(3 * MIB, s[0])?;
            a.free(y.ptr)?;
            Ok(vec![])
        };
        // Park a default block of each size right before the capture.
        make(&a)?;
        let steps = vec![
            Step::Alloc {
                bytes: 4096,
                stream: 0,
            },
            Step::Free { nth: 0 },
            Step::Alloc {
                bytes: 3 * MIB,
                stream: 0,
            },
            Step::Free { nth: 0 },
        ];
        let captures = vec![steps.clone(), steps];
        let recorded = warm_up(&a, &s, &captures)?;
        make(&a)?;
        let after = AfterCapture::FreeOutputs;
        // Between the captures the default pool asks for the same sizes on the same stream.
        let mut between = |a: &CachingAllocator, _| make(a).map(|_| ());
        let real = captured(&a, &s, &captures, after, &mut between)?;
        let plan = plan_pool(&AllocatorConfig::parse(conf)?, &recorded, after)?;
        assert_eq!(plan.reserved_after, vec![22 * MIB, 22 * MIB], "{conf:?}");
        assert_eq!(plan.reserved_after, real.reserved, "{conf:?}");
        a.check_invariants()?;
    }
    Ok(())
}

/// Between captures: `empty_cache`, another thread's default-pool traffic, another pool's
/// capture, default requests on the capture's streams. None of it belongs to the pool, so
/// none of it changes what the pool reserves.
#[test]
fn what_happens_between_captures_leaves_the_pool_alone() -> TestResult {
    for seed in 1..=60u64 {
        let mut rng = seeded(seed ^ 0xABCD);
        let conf = CONFIGS[(seed % CONFIGS.len() as u64) as usize];
        let (fake, a) = setup(512 * GIB, conf, Completion::Eager);
        let streams = [new_stream(&fake)?, new_stream(&fake)?];
        let count = 2 + rng.below(4) as usize;
        let captures = program(&mut rng, count, 2);
        let recorded = warm_up(&a, &streams, &captures)?;
        let after = AfterCapture::FreeOutputs;
        let mut between = |a: &CachingAllocator, i: usize| -> TestResult {
            match (seed + i as u64) % 4 {
                0 => a.empty_cache(),
                1 => std::thread::scope(|sc| {
                    sc.spawn(|| {
                        for n in [512, 3 * MIB, 30 * MIB] {
                            let b = a.allocate(n, streams[0]).unwrap();
                            a.free(b.ptr).unwrap();
                        }
                    });
                }),
                2 => {
                    let other = PoolId::for_capture();
                    a.begin_allocate_to_pool(other, Route::Thread(std::thread::current().id()))?;
                    let b = a.allocate(6 * MIB, streams[1])?;
                    a.free(b.ptr)?;
                    a.end_allocate_to_pool(other)?;
                }
                _ => {
                    let mut r = seeded(seed + i as u64);
                    busy(a, &streams, &mut r)?;
                }
            }
            Ok(())
        };
        let real = captured(&a, &streams, &captures, after, &mut between)?;
        let plan = plan_pool(&AllocatorConfig::parse(conf)?, &recorded, after)?;
        assert_eq!(plan.reserved_after, real.reserved, "seed {seed}, {conf:?}");
    }
    Ok(())
}

/// A block used on a second stream is freed, then a small block of the same stream is
/// freed, then a request the first block could serve: inside a routed capture. The eager
/// warm-up records both frees before either completes, so the trace's `free_completed` of
/// the first is not next after its `free_requested`.
fn used_then_two_frees() -> Vec<Step> {
    use Step::*;
    vec![
        Alloc {
            bytes: 12 * MIB,
            stream: 0,
        },
        Use { nth: 0, stream: 1 },
        Alloc {
            bytes: 1024,
            stream: 0,
        },
        Free { nth: 0 },
        Free { nth: 0 },
        Alloc {
            bytes: 12 * MIB,
            stream: 0,
        },
    ]
}

/// Two programs with a block used on a second stream (`record_stream`), captured for real on
/// the driver (`Route::Capture`): the capture defers a cross-stream free to its end
/// (PyTorch's rule), so the plan from the warm-up must say what the capture reserves,
/// whichever way the warm-up's trace fell (in the first, the next allocation completes
/// the free, so its `free_completed` follows its `free_requested` as a plain free's does).
/// A pool filled outside a capture (`Route::Thread`) gets such blocks back when their
/// events complete instead: not what a capture's plan models.
#[test]
fn a_cross_stream_free_in_a_driver_capture_plans_as_the_pool_reserves() -> TestResult {
    use Step::*;
    use ferrocuda_driver::Driver;
    use ferrocuda_types::{CaptureMode, CaptureStatus};
    let simple = vec![
        Alloc {
            bytes: 12 * MIB,
            stream: 0,
        },
        Use { nth: 0, stream: 1 },
        Free { nth: 0 },
        Alloc {
            bytes: 12 * MIB,
            stream: 0,
        },
    ];
    for steps in [simple, used_then_two_frees()] {
        let (fake, a) = setup(64 * GIB, "", Completion::Eager);
        let streams = [new_stream(&fake)?, new_stream(&fake)?];
        let recorded = warm_up(&a, &streams, std::slice::from_ref(&steps))?;
        let pool = PoolId::for_capture();
        fake.stream_begin_capture(streams[0], CaptureMode::Relaxed)?;
        let CaptureStatus::Active { id } = fake.stream_capture_status(streams[0])? else {
            panic!("not capturing");
        };
        a.begin_allocate_to_pool(pool, Route::Capture(id))?;
        let (mut x, mut y) = (0, 0);
        let left = run_steps(&a, &streams, &steps, &mut x, &mut y)?;
        a.end_allocate_to_pool(pool)?;
        fake.stream_end_capture(streams[0])?;
        let real = a.pool_reserved_bytes(pool);
        let plan = plan_pool(
            &AllocatorConfig::default(),
            &recorded,
            AfterCapture::KeepOutputs,
        )?;
        assert_eq!(
            plan.reserved_after,
            vec![real],
            "steps {steps:?}, recorded {:?}",
            recorded[0].requests()
        );
        assert!(!left.is_empty());
    }
    Ok(())
}
