//! Which streams a walk over a device's streams has to visit, kept as work is queued and
//! completed so that a walk costs what is pending, not the number of streams the device
//! has ever had: draining a device (at every `free`, `device_synchronize`, module unload)
//! and [`FakeDriver::advance_all`] visit the streams with work queued; the legacy stream's
//! implicit waits visit those with work queued and those capturing. A replay of a trace
//! with 100 000 streams frees its segments with a drain each: with a walk over every
//! stream that was quadratic.
//!
//! Walks visit streams in key order (device, then creation order): one of the orders the
//! walk over the stream map could take before, so nothing observable changed.
use super::{FakeDriver, StreamKey};
use std::collections::BTreeSet;

/// The streams with work queued and those capturing, and how many the walks visited.
#[derive(Default)]
pub(super) struct Busy {
    /// Streams whose queue is not empty.
    queued: BTreeSet<StreamKey>,
    /// Streams whose capture link is set (in a capture, or in one that has ended, for a
    /// stream that joined it through an event after its end).
    capturing: BTreeSet<StreamKey>,
    /// Streams visited since the driver was built: each time one was run, or looked at
    /// for an implicit wait.
    visits: u64,
}

/// The keys of device `dev`'s streams in a set, in order.
fn of_device(set: &BTreeSet<StreamKey>, dev: u16) -> Vec<StreamKey> {
    set.range((dev, 0)..=(dev, u64::MAX)).copied().collect()
}

impl Busy {
    /// Stream `key`'s queue is now empty (`false`) or not (`true`).
    pub(super) fn set_queued(&mut self, key: StreamKey, queued: bool) {
        if queued {
            self.queued.insert(key);
        } else {
            self.queued.remove(&key);
        }
    }

    /// Stream `key`'s capture link is now set (`true`) or cleared.
    pub(super) fn set_capturing(&mut self, key: StreamKey, capturing: bool) {
        if capturing {
            self.capturing.insert(key);
        } else {
            self.capturing.remove(&key);
        }
    }

    /// Stream `key` no longer exists.
    pub(super) fn forget(&mut self, key: StreamKey) {
        self.queued.remove(&key);
        self.capturing.remove(&key);
    }

    /// The streams of device `dev` with work queued.
    pub(super) fn queued_on(&self, dev: u16) -> Vec<StreamKey> {
        of_device(&self.queued, dev)
    }

    /// The streams of every device with work queued.
    pub(super) fn queued_anywhere(&self) -> Vec<StreamKey> {
        self.queued.iter().copied().collect()
    }

    /// The streams of device `dev` whose capture link is set.
    pub(super) fn capturing_on(&self, dev: u16) -> Vec<StreamKey> {
        of_device(&self.capturing, dev)
    }

    /// Counts `n` streams visited.
    pub(super) fn visited(&mut self, n: usize) {
        self.visits += n as u64;
    }
}

impl FakeDriver {
    /// Streams visited since the driver was built: each time the fake ran one's queue
    /// (enqueueing in eager mode, a synchronize, [`advance`](FakeDriver::advance), and each
    /// stream a drain of a device or [`advance_all`](FakeDriver::advance_all) runs) or looked
    /// at one for an implicit wait of a blocking or the legacy stream. The walks over a
    /// device's streams visit only those with work queued (or capturing, for the legacy
    /// stream's check), so this grows with the work done, never with the number of streams
    /// that exist: what a test asserts to catch a walk over every stream, without a clock.
    pub fn stream_visits(&self) -> u64 {
        self.state.lock().busy.visits
    }
}
