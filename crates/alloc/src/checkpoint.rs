//! Checkpoints of a private pool, the mechanism CUDAGraph trees stand on: PyTorch's
//! `getCheckpointState`, `setCheckpointPoolState` (with `freeBlocksAllocatedToPool` and
//! `setSegmentStateToCheckpoint`) and `checkPoolLiveAllocations`
//! (c10/cuda/CUDACachingAllocator.cpp, Note [Checkpointing PrivatePoolState]).
//!
//! A tree records several graphs into one pool, each allocating next to its parent's live
//! outputs. Replays change no allocator state, so before recording a new branch after a
//! replay the pool must be put back as it was after the branch point's recording: every
//! block of the pool is freed, each checkpointed segment is handed out again block by
//! block (splitting exactly where the checkpoint says, whatever `max_split_size_mb` says
//! now), and the blocks that were not live are freed. Statistics and history move through
//! the very steps PyTorch takes (`free`, `alloc_found_block`), so they end where PyTorch's
//! end, peaks included; no driver call is made.
//!
//! Beyond PyTorch: a restore is checked against the pool before anything changes (the
//! pool's segments as `freeBlocksAllocatedToPool` would leave them, walked as
//! `setSegmentStateToCheckpoint` walks them). Where PyTorch fails half-way, with the pool
//! freed and partly re-split, this fails with the same message and changes nothing.
use crate::allocator::CachingAllocator;
use crate::error::AllocError;
use crate::history::{HistoryContext, capture_frames};
use crate::state::{Request, State};
use ferrocuda_types::{
    BlockCheckpoint, DevicePtr, Frame, PoolCheckpoint, PoolId, RestoreResult, SegmentCheckpoint,
};
use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The conditions of `setSegmentStateToCheckpoint` a mismatch reports, as PyTorch spells
/// them.
const PTR_CHECK: &str = "curr_block->ptr == block_state.ptr";
const SIZE_CHECK: &str = "curr_block->size == block_state.size";
const END_CHECK: &str = "(curr_block != nullptr) == ((i + 1) < (segment_len))";

impl CachingAllocator {
    /// The state of private pool `pool`, to return it to with [`restore_pool`]
    /// (`getCheckpointState`): every segment of the pool, by address, with all its blocks
    /// (address, size, requested size, stream, live or not). Blocks freed during a capture
    /// that has ended get their events first (`insert_events_deferred_until_no_capture`;
    /// while a capture is underway no event is recorded, as everywhere in this allocator).
    ///
    /// Errors: `PoolNotFound` for a pool that does not exist; `CheckpointEventsPending` if
    /// a block of the pool waits for events. A pool no graph holds any more (freeable) is
    /// checkpointed while it has segments: PyTorch's `getCheckpointState` looks the pool up
    /// before it tests freeability (only [`restore_pool`] refuses such a pool).
    ///
    /// [`restore_pool`]: CachingAllocator::restore_pool
    pub fn checkpoint_pool(&self, pool: PoolId) -> Result<PoolCheckpoint, AllocError> {
        let mut st = self.engine.lock();
        if !st.capturing() {
            self.engine.record_deferred(&mut st);
        }
        // PyTorch looks the pool up among all private pools, freeable ones included.
        if st.private.use_count(pool).is_none() {
            return Err(AllocError::PoolNotFound(pool));
        }
        let mut segments = Vec::new();
        for head in segment_heads(&st, pool) {
            let mut blocks = Vec::new();
            for id in chain(&st, head) {
                let b = &st.blocks[id];
                if b.event_count > 0 {
                    return Err(AllocError::CheckpointEventsPending(DevicePtr(b.ptr)));
                }
                blocks.push(BlockCheckpoint {
                    ptr: DevicePtr(b.ptr),
                    size: b.size,
                    requested: b.requested,
                    stream: st.stream_handle(b.stream),
                    allocated: b.allocated,
                });
            }
            let kind = st.blocks[head].pool;
            segments.push(SegmentCheckpoint { kind, blocks });
        }
        Ok(PoolCheckpoint { pool, segments })
    }

    /// Returns the checkpoint's pool to the checkpoint (`setCheckpointPoolState`): frees
    /// every allocated block of the pool, then hands each checkpointed segment out again
    /// block by block and frees the blocks that were not live in it. Segments the pool
    /// gained since stay, free. The result names the blocks freed (every one allocated
    /// before, in address order: PyTorch's order follows a hash set) and those live now
    /// (the checkpoint's live blocks); restored blocks have `requested == size`, as in
    /// PyTorch.
    ///
    /// Errors, all before anything changes: `PrivatePoolNotFound`, `FreeablePool`;
    /// `RestoreEventsPending` if a block of the pool waits for events or, allocated, was
    /// used on another stream (freeing it would hold it back); `CheckpointSegmentNotFound`
    /// if a checkpointed segment starts at no free block of the pool once its blocks are
    /// freed (the segment was given back); `CheckpointMismatch` if a segment's layout does
    /// not fit the pool's (PyTorch's failing condition).
    pub fn restore_pool(&self, checkpoint: &PoolCheckpoint) -> Result<RestoreResult, AllocError> {
        // PyTorch gathers one context at STATE for the allocations and each `free` its own
        // at ALL (stacks are taken outside the lock).
        let context = self.context.load(Ordering::Relaxed);
        let frames = (context >= HistoryContext::State as u8).then(capture_frames);
        let free_frames = frames
            .clone()
            .filter(|_| context >= HistoryContext::All as u8);
        let mut st = self.engine.lock();
        check_restore(&st, checkpoint)?;
        Ok(restore(&mut st, checkpoint, frames, free_frames.as_ref()))
    }

    /// Whether the allocated blocks of private pool `pool` are exactly those at `expected`
    /// (`checkPoolLiveAllocations`; repeated addresses count once). `PoolNotFound` for a
    /// pool that does not exist (a freeable one is looked at).
    pub fn pool_live_allocations_are(
        &self,
        pool: PoolId,
        expected: &[DevicePtr],
    ) -> Result<bool, AllocError> {
        let st = self.engine.lock();
        if st.private.use_count(pool).is_none() {
            return Err(AllocError::PoolNotFound(pool));
        }
        let expected: FxHashSet<u64> = expected.iter().map(|p| p.0).collect();
        let mut live = 0;
        for b in st.blocks.iter() {
            if b.vacant || !b.allocated || b.pool_id != pool {
                continue;
            }
            if !expected.contains(&b.ptr) {
                return Ok(false);
            }
            live += 1;
        }
        Ok(live == expected.len())
    }
}

/// `pool` exists and a graph holds it; else `missing`, or `FreeablePool`.
fn in_use(st: &State, pool: PoolId, missing: AllocError) -> Result<(), AllocError> {
    match st.private.use_count(pool) {
        None => Err(missing),
        Some(0) => Err(AllocError::FreeablePool(pool)),
        Some(_) => Ok(()),
    }
}

/// The first block of every segment of `pool`, by address.
fn segment_heads(st: &State, pool: PoolId) -> Vec<usize> {
    let mut heads: Vec<usize> = (st.blocks.iter().enumerate())
        .filter(|(_, b)| !b.vacant && b.pool_id == pool && b.prev.is_none())
        .map(|(id, _)| id)
        .collect();
    heads.sort_by_key(|&id| st.blocks[id].ptr);
    heads
}

/// The blocks of the segment starting at `head`, in address order.
fn chain(st: &State, head: usize) -> Vec<usize> {
    std::iter::successors(Some(head), |&id| st.blocks[id].next.get()).collect()
}

/// A stretch of a pool segment as `freeBlocksAllocatedToPool` leaves it: free (free
/// blocks and freed allocations, merged), or a block held back by events.
#[derive(Copy, Clone, Debug)]
struct Piece {
    ptr: u64,
    size: u64,
    free: bool,
}

/// Whether restoring `cp` would succeed, worked out on the pool's layout without
/// changing it.
fn check_restore(st: &State, cp: &PoolCheckpoint) -> Result<(), AllocError> {
    in_use(st, cp.pool, AllocError::PrivatePoolNotFound(cp.pool))?;
    let mut segments: Vec<Vec<Piece>> = Vec::new();
    for head in segment_heads(st, cp.pool) {
        let mut pieces: Vec<Piece> = Vec::new();
        for id in chain(st, head) {
            let b = &st.blocks[id];
            if b.allocated && (b.event_count > 0 || b.has_uses) {
                return Err(AllocError::RestoreEventsPending(DevicePtr(b.ptr)));
            }
            let free = b.allocated || st.blocks.in_pool(id);
            match pieces.last_mut() {
                Some(last) if last.free && free => last.size += b.size,
                _ => pieces.push(Piece {
                    ptr: b.ptr,
                    size: b.size,
                    free,
                }),
            }
        }
        segments.push(pieces);
    }
    // The free blocks by address (`ptrs_to_blocks`); a segment found is used up.
    let mut starts: FxHashMap<u64, (usize, usize)> = FxHashMap::default();
    for (s, pieces) in segments.iter().enumerate() {
        for (p, piece) in pieces.iter().enumerate().filter(|(_, p)| p.free) {
            starts.insert(piece.ptr, (s, p));
        }
    }
    for seg in &cp.segments {
        let Some(first) = seg.blocks.first() else {
            // PyTorch's `segment.blocks.at(0)` throws.
            return Err(AllocError::CheckpointSegmentNotFound(DevicePtr(0)));
        };
        let (s, p) = (starts.remove(&first.ptr.0))
            .ok_or(AllocError::CheckpointSegmentNotFound(first.ptr))?;
        check_segment(&segments[s][p..], &seg.blocks)?;
    }
    Ok(())
}

/// `setSegmentStateToCheckpoint`'s walk over `pieces` (the first one free, where the
/// segment starts) with its checks, and the check its frees imply: a block freed again
/// must not merge (its address would change), so no two adjacent blocks are free.
fn check_segment(pieces: &[Piece], blocks: &[BlockCheckpoint]) -> Result<(), AllocError> {
    let mismatch = |check, b: &BlockCheckpoint| AllocError::CheckpointMismatch {
        check,
        block: b.ptr,
    };
    let mut rest = pieces.iter().copied();
    let mut curr = rest.next();
    for (i, want) in blocks.iter().enumerate() {
        let Some(piece) = curr else {
            return Err(mismatch(END_CHECK, want));
        };
        if !piece.free {
            return Err(AllocError::RestoreEventsPending(DevicePtr(piece.ptr)));
        }
        let split = piece.size > want.size;
        if piece.ptr != want.ptr.0 {
            return Err(mismatch(PTR_CHECK, want));
        }
        // (A zero-byte block cannot be cut off: PyTorch would make one.)
        if (!split && piece.size != want.size) || want.size == 0 {
            return Err(mismatch(SIZE_CHECK, want));
        }
        curr = if split {
            Some(Piece {
                ptr: piece.ptr + want.size,
                size: piece.size - want.size,
                free: true,
            })
        } else {
            rest.next()
        };
        if curr.is_some() != (i + 1 < blocks.len()) {
            return Err(mismatch(END_CHECK, want));
        }
    }
    // The second loop: freeing a block next to one just freed merges them.
    let merged = blocks
        .windows(2)
        .find(|w| !w[0].allocated && !w[1].allocated);
    merged.map_or(Ok(()), |w| Err(mismatch(PTR_CHECK, &w[1])))
}

/// Applies a checkpoint that [`check_restore`] accepted.
fn restore(
    st: &mut State,
    cp: &PoolCheckpoint,
    frames: Option<Arc<[Frame]>>,
    free_frames: Option<&Arc<[Frame]>>,
) -> RestoreResult {
    let mut rr = RestoreResult::default();
    // `freeBlocksAllocatedToPool`.
    let live: Vec<u64> = (segment_heads(st, cp.pool).into_iter())
        .flat_map(|head| chain(st, head))
        .filter(|&id| st.blocks[id].allocated)
        .map(|id| st.blocks[id].ptr)
        .collect();
    for ptr in live {
        if let Some(id) = st.blocks.allocated_at(ptr) {
            rr.allocations_freed.push(DevicePtr(ptr));
            free(st, id, free_frames);
        }
    }
    for seg in &cp.segments {
        let ids = hand_out_segment(st, cp.pool, seg, &frames);
        for (want, id) in seg.blocks.iter().zip(ids) {
            if want.allocated {
                rr.allocations_created.push(want.ptr);
            } else {
                free(st, id, free_frames);
            }
        }
    }
    rr
}

/// `setSegmentStateToCheckpoint`'s first loop: hands out every block of `seg` from the
/// free block at its start, split where the checkpoint says. Returns the blocks' ids.
fn hand_out_segment(
    st: &mut State,
    pool: PoolId,
    seg: &SegmentCheckpoint,
    frames: &Option<Arc<[Frame]>>,
) -> Vec<usize> {
    let mut ids = Vec::with_capacity(seg.blocks.len());
    let mut cur = seg.blocks.first().and_then(|b| st.blocks.at(b.ptr.0));
    for want in &seg.blocks {
        let Some(id) = cur else { break };
        st.pool_remove(id);
        let b = &st.blocks[id];
        // Split iff the block is larger than the checkpoint's, whatever `max_split_size`
        // says now.
        let split = b.size > want.size;
        let req = Request {
            size: want.size,
            requested: want.size,
            kind: b.pool,
            stream: st.stream_handle(b.stream),
            pool,
            frames: frames.clone(),
            capture: None,
        };
        let (id, _) = st.use_block_split(id, &req, split);
        ids.push(id);
        cur = st.blocks[id].next.get();
    }
    ids
}

/// PyTorch's `free` of allocated block `id` (checked to have no other stream's uses, so
/// it goes straight back to the pool).
fn free(st: &mut State, id: usize, frames: Option<&Arc<[Frame]>>) {
    st.free_now(id, frames);
}
