//! `record_requests`, `from_trace` and `plan_pool` at their edges, sizes at the rounding
//! boundaries against hand-computed segments, and captures under memory pressure.
use super::{Step, captured, run_steps, setup, warm_up};
use crate::common::{GIB, MIB, TestResult, new_stream};
use ferrocuda_alloc::history::{HistoryMode, HistoryOptions};
use ferrocuda_alloc::{
    AfterCapture, AllocError, CachingAllocator, CaptureRequests, PlanError, PlannedRequest, Route,
    plan_pool,
};
use ferrocuda_driver::fake::Completion;
use ferrocuda_types::{AllocatorConfig, PoolId, TraceEntry};

fn history(mode: HistoryMode, max_entries: usize) -> HistoryOptions {
    HistoryOptions {
        mode,
        max_entries,
        ..HistoryOptions::default()
    }
}

/// Trace entries other than the snapshot marker.
fn events(a: &CachingAllocator) -> Vec<TraceEntry> {
    a.snapshot()
        .1
        .into_iter()
        .filter(|e| e.action != "snapshot")
        .collect()
}

fn default_plan(captures: &[CaptureRequests]) -> Result<ferrocuda_alloc::PoolPlan, PlanError> {
    plan_pool(
        &AllocatorConfig::default(),
        captures,
        AfterCapture::KeepOutputs,
    )
}

/// History off before: nothing stays recorded, and later requests are not recorded either.
#[test]
fn history_off_stays_off_after_a_recording() -> TestResult {
    let (fake, a) = setup(8 * GIB, "", Completion::Eager);
    let s = new_stream(&fake)?;
    let ((), r) = a.record_requests(&[], || {
        let b = a.allocate(3 * MIB, s).unwrap();
        a.free(b.ptr).unwrap();
    });
    assert_eq!(r.requests().len(), 2);
    let b = a.allocate(5 * MIB, s)?;
    a.free(b.ptr)?;
    assert_eq!(events(&a), vec![], "history was off");
    Ok(())
}

/// History on with a ring of 5: the recording returns every request of the warm-up (more
/// than 5, and none from before), and afterwards the ring holds at most 5, the newest.
#[test]
fn a_bounded_history_keeps_its_bound_and_its_newest_entries() -> TestResult {
    let (fake, a) = setup(8 * GIB, "", Completion::Eager);
    let s = new_stream(&fake)?;
    a.record_memory_history(history(HistoryMode::All, 5));
    for _ in 0..4 {
        let b = a.allocate(MIB, s)?;
        a.free(b.ptr)?;
    }
    let ((), r) = a.record_requests(&[s], || {
        for n in 1..=10u64 {
            let b = a.allocate(n * 4096, s).unwrap();
            a.free(b.ptr).unwrap();
        }
    });
    assert_eq!(r.requests().len(), 20, "{:?}", r.requests());
    assert!(matches!(
        r.requests()[0],
        PlannedRequest::Alloc { bytes: 4096, .. }
    ));
    let kept = events(&a);
    assert!(kept.len() <= 5, "{} entries kept", kept.len());
    assert!(!kept.is_empty());
    assert_eq!(kept.last().unwrap().size, 40960, "the newest entry is kept");
    let b = a.allocate(7 * MIB, s)?;
    let kept = events(&a);
    assert!(kept.len() <= 5, "{} entries after one more", kept.len());
    assert!(
        kept.iter()
            .any(|e| e.action == "alloc" && e.addr == b.ptr.0)
    );
    Ok(())
}

/// Under every history option, what the history holds after a recording is what it would
/// hold had the same requests been made without one (a twin allocator).
#[test]
fn a_recording_leaves_the_history_as_an_unrecorded_run_would() -> TestResult {
    let ops = |a: &CachingAllocator, s, from: u64| {
        for n in from..from + 6 {
            let b = a.allocate(n * 4096, s).unwrap();
            if n % 2 == 0 {
                a.free(b.ptr).unwrap();
            }
        }
    };
    let key = |es: Vec<TraceEntry>| -> Vec<(String, u64, u64)> {
        es.into_iter().map(|e| (e.action, e.addr, e.size)).collect()
    };
    for (mode, max) in [
        (HistoryMode::Off, usize::MAX),
        (HistoryMode::State, usize::MAX),
        (HistoryMode::State, 3),
        (HistoryMode::All, 1),
        (HistoryMode::All, 4),
        (HistoryMode::All, usize::MAX),
    ] {
        let (fa, a) = setup(8 * GIB, "", Completion::Eager);
        let (fb, b) = setup(8 * GIB, "", Completion::Eager);
        let (sa, sb) = (new_stream(&fa)?, new_stream(&fb)?);
        assert_eq!(sa, sb);
        a.record_memory_history(history(mode, max));
        b.record_memory_history(history(mode, max));
        ops(&a, sa, 1);
        ops(&b, sb, 1);
        let ((), r) = a.record_requests(&[], || ops(&a, sa, 10));
        ops(&b, sb, 10);
        assert_eq!(r.requests().len(), 9);
        assert_eq!(key(events(&a)), key(events(&b)), "{mode:?} {max} after");
        ops(&a, sa, 20);
        ops(&b, sb, 20);
        assert_eq!(key(events(&a)), key(events(&b)), "{mode:?} {max} later");
    }
    Ok(())
}

/// Only the named streams' requests are returned.
#[test]
fn a_recording_keeps_only_the_named_streams() -> TestResult {
    let (fake, a) = setup(8 * GIB, "", Completion::Eager);
    let (s0, s1) = (new_stream(&fake)?, new_stream(&fake)?);
    let ((), r) = a.record_requests(&[s1], || {
        let x = a.allocate(100, s0).unwrap();
        let y = a.allocate(200, s1).unwrap();
        a.free(x.ptr).unwrap();
        a.free(y.ptr).unwrap();
    });
    use PlannedRequest::*;
    assert_eq!(
        r.requests(),
        &[
            Alloc {
                block: 0,
                bytes: 200,
                stream: s1.raw
            },
            Free { block: 0 }
        ]
    );
    Ok(())
}

/// A recording inside another: the outer one still sees every request its warm-up made,
/// the inner one's included, and the history is off once both are done.
#[test]
fn a_nested_recording_loses_nothing() -> TestResult {
    let (fake, a) = setup(8 * GIB, "", Completion::Eager);
    let s = new_stream(&fake)?;
    let (inner, outer) = a.record_requests(&[], || {
        a.allocate(MIB, s).unwrap();
        let ((), inner) = a.record_requests(&[], || {
            a.allocate(2 * MIB, s).unwrap();
        });
        a.allocate(3 * MIB, s).unwrap();
        inner
    });
    assert_eq!(inner.requests().len(), 1);
    let sizes: Vec<u64> = outer
        .requests()
        .iter()
        .filter_map(|r| match r {
            PlannedRequest::Alloc { bytes, .. } => Some(*bytes),
            _ => None,
        })
        .collect();
    assert_eq!(sizes, vec![MIB, 2 * MIB, 3 * MIB]);
    a.allocate(4 * MIB, s)?;
    assert_eq!(events(&a), vec![], "history was off");
    Ok(())
}

/// A warm-up that panics: the history still goes back to its options (off).
#[test]
fn a_panicking_warm_up_restores_the_history() -> TestResult {
    let (fake, a) = setup(8 * GIB, "", Completion::Eager);
    let s = new_stream(&fake)?;
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        a.record_requests(&[], || -> () {
            a.allocate(MIB, s).unwrap();
            panic!("warm-up failed");
        })
    }));
    assert!(out.is_err());
    for _ in 0..3 {
        let b = a.allocate(MIB, s)?;
        a.free(b.ptr)?;
    }
    let kept = events(&a);
    assert!(
        kept.is_empty(),
        "history left on after a panic: {} entries",
        kept.len()
    );
    Ok(())
}

fn entry(action: &str, addr: u64, size: u64) -> TraceEntry {
    TraceEntry {
        action: action.into(),
        addr,
        size,
        stream: 3,
        time_us: 0,
        device_free: None,
        compile_context: "N/A".into(),
        user_metadata: String::new(),
        frames: None,
    }
}

/// An address reused within a trace names two blocks; a free of an address from before is
/// ignored; segment entries do not separate a free from its completion; a free never
/// completed is freed at the end.
#[test]
fn from_trace_follows_addresses_through_reuse() {
    let trace = [
        entry("free_requested", 999, 64),
        entry("free_completed", 999, 64),
        entry("segment_alloc", 100, 2 * MIB),
        entry("alloc", 100, 512),
        entry("free_requested", 100, 512),
        entry("segment_free", 5000, 2 * MIB),
        entry("free_completed", 100, 512),
        entry("alloc", 100, 1024),
        entry("alloc", 200, 4096),
        entry("free_requested", 100, 1024),
        entry("free_completed", 100, 1024),
        entry("free_requested", 200, 4096),
    ];
    use PlannedRequest::*;
    assert_eq!(
        CaptureRequests::from_trace(&trace).requests(),
        &[
            Alloc {
                block: 0,
                bytes: 512,
                stream: 3
            },
            Free { block: 0 },
            Alloc {
                block: 1,
                bytes: 1024,
                stream: 3
            },
            Alloc {
                block: 2,
                bytes: 4096,
                stream: 3
            },
            Free { block: 1 },
            FreeAtEnd { block: 2 },
        ]
    );
}

/// No captures, empty captures, a block of another capture, a free at the end of an unknown
/// block, and requests no device can hold: typed answers, no panic.
#[test]
fn plan_pool_edges_are_typed() {
    let plan = default_plan(&[]).unwrap();
    assert_eq!(
        (
            plan.reserved_bytes,
            plan.reserved_after.len(),
            plan.peak_allocated_bytes
        ),
        (0, 0, 0)
    );
    assert!(plan.segments.is_empty());
    let plan = default_plan(&[CaptureRequests::new(), CaptureRequests::new()]).unwrap();
    assert_eq!(plan.reserved_after, vec![0, 0]);
    let mut first = CaptureRequests::new();
    first.alloc(MIB, 0);
    let mut second = CaptureRequests::new();
    second.free(0);
    match default_plan(&[first.clone(), second]) {
        Err(PlanError::UnknownBlock { capture: 1, source }) => {
            assert_eq!((source.block, source.at), (0, 0));
        }
        other => panic!("a block of capture 0 freed by capture 1: {other:?}"),
    }
    let mut at_end = CaptureRequests::new();
    at_end.free_at_end(0);
    assert!(matches!(
        default_plan(&[at_end]),
        Err(PlanError::UnknownBlock { capture: 0, .. })
    ));
    for bytes in [1u64 << 60, u64::MAX, u64::MAX - 511] {
        let mut huge = CaptureRequests::new();
        huge.alloc(bytes, 0);
        let r = std::panic::catch_unwind(|| default_plan(&[huge]));
        assert!(
            matches!(r, Ok(Err(PlanError::Alloc(AllocError::OutOfMemory(_))))),
            "{bytes} bytes: {r:?}"
        );
    }
}

/// Zero-byte requests take no memory and their blocks free without error.
#[test]
fn zero_byte_requests_reserve_nothing() {
    let mut c = CaptureRequests::new();
    let x = c.alloc(0, 1);
    let y = c.alloc(0, 2);
    c.free(x);
    c.free_at_end(y);
    c.alloc(0, 1);
    let plan = default_plan(&[c]).unwrap();
    assert_eq!(plan.reserved_after, vec![0]);
    assert_eq!(plan.peak_allocated_bytes, 0);
}

/// Each request on a stream of its own, kept: the segments are PyTorch's for each size
/// (2 MiB small segments to 1 MiB, 20 MiB below 10 MiB, 2 MiB multiples from there).
#[test]
fn boundary_sizes_take_pytorchs_segments() -> TestResult {
    let cases = [
        (1, 2 * MIB),
        (MIB, 2 * MIB),
        (MIB + 1, 20 * MIB),
        (2 * MIB, 20 * MIB),
        (10 * MIB - 1, 10 * MIB),
        (10 * MIB, 10 * MIB),
        (10 * MIB + 1, 12 * MIB),
        (20 * MIB, 20 * MIB),
        (3 * GIB + 1, 3 * GIB + 2 * MIB),
    ];
    let mut c = CaptureRequests::new();
    for (i, (bytes, _)) in cases.iter().enumerate() {
        c.alloc(*bytes, 100 + i as u64);
    }
    let plan = default_plan(&[c])?;
    let mut expected: Vec<u64> = cases.iter().map(|c| c.1).collect();
    let mut got = plan.segments.clone();
    expected.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, expected);
    assert_eq!(plan.reserved_bytes, expected.iter().sum::<u64>());
    assert!(plan.peak_allocated_bytes <= plan.reserved_bytes);
    // Stream keys: one key shares, two keys do not, across captures too.
    let mut a = CaptureRequests::new();
    let x = a.alloc(12 * MIB, u64::MAX);
    a.free(x);
    for (key, reserved) in [(u64::MAX, 12 * MIB), (0, 24 * MIB)] {
        let mut b = CaptureRequests::new();
        b.alloc(12 * MIB, key);
        assert_eq!(default_plan(&[a.clone(), b])?.reserved_bytes, reserved);
    }
    Ok(())
}

/// 20 000 tiny requests on three streams, half freed as they go: the plan equals the pool.
#[test]
fn many_tiny_requests_plan_as_the_pool_reserves() -> TestResult {
    let (fake, a) = setup(64 * GIB, "", Completion::Eager);
    let streams = [new_stream(&fake)?, new_stream(&fake)?, new_stream(&fake)?];
    let steps: Vec<Step> = (0..20_000usize)
        .map(|i| {
            if i % 4 == 3 {
                Step::Free { nth: i * 7 }
            } else {
                Step::Alloc {
                    bytes: 1 + (i as u64 * 37) % 600,
                    stream: i % 3,
                }
            }
        })
        .collect();
    let captures = vec![steps.clone(), steps];
    let recorded = warm_up(&a, &streams, &captures)?;
    for after in [AfterCapture::KeepOutputs, AfterCapture::FreeOutputs] {
        let real = captured(&a, &streams, &captures, after, &mut |_, _| Ok(()))?;
        let plan = plan_pool(&AllocatorConfig::default(), &recorded, after)?;
        assert_eq!(plan.reserved_after, real.reserved, "{after:?}");
        assert_eq!(plan.peak_allocated_bytes, real.peak, "{after:?}");
    }
    Ok(())
}

/// A 1 GiB device whose default pool caches 900 MiB: the capture fits only once that cache
/// is released. The pool still reserves what the plan says, under releasing configurations.
#[test]
fn a_capture_that_needs_the_default_cache_released() -> TestResult {
    use Step::*;
    let steps = vec![
        Alloc {
            bytes: 300 * MIB,
            stream: 0,
        },
        Alloc {
            bytes: 200 * MIB,
            stream: 0,
        },
        Free { nth: 0 },
        Alloc {
            bytes: 100 * MIB,
            stream: 0,
        },
        Alloc {
            bytes: 5 * MIB,
            stream: 0,
        },
    ];
    for conf in [
        "",
        "oom_release_partial:True",
        "oom_search_after_sync:True",
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.95",
        "garbage_collection_threshold:0.3,garbage_collection_without_fraction:True",
        "cross_stream_reuse:True",
        "expandable_segments:True",
        "ferrocuda_recommended:True",
    ] {
        let (fake, a) = setup(GIB, conf, Completion::Eager);
        let streams = [new_stream(&fake)?, new_stream(&fake)?];
        let recorded = warm_up(&a, &streams, std::slice::from_ref(&steps))?;
        let cached: Vec<_> = (0..30)
            .map(|i| a.allocate(30 * MIB, streams[i % 2]).unwrap().ptr)
            .collect();
        cached.into_iter().try_for_each(|p| a.free(p))?;
        let keep = AfterCapture::KeepOutputs;
        let real = captured(
            &a,
            &streams,
            std::slice::from_ref(&steps),
            keep,
            &mut |_, _| Ok(()),
        )?;
        let plan = plan_pool(&AllocatorConfig::parse(conf)?, &recorded, keep)?;
        assert_eq!(plan.reserved_after, real.reserved, "{conf:?}");
        a.check_invariants()?;
    }
    Ok(())
}

/// Between two captures the pool holds a free 400 MiB segment (the pool is still in use);
/// the default pool's requests under pressure (released caches, garbage collection, a
/// request that cannot fit) must not take it: the second capture reuses it, as planned.
#[test]
fn pressure_between_captures_leaves_a_pool_in_use_alone() -> TestResult {
    for conf in [
        "",
        "oom_release_partial:True",
        "oom_search_after_sync:True,oom_release_partial:True",
        "garbage_collection_threshold:0.4,per_process_memory_fraction:1.0",
        "garbage_collection_threshold:0.2,garbage_collection_without_fraction:True",
        "cross_stream_reuse:True",
        "ferrocuda_recommended:True",
    ] {
        let (fake, a) = setup(GIB, conf, Completion::Eager);
        let streams = [new_stream(&fake)?, new_stream(&fake)?];
        let pool = PoolId::for_capture();
        let route = || Route::Thread(std::thread::current().id());
        a.begin_allocate_to_pool(pool, route())?;
        let (mut x, mut y) = (0, 0);
        let big = [Step::Alloc {
            bytes: 400 * MIB,
            stream: 0,
        }];
        for (p, _) in run_steps(&a, &streams, &big, &mut x, &mut y)? {
            a.free(p)?;
        }
        a.end_allocate_to_pool(pool)?;
        assert_eq!(a.pool_reserved_bytes(pool), 400 * MIB, "{conf:?}");
        // Default-pool traffic on both streams: 300 MiB cached, then 500 MiB (fits once the
        // default cache goes), then 700 MiB (fits only by taking the pool's segment).
        let c = a.allocate(300 * MIB, streams[1])?;
        a.free(c.ptr)?;
        let d = a.allocate(500 * MIB, streams[1])?;
        assert_eq!(
            a.pool_reserved_bytes(pool),
            400 * MIB,
            "{conf:?} after 500 MiB"
        );
        a.free(d.ptr)?;
        let e = a.allocate(700 * MIB, streams[0]);
        assert!(e.is_err(), "{conf:?}: 700 MiB fit beside a pool in use");
        assert_eq!(
            a.pool_reserved_bytes(pool),
            400 * MIB,
            "{conf:?} after 700 MiB"
        );
        a.empty_cache();
        a.begin_allocate_to_pool(pool, route())?;
        run_steps(&a, &streams, &big, &mut x, &mut y)?;
        a.end_allocate_to_pool(pool)?;
        assert_eq!(a.pool_reserved_bytes(pool), 400 * MIB, "{conf:?}: reused");
        a.check_invariants()?;
    }
    Ok(())
}

/// `max_split_size_mb:40` on a 1 GiB device whose default pool caches 800 MiB: the
/// capture frees a 200 MiB (oversize) block, then asks for 30 MiB, which the oversize
/// block may not serve. The capture fits once the default cache is released, so the pool
/// should reserve what the plan says (230 MiB), not lose its own free block to the retry.
#[test]
fn an_oom_retry_inside_a_capture_keeps_the_pools_own_oversize_block() -> TestResult {
    use Step::*;
    let steps = vec![
        Alloc {
            bytes: 200 * MIB,
            stream: 0,
        },
        Free { nth: 0 },
        Alloc {
            bytes: 30 * MIB,
            stream: 0,
        },
    ];
    let conf = "max_split_size_mb:40";
    let (fake, a) = setup(GIB, conf, Completion::Eager);
    let streams = [new_stream(&fake)?];
    let recorded = warm_up(&a, &streams, std::slice::from_ref(&steps))?;
    a.empty_cache();
    let cached: Vec<_> = (0..20)
        .map(|_| a.allocate(40 * MIB, streams[0]).unwrap().ptr)
        .collect();
    cached.into_iter().try_for_each(|p| a.free(p))?;
    let keep = AfterCapture::KeepOutputs;
    let real = captured(
        &a,
        &streams,
        std::slice::from_ref(&steps),
        keep,
        &mut |_, _| Ok(()),
    )?;
    let plan = plan_pool(&AllocatorConfig::parse(conf)?, &recorded, keep)?;
    assert_eq!(plan.reserved_after, vec![230 * MIB]);
    assert_eq!(
        plan.reserved_after, real.reserved,
        "the real pool after an OOM retry"
    );
    Ok(())
}
