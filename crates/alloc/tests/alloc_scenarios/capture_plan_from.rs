//! Plans from a pool that holds segments already (`plan_pool_from`, what CUDA-graph trees
//! need: they warm up in their pool and record into it step after step) against the pool
//! itself: seeded programs run for real into one private pool, some of their blocks left
//! live and some freed, the pool's layout read, then more captures planned from that
//! layout and run for real; the reserved bytes after each must agree, under several
//! configurations. The requests come straight from the programs (what a recording of them
//! gives: `capture_plan.rs` checks that).
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::Rng;
use crate::capture_plan::{CONFIGS, Step, busy_default_pool, program, run_steps};
use crate::common::{GIB, LEGACY, MIB, TestResult, new_stream, setup};
use ferrocuda_alloc::{AfterCapture, CaptureRequests, PlanError, Route, plan_pool_from};
use ferrocuda_driver::fake::Completion;
use ferrocuda_types::{
    AllocatorConfig, BlockCheckpoint, DevicePtr, PoolId, PoolKind, SegmentCheckpoint, StreamHandle,
};

/// The requests a capture running `steps` on `streams` makes (frees as `run_steps` picks
/// them: the `nth` live block of this capture).
fn requests(steps: &[Step], streams: [StreamHandle; 2]) -> CaptureRequests {
    let mut r = CaptureRequests::new();
    let mut live: Vec<usize> = Vec::new();
    for step in steps {
        match *step {
            Step::Alloc { bytes, stream } => live.push(r.alloc(bytes, streams[stream].raw)),
            Step::Free { nth } if !live.is_empty() => r.free(live.remove(nth % live.len())),
            Step::Free { .. } => {}
        }
    }
    r
}

/// 200 seeded programs: a first phase of captures fills the pool, a random part of what
/// it left live is freed, then a second phase is planned from the pool's layout and run:
/// the plan's reserved bytes equal the pool's after every capture of the second phase,
/// with the first phase's survivors still live in both.
#[test]
fn a_plan_from_a_pools_layout_equals_the_pool_after_more_captures() -> TestResult {
    let mut checked = 0;
    let mut with_live = 0;
    for seed in 1..=200u64 {
        let mut rng = Rng(seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
        let conf = CONFIGS[(seed % 5) as usize];
        let after = if seed % 2 == 0 {
            AfterCapture::KeepOutputs
        } else {
            AfterCapture::FreeOutputs
        };
        let (n_first, n_second) = (1 + rng.below(3) as usize, 1 + rng.below(4) as usize);
        let first = program(&mut rng, n_first);
        let second = program(&mut rng, n_second);
        let (fake, a) = setup(64 * GIB, conf, Completion::Eager);
        busy_default_pool(&a, &mut rng)?;
        let streams = [new_stream(&fake)?, new_stream(&fake)?];
        let pool = PoolId::for_capture();
        let route = || Route::Thread(std::thread::current().id());
        let mut survivors = Vec::new();
        for steps in &first {
            a.begin_allocate_to_pool(pool, route())?;
            survivors.extend(run_steps(&a, streams, steps)?);
            a.end_allocate_to_pool(pool)?;
        }
        survivors.retain(|&p| {
            let keep = rng.below(3) == 0;
            if !keep {
                a.free(p).unwrap();
            }
            keep
        });
        let layout = a.pool_layout(pool);
        assert_eq!(
            layout
                .iter()
                .flat_map(|s| &s.blocks)
                .map(|b| b.size)
                .sum::<u64>(),
            a.pool_reserved_bytes(pool)
        );
        let planned: Vec<CaptureRequests> = second.iter().map(|s| requests(s, streams)).collect();
        let plan = plan_pool_from(&AllocatorConfig::parse(conf)?, &layout, &planned, after)?;
        let mut real = Vec::new();
        for steps in &second {
            a.begin_allocate_to_pool(pool, route())?;
            let left = run_steps(&a, streams, steps)?;
            a.end_allocate_to_pool(pool)?;
            if after == AfterCapture::FreeOutputs {
                left.into_iter().try_for_each(|p| a.free(p))?;
            }
            real.push(a.pool_reserved_bytes(pool));
        }
        assert_eq!(
            plan.reserved_after,
            real,
            "seed {seed}, config {conf:?}, {after:?}, {} live at the start: planned against run",
            survivors.len()
        );
        a.check_invariants()?;
        checked += real.len();
        with_live += usize::from(!survivors.is_empty());
    }
    assert!(checked > 300, "{checked} captures checked");
    assert!(
        with_live > 50,
        "{with_live} programs began with live blocks"
    );
    Ok(())
}

/// A layout alone (no captures) plans to its own bytes; with the live blocks kept, a
/// request that fits only the free block of a starting segment takes it, one that fits
/// nowhere takes a new segment.
#[test]
fn a_layouts_free_and_live_blocks_are_the_pools() -> TestResult {
    let block = |ptr: u64, size: u64, allocated: bool| BlockCheckpoint {
        ptr: DevicePtr(ptr),
        size,
        requested: if allocated { size } else { 0 },
        stream: LEGACY,
        allocated,
    };
    let base = 1 << 30;
    let layout = [SegmentCheckpoint {
        kind: PoolKind::Large,
        blocks: vec![
            block(base, 12 * MIB, true),
            block(base + 12 * MIB, 8 * MIB, false),
        ],
    }];
    let conf = AllocatorConfig::default();
    let keep = AfterCapture::KeepOutputs;
    let alone = plan_pool_from(&conf, &layout, &[], keep)?;
    assert_eq!(
        (alone.reserved_bytes, alone.segments),
        (20 * MIB, vec![20 * MIB])
    );
    let mut fits = CaptureRequests::new();
    fits.alloc(8 * MIB, 0);
    assert_eq!(
        plan_pool_from(&conf, &layout, &[fits], keep)?.reserved_bytes,
        20 * MIB
    );
    let mut too_big = CaptureRequests::new();
    too_big.alloc(9 * MIB, 0);
    assert_eq!(
        plan_pool_from(&conf, &layout, &[too_big.clone()], keep)?.reserved_bytes,
        40 * MIB
    );
    // The same segment all free: 9 MiB fits it.
    let mut free = layout.clone();
    free[0].blocks.iter_mut().for_each(|b| b.allocated = false);
    assert_eq!(
        plan_pool_from(&conf, &free, &[too_big], keep)?.reserved_bytes,
        20 * MIB
    );
    Ok(())
}

/// Layouts that are not a pool's (a segment without blocks, blocks with a gap, segments
/// out of order or overlapping) are refused before anything is planned.
#[test]
fn a_malformed_layout_is_a_typed_error() {
    let block = |ptr: u64, size: u64| BlockCheckpoint {
        ptr: DevicePtr(ptr),
        size,
        requested: 0,
        stream: LEGACY,
        allocated: false,
    };
    let segment = |blocks: Vec<BlockCheckpoint>| SegmentCheckpoint {
        kind: PoolKind::Large,
        blocks,
    };
    let conf = AllocatorConfig::default();
    let keep = AfterCapture::KeepOutputs;
    let bad = [
        vec![segment(vec![])],
        vec![segment(vec![
            block(0x1000_0000, MIB),
            block(0x1020_0000, MIB),
        ])],
        vec![
            segment(vec![block(0x2000_0000, 2 * MIB)]),
            segment(vec![block(0x1000_0000, 2 * MIB)]),
        ],
        vec![
            segment(vec![block(0x1000_0000, 4 * MIB)]),
            segment(vec![block(0x1020_0000, 2 * MIB)]),
        ],
        vec![segment(vec![block(0x1000_0000, 0)])],
    ];
    for (i, layout) in bad.iter().enumerate() {
        assert!(
            matches!(
                plan_pool_from(&conf, layout, &[], keep),
                Err(PlanError::Layout(_))
            ),
            "layout {i} was accepted"
        );
    }
}
