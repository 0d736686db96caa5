//! `oom_forensics:<path>`: what an out-of-memory error adds (checked against the
//! allocator's own snapshot, taken right after the error), that PyTorch's message is
//! unchanged before it and with the key off, and the snapshot written to the path.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::common;
use common::{LEGACY, MIB, TestResult, new_stream, setup};
use ferrocuda_alloc::history::HistoryOptions;
use ferrocuda_alloc::{AllocError, CachingAllocator};
use ferrocuda_driver::fake::Completion;
use ferrocuda_types::{OutOfMemory, Snapshot, StreamHandle};
use std::collections::BTreeMap;

/// A fragmented device of 64 MiB: a live 20 MiB block, a 20 MiB large segment split into
/// a live piece and free pieces, a small segment with a live and a free piece on another
/// stream; then a request of 40 MiB that cannot fit. Returns the error's report.
fn fragment_and_fail(
    config: &str,
    history: bool,
) -> (CachingAllocator, Box<OutOfMemory>, StreamHandle) {
    let (fake, a) = setup(64 * MIB, config, Completion::Eager);
    if history {
        a.record_memory_history(HistoryOptions::parse(Some("all"), Some("all"), 1000).unwrap());
    }
    let other = new_stream(&fake).unwrap();
    let big = a.allocate(20 * MIB, LEGACY).unwrap();
    let pieces: Vec<_> = (0..4)
        .map(|_| a.allocate(3 * MIB, LEGACY).unwrap())
        .collect();
    a.free(pieces[0].ptr).unwrap();
    a.free(pieces[2].ptr).unwrap();
    let small: Vec<_> = (0..2).map(|_| a.allocate(4096, other).unwrap()).collect();
    a.free(small[0].ptr).unwrap();
    let report = match a.allocate(40 * MIB, LEGACY) {
        Err(AllocError::OutOfMemory(r)) => r,
        other => panic!("expected out of memory, got {other:?}"),
    };
    std::mem::forget((big, pieces, small));
    (a, report, other)
}

/// (pool, small, stream raw) of a group of free blocks, and its (bytes, blocks, largest).
type FreeKey = ((u64, u64), bool, u64);
type FreeFigures = (u64, usize, u64);

fn temp_path(tag: &str) -> String {
    let dir = std::env::temp_dir().join(format!("ferrocuda-oom-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("oom.pickle").to_string_lossy().into_owned()
}

/// With the key, the message is PyTorch's (exactly what it is without the key) followed by
/// the forensics; without it, no forensics at all.
#[test]
fn pytorchs_message_comes_first_and_alone_without_the_key() -> TestResult {
    let (_, plain, _) = fragment_and_fail("", false);
    assert!(plain.forensics.is_none());
    let path = temp_path("message");
    let (_, with, _) = fragment_and_fail(&format!("oom_forensics:{path}"), false);
    let (plain, with) = (plain.to_string(), with.to_string());
    let rest = with
        .strip_prefix(&plain)
        .unwrap_or_else(|| panic!("PyTorch's message first:\n{with}\n---\n{plain}"));
    assert!(
        rest.starts_with("\n\nferrocuda OOM forensics (oom_forensics):"),
        "{rest}"
    );
    assert!(
        rest.contains(&format!("snapshot written to {path}")),
        "{rest}"
    );
    Ok(())
}

/// Every figure against the allocator's snapshot taken right after the error: the free
/// blocks grouped by (pool, small or large, stream), what `empty_cache` would give back
/// (whole free segments), the largest request that would then succeed on the failed
/// stream, and the largest live blocks with their allocation sites.
#[test]
fn the_figures_agree_with_the_snapshot() -> TestResult {
    let path = temp_path("figures");
    let (a, report, other) = fragment_and_fail(&format!("oom_forensics:{path}"), true);
    let x = report.forensics.as_deref().expect("forensics");
    let (segments, _) = a.snapshot();
    // Free blocks by (pool, small, stream).
    let mut free: BTreeMap<FreeKey, FreeFigures> = BTreeMap::new();
    let mut live = Vec::new();
    let mut whole_free = 0;
    for s in &segments {
        if s.blocks.iter().all(|b| b.state == "inactive") {
            whole_free += s.total_size;
        }
        for b in &s.blocks {
            match b.state.as_str() {
                "inactive" => {
                    let e = free
                        .entry((s.segment_pool_id, s.segment_type == "small", s.stream))
                        .or_default();
                    e.0 += b.size;
                    e.1 += 1;
                    e.2 = e.2.max(b.size);
                }
                "active_allocated" => live.push((b.size, b.address, b.frames.clone())),
                _ => {}
            }
        }
    }
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
    assert_eq!(got, free);
    assert!(
        x.free.windows(2).all(|w| w[0].bytes >= w[1].bytes),
        "largest first"
    );
    // The small pool's free piece is on the other stream.
    assert!(x.free.iter().any(|c| c.small && c.stream == other));
    assert_eq!(x.releasable, whole_free);
    let kept_on_legacy = x
        .free
        .iter()
        .filter(|c| c.pool == (0, 0) && c.stream == LEGACY)
        .map(|c| c.largest)
        .max()
        .unwrap_or(0);
    assert_eq!(
        x.largest_after_release,
        (report.device_free + x.releasable).max(kept_on_legacy)
    );
    assert!(x.largest_after_release < 40 * MIB);
    live.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    live.truncate(5);
    let got_live: Vec<_> = x.largest_live.iter().map(|b| (b.size, b.ptr)).collect();
    let want_live: Vec<_> = live.iter().map(|(s, p, _)| (*s, *p)).collect();
    assert_eq!(got_live, want_live);
    assert_eq!(x.largest_live[0].size, 20 * MIB);
    for (b, (_, _, frames)) in x.largest_live.iter().zip(&live) {
        assert!(!b.frames.is_empty(), "history on: an allocation site");
        assert_eq!(&b.frames, frames);
    }
    assert!(report.to_string().contains("allocated at "));
    Ok(())
}

/// The snapshot at the path reads back, with the segments the allocator had at the error.
#[test]
fn the_snapshot_is_written_and_reads_back() -> TestResult {
    let path = temp_path("snapshot");
    let (a, report, _) = fragment_and_fail(&format!("oom_forensics:{path}"), true);
    let x = report.forensics.as_deref().expect("forensics");
    assert_eq!(x.snapshot, Ok(path.clone()));
    let written = Snapshot::from_pickle(&std::fs::read(&path)?)?;
    let (segments, trace) = a.snapshot();
    assert_eq!(written.segments, segments);
    assert!(
        written.device_traces[0].iter().any(|e| e.action == "oom"),
        "the history's oom entry is in the snapshot"
    );
    assert!(trace.len() >= written.device_traces[0].len());
    Ok(())
}

/// Without history, live blocks have no site and say so; a path that cannot be written is
/// reported in the message, and the error is still PyTorch's out of memory.
#[test]
fn no_stacks_and_an_unwritable_path_are_said() -> TestResult {
    let path = "/nonexistent-folder-of-ferrocuda/oom.pickle";
    let (_, report, _) = fragment_and_fail(&format!("oom_forensics:{path}"), false);
    let x = report.forensics.as_deref().expect("forensics");
    assert!(x.largest_live.iter().all(|b| b.frames.is_empty()));
    assert!(matches!(&x.snapshot, Err(why) if why.contains(path)));
    let text = report.to_string();
    assert!(text.contains("(no stack: record_memory_history records them)"));
    assert!(text.contains("no snapshot: "));
    Ok(())
}

/// Refused up front by the memory fraction (`throw_on_cudamalloc_oom`): nothing was
/// released, so a whole free segment is what `empty_cache` would give back, and the
/// largest request that would then succeed is bounded by the fraction.
#[test]
fn under_a_memory_fraction_the_releasable_cache_counts() -> TestResult {
    let path = temp_path("fraction");
    let (_, a) = setup(
        64 * MIB,
        &format!("oom_forensics:{path},throw_on_cudamalloc_oom:True"),
        Completion::Eager,
    );
    a.set_memory_fraction(0.5)?; // 32 MiB
    let x = a.allocate(24 * MIB, LEGACY)?;
    a.free(x.ptr)?; // a whole free 24 MiB segment, cached
    let err = a
        .allocate(30 * MIB, LEGACY)
        .expect_err("refused by the fraction");
    let AllocError::OutOfMemory(report) = err else {
        panic!("{err}")
    };
    assert!(report.rejected_by_fraction);
    let f = report.forensics.as_deref().expect("forensics");
    assert_eq!(f.releasable, 24 * MIB);
    assert_eq!(f.largest_after_release, 32 * MIB, "the fraction's room");
    Ok(())
}
