//! Where a large host-to-device copy from pageable memory is staged by several threads
//! (`pageable_copy_threads`, ferrocuda's own key; off by default).
//!
//! Why: the driver copies from pageable memory through page-locked buffers of its own,
//! filled by one thread's `memcpy`, and that `memcpy` is the bound. On an H200 host,
//! 64 MiB: PyTorch's `copy_` from a pageable tensor (the driver's path) 6.2-7.4 GB/s, from
//! a pinned one 54 GB/s; staged here, each chunk's transfer enqueued as soon as it is
//! staged, 7.0-7.6 GB/s with one thread, 13-15 with two, 24-29 with four, 35-39 with eight
//! (`docs/measurements/h200_2026-11-30g/`).
//!
//! What stays as with the driver's copy:
//! - the bytes, and the stream order: every chunk is enqueued, in order, on the stream the
//!   copy names before the call returns;
//! - `src` is consumed when the call returns (every chunk has been copied out of it);
//! - the errors: a copy to a stream being captured, or one below [`STAGED_MIN`] bytes,
//!   goes to the driver, which refuses or serves it as before;
//! - when the host waits. The driver's copy of 4 MiB or more returns only once the stream
//!   has run it (on an H200 behind a 1 s kernel, the call takes 1 s from 4 MiB up; 1 MiB
//!   returns at once). A staged copy waits too, for its own earlier chunks, before it
//!   reuses their slot; never for another copy's: a slot whose last transfer has not
//!   completed is left alone, and a new one made instead.
//!
//! Slots are [`CHUNK`] bytes of page-locked memory from the driver (`cuMemHostAlloc`, not
//! the caching host allocator, whose statistics stay PyTorch's), each with an event; per
//! device (an event belongs to one), kept for the next copy, and freed with the runtime. A
//! device holds at most `2 × threads ×` [`DEPTH`] (those lent to copies underway count); a
//! copy with fewer threads than earlier ones gives the idle slots beyond that back. A copy
//! that gets fewer slots than it has threads uses fewer threads; one that gets none
//! (page-locked memory refused, or every slot busy) goes to the driver.
//!
//! Captures: the staged copy's own calls (making and querying events, waiting for a slot's
//! transfer, page-locked allocations) are made in the relaxed capture mode
//! (`cuThreadExchangeStreamCaptureMode`), on the calling thread and on its workers, so that
//! a capture underway on another stream, begun by this thread or another in any mode, neither
//! refuses them nor is invalidated by them, as it is not by the driver's copy. None of them
//! touches a capturing stream: the copy's own stream is checked first.
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, DevicePtr, EventFlags, EventHandle, HostPtr,
    StreamHandle,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Copies below this go to the driver: it stages them without waiting for the stream, and
/// threads would cost more than they save.
pub const STAGED_MIN: usize = 4 << 20;
/// Bytes per slot, and so per chunk of a staged copy.
pub const CHUNK: usize = 2 << 20;
/// Slots each thread of a copy cycles through: its chunk's transfer runs while it stages
/// the next ones.
pub const DEPTH: usize = 4;

/// A page-locked buffer of [`CHUNK`] bytes and the event of its last transfer.
#[derive(Debug)]
struct Slot {
    host: HostPtr,
    event: EventHandle,
    /// Its event was recorded after a transfer out of it, not yet seen complete.
    in_flight: bool,
}

/// One device's slots: those kept between copies, and how many copies hold now.
#[derive(Debug, Default)]
struct DeviceSlots {
    idle: Vec<Slot>,
    lent: usize,
}

/// The slots of every device.
#[derive(Debug)]
pub(crate) struct PageableStaging {
    driver: Arc<dyn Driver>,
    slots: Mutex<HashMap<DeviceIndex, DeviceSlots>>,
}

impl PageableStaging {
    pub(crate) fn new(driver: Arc<dyn Driver>) -> PageableStaging {
        PageableStaging {
            driver,
            slots: Mutex::default(),
        }
    }

    /// Copies `src` to `dst` on `stream` (of device `dev`): staged by `threads` threads when
    /// the copy is large enough and slots can be had; by the driver otherwise.
    pub(crate) fn copy(
        &self,
        dst: DevicePtr,
        src: &[u8],
        stream: StreamHandle,
        dev: DeviceIndex,
        threads: usize,
    ) -> Result<(), DriverError> {
        // (A stream the driver does not know, too, goes to the driver, for its own error.)
        if threads > 0
            && src.len() >= STAGED_MIN
            && self.driver.stream_capture_status(stream) == Ok(CaptureStatus::None)
        {
            // Slots are taken, used and returned in the relaxed capture mode (see the module's
            // text); the driver's copy, where no slot can be had, runs in the caller's mode.
            let relaxed = RelaxedCapture::enter(&*self.driver);
            let mut slots = match relaxed {
                Some(_) => self.take(dev, threads, src.len().div_ceil(CHUNK)),
                None => Vec::new(),
            };
            if !slots.is_empty() {
                let done = self.stage(&mut slots, dst, src, stream, threads);
                let mut pool = self.slots.lock();
                let kept = pool.entry(dev).or_default();
                kept.lent -= slots.len();
                kept.idle.append(&mut slots);
                return done;
            }
        }
        self.driver.memcpy_htod_async(dst, src, stream)
    }

    /// Up to `threads ×` [`DEPTH`] slots of `dev` (no more than `chunks`) whose last
    /// transfer has completed, made where too few are, within the device's bound of
    /// `2 × threads ×` [`DEPTH`] (slots lent to other copies count); idle slots beyond the
    /// bound (kept from copies with more threads) go back to the driver.
    fn take(&self, dev: DeviceIndex, threads: usize, chunks: usize) -> Vec<Slot> {
        let want = (threads * DEPTH).min(chunks);
        let bound = 2 * threads * DEPTH;
        let mut pool = self.slots.lock();
        let kept = pool.entry(dev).or_default();
        let mut taken = Vec::with_capacity(want);
        let mut i = 0;
        while i < kept.idle.len() && taken.len() < want {
            if !self.idle(&kept.idle[i]) {
                i += 1;
                continue;
            }
            let mut slot = kept.idle.swap_remove(i);
            slot.in_flight = false;
            taken.push(slot);
        }
        while taken.len() < want && kept.idle.len() + kept.lent + taken.len() < bound {
            match self.new_slot(dev) {
                Some(slot) => taken.push(slot),
                None => break,
            }
        }
        while kept.idle.len() + kept.lent + taken.len() > bound {
            let Some(idle) = kept.idle.iter().position(|s| self.idle(s)) else {
                break;
            };
            let mut slot = kept.idle.swap_remove(idle);
            slot.in_flight = false;
            self.free_slot(slot);
        }
        kept.lent += taken.len();
        taken
    }

    /// Whether `slot`'s last transfer has run (a query that fails counts as not yet).
    fn idle(&self, slot: &Slot) -> bool {
        !slot.in_flight || self.driver.event_query(slot.event) == Ok(true)
    }

    /// A new slot, or `None` if the driver refuses page-locked memory or an event.
    fn new_slot(&self, dev: DeviceIndex) -> Option<Slot> {
        let host = self.driver.host_alloc(CHUNK as u64).ok()?;
        match self.driver.event_create(dev, EventFlags::default()) {
            Ok(event) => Some(Slot {
                host,
                event,
                in_flight: false,
            }),
            Err(_) => {
                // Nothing was written to it: giving it back can only fail for a driver
                // already gone, which frees it with the process.
                let _ = self.driver.host_free(host);
                None
            }
        }
    }

    /// Gives a slot back to the driver once its last transfer has run. Errors are dropped:
    /// only a driver already gone fails here, and it frees them with the process.
    fn free_slot(&self, slot: Slot) {
        if slot.in_flight {
            let _ = self.driver.event_synchronize(slot.event);
        }
        let _ = self.driver.event_destroy(slot.event);
        let _ = self.driver.host_free(slot.host);
    }

    /// The staged copy over `slots`: `threads` workers (no more than there are slots), each
    /// with its own share of the slots, claiming chunks in order until none is left (a
    /// worker whose thread cannot be had leaves its chunks to the others). The first error
    /// stops every worker and is returned.
    fn stage(
        &self,
        slots: &mut [Slot],
        dst: DevicePtr,
        src: &[u8],
        stream: StreamHandle,
        threads: usize,
    ) -> Result<(), DriverError> {
        let workers = threads.min(slots.len());
        let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
        let job = Job {
            driver: &*self.driver,
            dst,
            src,
            stream,
            next: &next,
            failed: &failed,
        };
        let mut shares = slots.chunks_mut(slots.len() / workers).take(workers);
        let Some(first) = shares.next() else {
            return Ok(());
        };
        std::thread::scope(|scope| {
            let spawned: Vec<_> = shares
                .filter_map(|share| {
                    std::thread::Builder::new()
                        .name("ferrocuda-pageable-copy".into())
                        .spawn_scoped(scope, move || {
                            // In the relaxed capture mode, as the calling thread (which
                            // does the chunks of a worker that cannot switch).
                            match RelaxedCapture::enter(job.driver) {
                                Some(_relaxed) => job.run(share),
                                None => Ok(()),
                            }
                        })
                        .ok()
                })
                .collect();
            let mine = job.run(first);
            spawned.into_iter().fold(mine, |result, handle| {
                let theirs = handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                result.and(theirs)
            })
        })
    }
}

impl Drop for PageableStaging {
    /// Gives every slot back (see [`PageableStaging::free_slot`]).
    fn drop(&mut self) {
        let _relaxed = RelaxedCapture::enter(&*self.driver);
        let slots: Vec<Slot> = self
            .slots
            .get_mut()
            .drain()
            .flat_map(|(_, kept)| kept.idle)
            .collect();
        slots.into_iter().for_each(|slot| self.free_slot(slot));
    }
}

/// The calling thread in the relaxed capture mode (`cuThreadExchangeStreamCaptureMode`)
/// until dropped, so that a capture underway on another stream, of this thread or another,
/// neither refuses the staged copy's calls nor is broken by them: none of them touches a
/// capturing stream.
struct RelaxedCapture<'a> {
    driver: &'a dyn Driver,
    previous: CaptureMode,
}

impl<'a> RelaxedCapture<'a> {
    fn enter(driver: &'a dyn Driver) -> Option<RelaxedCapture<'a>> {
        let previous = driver.exchange_capture_mode(CaptureMode::Relaxed).ok()?;
        Some(RelaxedCapture { driver, previous })
    }
}

impl Drop for RelaxedCapture<'_> {
    fn drop(&mut self) {
        // (Only a driver already gone fails to restore a mode it just exchanged.)
        let _ = self.driver.exchange_capture_mode(self.previous);
    }
}

/// One staged copy, as its workers share it.
#[derive(Copy, Clone)]
struct Job<'a> {
    driver: &'a dyn Driver,
    dst: DevicePtr,
    src: &'a [u8],
    stream: StreamHandle,
    /// The next chunk no worker has claimed.
    next: &'a AtomicUsize,
    failed: &'a AtomicBool,
}

impl Job<'_> {
    /// Claims chunks until none is left, staging each in the next of `slots` in turn (a
    /// slot is reused once the transfer out of it has run).
    fn run(&self, slots: &mut [Slot]) -> Result<(), DriverError> {
        for turn in (0..slots.len()).cycle() {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = self.src.chunks(CHUNK).nth(i) else {
                break;
            };
            if self.failed.load(Ordering::Relaxed) {
                break;
            }
            let step = self.chunk(&mut slots[turn], (i * CHUNK) as u64, chunk);
            if step.is_err() {
                self.failed.store(true, Ordering::Relaxed);
                return step;
            }
        }
        Ok(())
    }

    /// Stages `chunk` in `slot` and enqueues its transfer to `offset` bytes into the copy.
    fn chunk(&self, slot: &mut Slot, offset: u64, chunk: &[u8]) -> Result<(), DriverError> {
        if slot.in_flight {
            self.driver.event_synchronize(slot.event)?;
            slot.in_flight = false;
        }
        self.driver.host_write(slot.host, 0, chunk)?;
        self.driver.memcpy_htod_pinned_async(
            DevicePtr(self.dst.0 + offset),
            (slot.host, 0),
            chunk.len() as u64,
            self.stream,
        )?;
        if let Err(e) = self.driver.event_record(slot.event, self.stream) {
            // Without its event the slot cannot tell when the transfer has read it: wait
            // for the stream, so that it is idle when it goes back to the pool.
            let _ = self.driver.stream_synchronize(self.stream);
            return Err(e);
        }
        slot.in_flight = true;
        Ok(())
    }
}
