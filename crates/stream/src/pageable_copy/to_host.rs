//! A staged copy from a device to pageable memory: each worker claims the next chunk,
//! enqueues its transfer into one of its slots, and copies a slot out into its chunk of the
//! destination once that slot's transfer has run (before reusing the slot, and at the end).
use super::{CHUNK, Claims, Slot};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{DevicePtr, StreamHandle};
use std::iter::Enumerate;
use std::slice::ChunksMut;

/// One staged copy to the host, as its workers share it.
pub(super) struct Download<'a> {
    driver: &'a dyn Driver,
    src: DevicePtr,
    stream: StreamHandle,
    /// The destination's chunks no worker has claimed.
    claims: Claims<Enumerate<ChunksMut<'a, u8>>>,
}

/// Where each of a worker's slots is copied out to once its transfer has run.
type Landing<'a> = Vec<Option<&'a mut [u8]>>;

impl<'a> Download<'a> {
    pub(super) fn new(
        driver: &'a dyn Driver,
        dst: &'a mut [u8],
        src: DevicePtr,
        stream: StreamHandle,
    ) -> Download<'a> {
        Download {
            driver,
            src,
            stream,
            claims: Claims::new(dst.chunks_mut(CHUNK).enumerate()),
        }
    }

    /// Claims chunks until none is left, transferring each into the next of `slots` in turn
    /// (a slot is copied out before it is reused), then copies out the slots still holding
    /// a chunk.
    pub(super) fn run(&self, slots: &mut [Slot]) -> Result<(), DriverError> {
        let mut landing: Landing<'a> = slots.iter().map(|_| None).collect();
        let done = self.transfer(slots, &mut landing).and_then(|()| {
            slots
                .iter_mut()
                .zip(&mut landing)
                .try_for_each(|(slot, out)| self.copy_out(slot, out.take()))
        });
        self.claims.watch(done)
    }

    /// Claims chunks until none is left (or another worker failed), each transferred into
    /// the next of `slots` in turn once the chunk that slot held is copied out; `landing`
    /// keeps where each slot's chunk goes.
    fn transfer(&self, slots: &mut [Slot], landing: &mut Landing<'a>) -> Result<(), DriverError> {
        for turn in (0..slots.len()).cycle() {
            let Some((i, out)) = self.claims.next() else {
                break;
            };
            let slot = &mut slots[turn];
            self.copy_out(slot, landing[turn].take())?;
            self.driver.memcpy_dtoh_pinned_async(
                (slot.host, 0),
                DevicePtr(self.src.0 + (i * CHUNK) as u64),
                out.len() as u64,
                self.stream,
            )?;
            slot.record(self.driver, self.stream)?;
            landing[turn] = Some(out);
        }
        Ok(())
    }

    /// Copies `slot` out into `out` (if it holds a chunk) once its transfer has run.
    fn copy_out(&self, slot: &mut Slot, out: Option<&mut [u8]>) -> Result<(), DriverError> {
        let Some(out) = out else {
            return Ok(());
        };
        slot.wait(self.driver)?;
        self.driver.host_read(slot.host, 0, out)
    }
}
