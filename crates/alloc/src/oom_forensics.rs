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
    FreeCache, LiveBlock, OomForensics, OutOfMemory, PoolId, PoolKind, StreamHandle,
};
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Live blocks listed, at most.
const LIVE_LISTED: usize = 5;

impl CachingAllocator {
    /// With `oom_forensics` set, an out-of-memory error for a request on `stream` gains its
    /// [`OomForensics`] and the snapshot is written; any other error is returned as it is.
    #[cold]
    #[inline(never)]
    pub(crate) fn with_forensics(&self, e: AllocError, stream: StreamHandle) -> AllocError {
        let AllocError::OutOfMemory(mut report) = e else {
            return e;
        };
        // A plain read of the setting: the settling lock would act on the thread cache and
        // reclaim marks, which must stay as PyTorch's path left them when the key is off.
        let path = self
            .engine
            .state
            .lock()
            .state
            .config
            .release
            .oom_forensics
            .clone();
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
        }
        let mut free: Vec<FreeCache> = free.into_values().collect();
        free.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.stream.raw.cmp(&b.stream.raw)));
        let after = after_empty_cache(&st, stream.raw);
        let reserved_after = report.reserved.saturating_sub(after.releasable);
        let room = st
            .allowed_max
            .map_or(u64::MAX, |a| a.saturating_sub(reserved_after));
        let new_segment = report
            .device_free
            .saturating_add(after.releasable)
            .min(room);
        let mut live: Vec<LiveBlock> = if self.caching {
            st.blocks
                .iter()
                .filter(|b| !b.vacant && b.allocated)
                .map(|b| LiveBlock {
                    ptr: b.ptr,
                    size: b.size,
                    stream: st.stream_handle(b.stream),
                    frames: b.frames.as_deref().map(<[_]>::to_vec).unwrap_or_default(),
                })
                .collect()
        } else {
            // Without caching every allocation is the driver's, known only by its address.
            self.uncached
                .lock()
                .iter()
                .map(|(&ptr, &(size, s))| LiveBlock {
                    ptr,
                    size,
                    stream: st.stream_handle(s),
                    frames: Vec::new(),
                })
                .collect()
        };
        live.sort_by(|a, b| b.size.cmp(&a.size).then(a.ptr.cmp(&b.ptr)));
        live.truncate(LIVE_LISTED);
        OomForensics {
            free,
            releasable: after.releasable,
            largest_after_release: new_segment.max(after.kept_on_stream),
            largest_live: live,
            snapshot: Err("not written yet".into()),
        }
    }

    /// Writes this device's snapshot to `path`: where it went, or why not. Written to a
    /// file of its own beside `path` and renamed over it, so that errors on several
    /// threads at once leave one whole snapshot there, never two interleaved.
    fn write_oom_snapshot(&self, path: &str) -> Result<String, String> {
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let snapshot = self.device_snapshot();
        let bytes = snapshot.to_pickle()?;
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let partial = format!("{path}.{}.{n}.partial", std::process::id());
        std::fs::write(&partial, bytes)
            .and_then(|()| std::fs::rename(&partial, path))
            .map_err(|e| {
                let _ = std::fs::remove_file(&partial);
                format!("{path}: {e}")
            })?;
        Ok(path.to_owned())
    }
}

/// What `empty_cache()` would leave: it waits for every pending event first, so blocks
/// freed behind `record_stream` count as free (and merge with their free neighbours).
struct AfterEmptyCache {
    /// Bytes it gives back: whole free segments of pools that may release, and the whole
    /// pages inside free runs of expandable segments.
    releasable: u64,
    /// The largest free run it keeps in the default pool on the failed request's stream.
    kept_on_stream: u64,
}

/// Walks every segment (an ordinary one, or an expandable segment's mapped runs), treating
/// every block not allocated as free.
fn after_empty_cache(st: &State, stream: u64) -> AfterEmptyCache {
    let mut out = AfterEmptyCache {
        releasable: 0,
        kept_on_stream: 0,
    };
    for (head, b) in st.blocks.iter().enumerate() {
        let starts = !b.vacant && b.mapped && b.prev.get().is_none_or(|p| !st.blocks[p].mapped);
        if !starts {
            continue;
        }
        let releases = st.private.releasable(b.pool_id);
        let keeps_here = b.pool_id.is_default() && b.stream == stream;
        let expandable = st.expandable.segment_of(&st.blocks, head);
        let (mut whole_free, mut total) = (true, 0);
        let mut run: Option<(u64, u64)> = None;
        let mut cursor = Some(head);
        let close = |run: &mut Option<(u64, u64)>, out: &mut AfterEmptyCache| {
            let Some((start, len)) = run.take() else {
                return;
            };
            match expandable {
                Some(seg) if releases && seg.page > 0 => {
                    let base = seg.va.base.0;
                    let first = base + (start - base).div_ceil(seg.page) * seg.page;
                    let end = base + (start + len - base) / seg.page * seg.page;
                    out.releasable += end.saturating_sub(first);
                }
                _ if keeps_here => out.kept_on_stream = out.kept_on_stream.max(len),
                _ => {}
            }
        };
        while let Some(i) = cursor.filter(|&i| st.blocks[i].mapped) {
            let x = &st.blocks[i];
            total += x.size;
            if x.allocated {
                whole_free = false;
                close(&mut run, &mut out);
            } else {
                let r = run.get_or_insert((x.ptr, 0));
                r.1 += x.size;
            }
            cursor = x.next.get();
        }
        if expandable.is_none() && whole_free && releases {
            out.releasable += total;
        } else {
            close(&mut run, &mut out);
        }
    }
    out
}
