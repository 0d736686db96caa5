//! Page reclaim falling dormant (`reclaim_clock`): after 65 536 frees without a reclaim
//! (a steady state whose segments no longer grow) frees stop stamping pages and making
//! marks due, so no mark is recorded or queried; the next growth that would reclaim wakes
//! it by stamping every page, and no page whose last use has not run moves, dormant or
//! not. The fake device runs in manual completion where work must stay queued: an access to
//! an unmapped address is a sticky error that the final synchronization reports.
#![allow(clippy::unwrap_used)]
use crate::common;
use crate::reclaim_without_sync::{
    RECLAIM, allocate_n, hole_keeps_its_pages_until_its_work_ran,
    pieces_freed_apart_move_as_their_work_runs, reserved,
};
use common::{GIB, LEGACY, MIB, Rng, TestResult, new_stream, setup};
use ferrocuda_alloc::CachingAllocator;
use ferrocuda_driver::{Call, FakeDriver, fake::Completion};
use ferrocuda_types::StreamHandle;

/// More frees than reclaim takes to fall dormant (65 536), with room for the marks that
/// count them.
const PAST_DORMANCY: usize = 70_000;

/// The driver calls reclaim's marks make: events recorded and queried, streams queried.
fn mark_calls(fake: &FakeDriver) -> u64 {
    fake.calls(Call::EventRecord) + fake.calls(Call::EventQuery) + fake.calls(Call::StreamQuery)
}

/// `n` cached pairs of `bytes` on `stream` (a steady state: no growth after the first).
fn pairs(a: &CachingAllocator, n: usize, bytes: u64, stream: StreamHandle) -> TestResult {
    for _ in 0..n {
        let x = a.allocate(bytes, stream)?;
        a.free(x.ptr)?;
    }
    Ok(())
}

/// A steady state's frees make marks due at first (queries of the idle stream), none once
/// reclaim has fallen dormant; the pool's figures are what they were.
#[test]
fn a_steady_state_falls_dormant_and_stops_marking() -> TestResult {
    let (fake, a) = setup(80 * GIB, RECLAIM, Completion::Eager);
    let _held = a.allocate(40 * MIB, LEGACY)?;
    let start = mark_calls(&fake);
    pairs(&a, 4096, 4 * MIB, LEGACY)?;
    assert!(
        mark_calls(&fake) > start,
        "before dormancy, frees make marks due"
    );
    pairs(&a, PAST_DORMANCY, 4 * MIB, LEGACY)?;
    let (dormant, stats) = (mark_calls(&fake), a.stats().to_map());
    pairs(&a, 20_000, 4 * MIB, LEGACY)?;
    assert_eq!(mark_calls(&fake), dormant, "dormant: no mark, no query");
    let after = a.stats().to_map();
    for key in [
        "reserved_bytes.all.current",
        "allocated_bytes.all.current",
        "segment.all.current",
    ] {
        assert_eq!(after[key], stats[key], "{key}");
    }
    a.check_invariants()?;
    Ok(())
}

/// Three 40 MiB blocks; reclaim falls dormant over a steady churn; then the middle block is
/// freed with a memset queued on it. The growth that wakes reclaim maps new pages (the
/// memset has not run), the next one moves the hole's pages once it has.
#[test]
fn a_growth_after_dormancy_waits_for_work_queued_before_it() -> TestResult {
    let (fake, a) = setup(80 * GIB, RECLAIM, Completion::Manual);
    let xs = allocate_n(&a, 3, 40 * MIB)?;
    pairs(&a, PAST_DORMANCY, 2 * MIB, LEGACY)?;
    fake.advance_all();
    let dormant = mark_calls(&fake);
    pairs(&a, 1000, 2 * MIB, LEGACY)?;
    assert_eq!(mark_calls(&fake), dormant, "reclaim is dormant");
    // The churn's 2 MiB block is free at the end of the segment: growth takes it first.
    hole_keeps_its_pages_until_its_work_ran(&fake, &a, &xs, None, 2 * MIB)
}

/// After waking, reclaim is as precise as before for the frees that follow (the same steps
/// as `reclaim_without_sync`'s `only_the_pages_whose_last_use_ran_move`): of a hole merged
/// from pieces freed at different times, the pages whose last use has run move, the others
/// stay.
#[test]
fn after_waking_only_the_pages_whose_last_use_ran_move() -> TestResult {
    let (fake, a) = setup(80 * GIB, RECLAIM, Completion::Manual);
    let xs = allocate_n(&a, 4, 10 * MIB)?;
    // The first pair maps 2 MiB after the four blocks; the steady churn reuses it.
    pairs(&a, PAST_DORMANCY, 2 * MIB, LEGACY)?;
    fake.advance_all();
    // A growth onto that free tail wakes reclaim; the stream is idle, nothing else is free.
    let _woke = a.allocate(6 * MIB, LEGACY)?;
    assert_eq!(reserved(&a), 46 * MIB);
    pieces_freed_apart_move_as_their_work_runs(&fake, &a, &xs)
}

/// One long program, with and without the thread cache: reclaim falls dormant, wakes at a
/// growth and falls dormant again at the same operations either way (the same pointers,
/// statistics and mark calls).
#[test]
fn dormancy_is_the_same_with_and_without_the_thread_cache() -> TestResult {
    type Run = (Vec<u64>, Vec<(String, i64)>, [u64; 3]);
    let run = |conf: &str| -> Result<Run, Box<dyn std::error::Error>> {
        let (fake, a) = setup(80 * GIB, conf, Completion::Manual);
        let side = new_stream(&fake)?;
        let mut r = Rng(0x5eed_d0a7);
        // Every slot filled first: the live set never grows past it.
        let size = |slot: usize| if slot < 8 { 2 * MIB } else { 4 * MIB };
        let stream_of = |slot: usize| if slot < 8 { side } else { LEGACY };
        let mut live: Vec<Option<ferrocuda_alloc::Allocation>> = (0..64)
            .map(|slot| a.allocate(size(slot), stream_of(slot)).map(Some))
            .collect::<Result<_, _>>()?;
        let (mut ptrs, mut calls) = (Vec::new(), [0; 3]);
        for step in 0..400_000u64 {
            // Dormant well before step 150 000; the growth at 200 000 wakes it.
            match step {
                150_000 => calls[0] = mark_calls(&fake),
                199_999 => calls[1] = mark_calls(&fake),
                _ => {}
            }
            let slot = r.below(64) as usize;
            let stream = stream_of(slot);
            match live[slot].take() {
                Some(x) => a.free(x.ptr)?,
                None => {
                    // One size per stream (a steady state: every free block fits the next
                    // request), but for larger requests from step 200 000 on, now and then,
                    // which make the segment grow.
                    let bytes = match step {
                        200_000.. if r.below(2_000) == 0 => (8 + r.below(40)) * MIB,
                        _ => size(slot),
                    };
                    let x = a.allocate(bytes, stream)?;
                    ptrs.push(x.ptr.0);
                    live[slot] = Some(x);
                }
            }
            if step % 4096 == 0 {
                fake.advance_all();
            }
        }
        calls[2] = mark_calls(&fake);
        let mut stats: Vec<(String, i64)> = a.stats().to_map().into_iter().collect();
        stats.sort();
        a.check_invariants()?;
        Ok((ptrs, stats, calls))
    };
    let cached = run(RECLAIM)?;
    let locked = run(&format!("{RECLAIM},thread_cache:False"))?;
    assert_eq!(cached.2[0], cached.2[1], "dormant before the growth");
    assert!(cached.2[2] > cached.2[1], "the growth woke reclaim");
    assert_eq!(cached.0, locked.0, "the same pointers");
    assert_eq!(cached.1, locked.1, "the same statistics");
    assert_eq!(cached.2, locked.2, "the same mark calls");
    Ok(())
}
