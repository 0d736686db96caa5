//! `oom_forensics:<path>` (ferrocuda's own key): what an out-of-memory error adds when it is
//! set. PyTorch's message has asked for fragmentation figures since 2019 (pytorch#29554);
//! with this key the error also carries, and prints after PyTorch's message:
//! - the cached free memory per (pool, small or large, stream): bytes, blocks, the largest;
//! - what `empty_cache()` would give back, and the largest request on the failed stream
//!   that would then succeed;
//! - the five largest live blocks, with their allocation sites when history records stacks;
//! - a snapshot written to the path (`torch.cuda.memory._dump_snapshot`'s format, which
//!   PyTorch's viewer and `ferrocuda summary` read).
//!
//! All of it is gathered after the error is made, on the error path only: the allocation
//! path and PyTorch's message are unchanged, and so is everything the observers saw.
use crate::allocator::CachingAllocator;
use crate::error::AllocError;
use crate::state::State;
use ferrocuda_types::{
    FreeCache, LiveBlock, OomForensics, OutOfMemory, PoolId, PoolKind, Snapshot, StreamHandle,
};
use rustc_hash::FxHashMap;

/// Live blocks listed, at most.
const LIVE_LISTED: usize = 5;

impl CachingAllocator {
    /// With `oom_forensics` set, an out-of-memory error for a request on `stream` gains its
    /// [`OomForensics`] and the snapshot is written; any other error is returned as it is.
    pub(crate) fn with_forensics(&self, e: AllocError, stream: StreamHandle) -> AllocError {
        let AllocError::OutOfMemory(mut report) = e else {
            return e;
        };
        let path = self.engine.lock().config.release.oom_forensics.clone();
        if let Some(path) = path.filter(|_| !report.beyond_one_exabyte) {
            let mut figures = self.forensics(&report, stream);
            figures.snapshot = self.write_oom_snapshot(&path);
            report.forensics = Some(Box::new(figures));
        }
        AllocError::OutOfMemory(report)
    }

    /// The figures, with no snapshot yet.
    fn forensics(&self, report: &OutOfMemory, stream: StreamHandle) -> OomForensics {
        let st = self.engine.lock();
        let mut free: FxHashMap<(PoolId, PoolKind, u64), FreeCache> = FxHashMap::default();
        let (mut releasable, mut kept_on_stream) = (0, 0);
        for k in st.pools.keys() {
            let b = &st.blocks[k.id];
            let c = free.entry((k.pool, b.pool, k.stream)).or_insert(FreeCache {
                pool: (k.pool.0, k.pool.1),
                small: b.pool == PoolKind::Small,
                stream: st.stream_handle(k.stream),
                bytes: 0,
                blocks: 0,
                largest: 0,
            });
            c.bytes += b.size;
            c.blocks += 1;
            c.largest = c.largest.max(b.size);
            let given_back = released_by_empty_cache(&st, k.id, k.pool);
            releasable += given_back;
            if k.pool.is_default() && k.stream == stream.raw && given_back == 0 {
                kept_on_stream = kept_on_stream.max(b.size);
            }
        }
        let mut free: Vec<FreeCache> = free.into_values().collect();
        free.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.stream.raw.cmp(&b.stream.raw)));
        let reserved_after = report.reserved.saturating_sub(releasable);
        let room = st
            .allowed_max
            .map_or(u64::MAX, |a| a.saturating_sub(reserved_after));
        let new_segment = report.device_free.saturating_add(releasable).min(room);
        let mut live: Vec<LiveBlock> = st
            .blocks
            .iter()
            .filter(|b| !b.vacant && b.allocated)
            .map(|b| LiveBlock {
                ptr: b.ptr,
                size: b.size,
                stream: st.stream_handle(b.stream),
                frames: b.frames.as_deref().map(<[_]>::to_vec).unwrap_or_default(),
            })
            .collect();
        live.sort_by(|a, b| b.size.cmp(&a.size).then(a.ptr.cmp(&b.ptr)));
        live.truncate(LIVE_LISTED);
        OomForensics {
            free,
            releasable,
            largest_after_release: new_segment.max(kept_on_stream),
            largest_live: live,
            snapshot: Err("not written yet".into()),
        }
    }

    /// Writes this device's snapshot to `path`: where it went, or why not.
    fn write_oom_snapshot(&self, path: &str) -> Result<String, String> {
        let (segments, trace) = self.snapshot();
        let device = usize::from(self.device().0);
        let mut device_traces = vec![Vec::new(); device + 1];
        device_traces[device] = trace;
        let snapshot = Snapshot {
            segments,
            device_traces,
            allocator_settings: self.allocator_settings(),
            external_annotations: Vec::new(),
        };
        let bytes = snapshot.to_pickle()?;
        std::fs::write(path, bytes).map_err(|e| format!("{path}: {e}"))?;
        Ok(path.to_owned())
    }
}

/// Bytes of free block `id` (of `pool`) that `empty_cache()` gives back: a whole free
/// segment of a pool that may release, or the whole pages inside a free piece of an
/// expandable segment.
fn released_by_empty_cache(st: &State, id: usize, pool: PoolId) -> u64 {
    let b = &st.blocks[id];
    if !st.private.releasable(pool) {
        return 0;
    }
    match st.expandable.page_of(&st.blocks, id) {
        Some(page) if page > 0 => {
            let first = b.ptr.div_ceil(page) * page;
            let end = (b.ptr + b.size) / page * page;
            end.saturating_sub(first)
        }
        _ if b.is_whole_segment() => b.size,
        _ => 0,
    }
}
