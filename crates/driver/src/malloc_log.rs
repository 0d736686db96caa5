//! The addresses a driver's `malloc`s returned, in order, while asked to keep them: what a
//! replay on the GPU hands to a replay on the fake device as its address plan
//! ([`fake::AddressPlan`](crate::fake::AddressPlan)), so that both see the driver's
//! placement (best fit breaks ties between equal free blocks by address).
use ferrocuda_types::{DeviceIndex, DevicePtr};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// Off until [`set`](Self::set): an off log costs `malloc` one relaxed load.
#[derive(Debug, Default)]
pub(crate) struct MallocLog {
    on: AtomicBool,
    entries: Mutex<Vec<(DeviceIndex, DevicePtr)>>,
}

impl MallocLog {
    /// Starts (`true`) or stops keeping addresses; either way what was kept is dropped.
    pub(crate) fn set(&self, on: bool) {
        let mut entries = self.entries.lock();
        entries.clear();
        self.on.store(on, Ordering::Relaxed);
    }

    /// Keeps a successful `malloc`'s address, when on.
    pub(crate) fn note(&self, dev: DeviceIndex, ptr: DevicePtr) {
        if self.on.load(Ordering::Relaxed) {
            self.entries.lock().push((dev, ptr));
        }
    }

    /// What was kept since `set` or the last `take`, in `malloc` order; the log stays on.
    pub(crate) fn take(&self) -> Vec<(DeviceIndex, DevicePtr)> {
        std::mem::take(&mut *self.entries.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_addresses_only_while_on_and_hands_each_out_once() {
        let log = MallocLog::default();
        log.note(DeviceIndex(0), DevicePtr(0x1000));
        assert!(log.take().is_empty(), "an off log keeps nothing");
        log.set(true);
        log.note(DeviceIndex(0), DevicePtr(0x2000));
        log.note(DeviceIndex(1), DevicePtr(0x3000));
        assert_eq!(
            log.take(),
            vec![
                (DeviceIndex(0), DevicePtr(0x2000)),
                (DeviceIndex(1), DevicePtr(0x3000))
            ]
        );
        assert!(log.take().is_empty());
        log.note(DeviceIndex(0), DevicePtr(0x4000));
        log.set(false);
        assert!(log.take().is_empty(), "switching off drops what was kept");
    }
}
