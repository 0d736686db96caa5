//! The graph-memory planner against the pool it predicts: seeded random programs of
//! several captures sharing one private pool, each run for real (routed into the pool, on
//! an allocator whose own cache is busy with other memory) and planned from the requests a
//! warm-up of the same program recorded; the pool's reserved bytes after every capture
//! must equal the plan's, under several configurations.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::Rng;
use crate::common::{GIB, LEGACY, MIB, TestResult, new_stream, setup};
use ferrocuda_alloc::{
    AfterCapture, CachingAllocator, CaptureRequests, PlanError, PlannedRequest, Route, plan_pool,
};
use ferrocuda_driver::FakeDriver;
use ferrocuda_driver::fake::Completion;
use ferrocuda_types::{AllocatorConfig, DevicePtr, PoolId, StreamHandle};

/// One step of a capture's program: allocate `bytes` on stream `stream` (0 or 1), or free
/// the `nth` live block of this capture (modulo how many are live).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Step {
    Alloc { bytes: u64, stream: usize },
    Free { nth: usize },
}

/// Request sizes the way models make them: many small, some of a few MiB, a few large.
pub(crate) fn size(rng: &mut Rng) -> u64 {
    match rng.below(10) {
        0..=3 => 1 + rng.below(MIB),
        4..=7 => MIB + rng.below(12 * MIB),
        _ => 8 * MIB + rng.below(120 * MIB),
    }
}

pub(crate) fn program(rng: &mut Rng, captures: usize) -> Vec<Vec<Step>> {
    (0..captures)
        .map(|_| {
            (0..5 + rng.below(40))
                .map(|_| {
                    if rng.below(3) == 0 {
                        Step::Free {
                            nth: rng.below(64) as usize,
                        }
                    } else {
                        Step::Alloc {
                            bytes: size(rng),
                            stream: (rng.below(4) == 0) as usize,
                        }
                    }
                })
                .collect()
        })
        .collect()
}

/// Runs one capture's steps on `a` (on `streams`); returns the blocks it leaves live.
pub(crate) fn run_steps(
    a: &CachingAllocator,
    streams: [StreamHandle; 2],
    steps: &[Step],
) -> Result<Vec<DevicePtr>, Box<dyn std::error::Error>> {
    let mut live: Vec<DevicePtr> = Vec::new();
    for step in steps {
        match *step {
            Step::Alloc { bytes, stream } => live.push(a.allocate(bytes, streams[stream])?.ptr),
            Step::Free { nth } if !live.is_empty() => {
                let p = live.remove(nth % live.len());
                a.free(p)?;
            }
            Step::Free { .. } => {}
        }
    }
    Ok(live)
}

/// Memory of the program's own outside the captures: the default pool made busy, some of
/// it freed, so the captures' pool is not the allocator's only memory.
pub(crate) fn busy_default_pool(a: &CachingAllocator, rng: &mut Rng) -> TestResult {
    let blocks: Vec<DevicePtr> = (0..20)
        .map(|_| a.allocate(size(rng), LEGACY).map(|b| b.ptr))
        .collect::<Result<_, _>>()?;
    for (i, p) in blocks.into_iter().enumerate() {
        if i % 3 != 0 {
            a.free(p)?;
        }
    }
    Ok(())
}

/// The program captured for real into one pool: reserved bytes after each capture.
fn captured(
    fake: &FakeDriver,
    a: &CachingAllocator,
    captures: &[Vec<Step>],
    after: AfterCapture,
) -> Result<Vec<u64>, Box<dyn std::error::Error>> {
    let streams = [new_stream(fake)?, new_stream(fake)?];
    let pool = PoolId::for_capture();
    let mut reserved = Vec::new();
    for steps in captures {
        a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
        let left = run_steps(a, streams, steps)?;
        a.end_allocate_to_pool(pool)?;
        if after == AfterCapture::FreeOutputs {
            left.into_iter().try_for_each(|p| a.free(p))?;
        }
        reserved.push(a.pool_reserved_bytes(pool));
    }
    Ok(reserved)
}

/// The same program run eagerly (a warm-up), each capture's requests recorded.
fn warm_up(
    fake: &FakeDriver,
    a: &CachingAllocator,
    captures: &[Vec<Step>],
) -> Result<Vec<CaptureRequests>, Box<dyn std::error::Error>> {
    let streams = [new_stream(fake)?, new_stream(fake)?];
    let mut recorded = Vec::new();
    for steps in captures {
        let (left, requests) = a.record_requests(&streams, || run_steps(a, streams, steps));
        // A warm-up's outputs are dropped before the next size's warm-up.
        left?.into_iter().try_for_each(|p| a.free(p))?;
        recorded.push(requests);
    }
    Ok(recorded)
}

pub(crate) const CONFIGS: [&str; 5] = [
    "",
    "max_split_size_mb:64",
    "roundup_power2_divisions:4",
    "expandable_segments:True",
    "max_split_size_mb:200,roundup_power2_divisions:[256:2,>:8]",
];

/// 240 seeded programs of one to six captures sharing a pool, under five configurations
/// and both output policies: the plan from the warm-up's recorded requests equals the
/// pool's reserved bytes after every real capture.
#[test]
fn the_plan_equals_the_pool_every_capture_reserves() -> TestResult {
    let mut checked = 0;
    for seed in 1..=240u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let conf = CONFIGS[(seed % 5) as usize];
        let after = if seed % 2 == 0 {
            AfterCapture::KeepOutputs
        } else {
            AfterCapture::FreeOutputs
        };
        let count = 1 + rng.below(6) as usize;
        let captures = program(&mut rng, count);
        let (fake, a) = setup(64 * GIB, conf, Completion::Eager);
        busy_default_pool(&a, &mut rng)?;
        let recorded = warm_up(&fake, &a, &captures)?;
        let real = captured(&fake, &a, &captures, after)?;
        let plan = plan_pool(&AllocatorConfig::parse(conf)?, &recorded, after)?;
        assert_eq!(
            plan.reserved_after, real,
            "seed {seed}, config {conf:?}, {after:?}: planned against captured"
        );
        assert_eq!(plan.reserved_bytes, *real.last().unwrap());
        assert_eq!(plan.segments.iter().sum::<u64>(), plan.reserved_bytes);
        a.check_invariants()?;
        checked += real.len();
    }
    assert!(checked > 500, "{checked} captures checked");
    Ok(())
}

/// The recorded requests are the program's: allocations with their requested bytes and
/// streams by their handles, frees of the blocks allocated within, and a
/// free of memory allocated before the recording left out.
#[test]
fn a_recording_holds_the_warm_ups_requests() -> TestResult {
    let (fake, a) = setup(8 * GIB, "", Completion::Eager);
    let (s0, s1) = (new_stream(&fake)?, new_stream(&fake)?);
    let before = a.allocate(3 * MIB, s0)?;
    let ((), requests) = a.record_requests(&[], || {
        let x = a.allocate(1000, s1).unwrap();
        let y = a.allocate(5 * MIB, s0).unwrap();
        a.free(before.ptr).unwrap();
        a.free(x.ptr).unwrap();
        a.allocate(7, s1).unwrap();
        let _ = y;
    });
    use PlannedRequest::*;
    assert_eq!(
        requests.requests(),
        &[
            Alloc {
                block: 0,
                bytes: 1000,
                stream: s1.raw
            },
            Alloc {
                block: 1,
                bytes: 5 * MIB,
                stream: s0.raw
            },
            Free { block: 0 },
            Alloc {
                block: 2,
                bytes: 7,
                stream: s1.raw
            },
        ]
    );
    // The history is off again: nothing recorded stays behind.
    assert!(a.snapshot().1.iter().all(|e| e.action == "snapshot"));
    Ok(())
}

/// A block whose free waited for another stream's work is freed at the capture's end in
/// the plan (PyTorch defers such frees until no capture is underway), so a later request
/// of the capture cannot reuse it: two 12 MiB segments, where an immediate free shares one.
#[test]
fn a_free_that_waits_for_another_stream_frees_at_the_capture_end() -> TestResult {
    let mut deferred = CaptureRequests::new();
    let x = deferred.alloc(12 * MIB, 0);
    deferred.free_at_end(x);
    deferred.alloc(12 * MIB, 0);
    let mut immediate = CaptureRequests::new();
    let x = immediate.alloc(12 * MIB, 0);
    immediate.free(x);
    immediate.alloc(12 * MIB, 0);
    let conf = AllocatorConfig::default();
    let keep = AfterCapture::KeepOutputs;
    assert_eq!(
        plan_pool(&conf, &[deferred], keep)?.reserved_bytes,
        24 * MIB
    );
    assert_eq!(
        plan_pool(&conf, &[immediate], keep)?.reserved_bytes,
        12 * MIB
    );
    Ok(())
}

/// A trace whose `free_completed` does not follow its `free_requested` (the block was used
/// on another stream) reads as a free at the capture's end.
#[test]
fn a_trace_with_a_late_free_completed_reads_as_a_free_at_the_end() {
    let entry = |action: &str, addr: u64| ferrocuda_types::TraceEntry {
        action: action.into(),
        addr,
        size: 4096,
        stream: 7,
        time_us: 0,
        device_free: None,
        compile_context: "N/A".into(),
        user_metadata: String::new(),
        frames: None,
    };
    let trace = [
        entry("alloc", 100),
        entry("alloc", 200),
        entry("free_requested", 100),
        entry("free_requested", 200),
        entry("free_completed", 200),
        entry("segment_free", 0),
        entry("free_completed", 100),
    ];
    use PlannedRequest::*;
    assert_eq!(
        CaptureRequests::from_trace(&trace).requests(),
        &[
            Alloc {
                block: 0,
                bytes: 4096,
                stream: 7
            },
            Alloc {
                block: 1,
                bytes: 4096,
                stream: 7
            },
            FreeAtEnd { block: 0 },
            Free { block: 1 },
        ]
    );
}

/// Requests that free a block twice, or one never allocated, are refused with the capture
/// and position named, before anything is planned.
#[test]
fn a_free_of_an_unknown_block_is_a_typed_error() {
    let mut twice = CaptureRequests::new();
    let x = twice.alloc(10, 0);
    twice.free(x);
    twice.free(x);
    let fine = CaptureRequests::new();
    let conf = AllocatorConfig::default();
    match plan_pool(&conf, &[fine, twice], AfterCapture::KeepOutputs) {
        Err(PlanError::UnknownBlock { capture: 1, source }) => {
            assert_eq!((source.block, source.at), (0, 2));
        }
        other => panic!("expected an unknown block, got {other:?}"),
    }
    let mut never = CaptureRequests::new();
    never.free(3);
    assert!(matches!(
        plan_pool(&conf, &[never], AfterCapture::KeepOutputs),
        Err(PlanError::UnknownBlock { capture: 0, .. })
    ));
}
