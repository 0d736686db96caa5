//! The figures against the snapshot; private pools; expandable segments.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use super::*;

// ---- figures -------------------------------------------------------------------------------

/// A message under `throw_on_cudamalloc_oom` is PyTorch's rejection followed by the
/// forensics, like every other out-of-memory message.
#[test]
fn a_rejection_by_the_fraction_prints_the_forensics() {
    let path = temp_path("reject-message");
    let (_, a) = setup(
        64 * MIB,
        &format!("oom_forensics:{path},throw_on_cudamalloc_oom:True"),
        Completion::Eager,
    );
    a.set_memory_fraction(0.5).unwrap();
    let x = a.allocate(24 * MIB, LEGACY).unwrap();
    a.free(x.ptr).unwrap();
    let r = oom(a.allocate(30 * MIB, LEGACY));
    assert!(r.rejected_by_fraction);
    assert!(r.forensics.is_some());
    assert_message_is_pytorchs_then_forensics(&r);
}

/// Under the fraction with nothing released: `releasable` is what `empty_cache` gives back,
/// and after it the largest request the rule names succeeds.
#[test]
fn rejected_by_the_fraction_the_figures_hold() {
    let path = temp_path("reject-figures");
    let (fake, a) = setup(
        256 * MIB,
        &format!("oom_forensics:{path},throw_on_cudamalloc_oom:True"),
        Completion::Eager,
    );
    let side = new_stream(&fake).unwrap();
    a.set_memory_fraction(0.5).unwrap(); // 128 MiB
    // A whole free 40 MiB segment, a 30 MiB segment with a live and a free piece, both on
    // LEGACY; a whole free 22 MiB segment and small blocks on `side`.
    let w = a.allocate(40 * MIB, LEGACY).unwrap();
    let p = a.allocate(30 * MIB, LEGACY).unwrap();
    let keep: Vec<_> = (0..4)
        .map(|_| a.allocate(3 * MIB, LEGACY).unwrap())
        .collect();
    a.free(keep[0].ptr).unwrap();
    a.free(keep[2].ptr).unwrap(); // free 3, 3 and the 8 MiB tail of a 20 MiB segment
    a.free(w.ptr).unwrap();
    let q = a.allocate(22 * MIB, side).unwrap();
    a.free(q.ptr).unwrap();
    let s: Vec<_> = (0..3).map(|_| a.allocate(1000, side).unwrap()).collect();
    a.free(s[1].ptr).unwrap();
    let r = oom(a.allocate(100 * MIB, LEGACY));
    assert!(r.rejected_by_fraction);
    let x = r.forensics.clone().unwrap();
    let segments = check_against_snapshot(&a, &r);
    assert_eq!(x.releasable, whole_free(&segments, |_| true));
    assert_eq!(x.releasable, 62 * MIB);
    assert_eq!(x.largest_after_release, 76 * MIB, "128 - (114 - 62)");
    assert_eq!(
        x.largest_after_release,
        expected_after_release(&r, x.releasable, kept_largest(&segments, LEGACY))
    );
    check_releasable_by_empty_cache(&a, &r);
    let big = a.allocate(x.largest_after_release, LEGACY).unwrap();
    a.free(big.ptr).unwrap();
    let _ = (p, keep, s);
}

/// The memory fraction set below what is already reserved: the room is none (never an
/// overflow), so the largest block `empty_cache` keeps is the answer.
#[test]
fn a_fraction_below_the_reserved_bytes() {
    for throw in [false, true] {
        let path = temp_path(&format!("below-{throw}"));
        let (_, a) = setup(
            256 * MIB,
            &format!(
                "oom_forensics:{path},throw_on_cudamalloc_oom:{throw}",
                throw = if throw { "True" } else { "False" }
            ),
            Completion::Eager,
        );
        let live = a.allocate(60 * MIB, LEGACY).unwrap();
        let piece = a.allocate(30 * MIB, LEGACY).unwrap();
        let _tail = a.allocate(30 * MIB, LEGACY).unwrap();
        a.free(piece.ptr).unwrap();
        a.set_memory_fraction(0.125).unwrap(); // 32 MiB < 120 MiB reserved
        let r = oom(a.allocate(50 * MIB, LEGACY));
        let x = r.forensics.clone().unwrap();
        let segments = check_against_snapshot(&a, &r);
        assert_eq!(
            x.largest_after_release,
            expected_after_release(&r, x.releasable, kept_largest(&segments, LEGACY)),
            "throw {throw}: {x:?}"
        );
        check_releasable_by_empty_cache(&a, &r);
        let _ = live;
    }
}

/// A fraction of zero: nothing may be reserved at all.
#[test]
fn a_fraction_of_zero() {
    let path = temp_path("zero");
    let (_, a) = setup(
        64 * MIB,
        &format!("oom_forensics:{path}"),
        Completion::Eager,
    );
    a.set_memory_fraction(0.0).unwrap();
    let r = oom(a.allocate(MIB, LEGACY));
    let x = r.forensics.as_deref().expect("forensics");
    assert_eq!((x.releasable, x.largest_after_release), (0, 0), "{x:?}");
    assert!(x.free.is_empty() && x.largest_live.is_empty());
    assert_message_is_pytorchs_then_forensics(&r);
}

/// The five largest live blocks: ties broken by address, live blocks of private pools and
/// of other streams counted; a block freed behind an event (waited for and released by
/// the error path) is not listed.
#[test]
fn largest_live_ties_pools_and_pending_frees() {
    let path = temp_path("live");
    let (fake, a) = setup(
        200 * MIB,
        &format!("oom_forensics:{path}"),
        Completion::Manual,
    );
    let side = new_stream(&fake).unwrap();
    // Seven blocks of 8 MiB (ties), one in a private pool, one pending.
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
        .unwrap();
    let in_pool = a.allocate(8 * MIB, side).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    let ties: Vec<_> = (0..6)
        .map(|i| {
            a.allocate(8 * MIB, if i % 2 == 0 { LEGACY } else { side })
                .unwrap()
        })
        .collect();
    let pending = a.allocate(50 * MIB, side).unwrap();
    fake.memset_async(pending.ptr, MemsetValue::U8(0), 16, LEGACY)
        .unwrap();
    a.record_stream(pending.ptr, LEGACY).unwrap();
    a.free(pending.ptr).unwrap();
    let r = oom(a.allocate(150 * MIB, LEGACY));
    let x = r.forensics.clone().unwrap();
    check_against_snapshot(&a, &r);
    assert_eq!(x.largest_live.len(), 5);
    assert!(x.largest_live.iter().all(|b| b.size == 8 * MIB));
    assert!(x.largest_live.iter().all(|b| b.ptr != pending.ptr.0));
    let mut all: Vec<u64> = ties.iter().map(|t| t.ptr.0).collect();
    all.push(in_pool.ptr.0);
    all.sort_unstable();
    let got: Vec<u64> = x.largest_live.iter().map(|b| b.ptr).collect();
    assert_eq!(got, all[..5].to_vec(), "ties by address");
    for b in &x.largest_live {
        let want = if b.ptr == in_pool.ptr.0 {
            side
        } else {
            ties.iter().find(|t| t.ptr.0 == b.ptr).unwrap().stream
        };
        assert_eq!(b.stream, want);
    }
}

/// Stacks come with every context that records them, exactly as the snapshot has them;
/// blocks allocated before recording began have none.
#[test]
fn stacks_follow_the_history_context() {
    for context in [None, Some("state"), Some("alloc"), Some("all")] {
        let path = temp_path(&format!("ctx-{context:?}"));
        let (_, a) = setup(
            64 * MIB,
            &format!("oom_forensics:{path}"),
            Completion::Eager,
        );
        let early = a.allocate(25 * MIB, LEGACY).unwrap();
        a.record_memory_history(HistoryOptions::parse(Some("all"), context, 1000).unwrap());
        let late = a.allocate(24 * MIB, LEGACY).unwrap();
        let r = oom(a.allocate(30 * MIB, LEGACY));
        check_against_snapshot(&a, &r);
        let x = r.forensics.as_deref().unwrap();
        let by_ptr = |p: DevicePtr| x.largest_live.iter().find(|b| b.ptr == p.0).unwrap();
        assert!(by_ptr(early.ptr).frames.is_empty(), "{context:?}");
        assert_eq!(
            !by_ptr(late.ptr).frames.is_empty(),
            context.is_some(),
            "{context:?}"
        );
    }
}

// ---- private pools -------------------------------------------------------------------------

/// A retained private pool's free segment is counted in its own group and is not
/// releasable; a released pool's is, as `empty_cache` shows.
#[test]
fn private_pools_retained_and_released() {
    let path = temp_path("pools");
    let (fake, a) = setup(
        256 * MIB,
        &format!("oom_forensics:{path},throw_on_cudamalloc_oom:True"),
        Completion::Eager,
    );
    let side = new_stream(&fake).unwrap();
    let retained = pool_with_a_free_segment(&a, 40 * MIB, LEGACY);
    let released = pool_with_a_free_segment(&a, 30 * MIB, side);
    a.release_pool(released).unwrap();
    // A graph-style pool with a live block and a free piece in one segment.
    let graph = PoolId::handle();
    a.begin_allocate_to_pool(graph, Route::Thread(std::thread::current().id()))
        .unwrap();
    let g1 = a.allocate(12 * MIB, LEGACY).unwrap();
    let g2 = a.allocate(8 * MIB, LEGACY).unwrap();
    a.end_allocate_to_pool(graph).unwrap();
    a.free(g2.ptr).unwrap();
    let d = a.allocate(30 * MIB, LEGACY).unwrap();
    a.set_memory_fraction(0.5).unwrap(); // 128 MiB
    let r = oom(a.allocate(60 * MIB, LEGACY));
    assert!(r.rejected_by_fraction);
    let x = r.forensics.clone().unwrap();
    let segments = check_against_snapshot(&a, &r);
    assert!(
        x.free
            .iter()
            .any(|c| c.pool == (retained.0, retained.1) && c.bytes == 40 * MIB),
        "{:?}",
        x.free
    );
    assert!(
        x.free
            .iter()
            .any(|c| c.pool == (graph.0, graph.1) && !c.small),
        "{:?}",
        x.free
    );
    let may_release = |p: (u64, u64)| p == (0, 0) || p == (released.0, released.1);
    assert_eq!(x.releasable, whole_free(&segments, may_release), "{x:?}");
    assert_eq!(x.releasable, 30 * MIB);
    assert_eq!(
        x.largest_after_release,
        expected_after_release(&r, x.releasable, kept_largest(&segments, LEGACY))
    );
    check_releasable_by_empty_cache(&a, &r);
    let _ = (g1, d);
}

/// An error while allocating to a private pool (a capture): figures against the snapshot,
/// `releasable` against `empty_cache`, PyTorch's message first.
#[test]
fn an_error_while_allocating_to_a_pool() {
    for throw in [false, true] {
        let path = temp_path(&format!("in-pool-{throw}"));
        let (_, a) = setup(
            128 * MIB,
            &format!(
                "oom_forensics:{path},throw_on_cudamalloc_oom:{}",
                if throw { "True" } else { "False" }
            ),
            Completion::Eager,
        );
        let cached = a.allocate(30 * MIB, LEGACY).unwrap();
        a.free(cached.ptr).unwrap(); // a whole free default segment
        let pool = PoolId::handle();
        a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
            .unwrap();
        let inside = a.allocate(40 * MIB, LEGACY).unwrap();
        a.set_memory_fraction(0.75).unwrap(); // 96 MiB
        let r = oom(a.allocate(60 * MIB, LEGACY));
        assert_eq!(r.rejected_by_fraction, throw);
        if !throw {
            assert_message_is_pytorchs_then_forensics(&r);
        }
        check_against_snapshot(&a, &r);
        check_releasable_by_empty_cache(&a, &r);
        a.end_allocate_to_pool(pool).unwrap();
        a.free(inside.ptr).unwrap();
        a.release_pool(pool).unwrap();
        a.check_invariants().unwrap();
    }
}

// ---- expandable segments -------------------------------------------------------------------

/// Expandable segments under the fraction with nothing released: `releasable` is the whole
/// pages inside free blocks (pages counted from the segment's start), exactly what
/// `empty_cache` unmaps.
fn expandable_releasable(config: &str, large_page: u64) {
    let path = temp_path(&format!("exp-{}-{}", config.len(), large_page));
    let (fake, a) = setup(
        512 * MIB,
        &format!("{config},oom_forensics:{path},throw_on_cudamalloc_oom:True"),
        Completion::Eager,
    );
    let side = new_stream(&fake).unwrap();
    let blocks: Vec<_> = [7, 33, 5, 45, 3, 19]
        .iter()
        .map(|m| a.allocate(m * MIB + 12345, LEGACY).unwrap())
        .collect();
    for i in [1, 3, 4] {
        a.free(blocks[i].ptr).unwrap();
    }
    let smalls: Vec<_> = (0..40)
        .map(|_| a.allocate(100_000, side).unwrap())
        .collect();
    for s in smalls.iter().step_by(2) {
        a.free(s.ptr).unwrap();
    }
    a.set_memory_fraction(0.5).unwrap(); // 256 MiB
    let r = oom(a.allocate(200 * MIB, LEGACY));
    assert!(r.rejected_by_fraction, "{config}");
    let x = r.forensics.clone().unwrap();
    let segments = check_against_snapshot(&a, &r);
    assert_eq!(
        x.releasable,
        expandable_free_pages(&segments, large_page),
        "{config}: {}",
        brief(&x)
    );
    // What `empty_cache` keeps of LEGACY's free blocks: the pieces outside whole pages.
    let mut kept = 0;
    for s in segments
        .iter()
        .filter(|s| s.stream == LEGACY.raw && s.segment_pool_id == (0, 0))
    {
        let page = if s.segment_type == "small" {
            2 * MIB
        } else {
            large_page
        };
        for b in s.blocks.iter().filter(|b| b.state == "inactive") {
            let start = (b.address - s.address).div_ceil(page) * page + s.address;
            let end = (b.address + b.size - s.address) / page * page + s.address;
            if end > start {
                kept = kept.max(start - b.address).max(b.address + b.size - end);
            } else {
                kept = kept.max(b.size);
            }
        }
    }
    assert_eq!(
        x.largest_after_release,
        expected_after_release(&r, x.releasable, kept),
        "{config}: {}",
        brief(&x)
    );
    check_releasable_by_empty_cache(&a, &r);
}

/// PyTorch's expandable segments: 20 MiB pages in the large pool, the device's first range
/// starting at an address that is not a multiple of 20 MiB.
#[test]
fn expandable_pages_inside_free_blocks_are_releasable() {
    expandable_releasable("expandable_segments:True", 20 * MIB);
}

/// The same with 2 MiB pages.
#[test]
fn expandable_small_pages_inside_free_blocks_are_releasable() {
    expandable_releasable(
        "expandable_segments:True,expandable_segments_page_mb:2",
        2 * MIB,
    );
    expandable_releasable("ferrocuda_recommended:True", 2 * MIB);
}

/// Expandable segments on a full device: the usual path has unmapped what it could; the
/// figures still agree with the snapshot and with `empty_cache`.
#[test]
fn expandable_segments_on_a_full_device() {
    for config in ["expandable_segments:True", "ferrocuda_recommended:True"] {
        let path = temp_path(&format!("exp-full-{}", config.len()));
        let (fake, a) = setup(
            200 * MIB,
            &format!("{config},oom_forensics:{path}"),
            Completion::Eager,
        );
        let side = new_stream(&fake).unwrap();
        let blocks: Vec<_> = (0..8)
            .map(|i| {
                a.allocate((5 + 2 * i) * MIB, if i % 3 == 0 { side } else { LEGACY })
                    .unwrap()
            })
            .collect();
        for i in [1, 2, 5] {
            a.free(blocks[i].ptr).unwrap();
        }
        let r = oom(a.allocate(150 * MIB, LEGACY));
        assert_message_is_pytorchs_then_forensics(&r);
        check_against_snapshot(&a, &r);
        check_releasable_by_empty_cache(&a, &r);
    }
}
