//! A staged copy from pageable memory to a device: each worker claims the next chunk, copies
//! it into one of its slots and enqueues the slot's transfer at once.
use super::{CHUNK, Claims, Slot};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{DevicePtr, StreamHandle};
use std::iter::Enumerate;
use std::slice::Chunks;

/// One staged copy to a device, as its workers share it.
pub(super) struct Upload<'a> {
    driver: &'a dyn Driver,
    dst: DevicePtr,
    stream: StreamHandle,
    /// The source's chunks no worker has claimed.
    claims: Claims<Enumerate<Chunks<'a, u8>>>,
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
            stream,
            claims: Claims::new(src.chunks(CHUNK).enumerate()),
        }
    }

    /// Claims chunks until none is left, staging each in the next of `slots` in turn (a
    /// slot is reused once the transfer out of it has run).
    pub(super) fn run(&self, slots: &mut [Slot]) -> Result<(), DriverError> {
        for turn in (0..slots.len()).cycle() {
            let Some((i, chunk)) = self.claims.next() else {
                break;
            };
            let offset = (i * CHUNK) as u64;
            self.claims
                .watch(self.chunk(&mut slots[turn], offset, chunk))?;
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
