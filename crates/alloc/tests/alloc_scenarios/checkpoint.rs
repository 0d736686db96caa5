//! Checkpoints of a private pool (`getCheckpointState`, `setCheckpointPoolState`,
//! `checkPoolLiveAllocations`) on the fake device: the CUDAGraph-tree scenario of PyTorch's
//! Note [Checkpointing PrivatePoolState], statistics against figures worked out along
//! PyTorch's code path, every error (with nothing changed), and random programs.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use common::{D0, GIB, LEGACY, MIB, TestResult, new_stream, setup};
use ferrocuda_alloc::history::{HistoryContext, HistoryMode, HistoryOptions};
use ferrocuda_alloc::{AllocError, BlockInfo, Caching, CachingAllocator, Route};
use ferrocuda_driver::FakeDriver;
use ferrocuda_driver::fake::{Call, Completion};
use ferrocuda_types::{
    AllocatorConfig, DevicePtr, PoolCheckpoint, PoolId, RestoreResult, StreamHandle,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::collections::BTreeMap;
use std::sync::Arc;

/// (address, size, allocated) of every block.
type Layout = Vec<(u64, u64, bool)>;

/// By address.
fn layout(blocks: &[BlockInfo]) -> Layout {
    let mut l: Layout = blocks
        .iter()
        .map(|b| (b.ptr.0, b.size, b.allocated))
        .collect();
    l.sort_unstable();
    l
}

fn checkpoint_layout(cp: &PoolCheckpoint) -> Layout {
    let blocks = cp.segments.iter().flat_map(|s| s.blocks.iter());
    blocks.map(|b| (b.ptr.0, b.size, b.allocated)).collect()
}

/// A pool that takes every allocation made on a stream of its own.
fn pool_on_new_stream(
    fake: &FakeDriver,
    a: &CachingAllocator,
) -> Result<(PoolId, StreamHandle), Box<dyn std::error::Error>> {
    let s = new_stream(fake)?;
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Stream(s))?;
    Ok((pool, s))
}

/// Every statistic that differs between `before` and `after`, by PyTorch's key.
fn deltas(before: &BTreeMap<String, i64>, after: &BTreeMap<String, i64>) -> BTreeMap<String, i64> {
    (after.iter())
        .map(|(k, v)| (k.clone(), v - before[k]))
        .filter(|(_, d)| *d != 0)
        .collect()
}

/// The outputs and checkpoints of recording A, B and C in one pool (Note [Checkpointing
/// PrivatePoolState]). In the pool's one 20 MiB segment S:
/// - A: a temporary of 3 MiB at S, output `a` (2 MiB - 100 bytes asked) at S+3M; the
///   temporary dies: [free 3M][a 2M][free 15M].
/// - B: output `b` (4 MiB) at S+5M; a 1.5 MiB temporary in the 3M hole, dead again:
///   [free 3M][a][b 4M][free 11M].
/// - C: output `c` (5 MiB) at S+9M; `a` dies: [free 5M][b][c 5M][free 6M].
struct Tree {
    s: u64,
    outputs: [DevicePtr; 3],
    checkpoints: [PoolCheckpoint; 3],
}

fn record_abc(
    a: &CachingAllocator,
    pool: PoolId,
    stream: StreamHandle,
) -> Result<Tree, AllocError> {
    let tmp = a.allocate(3 * MIB, stream)?;
    let out_a = a.allocate(2 * MIB - 100, stream)?.ptr;
    a.free(tmp.ptr)?;
    let ca = a.checkpoint_pool(pool)?;
    let out_b = a.allocate(4 * MIB, stream)?.ptr;
    let tmp = a.allocate(3 * MIB / 2, stream)?;
    a.free(tmp.ptr)?;
    let cb = a.checkpoint_pool(pool)?;
    let out_c = a.allocate(5 * MIB, stream)?.ptr;
    a.free(out_a)?;
    let cc = a.checkpoint_pool(pool)?;
    Ok(Tree {
        s: out_a.0 - 3 * MIB,
        outputs: [out_a, out_b, out_c],
        checkpoints: [ca, cb, cc],
    })
}

#[test]
fn checkpoints_record_every_block_of_the_pool() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let t = record_abc(&a, pool, s)?;
    let [ca, cb, cc] = &t.checkpoints;
    let m = MIB;
    let seg = t.s;
    assert_eq!(
        checkpoint_layout(ca),
        [
            (seg, 3 * m, false),
            (seg + 3 * m, 2 * m, true),
            (seg + 5 * m, 15 * m, false)
        ]
    );
    assert_eq!(
        checkpoint_layout(cb),
        [
            (seg, 3 * m, false),
            (seg + 3 * m, 2 * m, true),
            (seg + 5 * m, 4 * m, true),
            (seg + 9 * m, 11 * m, false)
        ]
    );
    assert_eq!(
        checkpoint_layout(cc),
        [
            (seg, 5 * m, false),
            (seg + 5 * m, 4 * m, true),
            (seg + 9 * m, 5 * m, true),
            (seg + 14 * m, 6 * m, false)
        ]
    );
    let block = cb.segments[0].blocks[1];
    assert_eq!((block.requested, block.stream), (2 * MIB - 100, s));
    assert_eq!(cb.live(), [t.outputs[0], t.outputs[1]]);
    assert_eq!(checkpoint_layout(cc), layout(&a.pool_blocks(pool)));
    Ok(())
}

/// The note's tree: A → B → C recorded and replayed; every output then died. Replaying A
/// and B makes their outputs live again at their recorded addresses, which the allocator
/// does not know: restoring B's checkpoint before recording D keeps D off them.
#[test]
fn restoring_a_branch_point_keeps_the_next_recording_off_live_outputs() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let t = record_abc(&a, pool, s)?;
    let [out_a, out_b, out_c] = t.outputs;
    a.free(out_b)?;
    a.free(out_c)?;
    assert!(a.pool_live_allocations_are(pool, &[])?);
    // Replaying A and B changes nothing in the allocator; restore B's state.
    let rr = a.restore_pool(&t.checkpoints[1])?;
    assert_eq!(
        rr,
        RestoreResult {
            allocations_freed: vec![],
            allocations_created: vec![out_a, out_b],
        }
    );
    assert!(a.pool_live_allocations_are(pool, &[out_a, out_b])?);
    assert_eq!(
        layout(&a.pool_blocks(pool)),
        checkpoint_layout(&t.checkpoints[1])
    );
    a.check_invariants()?;
    // D's 6 MiB output goes to the 11 MiB hole after `b`, not over `a` or `b` (without the
    // restore the whole free segment would have taken it at S, over `a`).
    let d = a.allocate(6 * MIB, s)?;
    assert_eq!(d.ptr.0, t.s + 9 * MIB);
    assert!(a.pool_live_allocations_are(pool, &[out_a, out_b, d.ptr])?);
    // Going back to C's branch frees everything allocated now (address order) and brings
    // back C's live outputs.
    let rr = a.restore_pool(&t.checkpoints[2])?;
    assert_eq!(rr.allocations_freed, [out_a, out_b, d.ptr]);
    assert_eq!(rr.allocations_created, [out_b, out_c]);
    assert_eq!(
        layout(&a.pool_blocks(pool)),
        checkpoint_layout(&t.checkpoints[2])
    );
    // The caller frees what died since (`raw_delete`), as the tree manager does.
    a.free(out_c)?;
    assert!(a.pool_live_allocations_are(pool, &[out_b])?);
    assert_eq!(fake.calls(Call::Malloc), 1, "one segment, never another");
    a.check_invariants()?;
    Ok(())
}

/// Restoring B's checkpoint over the state after C (`b`, `c` live): every statistic moves
/// as PyTorch's `free` and `alloc_found_block` move it (worked out step by step below).
#[test]
fn a_restore_moves_the_statistics_as_pytorchs_calls_do() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let t = record_abc(&a, pool, s)?;
    let [_, out_b, out_c] = t.outputs;
    let before = a.stats().to_map();
    let calls = fake.calls(Call::Malloc) + fake.calls(Call::Free);
    let rr = a.restore_pool(&t.checkpoints[1])?;
    assert_eq!(rr.allocations_freed, [out_b, out_c]);
    assert_eq!(rr.allocations_created, [t.outputs[0], out_b]);
    let m = MIB as i64;
    // 1. free b (merges with the 5M hole: inactive split +0 blocks, +4M) and c (merges
    //    both ways into the whole segment: -2 blocks, -15M).
    // 2. hand out 3M (splits an unsplit block: +1, +17M), 2M (-2M), 4M (-4M), 11M (no
    //    split, was split: -1, -11M); requested = size.
    // 3. free the 3M and the 11M blocks (no merge: +1, +3M; +1, +11M).
    let mut want = BTreeMap::new();
    for pool in ["all", "large_pool"] {
        for (stat, v) in [
            ("allocation.allocated", 4),
            ("allocation.freed", 4),
            ("allocation.peak", 1),
            ("active.allocated", 4),
            ("active.freed", 4),
            ("active.peak", 1),
            ("allocated_bytes.current", -3 * m),
            ("allocated_bytes.allocated", 20 * m),
            ("allocated_bytes.freed", 23 * m),
            ("allocated_bytes.peak", 9 * m),
            ("active_bytes.current", -3 * m),
            ("active_bytes.allocated", 20 * m),
            ("active_bytes.freed", 23 * m),
            ("active_bytes.peak", 9 * m),
            // b and c had asked for their sizes; the restored a asks for its size (2M),
            // not for the 2M - 100 it asked for when recorded.
            ("requested_bytes.current", -3 * m),
            ("requested_bytes.allocated", 20 * m),
            ("requested_bytes.freed", 23 * m),
            ("requested_bytes.peak", 9 * m + 100),
            ("inactive_split.allocated", 3),
            ("inactive_split.freed", 3),
            ("inactive_split_bytes.current", 3 * m),
            ("inactive_split_bytes.allocated", 35 * m),
            ("inactive_split_bytes.freed", 32 * m),
        ] {
            let (name, field) = stat.split_once('.').unwrap();
            want.insert(format!("{name}.{pool}.{field}"), v);
        }
    }
    assert_eq!(deltas(&before, &a.stats().to_map()), want);
    assert_eq!(
        fake.calls(Call::Malloc) + fake.calls(Call::Free),
        calls,
        "no driver call"
    );
    a.check_invariants()?;
    Ok(())
}

#[test]
fn a_restore_records_pytorchs_trace_entries() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let t = record_abc(&a, pool, s)?;
    a.record_memory_history(HistoryOptions {
        mode: HistoryMode::All,
        context: HistoryContext::All,
        ..HistoryOptions::default()
    });
    a.restore_pool(&t.checkpoints[1])?;
    let (_, trace) = a.snapshot();
    let seg = t.s;
    let m = MIB;
    let actions: Vec<(&str, u64, u64)> = (trace.iter())
        .filter(|e| e.action != "snapshot")
        .map(|e| (e.action.as_str(), e.addr - seg, e.size))
        .collect();
    assert_eq!(
        actions,
        [
            ("free_requested", 5 * m, 4 * m),
            ("free_completed", 5 * m, 4 * m),
            ("free_requested", 9 * m, 5 * m),
            ("free_completed", 9 * m, 5 * m),
            ("alloc", 0, 3 * m),
            ("alloc", 3 * m, 2 * m),
            ("alloc", 5 * m, 4 * m),
            ("alloc", 9 * m, 11 * m),
            ("free_requested", 0, 3 * m),
            ("free_completed", 0, 3 * m),
            ("free_requested", 9 * m, 11 * m),
            ("free_completed", 9 * m, 11 * m),
        ]
    );
    assert!(
        (trace.iter())
            .filter(|e| e.action != "snapshot")
            .all(|e| e.stream == s.raw)
    );
    Ok(())
}

/// The checkpoint's split is recreated even where `max_split_size_mb` would now forbid
/// it; the block is counted as oversize under the new limit, as `alloc_found_block` does.
#[test]
fn a_restore_splits_as_the_checkpoint_whatever_max_split_size_says() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let big = a.allocate(40 * MIB, s)?;
    a.free(big.ptr)?;
    let x = a.allocate(25 * MIB, s)?;
    assert_eq!(a.pool_blocks(pool).len(), 2, "split: no size limit yet");
    let cp = a.checkpoint_pool(pool)?;
    a.free(x.ptr)?;
    a.update_config("max_split_size_mb:21")?;
    let y = a.allocate(25 * MIB, s)?;
    assert_eq!(a.pool_blocks(pool).len(), 1, "not split under the limit");
    let oversize = common::stat(&a, "oversize_allocations.current");
    let rr = a.restore_pool(&cp)?;
    assert_eq!(
        (rr.allocations_freed, rr.allocations_created),
        (vec![y.ptr], vec![x.ptr])
    );
    assert_eq!(layout(&a.pool_blocks(pool)), checkpoint_layout(&cp));
    assert_eq!(
        common::stat(&a, "oversize_allocations.current"),
        oversize,
        "y freed, x counted under the new limit"
    );
    a.check_invariants()?;
    Ok(())
}

/// With expandable segments on, private pools still use plain segments (docs/graphs.md);
/// their checkpoints and restores leave the default pool's expandable segment alone.
#[test]
fn a_restore_leaves_expandable_segments_of_the_default_pool_alone() -> TestResult {
    let (fake, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let outside = a.allocate(3 * MIB, LEGACY)?;
    let t = record_abc(&a, pool, s)?;
    assert!(a.pool_blocks(pool).iter().all(|b| !b.expandable));
    let default_before = a.pool_blocks(PoolId::DEFAULT);
    assert!(
        default_before
            .iter()
            .any(|b| b.expandable && b.ptr == outside.ptr)
    );
    a.restore_pool(&t.checkpoints[0])?;
    assert_eq!(
        layout(&a.pool_blocks(pool)),
        checkpoint_layout(&t.checkpoints[0])
    );
    assert_eq!(a.pool_blocks(PoolId::DEFAULT), default_before);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn live_allocations_are_compared_as_a_set() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let x = a.allocate(1000, s)?.ptr;
    let y = a.allocate(3 * MIB, s)?.ptr;
    let elsewhere = a.allocate(1000, LEGACY)?.ptr;
    assert!(a.pool_live_allocations_are(pool, &[y, x])?);
    assert!(
        a.pool_live_allocations_are(pool, &[x, y, x])?,
        "repeats count once"
    );
    assert!(!a.pool_live_allocations_are(pool, &[x])?, "y is live too");
    assert!(
        !a.pool_live_allocations_are(pool, &[x, y, elsewhere])?,
        "not the pool's"
    );
    a.free(y)?;
    assert!(a.pool_live_allocations_are(pool, &[x])?);
    // A freeable pool is still looked at; an unknown one is an error.
    a.end_allocate_to_pool(pool)?;
    a.release_pool(pool)?;
    assert!(a.pool_live_allocations_are(pool, &[x])?);
    let unknown = PoolId::handle();
    let e = a.pool_live_allocations_are(unknown, &[]).unwrap_err();
    assert_eq!(e, AllocError::PoolNotFound(unknown));
    assert_eq!(e.to_string(), "Could not find pool of id");
    Ok(())
}

#[test]
fn unknown_and_freeable_pools_are_refused() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let unknown = PoolId::handle();
    let e = a.checkpoint_pool(unknown).unwrap_err();
    assert_eq!(e, AllocError::PoolNotFound(unknown));
    assert_eq!(e.to_string(), "Could not find pool of id");
    assert_eq!(
        a.checkpoint_pool(PoolId::DEFAULT).unwrap_err(),
        AllocError::PoolNotFound(PoolId::DEFAULT)
    );
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let x = a.allocate(3 * MIB, s)?;
    let cp = a.checkpoint_pool(pool)?;
    let stranger = PoolCheckpoint {
        pool: unknown,
        ..cp.clone()
    };
    let e = a.restore_pool(&stranger).unwrap_err();
    assert_eq!(e, AllocError::PrivatePoolNotFound(unknown));
    assert_eq!(e.to_string(), "Could not find private pool id");
    a.end_allocate_to_pool(pool)?;
    a.release_pool(pool)?;
    assert_eq!(a.pool_use_count(pool), Some(0));
    // PyTorch's getCheckpointState finds a freeable pool among graph_pools first and
    // checkpoints it; setCheckpointPoolState refuses it.
    assert_eq!(a.checkpoint_pool(pool)?, cp);
    let e = a.restore_pool(&cp).unwrap_err();
    assert_eq!(e, AllocError::FreeablePool(pool));
    assert_eq!(e.to_string(), "Not expected to checkpoint freeable graph");
    assert!(
        a.pool_live_allocations_are(pool, &[x.ptr])?,
        "nothing changed"
    );
    Ok(())
}

/// A checkpoint whose segment went back to the driver (the pool was released, emptied and
/// made again) fails with PyTorch's message, before freeing anything.
#[test]
fn a_checkpoint_of_a_released_segment_is_refused() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let x = a.allocate(3 * MIB, s)?;
    let cp = a.checkpoint_pool(pool)?;
    a.free(x.ptr)?;
    a.end_allocate_to_pool(pool)?;
    a.release_pool(pool)?;
    a.empty_cache();
    assert_eq!(a.pool_use_count(pool), None, "the pool is gone");
    // (The driver may hand the address out again: to the default pool here.)
    let _elsewhere = a.allocate(3 * MIB, LEGACY)?;
    a.begin_allocate_to_pool(pool, Route::Stream(s))?;
    let y = a.allocate(1000, s)?;
    let (blocks, stats) = (a.blocks(), a.stats());
    let e = a.restore_pool(&cp).unwrap_err();
    let first = cp.segments[0].blocks[0].ptr;
    assert_eq!(e, AllocError::CheckpointSegmentNotFound(first));
    assert_eq!(e.to_string(), format!(" could not find {:#x}", first.0));
    assert_eq!((a.blocks(), a.stats()), (blocks, stats), "nothing changed");
    assert!(a.pool_live_allocations_are(pool, &[y.ptr])?);
    Ok(())
}

/// Where PyTorch would fail half-way (the pool freed, the first segment re-split), nothing
/// changes: the second segment's layout is checked before the first is touched.
#[test]
fn a_checkpoint_that_does_not_fit_changes_nothing() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let x = a.allocate(3 * MIB, s)?;
    let y = a.allocate(1000, s)?;
    let cp = a.checkpoint_pool(pool)?;
    assert_eq!(cp.segments.len(), 2);
    let large = cp
        .segments
        .iter()
        .position(|g| g.blocks.len() == 2)
        .unwrap();
    let (blocks, stats) = (a.blocks(), a.stats());
    let unchanged = |a: &CachingAllocator| {
        assert_eq!((a.blocks(), a.stats()), (blocks.clone(), stats.clone()));
    };
    let mut cases: Vec<(PoolCheckpoint, &str)> = Vec::new();
    // A block bigger than what is left of the segment.
    let mut bad = cp.clone();
    bad.segments[large].blocks[0].size += 512;
    cases.push((bad, "curr_block->ptr == block_state.ptr"));
    // Blocks that stop short of the segment's end.
    let mut bad = cp.clone();
    bad.segments[large].blocks.pop();
    cases.push((bad, "(curr_block != nullptr) == ((i + 1) < (segment_len))"));
    // One that runs past it.
    let mut bad = cp.clone();
    bad.segments[large].blocks[1].size += 512;
    cases.push((bad, "curr_block->size == block_state.size"));
    // Two free blocks side by side: the second free would merge into the first.
    let mut bad = cp.clone();
    let b = &mut bad.segments[large].blocks;
    b[0].allocated = false;
    let tail = b[1];
    b[1].size = MIB;
    b.push(ferrocuda_types::BlockCheckpoint {
        ptr: DevicePtr(tail.ptr.0 + MIB),
        size: tail.size - MIB,
        ..tail
    });
    cases.push((bad, "curr_block->ptr == block_state.ptr"));
    for (bad, check) in cases {
        let e = a.restore_pool(&bad).unwrap_err();
        assert!(
            matches!(e, AllocError::CheckpointMismatch { check: c, .. } if c == check),
            "{e:?} for {check}"
        );
        assert!(
            e.to_string()
                .starts_with(&format!("Expected {check} to be true"))
        );
        unchanged(&a);
    }
    // The same segment twice.
    let mut twice = cp.clone();
    twice.segments.push(cp.segments[large].clone());
    let first = cp.segments[large].blocks[0].ptr;
    assert_eq!(
        a.restore_pool(&twice).unwrap_err(),
        AllocError::CheckpointSegmentNotFound(first)
    );
    unchanged(&a);
    // And the real one works.
    let rr = a.restore_pool(&cp)?;
    let mut live = vec![x.ptr, y.ptr];
    live.sort();
    assert_eq!(rr.allocations_freed, live);
    a.check_invariants()?;
    Ok(())
}

/// Blocks waiting for events (or that would, being freed) refuse a checkpoint or a
/// restore, before anything changes.
#[test]
fn pending_events_are_refused() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let (pool, s) = pool_on_new_stream(&fake, &a)?;
    let side = new_stream(&fake)?;
    let x = a.allocate(3 * MIB, s)?;
    let cp = a.checkpoint_pool(pool)?;
    a.record_stream(x.ptr, side)?;
    let stats = a.stats();
    let e = a.restore_pool(&cp).unwrap_err();
    assert_eq!(e, AllocError::RestoreEventsPending(x.ptr));
    assert_eq!(
        e.to_string(),
        "Events should have synchronized when setting checkpointed block"
    );
    assert_eq!(a.stats(), stats);
    // Freed, it waits for the side stream.
    a.free(x.ptr)?;
    let stats = a.stats();
    let e = a.checkpoint_pool(pool).unwrap_err();
    assert_eq!(e, AllocError::CheckpointEventsPending(x.ptr));
    assert_eq!(
        e.to_string(),
        "Events should have synchronized when checkpointing block"
    );
    // The segment now starts with a block held back: no free block is found there.
    assert_eq!(
        a.restore_pool(&cp).unwrap_err(),
        AllocError::CheckpointSegmentNotFound(x.ptr)
    );
    assert_eq!(a.stats(), stats);
    // Once the side stream is done, the next operation frees it and all is well.
    fake.advance_all();
    let _ = a.allocate(512, LEGACY)?;
    let rr = a.restore_pool(&a.checkpoint_pool(pool)?)?;
    assert_eq!(rr, RestoreResult::default());
    a.check_invariants()?;
    Ok(())
}

// ---- random programs ---------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    /// Allocate `SIZES[i]` in the pool.
    Alloc(usize),
    /// Free one of the pool's live blocks.
    Free(usize),
    /// Allocate in the default pool, or free one of its blocks.
    Outside(usize, bool),
    Checkpoint,
    /// Restore one of the checkpoints taken.
    Restore(usize),
    /// Restore one of them changed by hand (`mutate`): refused with nothing changed, or
    /// applied exactly.
    RestoreMutated(usize, usize, u8),
    /// Change `max_split_size_mb`.
    Configure(usize),
}

const SIZES: [u64; 10] = [
    512,
    3000,
    100_000,
    1 << 20,
    1_500_000,
    3 << 20,
    7 << 20,
    12 << 20,
    25 << 20,
    (40 << 20) + 4096,
];

const CONFIGS: [&str; 3] = [
    "max_split_size_mb:21",
    "max_split_size_mb:64",
    "max_split_size_mb:100000",
];

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SIZES.len()).prop_map(Op::Alloc),
        4 => any::<usize>().prop_map(Op::Free),
        1 => (0..SIZES.len(), any::<bool>()).prop_map(|(i, f)| Op::Outside(i, f)),
        2 => Just(Op::Checkpoint),
        2 => any::<usize>().prop_map(Op::Restore),
        1 => (any::<usize>(), any::<usize>(), any::<u8>())
            .prop_map(|(p, b, k)| Op::RestoreMutated(p, b, k)),
        1 => (0..CONFIGS.len()).prop_map(Op::Configure),
    ]
}

fn fail(e: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Checkpoint `cp` changed by hand: a block grown, shrunk, moved, dropped or made live or
/// dead, or a segment repeated.
fn mutate(cp: &PoolCheckpoint, block: usize, kind: u8) -> PoolCheckpoint {
    let mut cp = cp.clone();
    let at: Vec<(usize, usize)> = (cp.segments.iter().enumerate())
        .flat_map(|(s, seg)| (0..seg.blocks.len()).map(move |i| (s, i)))
        .collect();
    let Some(&(s, i)) = at.get(block % at.len().max(1)) else {
        return cp;
    };
    let seg = cp.segments[s].clone();
    let b = &mut cp.segments[s].blocks;
    match kind % 6 {
        0 => b[i].size += 512,
        1 => b[i].size -= b[i].size.min(512),
        2 => b[i].allocated = !b[i].allocated,
        3 => drop(b.remove(i)),
        4 => b[i].ptr.0 += 512,
        _ => cp.segments.push(seg),
    }
    cp
}

/// Applies checkpoint `cp` and checks everything against it: the pool's layout is the
/// checkpoint's (segments it gained since stay whole and free), the result names what was
/// live and what is now, the counters move by one allocation per checkpointed block and one
/// free per block freed, and nothing else (segments, the default pool, the driver) moves.
/// A refused checkpoint changes nothing at all. Returns whether it was applied.
fn restore_and_check(
    a: &CachingAllocator,
    pool: PoolId,
    cp: &PoolCheckpoint,
    live: &[DevicePtr],
) -> Result<bool, TestCaseError> {
    let before = a.stats().to_map();
    let (blocks, stats) = (a.blocks(), a.stats());
    let outside = a.pool_blocks(PoolId::DEFAULT);
    let rr = match a.restore_pool(cp) {
        Ok(rr) => rr,
        Err(_) => {
            prop_assert_eq!((a.blocks(), a.stats()), (blocks, stats));
            return Ok(false);
        }
    };
    let mut freed = live.to_vec();
    freed.sort_unstable();
    prop_assert_eq!(&rr.allocations_freed, &freed);
    prop_assert_eq!(&rr.allocations_created, &cp.live());
    let bases: Vec<u64> = cp.segments.iter().map(|s| s.blocks[0].ptr.0).collect();
    let (restored, gained): (Vec<BlockInfo>, Vec<BlockInfo>) =
        (a.pool_blocks(pool).into_iter()).partition(|b| bases.contains(&b.segment.0));
    prop_assert_eq!(layout(&restored), checkpoint_layout(cp));
    prop_assert!(gained.iter().all(|b| !b.allocated && b.ptr == b.segment));
    let after = a.stats().to_map();
    let d = |k: &str| after[k] - before[k];
    let blocks = checkpoint_layout(cp).len() as i64;
    let dead = checkpoint_layout(cp).iter().filter(|b| !b.2).count() as i64;
    prop_assert_eq!(d("allocation.all.allocated"), blocks);
    prop_assert_eq!(d("allocation.all.freed"), live.len() as i64 + dead);
    for k in [
        "segment.all.current",
        "reserved_bytes.all.current",
        "num_device_alloc",
        "num_device_free",
    ] {
        prop_assert_eq!(d(k), 0, "{}", k);
    }
    prop_assert_eq!(a.pool_blocks(PoolId::DEFAULT), outside);
    Ok(true)
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let fake = Arc::new(
        FakeDriver::builder()
            .completion(Completion::Eager)
            .capacity(64 * GIB)
            .backing(false)
            .build(),
    );
    let a = CachingAllocator::new(fake.clone(), D0, AllocatorConfig::default(), Caching::On)
        .map_err(fail)?;
    let s = new_stream(&fake).map_err(fail)?;
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Stream(s))
        .map_err(fail)?;
    let (mut live, mut outside, mut checkpoints) = (Vec::new(), Vec::new(), Vec::new());
    for op in ops {
        match *op {
            Op::Alloc(i) => live.push(a.allocate(SIZES[i], s).map_err(fail)?.ptr),
            Op::Free(pick) if !live.is_empty() => {
                a.free(live.swap_remove(pick % live.len())).map_err(fail)?;
            }
            Op::Outside(i, true) if !outside.is_empty() => {
                a.free(outside.swap_remove(i % outside.len()))
                    .map_err(fail)?;
            }
            Op::Outside(i, _) => outside.push(a.allocate(SIZES[i], LEGACY).map_err(fail)?.ptr),
            Op::Checkpoint => {
                let cp = a.checkpoint_pool(pool).map_err(fail)?;
                prop_assert_eq!(checkpoint_layout(&cp), layout(&a.pool_blocks(pool)));
                checkpoints.push(cp);
            }
            Op::Restore(pick) if !checkpoints.is_empty() => {
                let cp = &checkpoints[pick % checkpoints.len()];
                prop_assert!(restore_and_check(&a, pool, cp, &live)?, "refused");
                live = cp.live();
            }
            Op::RestoreMutated(pick, block, kind) if !checkpoints.is_empty() => {
                let cp = mutate(&checkpoints[pick % checkpoints.len()], block, kind);
                if restore_and_check(&a, pool, &cp, &live)? {
                    live = cp.live();
                }
            }
            Op::Configure(i) => a.update_config(CONFIGS[i]).map_err(fail)?,
            Op::Free(_) | Op::Restore(_) | Op::RestoreMutated(..) => {}
        }
        a.check_invariants().map_err(fail)?;
        prop_assert!(a.pool_live_allocations_are(pool, &live).map_err(fail)?);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn restores_return_the_pool_to_its_checkpoints(ops in proptest::collection::vec(op(), 1..120)) {
        run(&ops)?;
    }
}
