//! A sleepable pool's segments as the driver sees them: an address range with physical
//! memory mapped under it in pieces, made, unmapped and given back here.
use super::reports::SleepStats;
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{DeviceIndex, DevicePtr, HostPtr, PhysHandle, PoolId, StreamHandle, VaRange};
use rustc_hash::FxHashMap;

/// Bytes each copy of an offload or a restore moves, and a restore's piece of physical
/// memory.
pub(super) const CHUNK: u64 = 64 << 20;

/// A segment of a sleepable pool: its address range, and its physical memory while awake.
/// (A sleep or wake works on a copy taken with the lock held, the pool marked changing.)
#[derive(Clone, Debug)]
pub(crate) struct PagedSegment {
    pub(super) pool: PoolId,
    pub(super) va: VaRange,
    /// Its physical memory, in pieces mapped one after the other from the range's start
    /// (none while asleep).
    pub(super) pages: Vec<Piece>,
    pub(super) offload: Option<Offload>,
    /// Physical memory unmapped by a sleep whose destroy failed: the next wake destroys it
    /// before mapping new memory.
    pub(super) stale: Vec<PhysHandle>,
    /// The pinned buffer of its last offload, kept for the next one while awake: pinning
    /// and unpinning a GiB costs more than copying it.
    pub(super) spare: Option<HostPtr>,
}

/// Physical memory mapped under part of a segment: its length and handle.
pub(super) type Piece = (u64, PhysHandle);

/// A sleeping segment's contents in pinned host memory.
#[derive(Copy, Clone, Debug)]
pub(super) struct Offload {
    pub(super) host: HostPtr,
    pub(super) checksum: Option<u64>,
}

/// The segments of sleepable pools, by address.
#[derive(Debug, Default)]
pub(crate) struct PagedSegments {
    pub(super) segments: FxHashMap<u64, PagedSegment>,
}

impl PagedSegment {
    /// Its address.
    pub(crate) fn base(&self) -> DevicePtr {
        self.va.base
    }
}

impl PagedSegments {
    /// Books a new segment.
    pub(crate) fn insert(&mut self, segment: PagedSegment) {
        self.segments.insert(segment.va.base.0, segment);
    }

    /// The segment at `ptr`, taken out of the books (it is being given back).
    pub(crate) fn take(&mut self, ptr: u64) -> Option<PagedSegment> {
        self.segments.remove(&ptr)
    }

    pub(super) fn of_pool(&self, pool: PoolId) -> impl Iterator<Item = &PagedSegment> {
        self.segments.values().filter(move |s| s.pool == pool)
    }

    /// What is asleep, `pools` of them pools.
    pub(crate) fn stats(&self, pools: usize) -> SleepStats {
        let mut stats = SleepStats {
            pools,
            ..SleepStats::default()
        };
        for s in self.segments.values() {
            stats.spare_host_bytes += s.spare.map_or(0, |h| h.bytes);
            if s.pages.is_empty() {
                stats.segments += 1;
                stats.bytes += s.va.bytes;
                stats.offloaded_bytes += s.offload.map_or(0, |o| o.host.bytes);
            }
        }
        stats
    }

    /// Whether the segment at `ptr` has no pages now.
    pub(crate) fn asleep_at(&self, ptr: u64) -> bool {
        self.segments.get(&ptr).is_some_and(|s| s.pages.is_empty())
    }
}

/// A new segment of `bytes` from the driver's virtual memory API (the range and the physical
/// memory rounded up to the mapping granularity). Undone in full on failure.
pub(crate) fn map_segment(
    driver: &dyn Driver,
    device: DeviceIndex,
    bytes: u64,
    pool: PoolId,
) -> Result<PagedSegment, DriverError> {
    let granularity = driver.vm_granularity(device)?;
    let va = driver.vm_reserve(device, bytes.div_ceil(granularity) * granularity)?;
    match map_pages(driver, va) {
        Ok(handle) => Ok(PagedSegment {
            pool,
            va,
            pages: vec![(va.bytes, handle)],
            offload: None,
            stale: Vec::new(),
            spare: None,
        }),
        Err(e) => {
            let _ = driver.vm_release(va);
            Err(e)
        }
    }
}

/// Physical memory for all of `va`, mapped and made accessible. Undone on failure.
fn map_pages(driver: &dyn Driver, va: VaRange) -> Result<PhysHandle, DriverError> {
    let handle = driver.vm_create(va.device, va.bytes)?;
    map_handle(driver, va, handle).inspect_err(|_| {
        let _ = driver.vm_destroy(handle);
    })?;
    Ok(handle)
}

/// Maps `handle` over all of `va` and makes it accessible; unmapped again on failure (the
/// handle stays the caller's).
fn map_handle(driver: &dyn Driver, va: VaRange, handle: PhysHandle) -> Result<(), DriverError> {
    driver.vm_map(va.base, handle)?;
    driver
        .vm_set_access(va.device, va.base, va.bytes)
        .inspect_err(|_| {
            let _ = driver.vm_unmap(va.device, va.base, va.bytes);
        })
}

/// Unmaps all of `va` (nothing changes if that fails), then destroys each of `pieces`;
/// returns the handles whose destroy failed, with the first such error.
pub(super) fn unmap_pieces(
    driver: &dyn Driver,
    va: VaRange,
    pieces: &[Piece],
) -> Result<(Vec<PhysHandle>, Option<DriverError>), DriverError> {
    driver.vm_unmap(va.device, va.base, va.bytes)?;
    let mut stale = Vec::new();
    let mut first = None;
    for &(_, handle) in pieces {
        if let Err(e) = driver.vm_destroy(handle) {
            stale.push(handle);
            first.get_or_insert(e);
        }
    }
    Ok((stale, first))
}

/// Maps new physical memory under all of `m`'s range, in pieces of [`CHUNK`] bytes when
/// its contents come back (each piece's copy enqueued on `stream` as soon as it is mapped,
/// so mapping the next overlaps the copy), else in one. Undone on failure.
pub(super) fn map_pieces(
    driver: &dyn Driver,
    m: &PagedSegment,
    stream: Option<StreamHandle>,
) -> Result<Vec<Piece>, DriverError> {
    let va = m.va;
    let granularity = driver.vm_granularity(va.device)?;
    let piece = match (m.offload, stream) {
        (Some(_), Some(_)) => (CHUNK / granularity).max(1) * granularity,
        _ => va.bytes,
    };
    let mut pieces: Vec<Piece> = Vec::new();
    let mut at = 0;
    while at < va.bytes {
        let n = piece.min(va.bytes - at);
        let sub = VaRange {
            base: DevicePtr(va.base.0 + at),
            bytes: n,
            ..va
        };
        let mapped = map_pages(driver, sub).and_then(|handle| {
            pieces.push((n, handle));
            match (m.offload, stream) {
                (Some(o), Some(stream)) => {
                    driver.memcpy_htod_pinned_async(sub.base, (o.host, at), n, stream)
                }
                _ => Ok(()),
            }
        });
        if let Err(e) = mapped {
            if !pieces.is_empty() {
                let done = VaRange {
                    bytes: pieces.iter().map(|(n, _)| n).sum(),
                    ..va
                };
                let _ = unmap_pieces(driver, done, &pieces);
            }
            return Err(e);
        }
        at += n;
    }
    Ok(pieces)
}

/// Gives a segment of a sleepable pool back: its pages (if mapped), its address range and
/// its host copy (if asleep with one). Failures leave the address unusable, as a failed
/// `cudaFree` does; the segment was already out of the books.
pub(crate) fn give_back(driver: &dyn Driver, segment: PagedSegment) {
    if !segment.pages.is_empty() {
        let _ = unmap_pieces(driver, segment.va, &segment.pages);
    }
    for handle in segment.stale {
        let _ = driver.vm_destroy(handle);
    }
    if let Some(host) = segment.spare {
        let _ = driver.host_free(host);
    }
    if let Some(o) = segment.offload {
        let _ = driver.host_free(o.host);
    }
    let _ = driver.vm_release(segment.va);
}
