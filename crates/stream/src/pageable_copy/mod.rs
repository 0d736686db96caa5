//! Where a large copy between pageable host memory and a device is staged by several
//! threads (`pageable_copy_threads`, ferrocuda's own key; off by default): to the device in
//! `to_device.rs`, to the host in `to_host.rs`; the page-locked slots both use, here.
//!
//! Why: the driver copies pageable memory through page-locked buffers of its own, filled or
//! emptied by one thread's `memcpy`, and that `memcpy` is the bound. On an H200 host,
//! 64 MiB to the device: PyTorch's `copy_` from a pageable tensor (the driver's path)
//! 6.2-7.4 GB/s, from a pinned one 54 GB/s; staged here, each chunk's transfer enqueued as
//! soon as it is staged, 7.0-7.6 GB/s with one thread, 13-15 with two, 24-29 with four,
//! 35-39 with eight (`docs/measurements/h200_2026-11-30g/`). To the host, each worker
//! enqueues its chunks' transfers into its slots and copies each slot out once its transfer
//! has run; the driver's copy is faster that way (12-15 GB/s into memory written before),
//! so a copy to the host is staged only from [`STAGED_READ_MIN`] bytes with at least
//! [`READ_MIN_THREADS`] threads: 64 MiB at 29-31 GB/s with four threads, 256 MiB at 35-36
//! with eight (`docs/measurements/h200_2026-11-30h/`).
//!
//! What stays as with the driver's copy:
//! - the bytes, and the stream order: every chunk is enqueued on the stream the copy names
//!   before the call returns (to the device, in order);
//! - to the device, `src` is consumed when the call returns (every chunk has been copied out
//!   of it); to the host, `dst` is written when it returns;
//! - the errors: a copy on a stream being captured, or one below [`STAGED_MIN`] bytes
//!   ([`STAGED_READ_MIN`] to the host), goes to the driver, which refuses or serves it as
//!   before; a copy to the host first waits for
//!   its stream in the caller's capture mode, so that a capture underway elsewhere that
//!   forbids the driver's copy (which waits for the stream) forbids it too, with the same
//!   error;
//! - when the host waits. The driver's copy to the device of 4 MiB or more returns only once
//!   the stream has run it (on an H200 behind a 1 s kernel, the call takes 1 s from 4 MiB
//!   up; 1 MiB returns at once), and its copy to the host once the copy has run. A staged
//!   copy waits too, for its own earlier chunks, before it reuses their slot; never for
//!   another copy's: a slot whose last transfer has not completed is left alone, and a new
//!   one made instead.
//!
//! Slots are [`CHUNK`] bytes of page-locked memory from the driver (`cuMemHostAlloc`, not
//! the caching host allocator, whose statistics stay PyTorch's), each with an event; per
//! device (an event belongs to one), kept for the next copy in either direction, and freed
//! with the runtime. A device holds at most `2 × threads ×` [`DEPTH`] (those lent to copies
//! underway, and those kept with a transfer still running, count); a copy with fewer
//! threads than earlier ones (or a copy of 4 MiB or more that the driver does because the
//! count is now 0, or below a copy to the host's minimum) gives the completed idle slots
//! beyond that back, without waiting for the others. A copy that gets
//! fewer slots than it has threads uses fewer threads; one that gets none (page-locked
//! memory refused, or the bound reached) goes to the driver. A slot whose transfer was
//! enqueued but neither its event recorded nor its stream waited for (two driver failures
//! in a row) is never used again; it is freed with the runtime once its device has been
//! synchronized.
//!
//! Captures: the staged copy's own calls (making and querying events, waiting for a slot's
//! transfer, page-locked allocations) are made in the relaxed capture mode
//! (`cuThreadExchangeStreamCaptureMode`), on the calling thread and on its workers, so that
//! a capture underway on another stream, begun by this thread or another in any mode, neither
//! refuses them nor is invalidated by them, as it is not by the driver's copy to the device.
//! None of them touches a capturing stream: the copy's own stream is checked first.
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{
    CaptureMode, CaptureStatus, DeviceIndex, DevicePtr, EventFlags, EventHandle, HostPtr,
    StreamHandle,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

mod to_device;
mod to_host;

/// Copies below this go to the driver: it stages them without waiting for the stream, and
/// threads would cost more than they save.
pub const STAGED_MIN: usize = 4 << 20;
/// Copies to the host below this go to the driver, and those with fewer than
/// [`READ_MIN_THREADS`] threads: the driver's copy into pageable memory the process has
/// written before runs at 12-15 GB/s on an H200 host, which a staged one beats only from
/// 16 MiB with two threads or more (`docs/measurements/h200_2026-11-30h/`).
pub const STAGED_READ_MIN: usize = 16 << 20;
/// The fewest threads that stage a copy to the host (see [`STAGED_READ_MIN`]).
pub const READ_MIN_THREADS: usize = 2;
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
    last: Last,
}

/// Where a slot's last transfer stands.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Last {
    /// Seen complete (or none yet).
    Done,
    /// Its event was recorded after it, not yet seen complete.
    InFlight,
    /// Enqueued, but neither its event recorded nor its stream waited for: nothing tells
    /// when it has run, so the slot is never used again, and freed only once its device
    /// has been synchronized.
    Unknown,
}

impl Slot {
    /// Waits for the slot's last transfer, if one has not been seen complete.
    fn wait(&mut self, driver: &dyn Driver) -> Result<(), DriverError> {
        if self.last == Last::InFlight {
            driver.event_synchronize(self.event)?;
            self.last = Last::Done;
        }
        Ok(())
    }

    /// Records the slot's event after a transfer just enqueued on `stream`.
    fn record(&mut self, driver: &dyn Driver, stream: StreamHandle) -> Result<(), DriverError> {
        if let Err(e) = driver.event_record(self.event, stream) {
            // Without its event the slot cannot tell when the transfer has run: wait for
            // the stream, so that it is idle when it goes back to the pool.
            self.last = match driver.stream_synchronize(stream) {
                Ok(()) => Last::Done,
                Err(_) => Last::Unknown,
            };
            return Err(e);
        }
        self.last = Last::InFlight;
        Ok(())
    }
}

/// The chunks of one staged copy that no worker has claimed yet (numbered), shared by its
/// workers, and whether one of them failed: the others then claim no more.
struct Claims<I> {
    chunks: Mutex<I>,
    failed: AtomicBool,
}

impl<I: Iterator> Claims<I> {
    fn new(chunks: I) -> Claims<I> {
        Claims {
            chunks: Mutex::new(chunks),
            failed: AtomicBool::new(false),
        }
    }

    /// The next unclaimed chunk; `None` when none is left or a worker has failed.
    fn next(&self) -> Option<I::Item> {
        if self.failed.load(Ordering::Relaxed) {
            return None;
        }
        self.chunks.lock().next()
    }

    /// Passes a worker's `result` on, stopping the other workers when it is an error.
    fn watch<T>(&self, result: Result<T, DriverError>) -> Result<T, DriverError> {
        if result.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        result
    }
}

/// The most slots a device keeps for copies of `threads` threads (lent, idle, or with a
/// transfer still running).
fn bound(threads: usize) -> usize {
    2 * threads * DEPTH
}

/// One device's slots: those kept between copies, and how many copies hold now.
#[derive(Debug, Default)]
struct DeviceSlots {
    idle: Vec<Slot>,
    lent: usize,
}

/// Slots lent to one copy, used in the relaxed capture mode until given back.
struct Lent<'a> {
    slots: Vec<Slot>,
    dev: DeviceIndex,
    _relaxed: RelaxedCapture<'a>,
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
    pub(crate) fn to_device(
        &self,
        dst: DevicePtr,
        src: &[u8],
        stream: StreamHandle,
        dev: DeviceIndex,
        threads: usize,
    ) -> Result<(), DriverError> {
        if self.stageable(stream, threads, src.len(), STAGED_MIN)
            && let Some(lent) = self.lend(dev, threads, src.len())
        {
            let upload = to_device::Upload::new(&*self.driver, dst, src, stream);
            return self.stage(lent, threads, |slots| upload.run(slots));
        }
        self.unstaged(dev, threads, src.len());
        self.driver.memcpy_htod_async(dst, src, stream)
    }

    /// Copies `src` to `dst` in `stream` order (of device `dev`) and waits for it: staged by
    /// `threads` threads when the copy is large enough and slots can be had; by the driver
    /// otherwise.
    pub(crate) fn to_host(
        &self,
        dst: &mut [u8],
        src: DevicePtr,
        stream: StreamHandle,
        dev: DeviceIndex,
        threads: usize,
    ) -> Result<(), DriverError> {
        let read_threads = if threads >= READ_MIN_THREADS {
            threads
        } else {
            0
        };
        if self.stageable(stream, read_threads, dst.len(), STAGED_READ_MIN) {
            // The driver's copy waits for the stream, which a capture underway on another
            // stream may forbid (this thread's, or another thread's in the global mode):
            // waiting first, in the caller's mode, refuses the staged copy where the
            // driver's copy is refused, with its error (and the chunks' transfers then
            // start at once).
            self.driver.stream_synchronize(stream)?;
            if let Some(lent) = self.lend(dev, threads, dst.len()) {
                let download = to_host::Download::new(&*self.driver, dst, src, stream);
                return self.stage(lent, threads, |slots| download.run(slots));
            }
        }
        self.unstaged(dev, threads, dst.len());
        self.driver.memcpy_dtoh(dst, src, stream)
    }

    /// Whether a copy of `bytes` on `stream` is one to stage: `threads` above 0, at least
    /// `min` bytes, and `stream` not capturing (a stream the driver does not know, too, goes
    /// to the driver, for its own error).
    fn stageable(&self, stream: StreamHandle, threads: usize, bytes: usize, min: usize) -> bool {
        threads > 0
            && bytes >= min
            && self.driver.stream_capture_status(stream) == Ok(CaptureStatus::None)
    }

    /// Slots of `dev` for a copy of `bytes` by `threads` threads (see [`Self::take`]), in
    /// the relaxed capture mode (see the module's text) until they are given back; `None`
    /// when none can be had (the driver copies then, in the caller's mode).
    fn lend(&self, dev: DeviceIndex, threads: usize, bytes: usize) -> Option<Lent<'_>> {
        let relaxed = RelaxedCapture::enter(&*self.driver)?;
        let slots = self.take(dev, threads, bytes.div_ceil(CHUNK));
        (!slots.is_empty()).then_some(Lent {
            slots,
            dev,
            _relaxed: relaxed,
        })
    }

    /// Runs a staged copy over `lent` slots: up to `threads` workers (no more than there are
    /// slots; the calling thread is one of them) each running `run` over its own share of
    /// the slots. A worker whose thread cannot be had leaves its chunks to the others; the
    /// first error stops every worker and is returned. The slots go back to their device's
    /// pool.
    fn stage(
        &self,
        mut lent: Lent<'_>,
        threads: usize,
        run: impl Fn(&mut [Slot]) -> Result<(), DriverError> + Sync,
    ) -> Result<(), DriverError> {
        let slots = &mut lent.slots;
        let workers = threads.min(slots.len());
        let per_worker = slots.len() / workers;
        let done = std::thread::scope(|scope| {
            let mut shares = slots.chunks_mut(per_worker).take(workers);
            let Some(first) = shares.next() else {
                return Ok(());
            };
            let run = &run;
            let spawned: Vec<_> = shares
                .filter_map(|share| {
                    std::thread::Builder::new()
                        .name("ferrocuda-pageable-copy".into())
                        .spawn_scoped(scope, move || {
                            // In the relaxed capture mode, as the calling thread (which
                            // does the chunks of a worker that cannot switch).
                            match RelaxedCapture::enter(&*self.driver) {
                                Some(_relaxed) => run(share),
                                None => Ok(()),
                            }
                        })
                        .ok()
                })
                .collect();
            let mine = run(first);
            spawned.into_iter().fold(mine, |result, handle| {
                let theirs = handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                result.and(theirs)
            })
        });
        let mut pool = self.slots.lock();
        let kept = pool.entry(lent.dev).or_default();
        kept.lent -= slots.len();
        kept.idle.append(slots);
        done
    }

    /// Up to `threads ×` [`DEPTH`] slots of `dev` (no more than `chunks`) whose last
    /// transfer has completed, made where too few are, within the device's bound of
    /// `2 × threads ×` [`DEPTH`], which counts the slots lent to other copies and those kept
    /// with a transfer still running; the completed slots the bound has no room for go back
    /// to the driver (kept from copies with more threads), without waiting for any other.
    fn take(&self, dev: DeviceIndex, threads: usize, chunks: usize) -> Vec<Slot> {
        let bound = bound(threads);
        let mut pool = self.slots.lock();
        let kept = pool.entry(dev).or_default();
        let (mut done, busy): (Vec<Slot>, Vec<Slot>) =
            kept.idle.drain(..).partition(|s| self.idle(s));
        done.iter_mut().for_each(|s| s.last = Last::Done);
        let room = bound.saturating_sub(busy.len() + kept.lent);
        let want = (threads * DEPTH).min(chunks).min(room);
        let mut taken: Vec<Slot> = done.drain(..want.min(done.len())).collect();
        while taken.len() < want {
            match self.new_slot(dev) {
                Some(slot) => taken.push(slot),
                None => break,
            }
        }
        let keep = (room - taken.len()).min(done.len());
        done.drain(keep..)
            .for_each(|slot| self.free_slot(dev, slot));
        kept.idle = busy;
        kept.idle.append(&mut done);
        kept.lent += taken.len();
        taken
    }

    /// Before the driver's copy of `bytes` (at least [`STAGED_MIN`], a size that could have
    /// been staged): when `dev` keeps more slots than the bound of `threads` allows (the
    /// count was lowered, to 0 or below a copy to the host's [`READ_MIN_THREADS`]), its
    /// completed idle slots beyond the bound go back to the driver, as a staged copy with
    /// fewer threads gives them back.
    fn unstaged(&self, dev: DeviceIndex, threads: usize, bytes: usize) {
        if bytes < STAGED_MIN {
            return;
        }
        let over = self
            .slots
            .lock()
            .get(&dev)
            .is_some_and(|kept| kept.idle.len() + kept.lent > bound(threads));
        if over && let Some(_relaxed) = RelaxedCapture::enter(&*self.driver) {
            self.take(dev, threads, 0);
        }
    }

    /// Whether `slot`'s last transfer has run (a query that fails counts as not yet).
    fn idle(&self, slot: &Slot) -> bool {
        match slot.last {
            Last::Done => true,
            Last::InFlight => self.driver.event_query(slot.event) == Ok(true),
            Last::Unknown => false,
        }
    }

    /// A new slot, or `None` if the driver refuses page-locked memory or an event.
    fn new_slot(&self, dev: DeviceIndex) -> Option<Slot> {
        let host = self.driver.host_alloc(CHUNK as u64).ok()?;
        match self.driver.event_create(dev, EventFlags::default()) {
            Ok(event) => Some(Slot {
                host,
                event,
                last: Last::Done,
            }),
            Err(_) => {
                // Nothing was written to it: giving it back can only fail for a driver
                // already gone, which frees it with the process.
                let _ = self.driver.host_free(host);
                None
            }
        }
    }

    /// Gives a slot of `dev` back to the driver once its last transfer has run. Errors are
    /// dropped: only a driver already gone fails here, and it frees them with the process;
    /// but a slot whose transfer nothing tells the end of stays allocated unless its device
    /// can be synchronized (a transfer may still write it).
    fn free_slot(&self, dev: DeviceIndex, slot: Slot) {
        match slot.last {
            Last::Done => {}
            Last::InFlight => {
                let _ = self.driver.event_synchronize(slot.event);
            }
            Last::Unknown => {
                if self.driver.device_synchronize(dev).is_err() {
                    let _ = self.driver.event_destroy(slot.event);
                    return;
                }
            }
        }
        let _ = self.driver.event_destroy(slot.event);
        let _ = self.driver.host_free(slot.host);
    }
}

impl Drop for PageableStaging {
    /// Gives every slot back (see [`PageableStaging::free_slot`]).
    fn drop(&mut self) {
        let _relaxed = RelaxedCapture::enter(&*self.driver);
        let slots: Vec<(DeviceIndex, Slot)> = self
            .slots
            .get_mut()
            .drain()
            .flat_map(|(dev, kept)| kept.idle.into_iter().map(move |slot| (dev, slot)))
            .collect();
        slots
            .into_iter()
            .for_each(|(dev, slot)| self.free_slot(dev, slot));
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
