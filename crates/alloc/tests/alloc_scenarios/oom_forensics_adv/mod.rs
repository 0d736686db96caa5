//! Adversarial scenarios for `oom_forensics:<path>`: the same programs with and without the
//! key (pointers, statistics and PyTorch's message identical at every step), every figure
//! against the allocator's own snapshot and against what `empty_cache()` really gives back,
//! private pools, expandable segments, the memory fraction, several errors in a row, the key
//! set and unset at run time, odd paths, concurrent errors, 1 EB requests and caching off.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::{Rng, common};
use common::{D0, GIB, LEGACY, MIB, new_stream, setup, stat};
use ferrocuda_alloc::history::HistoryOptions;
use ferrocuda_alloc::{AllocError, Allocation, Caching, CachingAllocator, Route};
use ferrocuda_driver::{Call, Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{
    AllocatorConfig, DevicePtr, MemsetValue, OomForensics, OutOfMemory, PoolId, Snapshot,
    SnapshotSegment, StreamHandle,
};
use std::collections::BTreeMap;
use std::sync::Arc;

const HEADER: &str = "\n\nferrocuda OOM forensics (oom_forensics):";

// ---- helpers ------------------------------------------------------------------------------

/// A fresh folder for this test's snapshots.
fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrocuda-oom-adv-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn temp_path(tag: &str) -> String {
    temp_dir(tag)
        .join("oom.pickle")
        .to_string_lossy()
        .into_owned()
}

/// The out-of-memory report of `r`, or a panic.
fn oom(r: Result<Allocation, AllocError>) -> Box<OutOfMemory> {
    match r {
        Err(AllocError::OutOfMemory(report)) => report,
        other => panic!("expected out of memory, got {other:?}"),
    }
}

/// The report without its forensics.
fn plain_part(r: &OutOfMemory) -> OutOfMemory {
    OutOfMemory {
        forensics: None,
        ..r.clone()
    }
}

/// The message with the key: PyTorch's (the same report without forensics) followed by the
/// header and the figures.
fn assert_message_is_pytorchs_then_forensics(r: &OutOfMemory) {
    let with = r.to_string();
    let plain = plain_part(r).to_string();
    let rest = with
        .strip_prefix(&plain)
        .unwrap_or_else(|| panic!("PyTorch's message first:\n{with}\n---\n{plain}"));
    assert!(
        rest.starts_with(HEADER),
        "the forensics follow PyTorch's message:\n{with}"
    );
}

/// The figures without the frames, for messages.
fn brief(x: &OomForensics) -> String {
    let live: Vec<_> = x
        .largest_live
        .iter()
        .map(|b| (b.size, b.ptr, b.stream.raw, b.frames.len()))
        .collect();
    format!(
        "free {:?} releasable {} largest_after_release {} live {live:?} snapshot {:?}",
        x.free
            .iter()
            .map(|c| (c.pool, c.small, c.stream.raw, c.bytes, c.blocks, c.largest))
            .collect::<Vec<_>>(),
        x.releasable,
        x.largest_after_release,
        x.snapshot
    )
}

/// (pool, small, stream raw) of a group of free blocks, and its (bytes, blocks, largest).
type FreeKey = ((u64, u64), bool, u64);
type FreeFigures = (u64, usize, u64);

fn free_groups(segments: &[SnapshotSegment]) -> BTreeMap<FreeKey, FreeFigures> {
    let mut free: BTreeMap<FreeKey, FreeFigures> = BTreeMap::new();
    for s in segments {
        for b in s.blocks.iter().filter(|b| b.state == "inactive") {
            let e = free
                .entry((s.segment_pool_id, s.segment_type == "small", s.stream))
                .or_default();
            e.0 += b.size;
            e.1 += 1;
            e.2 = e.2.max(b.size);
        }
    }
    free
}

/// The five largest allocated blocks, largest first, ties by address: (size, address,
/// frames).
fn live_top5(segments: &[SnapshotSegment]) -> Vec<(u64, u64, Vec<ferrocuda_types::Frame>)> {
    let mut live: Vec<_> = segments
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == "active_allocated")
        .map(|b| (b.size, b.address, b.frames.clone()))
        .collect();
    live.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    live.truncate(5);
    live
}

/// The free groups, their order and the live blocks (with their frames) against the
/// allocator's snapshot taken now; returns the snapshot's segments.
fn check_against_snapshot(a: &CachingAllocator, r: &OutOfMemory) -> Vec<SnapshotSegment> {
    let x = r.forensics.as_deref().expect("forensics");
    let (segments, _) = a.snapshot();
    let got: BTreeMap<_, _> = x
        .free
        .iter()
        .map(|c| {
            (
                (c.pool, c.small, c.stream.raw),
                (c.bytes, c.blocks, c.largest),
            )
        })
        .collect();
    assert_eq!(got.len(), x.free.len(), "one entry per group: {:?}", x.free);
    assert_eq!(got, free_groups(&segments), "free groups");
    assert!(
        x.free.windows(2).all(|w| w[0].bytes >= w[1].bytes),
        "largest first: {:?}",
        x.free
    );
    let want: Vec<_> = live_top5(&segments);
    let got_live: Vec<_> = x
        .largest_live
        .iter()
        .map(|b| (b.size, b.ptr, b.frames.clone()))
        .collect();
    assert_eq!(got_live, want, "largest live blocks");
    segments
}

/// Bytes of whole segments whose blocks are all free (or waiting for events, which
/// `empty_cache` waits for), in pools `may_release` allows.
fn whole_free(segments: &[SnapshotSegment], may_release: impl Fn((u64, u64)) -> bool) -> u64 {
    segments
        .iter()
        .filter(|s| !s.is_expandable && may_release(s.segment_pool_id))
        .filter(|s| {
            s.blocks
                .iter()
                .all(|b| b.state == "inactive" || b.state == "active_pending_free")
        })
        .map(|s| s.total_size)
        .sum()
}

/// Bytes of the whole pages inside free blocks of expandable segments: a snapshot segment
/// is a mapped run starting at a page boundary; pages are `large_page` in the large pool
/// and 2 MiB in the small one.
fn expandable_free_pages(segments: &[SnapshotSegment], large_page: u64) -> u64 {
    let mut total = 0;
    for s in segments.iter().filter(|s| s.is_expandable) {
        let page = if s.segment_type == "small" {
            2 * MIB
        } else {
            large_page
        };
        for b in s.blocks.iter().filter(|b| b.state == "inactive") {
            let start = (b.address - s.address).div_ceil(page) * page;
            let end = (b.address + b.size - s.address) / page * page;
            total += end.saturating_sub(start);
        }
    }
    total
}

/// The largest default-pool free block on `stream` that `empty_cache` keeps (non-expandable
/// segments with an allocated block; blocks waiting for events are free once it has waited,
/// and merge with their free neighbours).
fn kept_largest(segments: &[SnapshotSegment], stream: StreamHandle) -> u64 {
    let mut largest = 0;
    for s in segments
        .iter()
        .filter(|s| s.segment_pool_id == (0, 0) && s.stream == stream.raw && !s.is_expandable)
        .filter(|s| s.blocks.iter().any(|b| b.state == "active_allocated"))
    {
        let mut run = 0;
        for b in &s.blocks {
            if b.state == "active_allocated" {
                run = 0;
            } else {
                run += b.size;
                largest = largest.max(run);
            }
        }
    }
    largest
}

/// The rule's `largest_after_release` from the report and the figures `releasable`, `kept`.
fn expected_after_release(r: &OutOfMemory, releasable: u64, kept: u64) -> u64 {
    let mut fresh = r.device_free + releasable;
    if let Some(allowed) = r.allowed {
        fresh = fresh.min(allowed.saturating_sub(r.reserved.saturating_sub(releasable)));
    }
    fresh.max(kept)
}

/// `releasable` is what `empty_cache()` gives back now: calls it and compares the reserved
/// bytes before and after.
fn check_releasable_by_empty_cache(a: &CachingAllocator, r: &OutOfMemory) {
    let x = r.forensics.as_deref().expect("forensics");
    let before = a.stats().reserved_bytes.all.current;
    a.empty_cache();
    let after = a.stats().reserved_bytes.all.current;
    assert_eq!(
        x.releasable,
        (before - after) as u64,
        "releasable against empty_cache (reserved {before} -> {after})"
    );
}

/// A retained private pool holding one free segment of `bytes`, allocated on `stream`.
fn pool_with_a_free_segment(a: &CachingAllocator, bytes: u64, stream: StreamHandle) -> PoolId {
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
        .unwrap();
    let x = a.allocate(bytes, stream).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    a.free(x.ptr).unwrap();
    pool
}

mod differential;
mod edges;
mod figures;
