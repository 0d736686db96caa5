//! The stream-ordered allocator on the fake device (`cuMemAllocAsync`, `cuMemFreeAsync`,
//! the default pool's attributes, `cuMemPoolTrimTo`): one pool per device.
//!
//! The pool holds blocks of device memory (each a fake `cuMemAlloc` of the request rounded
//! up to 2 MiB; blocks are not split). A free is stream-ordered: the block is reusable at
//! once by an allocation on the stream it was freed on, and by one on another stream only
//! once the work enqueued on the freeing stream before the free has completed (CUDA's
//! opportunistic reuse; event dependencies are not followed). An allocation takes the
//! smallest reusable block that fits (the lowest address among equals), else a new block.
//! Unused completed blocks stay reserved until a trim, or until reserved memory exceeds
//! the release threshold (checked at every pool act: the real driver checks at
//! synchronizations). `used` counts block sizes; the highs follow `reserved` and `used`.
//!
//! On a capturing stream, `cuMemAllocAsync` and `cuMemFreeAsync` become graph memory
//! nodes (CUDA's "graph memory nodes"): the memory is the graph's, outside the default pool
//! and its usage, at an address fixed for the graph's life and kept mapped (CUDA's graph
//! memory pool keeps it until a trim). A captured free must name graph memory. Graph
//! memory is live from its capture (or a launch of its graph) until a free node runs or
//! `cuMemFreeAsync` frees it outside the graph; a launch makes it live again, as
//! `CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH` frees and re-allocates it.
use super::work::{Node, Work};
use super::{State, StreamKey};
use crate::{DriverError, MemPoolUsage};
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use std::collections::HashMap;

/// Blocks are whole multiples of this.
const BLOCK: u64 = 2 << 20;

/// A block given back and not yet released.
#[derive(Copy, Clone, Debug)]
struct Freed {
    ptr: DevicePtr,
    bytes: u64,
    stream: StreamKey,
    /// Reusable on other streams once `stream` has completed this many items.
    seq: u64,
}

/// One device's default pool.
#[derive(Debug, Default)]
pub(super) struct Pool {
    /// CUDA's default pool starts with a release threshold of 0.
    threshold: u64,
    usage: MemPoolUsage,
    /// Live blocks: address → size.
    live: HashMap<u64, u64>,
    freed: Vec<Freed>,
    /// Graph memory made on this device: address → whether it is allocated now.
    graph: HashMap<u64, bool>,
}

impl Pool {
    fn grow(&mut self, bytes: u64) {
        self.usage.reserved += bytes;
        self.usage.reserved_high = self.usage.reserved_high.max(self.usage.reserved);
    }

    fn take(&mut self, ptr: DevicePtr, bytes: u64) {
        self.live.insert(ptr.0, bytes);
        self.usage.used += bytes;
        self.usage.used_high = self.usage.used_high.max(self.usage.used);
    }
}

fn pool(st: &mut State, dev: DeviceIndex) -> Result<&mut Pool, DriverError> {
    st.check_device(dev)?;
    if st.pools.len() < st.devices {
        st.pools.resize_with(st.devices, Pool::default);
    }
    st.pools
        .get_mut(dev.as_usize())
        .ok_or(DriverError::INVALID_DEVICE)
}

/// Whether the free `f` may be reused by work on `on`.
fn reusable(st: &State, f: &Freed, on: StreamKey) -> bool {
    f.stream == on || st.is_done(f.stream, f.seq)
}

/// Releases completed free blocks, largest first, while `keep` is exceeded.
fn release_down_to(st: &mut State, dev: DeviceIndex, keep: u64) -> Result<(), DriverError> {
    let freed = pool(st, dev)?.freed.clone();
    let mut candidates: Vec<Freed> = freed
        .into_iter()
        .filter(|f| st.is_done(f.stream, f.seq))
        .collect();
    candidates.sort_by_key(|f| (std::cmp::Reverse(f.bytes), f.ptr.0));
    for f in candidates {
        if pool(st, dev)?.usage.reserved <= keep {
            break;
        }
        st.memory.free(dev, f.ptr)?;
        let p = pool(st, dev)?;
        p.freed.retain(|g| g.ptr != f.ptr);
        p.usage.reserved -= f.bytes;
    }
    Ok(())
}

fn apply_threshold(st: &mut State, dev: DeviceIndex) -> Result<(), DriverError> {
    let threshold = pool(st, dev)?.threshold;
    release_down_to(st, dev, threshold)
}

pub(super) fn alloc_async(
    st: &mut State,
    dev: DeviceIndex,
    bytes: u64,
    stream: StreamHandle,
) -> Result<DevicePtr, DriverError> {
    let key = st.stream_key(stream)?;
    if stream.device != dev || bytes == 0 {
        return Err(DriverError::INVALID_VALUE);
    }
    apply_threshold(st, dev)?;
    let want = bytes.div_ceil(BLOCK).saturating_mul(BLOCK);
    if capturing(st, key) {
        return alloc_in_capture(st, dev, want, key);
    }
    let freed = pool(st, dev)?.freed.clone();
    let best = freed
        .iter()
        .enumerate()
        .filter(|(_, f)| f.bytes >= want && reusable(st, f, key))
        .min_by_key(|(_, f)| (f.bytes, f.ptr.0))
        .map(|(i, _)| i);
    let p = pool(st, dev)?;
    let (ptr, size) = match best {
        Some(i) => {
            let f = p.freed.swap_remove(i);
            (f.ptr, f.bytes)
        }
        None => {
            let ptr = st.memory.malloc(dev, want)?;
            pool(st, dev)?.grow(want);
            (ptr, want)
        }
    };
    pool(st, dev)?.take(ptr, size);
    Ok(ptr)
}

fn capturing(st: &State, key: StreamKey) -> bool {
    st.streams.get(&key).is_some_and(|s| s.capture.is_some())
}

/// A captured `cuMemAllocAsync`: a graph memory node and its memory.
fn alloc_in_capture(
    st: &mut State,
    dev: DeviceIndex,
    bytes: u64,
    key: StreamKey,
) -> Result<DevicePtr, DriverError> {
    let ptr = st.memory.malloc(dev, bytes)?;
    let node = Work::GraphMemory {
        device: dev,
        ptr,
        alloc: true,
    };
    if let Err(e) = st.enqueue(key, node) {
        st.memory.free(dev, ptr)?;
        return Err(e);
    }
    pool(st, dev)?.graph.insert(ptr.0, true);
    Ok(ptr)
}

/// `cuMemFreeAsync` of graph memory: a free node while capturing, else a free of what
/// the graph's last launch (or its capture) allocated.
fn free_graph_memory(
    st: &mut State,
    ptr: DevicePtr,
    dev: DeviceIndex,
    key: StreamKey,
) -> Result<(), DriverError> {
    if pool(st, dev)?.graph.get(&ptr.0) != Some(&true) {
        return Err(DriverError::INVALID_VALUE);
    }
    if capturing(st, key) {
        let node = Work::GraphMemory {
            device: dev,
            ptr,
            alloc: false,
        };
        st.enqueue(key, node)?;
    }
    pool(st, dev)?.graph.insert(ptr.0, false);
    Ok(())
}

/// A launch runs the graph's memory nodes: each allocation it makes is live again (an
/// unfreed one from the last launch is freed first, as auto-free-on-launch does), each
/// free it makes ends one.
pub(super) fn launch_graph_memory(st: &mut State, nodes: &[Node]) -> Result<(), DriverError> {
    for node in nodes {
        if let Work::GraphMemory { device, ptr, alloc } = node.work
            && let Some(live) = pool(st, device)?.graph.get_mut(&ptr.0)
        {
            *live = alloc;
        }
    }
    Ok(())
}

pub(super) fn free_async(
    st: &mut State,
    ptr: DevicePtr,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let key = st.stream_key(stream)?;
    let dev = stream.device;
    if pool(st, dev)?.graph.contains_key(&ptr.0) {
        return free_graph_memory(st, ptr, dev, key);
    }
    if capturing(st, key) {
        // A captured free becomes a free node, which can free graph memory only.
        return Err(DriverError::INVALID_VALUE);
    }
    let seq = st.streams.get(&key).map_or(0, |s| s.enqueued);
    let p = pool(st, dev)?;
    let bytes = p.live.remove(&ptr.0).ok_or(DriverError::INVALID_VALUE)?;
    p.usage.used -= bytes;
    p.freed.push(Freed {
        ptr,
        bytes,
        stream: key,
        seq,
    });
    apply_threshold(st, dev)
}

pub(super) fn set_release_threshold(
    st: &mut State,
    dev: DeviceIndex,
    bytes: u64,
) -> Result<(), DriverError> {
    pool(st, dev)?.threshold = bytes;
    Ok(())
}

pub(super) fn usage(st: &mut State, dev: DeviceIndex) -> Result<MemPoolUsage, DriverError> {
    apply_threshold(st, dev)?;
    Ok(pool(st, dev)?.usage)
}

pub(super) fn reset_peaks(st: &mut State, dev: DeviceIndex) -> Result<(), DriverError> {
    let u = &mut pool(st, dev)?.usage;
    u.reserved_high = u.reserved;
    u.used_high = u.used;
    Ok(())
}

pub(super) fn trim_to(st: &mut State, dev: DeviceIndex, keep: u64) -> Result<(), DriverError> {
    release_down_to(st, dev, keep)
}
