//! The saved state of a private memory pool, to return the pool to later: PyTorch's
//! `PrivatePoolState` / `SegmentState` / `BlockState` and `RestoreResult`
//! (c10/cuda/CUDACachingAllocator.h), which CUDAGraph trees take after recording each node
//! and apply before recording another branch (`getCheckpointState`,
//! `setCheckpointPoolState`). Plain data: the allocator fills it in and checks it against
//! the pool when it is applied.
use crate::handles::{DevicePtr, PoolId, StreamHandle};
use crate::stats::PoolKind;
use serde::{Deserialize, Serialize};

/// One block of a checkpointed segment (`BlockState`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockCheckpoint {
    /// Address.
    pub ptr: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for when it was handed out (0 for a free block). Informational: a
    /// restore hands allocated blocks out again with `requested == size`, as PyTorch's
    /// `setSegmentStateToCheckpoint` does (it passes the block's size as the request).
    pub requested: u64,
    /// Its allocation stream.
    pub stream: StreamHandle,
    /// Handed out (live) when the checkpoint was taken.
    pub allocated: bool,
}

/// One segment of the pool with its blocks in address order (`SegmentState`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SegmentCheckpoint {
    /// The small or the large pool (`is_small`).
    pub kind: PoolKind,
    /// Every block of the segment, from its first address to its last.
    pub blocks: Vec<BlockCheckpoint>,
}

/// The state of one private pool (`PrivatePoolState`): every segment it held, in address
/// order, with the split of each into blocks and which of them were live.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PoolCheckpoint {
    /// The pool (`owner_id`).
    pub pool: PoolId,
    /// Its segments, by address.
    pub segments: Vec<SegmentCheckpoint>,
}

impl PoolCheckpoint {
    /// The addresses of the blocks that were live when the checkpoint was taken, in
    /// segment and address order.
    pub fn live(&self) -> Vec<DevicePtr> {
        self.segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.allocated)
            .map(|b| b.ptr)
            .collect()
    }
}

/// What applying a checkpoint changed (`RestoreResult`): the caller rebinds its storages
/// from these.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RestoreResult {
    /// Blocks of the pool that were allocated before the restore and were freed by it
    /// (every one allocated then), in address order.
    pub allocations_freed: Vec<DevicePtr>,
    /// Blocks allocated by the restore: those live in the checkpoint, in the checkpoint's
    /// segment and address order.
    pub allocations_created: Vec<DevicePtr>,
}
