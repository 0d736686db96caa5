//! `expandable_segments_reclaim` without a stream synchronization: a page moves only once
//! the work queued before its last free has run (an event shows it), growth maps new pages
//! for the rest, and no work queued on a freed block ever touches an unmapped page. The
//! fake device runs in manual completion, where an access to an unmapped address is a
//! sticky error that the final synchronization reports.
#![allow(clippy::unwrap_used)]
use crate::common;
use common::{D0, GIB, LEGACY, MIB, TestResult, new_stream, setup, stat, stream_on};
use ferrocuda_alloc::{Allocation, Route};
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver, fake::Completion};
use ferrocuda_types::{CaptureMode, DevicePtr, MemsetValue, PoolId, StreamHandle};
use proptest::prelude::*;
use std::sync::Arc;

pub(crate) const RECLAIM: &str =
    "expandable_segments:True,expandable_segments_reclaim:True,expandable_segments_page_mb:2";

/// `n` allocations of `bytes` on the legacy stream.
pub(crate) fn allocate_n(
    a: &ferrocuda_alloc::CachingAllocator,
    n: usize,
    bytes: u64,
) -> Result<Vec<Allocation>, ferrocuda_alloc::AllocError> {
    (0..n).map(|_| a.allocate(bytes, LEGACY)).collect()
}

pub(crate) fn reserved(a: &ferrocuda_alloc::CachingAllocator) -> u64 {
    stat(a, "reserved_bytes.all.current") as u64
}

/// Three 40 MiB blocks under `conf`, the middle one freed with a memset queued on it, then
/// `switch` applied to the configuration (if any): growth maps new pages while the memset
/// has not run, and moves the hole's pages once it has, with no synchronization.
fn hole_waits_for_its_queued_work(conf: &str, switch: Option<&str>) -> TestResult {
    let (fake, a) = setup(80 * GIB, conf, Completion::Manual);
    let xs: Vec<_> = allocate_n(&a, 3, 40 * MIB)?;
    fake.advance_all();
    hole_keeps_its_pages_until_its_work_ran(&fake, &a, &xs, switch, 0)
}

/// [`hole_waits_for_its_queued_work`]'s steps on three 40 MiB blocks `xs` with the stream
/// idle and `tail_free` bytes free at the end of their segment (which growth takes first;
/// also run after reclaim fell dormant: `reclaim_dormancy`).
pub(crate) fn hole_keeps_its_pages_until_its_work_ran(
    fake: &FakeDriver,
    a: &ferrocuda_alloc::CachingAllocator,
    xs: &[Allocation],
    switch: Option<&str>,
    tail_free: u64,
) -> TestResult {
    let base = reserved(a) - tail_free;
    fake.memset_async(xs[1].ptr, MemsetValue::U8(7), xs[1].size, LEGACY)?;
    a.free(xs[1].ptr)?;
    if let Some(switch) = switch {
        a.update_config(switch)?;
    }
    let syncs = fake.calls(Call::StreamSynchronize) + fake.calls(Call::DeviceSynchronize);
    let big = a.allocate(60 * MIB, LEGACY)?;
    assert_eq!(
        reserved(a),
        base + 60 * MIB,
        "the hole's memset has not run: all 60 MiB are new pages"
    );
    fake.advance_all();
    a.free(big.ptr)?;
    let bigger = a.allocate(100 * MIB, LEGACY)?;
    assert_eq!(
        reserved(a),
        base + 60 * MIB,
        "the stream ran the memset: the hole's and the freed block's pages moved"
    );
    assert_eq!(
        fake.calls(Call::StreamSynchronize) + fake.calls(Call::DeviceSynchronize),
        syncs,
        "no synchronization"
    );
    fake.memset_async(bigger.ptr, MemsetValue::U8(9), bigger.size, LEGACY)?;
    fake.device_synchronize(D0)?;
    let (free, total) = fake.mem_get_info(D0)?;
    assert_eq!(total - free, reserved(a), "every physical page is counted");
    a.check_invariants()?;
    Ok(())
}

/// The pages of a block freed with work still queued on it stay mapped; growth maps new
/// ones, and moves them once the stream has run that work.
#[test]
fn a_free_with_queued_work_keeps_its_pages_until_that_work_has_run() -> TestResult {
    hole_waits_for_its_queued_work(RECLAIM, None)
}

/// Reclaim switched on at run time (PyTorch's `_set_allocator_settings`) after a free made
/// with it off: the page freed with work still queued does not move before that work has
/// run (frees without reclaim stamp nothing; switching it on stamps every page).
#[test]
fn reclaim_switched_on_later_waits_for_work_queued_before_it() -> TestResult {
    hole_waits_for_its_queued_work(
        "expandable_segments:True,expandable_segments_page_mb:2",
        Some("expandable_segments_reclaim:True"),
    )
}

/// A free block merged from pieces freed at different times gives the pages whose last use
/// has run, and keeps the others.
#[test]
fn only_the_pages_whose_last_use_ran_move() -> TestResult {
    let (fake, a) = setup(80 * GIB, RECLAIM, Completion::Manual);
    let xs: Vec<_> = allocate_n(&a, 4, 10 * MIB)?;
    fake.advance_all();
    pieces_freed_apart_move_as_their_work_runs(&fake, &a, &xs)
}

/// `only_the_pages_whose_last_use_ran_move`'s steps on four 10 MiB blocks `xs` at the end of
/// a segment with nothing else free and the stream idle (also run after reclaim woke:
/// `reclaim_dormancy`).
pub(crate) fn pieces_freed_apart_move_as_their_work_runs(
    fake: &FakeDriver,
    a: &ferrocuda_alloc::CachingAllocator,
    xs: &[Allocation],
) -> TestResult {
    let base = reserved(a);
    for x in [&xs[0], &xs[2]] {
        fake.memset_async(x.ptr, MemsetValue::U8(3), x.size, LEGACY)?;
        a.free(x.ptr)?;
    }
    // Growth records a mark covering both frees; the device has not reached it yet.
    let _grown_first = a.allocate(12 * MIB, LEGACY)?;
    assert_eq!(reserved(a), base + 12 * MIB, "nothing was known to be safe");
    fake.advance_all();
    // xs[1] is freed with work queued: it merges with the holes around it.
    fake.memset_async(xs[1].ptr, MemsetValue::U8(1), xs[1].size, LEGACY)?;
    a.free(xs[1].ptr)?;
    let grown = a.allocate(34 * MIB, LEGACY)?;
    assert_eq!(
        reserved(a),
        base + 26 * MIB,
        "xs[0] and xs[2] gave 20 MiB; xs[1]'s 10 MiB still had queued work"
    );
    fake.memset_async(grown.ptr, MemsetValue::U8(2), grown.size, LEGACY)?;
    fake.device_synchronize(D0)?;
    a.check_invariants()?;
    Ok(())
}

/// While a capture is underway no event is queried (the driver would invalidate a global
/// capture): growth maps new pages and the capture stays valid.
#[test]
fn growth_during_a_capture_queries_no_event() -> TestResult {
    let (fake, a) = setup(80 * GIB, RECLAIM, Completion::Eager);
    let x = a.allocate(40 * MIB, LEGACY)?;
    let _y = a.allocate(40 * MIB, LEGACY)?;
    a.free(x.ptr)?;
    let s = new_stream(&fake)?;
    fake.stream_begin_capture(s, CaptureMode::Global)?;
    let pool = PoolId::for_capture();
    let id = match fake.stream_capture_status(s)? {
        ferrocuda_types::CaptureStatus::Active { id } => id,
        other => return Err(format!("not capturing: {other:?}").into()),
    };
    a.begin_allocate_to_pool(pool, Route::Capture(id))?;
    let queries = fake.calls(Call::EventQuery);
    let z = a.allocate(60 * MIB, LEGACY)?;
    assert_eq!(fake.calls(Call::EventQuery), queries);
    assert_eq!(reserved(&a), 140 * MIB, "new pages only");
    a.end_allocate_to_pool(pool)?;
    let graph = fake.stream_end_capture(s)?;
    fake.graph_destroy(graph)?;
    a.free(z.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// A growth on a stream under a capture the allocator was not told of queries nothing (a
/// query of the capturing stream would invalidate the capture): it maps new pages, as
/// PyTorch's expandable segments would, and the capture stays active.
#[test]
fn growth_on_a_stream_in_an_unannounced_capture_keeps_it_valid() -> TestResult {
    let (fake, a) = setup(
        80 * GIB,
        &format!("{RECLAIM},thread_cache:False"),
        Completion::Eager,
    );
    let s = new_stream(&fake)?;
    growth_leaves_a_capture_valid(&fake, &a, s, s)
}

/// The same on the legacy stream while a blocking stream captures: the legacy stream cannot
/// be asked (the driver answers `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, and a query of it
/// would invalidate that capture), so growth there maps new pages too.
#[test]
fn growth_on_the_legacy_stream_while_a_blocking_stream_captures_keeps_it_valid() -> TestResult {
    let (fake, a, blocking) = reclaim_beside_a_blocking_stream()?;
    growth_leaves_a_capture_valid(&fake, &a, LEGACY, blocking)
}

/// Reclaim without the thread cache on an eager fake device, and a blocking stream there.
fn reclaim_beside_a_blocking_stream() -> Result<
    (
        Arc<FakeDriver>,
        ferrocuda_alloc::CachingAllocator,
        StreamHandle,
    ),
    DriverError,
> {
    let (fake, a) = setup(
        80 * GIB,
        &format!("{RECLAIM},thread_cache:False"),
        Completion::Eager,
    );
    let blocking = stream_on(&fake, D0, false)?;
    Ok((fake, a, blocking))
}

/// Four 10 MiB blocks on `grows`, the second freed (a hole reclaim could move), then a
/// capture the allocator is not told of begun on `captures`: a 30 MiB growth on `grows`
/// asks no stream or event anything, maps new pages, and leaves the capture valid.
fn growth_leaves_a_capture_valid(
    fake: &FakeDriver,
    a: &ferrocuda_alloc::CachingAllocator,
    grows: StreamHandle,
    captures: StreamHandle,
) -> TestResult {
    let xs = (0..4)
        .map(|_| a.allocate(10 * MIB, grows))
        .collect::<Result<Vec<_>, _>>()?;
    a.free(xs[1].ptr)?;
    fake.stream_begin_capture(captures, CaptureMode::Relaxed)?;
    let queries = fake.calls(Call::StreamQuery) + fake.calls(Call::EventQuery);
    let grown = a.allocate(30 * MIB, grows)?;
    assert_eq!(
        fake.calls(Call::StreamQuery) + fake.calls(Call::EventQuery),
        queries,
        "no query during the capture"
    );
    assert_eq!(reserved(a), 70 * MIB, "new pages only");
    assert!(
        matches!(
            fake.stream_capture_status(captures)?,
            ferrocuda_types::CaptureStatus::Active { .. }
        ),
        "the capture is still valid"
    );
    let graph = fake.stream_end_capture(captures)?;
    fake.graph_destroy(graph)?;
    a.free(grown.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// Frees during a capture the allocator was not told of (a block of the capturing stream,
/// allocated before it began) make a reclaim mark due, which waits for the capture to end:
/// no query would invalidate it, no event joins its graph.
#[test]
fn a_mark_due_during_an_unannounced_capture_waits_for_it() -> TestResult {
    let config = format!("{RECLAIM},thread_cache:False");
    let (fake, a) = setup(80 * GIB, &config, Completion::Eager);
    let s = new_stream(&fake)?;
    a_mark_waits_for_the_capture(&fake, &a, s, s)
}

/// The same with the frees on the legacy stream while a blocking stream captures (the
/// legacy stream's query or event would break that capture).
#[test]
fn a_mark_due_on_the_legacy_stream_while_a_blocking_stream_captures_waits_for_it() -> TestResult {
    let (fake, a, blocking) = reclaim_beside_a_blocking_stream()?;
    a_mark_waits_for_the_capture(&fake, &a, LEGACY, blocking)
}

/// 64 blocks of 1 MiB on `frees_on`, freed while `captures` is in a global capture the
/// allocator was not told of: no query or event until it ends, then the due mark is taken.
fn a_mark_waits_for_the_capture(
    fake: &FakeDriver,
    a: &ferrocuda_alloc::CachingAllocator,
    frees_on: StreamHandle,
    captures: StreamHandle,
) -> TestResult {
    let xs: Vec<_> = (0..64)
        .map(|_| a.allocate(MIB, frees_on))
        .collect::<Result<_, _>>()?;
    fake.stream_begin_capture(captures, CaptureMode::Global)?;
    let (queries, records) = (fake.calls(Call::StreamQuery), fake.calls(Call::EventRecord));
    for x in &xs {
        a.free(x.ptr)?;
    }
    assert_eq!(
        (fake.calls(Call::StreamQuery), fake.calls(Call::EventRecord)),
        (queries, records),
        "nothing asked of the stream while the capture runs"
    );
    let graph = fake.stream_end_capture(captures)?;
    assert_eq!(
        fake.graph_node_count(graph)?,
        0,
        "no event joined the graph"
    );
    fake.graph_destroy(graph)?;
    let y = a.allocate(MIB, frees_on)?;
    assert!(
        fake.calls(Call::StreamQuery) > queries,
        "the due mark is taken once the capture ended"
    );
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}

#[derive(Clone, Debug)]
enum Step {
    Alloc {
        mib: u64,
        stream: usize,
    },
    Free {
        pick: usize,
    },
    Write {
        pick: usize,
    },
    Advance {
        stream: usize,
        items: usize,
    },
    /// Runs everything queued on every stream (as a synchronization of the program would).
    Drain,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1..48u64, 0..2usize).prop_map(|(mib, stream)| Step::Alloc { mib, stream }),
        3 => any::<usize>().prop_map(|pick| Step::Free { pick }),
        3 => any::<usize>().prop_map(|pick| Step::Write { pick }),
        2 => (0..2usize, 0..40usize).prop_map(|(stream, items)| Step::Advance { stream, items }),
        1 => Just(Step::Drain),
    ]
}

/// One byte in each 2 MiB page a block spans, and its last byte: every page it touches is
/// used (writing whole blocks byte by byte would make the fake slow).
fn probes(x: &Allocation) -> Vec<DevicePtr> {
    (0..x.size.div_ceil(2 * MIB))
        .map(|k| DevicePtr(x.ptr.0 + k * 2 * MIB))
        .chain(std::iter::once(DevicePtr(x.ptr.0 + x.size - 1)))
        .collect()
}

fn write(fake: &FakeDriver, x: &Allocation, tag: u8) {
    for p in probes(x) {
        fake.memset_async(p, MemsetValue::U8(tag), 1, x.stream)
            .unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48),
        ..ProptestConfig::default()
    })]

    /// Random programs of allocations, frees and writes on two streams whose work runs
    /// late: no write ever lands on an unmapped page, every live block keeps what was last
    /// written to it, the allocator never synchronizes, and the books hold.
    #[test]
    fn late_work_never_meets_a_moved_page(steps in proptest::collection::vec(step(), 1..120)) {
        let (fake, a) = setup(4 * GIB, RECLAIM, Completion::Manual);
        let streams: Vec<StreamHandle> = vec![LEGACY, new_stream(&fake).unwrap()];
        let mut live: Vec<(Allocation, u8)> = Vec::new();
        let syncs = fake.calls(Call::StreamSynchronize) + fake.calls(Call::DeviceSynchronize);
        let mut tag = 0u8;
        for s in steps {
            match s {
                Step::Alloc { mib, stream } => {
                    let x = a.allocate(mib * MIB - 512, streams[stream]).unwrap();
                    tag = tag.wrapping_add(1);
                    write(&fake, &x, tag);
                    live.push((x, tag));
                }
                Step::Free { pick } if !live.is_empty() => {
                    let (x, _) = live.swap_remove(pick % live.len());
                    a.free(x.ptr).unwrap();
                }
                Step::Write { pick } if !live.is_empty() => {
                    let i = pick % live.len();
                    tag = tag.wrapping_add(1);
                    write(&fake, &live[i].0, tag);
                    live[i].1 = tag;
                }
                Step::Advance { stream, items } => {
                    fake.advance(streams[stream], Some(items)).unwrap();
                }
                Step::Drain => {
                    fake.advance_all();
                }
                _ => {}
            }
            a.check_invariants().unwrap();
        }
        prop_assert_eq!(
            fake.calls(Call::StreamSynchronize) + fake.calls(Call::DeviceSynchronize),
            syncs
        );
        fake.device_synchronize(D0).unwrap();
        for (x, tag) in &live {
            for p in probes(x) {
                let mut byte = [0u8];
                fake.memcpy_dtoh(&mut byte, p, x.stream).unwrap();
                prop_assert_eq!(byte[0], *tag);
            }
        }
        let (free, total) = fake.mem_get_info(D0).unwrap();
        prop_assert_eq!(total - free, reserved(&a));
    }
}

/// Short of safe pages, a reclaim waits for an older mark (one with four newer marks after
/// it), not for the stream: the work queued behind that mark is still queued afterwards,
/// and the pages freed before it move.
#[test]
fn short_of_safe_pages_a_reclaim_waits_for_an_older_mark_not_the_stream() -> TestResult {
    let (fake, a) = setup(80 * GIB, RECLAIM, Completion::Manual);
    let big: Vec<_> = allocate_n(&a, 4, 10 * MIB)?;
    let small: Vec<_> = allocate_n(&a, 96, MIB)?;
    fake.advance_all();
    // Two holes whose frees the device has not reached, then enough frees for several
    // marks, each behind queued work.
    a.free(big[0].ptr)?;
    a.free(big[2].ptr)?;
    for x in &small {
        fake.memset_async(x.ptr, MemsetValue::U8(1), 64, LEGACY)?;
        a.free(x.ptr)?;
    }
    let (syncs, waits) = (
        fake.calls(Call::StreamSynchronize) + fake.calls(Call::DeviceSynchronize),
        fake.calls(Call::EventSynchronize),
    );
    let before = reserved(&a);
    let grown = a.allocate(120 * MIB, LEGACY)?;
    assert_eq!(fake.calls(Call::EventSynchronize), waits + 1, "one wait");
    assert_eq!(
        fake.calls(Call::StreamSynchronize) + fake.calls(Call::DeviceSynchronize),
        syncs,
        "no synchronization of the stream"
    );
    assert!(
        fake.pending(LEGACY)? > 0,
        "work queued behind the mark waited for is still queued"
    );
    assert!(
        reserved(&a) - before <= 100 * MIB,
        "the holes' 20 MiB moved: {} MiB new",
        (reserved(&a) - before) / MIB
    );
    fake.memset_async(grown.ptr, MemsetValue::U8(2), grown.size, LEGACY)?;
    fake.device_synchronize(D0)?;
    for x in [&big[1], &big[3]] {
        a.free(x.ptr)?;
    }
    a.free(grown.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// Frees that never lead to a reclaim (a steady state) keep a bounded number of marks and
/// events: on an idle stream a due mark is a query, not an event; with the device far
/// behind, a stream keeps at most 1 024 marks (an event each), and a reclaim afterwards
/// still moves the pages whose last use has run.
#[test]
fn a_steady_state_keeps_few_marks_and_events() -> TestResult {
    let config = format!("{RECLAIM},thread_cache:False");
    // More frees than 1 024 marks take, one per 16 frees on a busy stream.
    let frees = 20_000;
    // Two sizes in turn: every free splits and merges in one expandable segment.
    let churn = |a: &ferrocuda_alloc::CachingAllocator, fake: &FakeDriver, queue: bool| {
        let mut kept = Vec::new();
        for i in 0..frees {
            let x = a.allocate(if i % 2 == 0 { MIB } else { 3 * MIB }, LEGACY)?;
            if queue {
                fake.memset_async(x.ptr, MemsetValue::U8(1), 64, LEGACY)?;
            }
            kept.push(x);
            if kept.len() > 4 {
                a.free(kept.remove(0).ptr)?;
            }
        }
        for x in kept {
            a.free(x.ptr)?;
        }
        Ok::<(), Box<dyn std::error::Error>>(())
    };

    let (fake, a) = setup(80 * GIB, &config, Completion::Eager);
    churn(&a, &fake, false)?;
    let (records, queries) = (fake.calls(Call::EventRecord), fake.calls(Call::StreamQuery));
    assert_eq!(records, 0, "an idle stream takes no mark");
    assert!(
        (1..frees as u64 / 16 / 8).contains(&queries),
        "due marks on an idle stream grow rare: {queries} queries for {frees} frees"
    );
    a.check_invariants()?;

    let (fake, a) = setup(80 * GIB, &config, Completion::Manual);
    churn(&a, &fake, true)?;
    let (records, created) = (fake.calls(Call::EventRecord), fake.calls(Call::EventCreate));
    assert!(
        records >= frees as u64 / 16 - 1 && created == 1024,
        "the device never ran: {records} marks recorded, {created} events made"
    );
    fake.advance_all();
    let before = reserved(&a);
    let grown = a.allocate(40 * MIB, LEGACY)?;
    assert!(
        reserved(&a) < before + 40 * MIB,
        "the freed pages moved once the device ran: {} MiB new",
        (reserved(&a) - before) / MIB
    );
    a.free(grown.ptr)?;
    fake.device_synchronize(D0)?;
    a.check_invariants()?;
    Ok(())
}

/// Best fit with a hole between mapped blocks (here `empty_cache`'s; page reclaim cuts the
/// same kind): PyTorch's rule counts the hole as room the block before it can grow into,
/// and passes that block over for the next candidate, which could grow to less; with page
/// reclaim only a segment's unmapped tail counts, so the block before the hole is an
/// ordinary best fit.
///
/// 2 MiB pages. A 4 MiB, B 6 MiB, C 4 MiB, X 5 MiB, Y 2 MiB in a row; B freed and its three
/// pages unmapped (C stays: the hole is between mapped blocks); A and X freed. A 4 MiB
/// request: X under PyTorch's expandable segments (A could grow to 10 MiB, X to 5), A with
/// reclaim.
#[test]
fn with_reclaim_a_hole_between_mapped_blocks_is_no_room_to_grow() -> TestResult {
    for (conf, takes_a) in [
        (
            "expandable_segments:True,expandable_segments_page_mb:2",
            false,
        ),
        (RECLAIM, true),
    ] {
        let (_, a) = setup(80 * GIB, conf, Completion::Eager);
        let [x_a, x_b, _c, x_x, _y] = [4, 6, 4, 5, 2].map(|m| a.allocate(m * MIB, LEGACY));
        let (x_a, x_b, x_x) = (x_a?, x_b?, x_x?);
        assert_eq!(
            (x_b.ptr.0 - x_a.ptr.0, x_x.ptr.0 - x_a.ptr.0),
            (4 * MIB, 14 * MIB),
            "{conf}: one range, in order"
        );
        a.free(x_b.ptr)?;
        a.empty_cache();
        assert!(
            a.blocks()
                .iter()
                .any(|b| !b.mapped && b.ptr == x_b.ptr && b.size == 6 * MIB),
            "{conf}: B's pages are unmapped"
        );
        a.free(x_a.ptr)?;
        a.free(x_x.ptr)?;
        let got = a.allocate(4 * MIB, LEGACY)?;
        let want = if takes_a { x_a.ptr } else { x_x.ptr };
        assert_eq!(got.ptr, want, "{conf}");
        a.check_invariants()?;
    }
    Ok(())
}
