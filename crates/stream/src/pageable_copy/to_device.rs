//! A staged copy from pageable memory to a device: each worker claims the next chunk, copies
//! it into one of its slots and enqueues the slot's transfer at once.
use super::{CHUNK, Slot};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{DevicePtr, StreamHandle};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// One staged copy to a device, as its workers share it.
pub(super) struct Upload<'a> {
    driver: &'a dyn Driver,
    dst: DevicePtr,
    src: &'a [u8],
    stream: StreamHandle,
    /// The next chunk no worker has claimed.
    next: AtomicUsize,
    failed: AtomicBool,
}

impl<'a> Upload<'a> {
    pub(super) fn new(
        driver: &'a dyn Driver,
        dst: DevicePtr,
        src: &'a [u8],
        stream: StreamHandle,
    ) -> Upload<'a> {
        Upload {
            driver,
            dst,
            src,
            stream,
            next: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
        }
    }

    /// Claims chunks until none is left, staging each in the next of `slots` in turn (a
    /// slot is reused once the transfer out of it has run).
    pub(super) fn run(&self, slots: &mut [Slot]) -> Result<(), DriverError> {
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
        slot.wait(self.driver)?;
        self.driver.host_write(slot.host, 0, chunk)?;
        self.driver.memcpy_htod_pinned_async(
            DevicePtr(self.dst.0 + offset),
            (slot.host, 0),
            chunk.len() as u64,
            self.stream,
        )?;
        slot.record(self.driver, self.stream)
    }
}
