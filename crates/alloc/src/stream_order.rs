//! Stream ordering: the events that keep a freed block out of the pools until the streams
//! that used it (`record_stream`) have done the work enqueued before the free, and the
//! spare events they are recorded with. PyTorch's `insert_events` / `process_events` /
//! `synchronize_and_free_events` (c10/cuda/CUDACachingAllocator.cpp). Which block an
//! event frees is the caller's business: this type hands back (event, block) pairs.
use crate::block::Blocks;
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{DeviceIndex, EventFlags, EventHandle, StreamHandle};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

#[derive(Debug, Default)]
pub(crate) struct StreamOrder {
    /// Outstanding events per stream, oldest first, with the block each holds back.
    events: FxHashMap<u64, VecDeque<(EventHandle, usize)>>,
    pending: usize,
    /// Events done with, to be recorded again.
    spare: Vec<EventHandle>,
    /// Blocks freed with other streams' uses while a capture was underway: their events
    /// are recorded once no capture is (event queries are illegal during capture).
    deferred: Vec<(usize, Vec<StreamHandle>)>,
}

impl StreamOrder {
    /// Whether no event is outstanding and no block waits for a capture to end.
    pub(crate) fn is_quiet(&self) -> bool {
        self.pending == 0 && self.deferred.is_empty()
    }

    /// Whether any event is outstanding.
    pub(crate) fn has_pending(&self) -> bool {
        self.pending > 0
    }

    /// A spare event of `device`, or a new one.
    pub(crate) fn event(
        &mut self,
        driver: &dyn Driver,
        device: DeviceIndex,
    ) -> Result<EventHandle, DriverError> {
        match self.spare.iter().rposition(|e| e.device == device) {
            Some(i) => Ok(self.spare.swap_remove(i)),
            None => driver.event_create(device, EventFlags::default()),
        }
    }

    /// Gives back an event taken with [`StreamOrder::event`] and not left outstanding.
    pub(crate) fn give_back(&mut self, event: EventHandle) {
        self.spare.push(event);
    }

    /// Gives back events no longer outstanding anywhere.
    pub(crate) fn give_back_all(&mut self, events: Vec<EventHandle>) {
        self.spare.extend(events);
    }

    /// `insert_events`: records an event on each stream of `uses` for block `id` (counted
    /// in its `event_count`), made on that stream's device (a stream of another device, a
    /// peer's, takes an event of its own device, as PyTorch switches device for it).
    /// Returns the streams no event could be recorded on.
    pub(crate) fn record(
        &mut self,
        driver: &dyn Driver,
        blocks: &mut Blocks,
        id: usize,
        uses: Vec<StreamHandle>,
    ) -> Vec<StreamHandle> {
        let mut unrecorded = Vec::new();
        for stream in uses {
            let recorded = self.event(driver, stream.device).and_then(|e| {
                driver
                    .event_record(e, stream)
                    .map(|()| e)
                    .inspect_err(|_| self.spare.push(e))
            });
            match recorded {
                Ok(event) => {
                    self.events
                        .entry(stream.raw)
                        .or_default()
                        .push_back((event, id));
                    blocks[id].event_count += 1;
                    self.pending += 1;
                }
                Err(_) => unrecorded.push(stream),
            }
        }
        unrecorded
    }

    /// Holds block `id` back until a capture ends (its `event_count` counts the wait).
    pub(crate) fn defer(&mut self, blocks: &mut Blocks, id: usize, uses: Vec<StreamHandle>) {
        blocks[id].event_count += 1;
        self.deferred.push((id, uses));
    }

    /// The blocks held back during a capture, their waits uncounted: the caller records
    /// their events now.
    pub(crate) fn take_deferred(&mut self, blocks: &mut Blocks) -> Vec<(usize, Vec<StreamHandle>)> {
        let deferred = std::mem::take(&mut self.deferred);
        for (id, _) in &deferred {
            blocks[*id].event_count -= 1;
        }
        deferred
    }

    /// The events that completed, stream by stream, oldest first, each taken out of the
    /// books (a failed query counts as not ready; the block is reclaimed at the next sync).
    pub(crate) fn completed(&mut self, driver: &dyn Driver) -> Vec<(EventHandle, usize)> {
        let mut done = Vec::new();
        if self.pending == 0 {
            return done;
        }
        for q in self.events.values_mut() {
            while let Some(&(event, id)) = q.front()
                && driver.event_query(event).unwrap_or(false)
            {
                q.pop_front();
                done.push((event, id));
            }
        }
        self.events.retain(|_, q| !q.is_empty());
        done
    }

    /// Every outstanding event, to wait for (outside the lock) and then [`complete`].
    ///
    /// [`complete`]: StreamOrder::complete
    pub(crate) fn drain(&mut self) -> Vec<(EventHandle, usize)> {
        self.events.drain().flat_map(|(_, q)| q).collect()
    }

    /// Event `event`, outstanding for block `id`, has completed: it becomes spare and the
    /// block waits for one event less. Returns whether the block waits for none.
    pub(crate) fn complete(&mut self, blocks: &mut Blocks, event: EventHandle, id: usize) -> bool {
        self.spare.push(event);
        self.pending -= 1;
        let b = &mut blocks[id];
        b.event_count -= 1;
        b.event_count == 0
    }

    /// The spare events, for destroying.
    pub(crate) fn take_spare(&mut self) -> Vec<EventHandle> {
        std::mem::take(&mut self.spare)
    }
}
