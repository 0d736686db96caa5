//! Looking at an allocator: statistics, blocks, snapshots (`torch.cuda.memory._snapshot()`
//! and `memory_stats()`), and a recount of every book against the blocks for tests.
use crate::allocator::CachingAllocator;
use crate::block::{Block, BlockInfo};
use ferrocuda_types::{
    AllocatorSettings, DevicePtr, DeviceStats, Frame, IntervalMib, PoolId, PoolKind, Snapshot,
    SnapshotBlock, SnapshotSegment, TraceEntry,
};
use rustc_hash::FxHashMap;

impl CachingAllocator {
    /// The segments with their blocks (one segment per contiguous mapped run of an
    /// expandable segment) and the recorded history, as `torch.cuda.memory._snapshot()`
    /// has them. Taking a snapshot records a `snapshot` event.
    pub fn snapshot(&self) -> (Vec<SnapshotSegment>, Vec<TraceEntry>) {
        let mut st = self.engine.lock();
        let state_of = |b: &Block| {
            if b.allocated {
                "active_allocated"
            } else if b.event_count > 0 {
                "active_pending_free"
            } else {
                "inactive"
            }
        };
        let mut segments = Vec::new();
        for (head, b) in st.blocks.iter().enumerate() {
            let starts_run =
                !b.vacant && b.mapped && b.prev.get().is_none_or(|p| !st.blocks[p].mapped);
            if !starts_run {
                continue;
            }
            let mut seg = SnapshotSegment {
                device: self.engine.device.0,
                address: b.ptr,
                total_size: 0,
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                stream: b.stream,
                segment_type: if b.pool == PoolKind::Small {
                    "small"
                } else {
                    "large"
                }
                .into(),
                segment_pool_id: (b.pool_id.0, b.pool_id.1),
                is_expandable: b.segment.is_some(),
                asleep: st.paged.asleep_at(b.ptr),
                frames: st.history.segment_frames(b.ptr),
                blocks: Vec::new(),
            };
            let mut cursor = Some(head);
            while let Some(i) = cursor.filter(|&i| st.blocks[i].mapped) {
                let x = &st.blocks[i];
                let active = x.allocated || x.event_count > 0;
                seg.total_size += x.size;
                if x.allocated {
                    seg.allocated_size += x.size;
                }
                if active {
                    seg.active_size += x.size;
                    seg.requested_size += x.requested;
                }
                seg.blocks.push(SnapshotBlock {
                    address: x.ptr,
                    size: x.size,
                    requested_size: x.requested,
                    state: state_of(x).into(),
                    frames: x
                        .frames
                        .as_deref()
                        .map(<[Frame]>::to_vec)
                        .unwrap_or_default(),
                });
                cursor = x.next.get();
            }
            segments.push(seg);
        }
        segments.sort_by_key(|s| s.address);
        // The trace is copied before the `snapshot` entry is recorded, so that entry shows
        // in the next snapshot only (PyTorch's `NativeCachingAllocator::snapshot`).
        let trace = st.history.entries();
        let active = st.stats.active_bytes().current() as u64;
        st.history.record("snapshot", 0, active, 0, None);
        (segments, trace)
    }

    /// This device's snapshot as `torch.cuda.memory._snapshot()` writes it (the other
    /// devices' traces empty): what [`Snapshot::to_pickle`] saves for PyTorch's viewer and
    /// `ferrocuda summary`, `plot` and `plan`.
    pub fn device_snapshot(&self) -> Snapshot {
        let (segments, trace) = self.snapshot();
        let device = usize::from(self.device().0);
        let mut device_traces = vec![Vec::new(); device + 1];
        device_traces[device] = trace;
        Snapshot {
            segments,
            device_traces,
            allocator_settings: self.allocator_settings(),
            external_annotations: Vec::new(),
        }
    }

    /// `allocator_settings` of a snapshot.
    pub fn allocator_settings(&self) -> AllocatorSettings {
        let c = self.engine.lock().config.clone();
        AllocatorSettings {
            conf: c.settings_text.as_str().to_owned(),
            max_split_size: c.sizes.max_split_size.map_or(-1, |m| m as i64),
            garbage_collection_threshold: c.release.garbage_collection_threshold,
            expandable_segments: c.expandable.enabled,
            pinned_num_register_threads: c.pinned.num_register_threads,
            release_lock_on_cudamalloc: c.release_lock_on_cudamalloc,
            pinned_use_cuda_host_register: c.pinned.use_cuda_host_register,
            graph_capture_record_stream_reuse: c.reuse.graph_capture_record_stream_reuse,
            roundup_power2_divisions: c
                .sizes
                .roundup_power2_divisions
                .iter()
                .enumerate()
                .map(|(i, d)| (IntervalMib(1u64 << i), *d))
                .collect(),
        }
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> DeviceStats {
        self.engine.lock().stats.snapshot()
    }

    /// `reset_peak_memory_stats`.
    pub fn reset_peak_stats(&self) {
        self.engine.lock().stats.reset_peak();
    }

    /// `reset_accumulated_memory_stats`.
    pub fn reset_accumulated_stats(&self) {
        self.engine.lock().stats.reset_accumulated();
    }

    /// Every block, in address order per segment.
    pub fn blocks(&self) -> Vec<BlockInfo> {
        let st = self.engine.lock();
        let mut out = Vec::new();
        for (id, b) in st.blocks.iter().enumerate() {
            if b.prev.is_some() || b.vacant {
                continue;
            }
            let mut cursor = Some(id);
            while let Some(i) = cursor {
                let x = &st.blocks[i];
                out.push(BlockInfo {
                    ptr: DevicePtr(x.ptr),
                    size: x.size,
                    requested: x.requested,
                    pool: x.pool,
                    allocated: x.allocated,
                    pending_events: x.event_count > 0,
                    segment: DevicePtr(b.ptr),
                    stream: st.stream_handle(x.stream),
                    mapped: x.mapped,
                    expandable: x.segment.is_some(),
                    pool_id: x.pool_id,
                });
                cursor = x.next.get();
            }
        }
        out
    }

    /// Recounts everything from the blocks and compares with the books: no two blocks
    /// overlap, neighbours touch, the current statistics equal a recount, reserved bytes
    /// equal the sum of segments. For tests and debugging; `Err` says what differs.
    pub fn check_invariants(&self) -> Result<(), String> {
        let blocks = self.blocks();
        let st = self.engine.lock();
        let mut by_addr: Vec<&BlockInfo> = blocks.iter().collect();
        by_addr.sort_by_key(|b| b.ptr.0);
        for w in by_addr.windows(2) {
            if w[0].ptr.0 + w[0].size > w[1].ptr.0 {
                return Err(format!("blocks overlap: {:?} and {:?}", w[0], w[1]));
            }
        }
        let (mut want, segment_bytes) = recount(&blocks);
        // Pages unmapped for reuse by `expandable_segments_reclaim` are still reserved.
        for kind in [PoolKind::Small, PoolKind::Large] {
            want.reserved_bytes
                .increase(kind, st.expandable.spare_bytes(kind) as i64);
        }
        let have = st.stats.snapshot();
        for ((name, a), (_, b)) in have.arrays().into_iter().zip(want.arrays()) {
            for (pool, x, y) in [
                ("all", &a.all, &b.all),
                ("small", &a.small_pool, &b.small_pool),
                ("large", &a.large_pool, &b.large_pool),
            ] {
                if x.current != y.current {
                    return Err(format!(
                        "{name}.{pool}.current is {} but a recount gives {}",
                        x.current, y.current
                    ));
                }
            }
        }
        let spare: u64 = st
            .expandable
            .spare_pages
            .iter()
            .flatten()
            .map(|(_, p)| p)
            .sum();
        let reserved: u64 = segment_bytes + spare;
        if reserved != st.total_reserved {
            return Err(format!(
                "reserved {} but segments sum to {reserved}",
                st.total_reserved
            ));
        }
        // Every slot was just settled and dropped its credit (under the lock, none comes back).
        let credits = self.engine.cache.credits();
        if credits != 0 {
            return Err(format!(
                "{credits} credits outstanding after settling every slot"
            ));
        }
        st.blocks.check_addresses()?;
        let free = st.pools.len();
        let in_pool = st
            .blocks
            .iter()
            .enumerate()
            .filter(|&(id, b)| st.blocks.in_pool(id) && !b.vacant)
            .count();
        if free != in_pool {
            return Err(format!(
                "{free} keys in the free lists but {in_pool} blocks marked free"
            ));
        }
        Ok(())
    }

    // ---- allocate ------------------------------------------------------------------------

    /// The bytes `pool`'s segments hold mapped: what the pool reserves (what
    /// [`plan_pool`](crate::plan_pool) predicts for a capture's pool).
    pub fn pool_reserved_bytes(&self, pool: PoolId) -> u64 {
        self.pool_segments(pool).iter().sum()
    }

    /// Each of `pool`'s segments' mapped bytes, by address (in a plan, whose device hands
    /// out ascending addresses and which frees no segment, the order they were taken).
    pub(crate) fn pool_segments(&self, pool: PoolId) -> Vec<u64> {
        let mut segments: std::collections::BTreeMap<u64, u64> = Default::default();
        for b in self.pool_blocks(pool).iter().filter(|b| b.mapped) {
            *segments.entry(b.segment.0).or_default() += b.size;
        }
        segments.into_values().collect()
    }

    /// The blocks of `pool`, by segment.
    pub fn pool_blocks(&self, pool: PoolId) -> Vec<BlockInfo> {
        self.blocks()
            .into_iter()
            .filter(|b| b.pool_id == pool)
            .collect()
    }
}

/// The current statistics a recount of `blocks` gives (spare pages aside), and the bytes
/// of their segments.
fn recount(blocks: &[BlockInfo]) -> (DeviceStats, u64) {
    let mut want = DeviceStats::default();
    // (pool, mapped bytes, blocks, expandable) per segment.
    let mut segments: FxHashMap<u64, (PoolKind, u64, usize, bool)> = FxHashMap::default();
    for b in blocks {
        let seg = segments
            .entry(b.segment.0)
            .or_insert((b.pool, 0, 0, b.expandable));
        if b.mapped {
            seg.1 += b.size;
        }
        seg.2 += 1;
    }
    for b in blocks.iter().filter(|b| b.mapped) {
        // Expandable blocks never count as inactive splits.
        let split = !b.expandable && segments.get(&b.segment.0).is_some_and(|s| s.2 > 1);
        if b.allocated {
            want.allocation.increase(b.pool, 1);
            want.allocated_bytes.increase(b.pool, b.size as i64);
        }
        if b.allocated || b.pending_events {
            want.active.increase(b.pool, 1);
            want.active_bytes.increase(b.pool, b.size as i64);
            want.requested_bytes.increase(b.pool, b.requested as i64);
        } else if split {
            want.inactive_split.increase(b.pool, 1);
            want.inactive_split_bytes.increase(b.pool, b.size as i64);
        }
    }
    for (kind, size, _, expandable) in segments.values() {
        // Expandable memory counts as reserved, but not as segments (PyTorch's rule).
        if !expandable {
            want.segment.increase(*kind, 1);
        }
        want.reserved_bytes.increase(*kind, *size as i64);
    }
    let bytes = segments.values().map(|s| s.1).sum();
    (want, bytes)
}
