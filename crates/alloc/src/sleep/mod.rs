//! Sleep and wake of a sleepable private pool (ferrocuda's own; PyTorch has no counterpart):
//! the pool's physical pages are released and mapped again at the same addresses, their
//! contents discarded or kept in pinned host memory meanwhile.
//!
//! Design choices:
//! - A sleepable pool takes each segment from the driver's virtual memory API (an address
//!   range reserved, one physical allocation mapped over it) instead of `cudaMalloc`, so
//!   that the physical memory can go while the addresses stay: pointers held by the user and
//!   by CUDA graphs captured over the pool stay valid across a sleep. The caching allocator
//!   splits, caches and counts those segments as any other; PyTorch's statistics do not
//!   change when a pool sleeps (the segments are still reserved by the allocator), and
//!   [`SleepStats`] says what is asleep.
//! - Sleep and wake make their driver calls (a device synchronization, copies, unmapping and
//!   mapping) outside the allocator's lock, with the pool marked as changing: nothing is
//!   allocated from it (a typed error) or given back meanwhile.
//! - The offload copies on a stream of its own, in chunks, to one pinned buffer per
//!   segment, which the segment keeps after waking for its next offload (pinning and
//!   unpinning a GiB cost more than copying it; `free_host_buffers` gives them back). A
//!   wake that restores maps new physical memory in 64 MiB pieces and enqueues each piece's
//!   copy as soon as it is mapped, so making the next piece overlaps the copy (one 1 GiB
//!   physical allocation first, then the copy, ran at 0.88 of a plain pinned copy on an
//!   H200). The optional checksum (xxh3) is taken of the host copy, and on wake of the
//!   device's bytes read back after the restore.
pub(crate) mod pages;
pub(crate) mod reports;

pub use reports::{SleepError, SleepMode, SleepReport, SleepStats, WakeReport};

use crate::CachingAllocator;
use crate::engine::Engine;
use crate::error::AllocError;
use crate::private_pools::{SegmentSource, Wakefulness};
use crate::state::State;
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{DevicePtr, HostPtr, PhysHandle, PoolId, StreamFlags, StreamHandle, VaRange};
use pages::{CHUNK, Offload, PagedSegment, Piece, map_pieces, unmap_pieces};
use std::sync::atomic::Ordering;

impl CachingAllocator {
    /// Creates private pool `pool` with one user, its segments made so that they can sleep
    /// ([`CachingAllocator::sleep`]). Allocations reach it as any private pool's (routed by
    /// [`begin_allocate_to_pool`](CachingAllocator::begin_allocate_to_pool), or by a CUDA
    /// graph captured into it). A pool that exists already is [`AllocError::Pool`].
    pub fn create_sleepable_pool(&self, pool: PoolId) -> Result<(), AllocError> {
        self.engine
            .lock()
            .private
            .create_with_source(pool, SegmentSource::Sleepable)
    }

    /// Releases the physical memory of every segment of sleepable pool `pool`, keeping its
    /// addresses, after the device's work has completed (a device synchronization); with
    /// [`SleepMode::Offload`] the contents are copied to pinned host memory first. Until
    /// [`CachingAllocator::wake`], allocations routed to the pool fail with
    /// [`SleepError::Asleep`]; blocks of it may be freed.
    pub fn sleep(&self, pool: PoolId, mode: SleepMode) -> Result<SleepReport, AllocError> {
        let Some(moving) = self.begin_change(pool, Wakefulness::Awake, |s| !s.pages.is_empty())?
        else {
            return Err(SleepError::AlreadyAsleep(pool).into());
        };
        let engine = &self.engine;
        let result = offload(engine, &moving, mode)
            .and_then(|offloads| release_pages(&*engine.driver, &moving, offloads));
        let mut st = engine.lock();
        let (done, outcome) = match result {
            Ok((done, report)) => (done, Ok(report)),
            Err((e, done, _)) => (done, Err(e.into())),
        };
        for (base, outcome) in done {
            if let Some(s) = st.paged.segments.get_mut(&base) {
                match outcome {
                    Outcome::Asleep { offload, stale } => {
                        s.pages.clear();
                        s.offload = offload;
                        s.stale = stale;
                        s.spare = None;
                    }
                    Outcome::Awake { spare } => s.spare = spare,
                }
            }
        }
        // Partly asleep (an unmap failed) counts as asleep: wake maps what is missing.
        self.settle_wakefulness(&mut st, pool, outcome.is_ok());
        outcome
    }

    /// Maps new physical memory under every segment of sleepable pool `pool` at its old
    /// addresses and restores offloaded contents (checked against their checksum when the
    /// sleep took one). A pool that is awake wakes at no cost. On an error the segments not
    /// yet mapped stay asleep, and a later wake retries them.
    pub fn wake(&self, pool: PoolId) -> Result<WakeReport, AllocError> {
        // Waking a pool that is awake does nothing (and leaves its wakefulness alone: another
        // call may be about to put it to sleep).
        let Some(moving) = self.begin_change(pool, Wakefulness::Asleep, |s| s.pages.is_empty())?
        else {
            return Ok(WakeReport::default());
        };
        let engine = &self.engine;
        let mut report = WakeReport::default();
        let mut mapped: Vec<(PagedSegment, Vec<Piece>)> = Vec::new();
        let mut failure = None;
        let offloaded = moving.iter().any(|m| m.offload.is_some());
        let stream = match offloaded.then(|| side_stream(engine)) {
            Some(Err(e)) => {
                failure = Some(AllocError::from(e));
                None
            }
            Some(Ok(stream)) => Some(stream),
            None => None,
        };
        for m in moving.iter().filter(|_| failure.is_none()) {
            // (Memory a failed destroy kept goes first, so it is not held twice.)
            for h in &m.stale {
                let _ = engine.driver.vm_destroy(*h);
            }
            match map_pieces(&*engine.driver, m, stream) {
                Ok(pieces) => {
                    mapped.push((m.clone(), pieces));
                    report.segments += 1;
                    report.mapped_bytes += m.va.bytes;
                }
                Err(e) => {
                    failure = Some(AllocError::from(e));
                    break;
                }
            }
        }
        // A restore that fails unmaps the offloaded segments' new pages again: they stay
        // asleep with their host copies, for a later wake.
        let restored = restore(engine, pool, stream, &mapped, &mut report);
        if let Some(stream) = stream {
            let _ = engine.driver.stream_destroy(stream);
        }
        let unrestored: Vec<u64> = match &restored {
            Err(Unrestored::Copy(_)) => mapped
                .iter()
                .filter(|(m, pieces)| {
                    m.offload.is_some() && unmap_pieces(&*engine.driver, m.va, pieces).is_ok()
                })
                .map(|(m, _)| m.va.base.0)
                .collect(),
            _ => Vec::new(),
        };
        let mut st = engine.lock();
        for (m, pieces) in mapped {
            if let Some(s) = st.paged.segments.get_mut(&m.va.base.0) {
                s.stale.clear();
                if !unrestored.contains(&m.va.base.0) {
                    s.pages = pieces;
                    s.spare = s.offload.take().map(|o| o.host).or(s.spare);
                }
            }
        }
        self.settle_wakefulness(&mut st, pool, false);
        drop(st);
        match (failure, restored) {
            (Some(e), _) => Err(e),
            (None, Err(Unrestored::Copy(e))) => Err(e.into()),
            (None, Err(Unrestored::Mismatch(e))) => Err(e.into()),
            (None, Ok(())) => Ok(report),
        }
    }

    /// [`CachingAllocator::sleep`] of each of `pools` in turn, with one mode: a server's
    /// tags (weights, KV cache, graphs' pools) put to sleep together. Every pool is checked
    /// first, so one that is not sleepable or not awake (or named twice), or a capture
    /// underway, is refused before any sleeps; a driver failure part way leaves the pools before it asleep
    /// ([`CachingAllocator::pool_asleep`] says which).
    pub fn sleep_pools(
        &self,
        pools: &[PoolId],
        mode: SleepMode,
    ) -> Result<Vec<SleepReport>, AllocError> {
        {
            let st = self.engine.lock();
            for (i, &pool) in pools.iter().enumerate() {
                match self.may_change(&st, pool)? {
                    Wakefulness::Awake if !pools[..i].contains(&pool) => {}
                    Wakefulness::Changing => return Err(SleepError::Changing(pool).into()),
                    _ => return Err(SleepError::AlreadyAsleep(pool).into()),
                }
            }
        }
        pools.iter().map(|&pool| self.sleep(pool, mode)).collect()
    }

    /// [`CachingAllocator::wake`] of each of `pools`: every one is tried, and the first
    /// error (if any) is returned after the others were woken.
    pub fn wake_pools(&self, pools: &[PoolId]) -> Result<Vec<WakeReport>, AllocError> {
        let woken: Vec<Result<WakeReport, AllocError>> =
            pools.iter().map(|&pool| self.wake(pool)).collect();
        woken.into_iter().collect()
    }

    /// Gives back the pinned host buffers that `pool`'s awake segments kept from their last
    /// offload (a wake keeps them for the next sleep: pinning memory costs more than copying
    /// it). Returns the bytes freed; refused while the pool is being put to sleep or woken.
    pub fn free_host_buffers(&self, pool: PoolId) -> Result<u64, AllocError> {
        let spares: Vec<HostPtr> = {
            let mut st = self.engine.lock();
            // (A sleep under way copies into them outside the lock.)
            if st.private.wakefulness(pool) == Wakefulness::Changing {
                return Err(SleepError::Changing(pool).into());
            }
            st.paged
                .segments
                .values_mut()
                .filter(|s| s.pool == pool)
                .filter_map(|s| s.spare.take())
                .collect()
        };
        Ok(spares
            .into_iter()
            .map(|host| {
                let _ = self.engine.driver.host_free(host);
                host.bytes
            })
            .sum())
    }

    /// What is asleep.
    pub fn sleep_stats(&self) -> SleepStats {
        let st = self.engine.lock();
        st.paged.stats(st.private.not_awake())
    }

    /// Whether `pool` sleeps (or is being put to sleep or woken): its memory may not be
    /// used. A graph replay over the pool checks this first.
    pub fn pool_asleep(&self, pool: PoolId) -> bool {
        // (No lock while no pool sleeps: every replay asks.)
        if self.sleeping.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.engine.lock().private.wakefulness(pool) != Wakefulness::Awake
    }

    /// Sets `pool`'s wakefulness and the lock-free count of pools not awake (with the lock
    /// held, as every change of it is; a pool released while asleep leaves the count high
    /// until the next change, which only sends `pool_asleep` to the lock).
    fn set_wakefulness(&self, st: &mut State, pool: PoolId, to: Wakefulness) {
        st.private.set_wakefulness(pool, to);
        self.sleeping
            .store(st.private.not_awake(), Ordering::Release);
    }

    /// Ends a change of `pool`: asleep if any of its segments has no pages (or `asleep`
    /// says so regardless), else awake.
    fn settle_wakefulness(&self, st: &mut State, pool: PoolId, asleep: bool) {
        let asleep = asleep || st.paged.of_pool(pool).any(|s| s.pages.is_empty());
        let to = if asleep {
            Wakefulness::Asleep
        } else {
            Wakefulness::Awake
        };
        self.set_wakefulness(st, pool, to);
    }

    /// Whether `pool` may be put to sleep or woken now (caching on, the pool sleepable, no
    /// capture underway): its wakefulness if so.
    fn may_change(&self, st: &State, pool: PoolId) -> Result<Wakefulness, SleepError> {
        if !self.caching {
            return Err(SleepError::CachingOff(pool));
        }
        if !matches!(st.private.source(pool), SegmentSource::Sleepable) {
            return Err(SleepError::NotSleepable(pool));
        }
        if st.capturing() {
            return Err(SleepError::CaptureUnderway(pool));
        }
        Ok(st.private.wakefulness(pool))
    }

    /// Checks that `pool` can change from `from`, marks it changing and returns its
    /// segments that `select` picks; `None` (nothing marked) when it is awake and `from` is
    /// asleep.
    fn begin_change(
        &self,
        pool: PoolId,
        from: Wakefulness,
        select: impl Fn(&PagedSegment) -> bool,
    ) -> Result<Option<Vec<PagedSegment>>, AllocError> {
        let mut st = self.engine.lock();
        match (self.may_change(&st, pool)?, from) {
            (now, want) if now == want => {}
            (Wakefulness::Changing, _) => return Err(SleepError::Changing(pool).into()),
            (Wakefulness::Awake, _) => return Ok(None),
            _ => return Err(SleepError::AlreadyAsleep(pool).into()),
        }
        self.set_wakefulness(&mut st, pool, Wakefulness::Changing);
        let mut moving: Vec<PagedSegment> = st
            .paged
            .of_pool(pool)
            .filter(|s| select(s))
            .cloned()
            .collect();
        moving.sort_by_key(|m| m.va.base.0);
        Ok(Some(moving))
    }
}

/// A failed step of a sleep, with the segments already asleep and their report.
type SleepFailure = (DriverError, Vec<(u64, Outcome)>, SleepReport);

/// What a sleep left of a segment (by its address).
enum Outcome {
    /// Unmapped: its host copy, and its physical memory if the destroy failed.
    Asleep {
        offload: Option<Offload>,
        stale: Vec<PhysHandle>,
    },
    /// Left mapped by a failure: its offload's buffer becomes its spare.
    Awake { spare: Option<HostPtr> },
}

/// Waits for the device's work, then, for [`SleepMode::Offload`], copies each segment to a
/// pinned buffer of its own (with its checksum if asked). One entry per segment of `moving`.
fn offload(
    engine: &Engine,
    moving: &[PagedSegment],
    mode: SleepMode,
) -> Result<Vec<Option<Offload>>, SleepFailure> {
    let failed = |e: DriverError| (e, Vec::new(), SleepReport::default());
    engine
        .driver
        .device_synchronize(engine.device)
        .map_err(failed)?;
    let SleepMode::Offload { checksum } = mode else {
        return Ok(vec![None; moving.len()]);
    };
    let mut hosts = Vec::with_capacity(moving.len());
    let offloads = with_side_stream(engine, |stream| {
        copy_out(engine, moving, stream, &mut hosts)
    })
    .and_then(|()| {
        hosts
            .iter()
            .map(|&(host, _)| {
                let checksum = checksum
                    .then(|| host_checksum(&*engine.driver, host))
                    .transpose()?;
                Ok(Some(Offload { host, checksum }))
            })
            .collect()
    });
    offloads.map_err(|e| {
        // (Spare buffers stay with their segments.)
        for (host, new) in hosts {
            if new {
                let _ = engine.driver.host_free(host);
            }
        }
        failed(e)
    })
}

/// Copies each of `moving` into its spare pinned buffer or a new one (pushed to `hosts`,
/// with whether it is new, for the caller to free on failure) on `stream`, and waits for
/// the copies.
fn copy_out(
    engine: &Engine,
    moving: &[PagedSegment],
    stream: StreamHandle,
    hosts: &mut Vec<(HostPtr, bool)>,
) -> Result<(), DriverError> {
    for m in moving {
        let (host, new) = match m.spare {
            Some(spare) => (spare, false),
            None => (engine.driver.host_alloc(m.va.bytes)?, true),
        };
        hosts.push((host, new));
        chunks(m.va.bytes).try_for_each(|(at, n)| {
            engine.driver.memcpy_dtoh_pinned_async(
                (host, at),
                DevicePtr(m.va.base.0 + at),
                n,
                stream,
            )
        })?;
    }
    engine.driver.stream_synchronize(stream)
}

/// Unmaps and destroys the pages of each of `moving` (whose contents `offloads` hold, one
/// entry each), in order, stopping at the first failure. A segment counts as asleep once
/// its pages are unmapped (a failed destroy keeps the physical memory for the next wake);
/// on a failure the segments left awake keep their offload's buffer as their spare.
fn release_pages(
    driver: &dyn Driver,
    moving: &[PagedSegment],
    offloads: Vec<Option<Offload>>,
) -> Result<(Vec<(u64, Outcome)>, SleepReport), SleepFailure> {
    let mut report = SleepReport::default();
    let mut done = Vec::new();
    let mut failure = None;
    for (m, offload) in moving.iter().zip(offloads) {
        let awake = Outcome::Awake {
            spare: offload.map(|o| o.host).or(m.spare),
        };
        if failure.is_some() {
            done.push((m.va.base.0, awake));
            continue;
        }
        let stale = match unmap_pieces(driver, m.va, &m.pages) {
            Err(e) => {
                done.push((m.va.base.0, awake));
                failure = Some(e);
                continue;
            }
            Ok((stale, e)) => {
                failure = failure.or(e);
                stale
            }
        };
        done.push((m.va.base.0, Outcome::Asleep { offload, stale }));
        report.segments += 1;
        report.released_bytes += m.va.bytes;
        report.offloaded_bytes += offload.map_or(0, |o| o.host.bytes);
    }
    match failure {
        None => Ok((done, report)),
        Some(e) => Err((e, done, report)),
    }
}

/// Why a wake's restore failed.
enum Unrestored {
    /// A copy back (or its stream) failed: the host copies are kept.
    Copy(DriverError),
    /// The copies were made, but a segment's bytes differ from the offload's checksum.
    Mismatch(SleepError),
}

/// Waits for the copies back that mapping `mapped` enqueued on `stream` and checks the
/// checksums (the host buffers stay: they become the segments' spares).
fn restore(
    engine: &Engine,
    pool: PoolId,
    stream: Option<StreamHandle>,
    mapped: &[(PagedSegment, Vec<Piece>)],
    report: &mut WakeReport,
) -> Result<(), Unrestored> {
    let offloaded: Vec<(VaRange, Offload)> = mapped
        .iter()
        .filter_map(|(m, _)| Some((m.va, m.offload?)))
        .collect();
    let Some(stream) = stream.filter(|_| !offloaded.is_empty()) else {
        return Ok(());
    };
    let checked = engine
        .driver
        .stream_synchronize(stream)
        .and_then(|()| {
            offloaded
                .iter()
                .filter_map(|(va, o)| Some((va, o.checksum?)))
                .map(|(va, sum)| Ok((va.base, sum, device_checksum(&*engine.driver, *va, stream)?)))
                .collect::<Result<Vec<_>, DriverError>>()
        })
        .map_err(Unrestored::Copy)?;
    report.restored_bytes = offloaded.iter().map(|(_, o)| o.host.bytes).sum();
    report.verified_segments = checked.len();
    match checked.into_iter().find(|(_, a, b)| a != b) {
        Some((segment, offloaded, restored)) => {
            Err(Unrestored::Mismatch(SleepError::ChecksumMismatch {
                pool,
                segment,
                offloaded,
                restored,
            }))
        }
        None => Ok(()),
    }
}

/// Runs `f` on a new non-blocking stream of the allocator's device, destroyed after.
fn with_side_stream<T, X: From<DriverError>>(
    engine: &Engine,
    f: impl FnOnce(StreamHandle) -> Result<T, X>,
) -> Result<T, X> {
    let stream = side_stream(engine)?;
    let result = f(stream);
    let _ = engine.driver.stream_destroy(stream);
    result
}

/// A new non-blocking stream of the allocator's device, for copies off the user's streams.
fn side_stream(engine: &Engine) -> Result<StreamHandle, DriverError> {
    let flags = StreamFlags {
        non_blocking: true,
        priority: 0,
    };
    engine.driver.stream_create(engine.device, flags)
}

/// The (offset, length) pieces [`CHUNK`] bytes at most of `bytes`.
fn chunks(bytes: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..bytes.div_ceil(CHUNK)).map(move |i| (i * CHUNK, CHUNK.min(bytes - i * CHUNK)))
}

fn host_checksum(driver: &dyn Driver, host: HostPtr) -> Result<u64, DriverError> {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buffer = Vec::new();
    for (at, n) in chunks(host.bytes) {
        buffer.resize(n as usize, 0);
        driver.host_read(host, at, &mut buffer)?;
        hasher.update(&buffer);
    }
    Ok(hasher.digest())
}

fn device_checksum(
    driver: &dyn Driver,
    va: VaRange,
    stream: StreamHandle,
) -> Result<u64, DriverError> {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buffer = Vec::new();
    for (at, n) in chunks(va.bytes) {
        buffer.resize(n as usize, 0);
        driver.memcpy_dtoh(&mut buffer, DevicePtr(va.base.0 + at), stream)?;
        hasher.update(&buffer);
    }
    Ok(hasher.digest())
}
