//! When freed host blocks may be reused: an event recorded on every stream that used a
//! block when it is freed, pooled per device (PyTorch's `EventPool`, timing disabled), and
//! `process_events`: the oldest events of a pool queried first, the pass stopping at the
//! first one not ready; a block whose last event completed goes back on its free list.
use super::HostAllocator;
use super::state::Freed;
use crate::AllocError;
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::{CaptureMode, EventFlags, EventHandle, PoolId, StreamHandle};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

/// Events not in use, per device: made once, recorded again and again.
#[derive(Debug, Default)]
pub(crate) struct EventPool {
    idle: Mutex<FxHashMap<u16, Vec<EventHandle>>>,
}

impl EventPool {
    /// An idle event of `stream`'s device, or a new one (made without the pool's lock).
    fn get(&self, driver: &dyn Driver, stream: StreamHandle) -> Result<EventHandle, DriverError> {
        let idle = self
            .idle
            .lock()
            .get_mut(&stream.device.0)
            .and_then(Vec::pop);
        match idle {
            Some(e) => Ok(e),
            None => driver.event_create(
                stream.device,
                EventFlags {
                    timing: false,
                    blocking: false,
                    interprocess: false,
                },
            ),
        }
    }

    /// Every idle event (the allocator is going).
    pub(crate) fn drain(&self) -> Vec<EventHandle> {
        self.idle.lock().drain().flat_map(|(_, v)| v).collect()
    }

    fn put(&self, event: EventHandle) {
        self.idle
            .lock()
            .entry(event.device.0)
            .or_default()
            .push(event);
    }
}

impl HostAllocator {
    /// Records one event on each of `streams` for the block at `addr` and queues them in
    /// `pool`. An event that cannot be recorded is not queued, so the block waits for it
    /// for ever (retired, as PyTorch 2.15 does); the first such error is returned.
    pub(crate) fn record_events(
        &self,
        pool: PoolId,
        addr: u64,
        streams: &[StreamHandle],
    ) -> Result<(), AllocError> {
        let mut recorded = Vec::with_capacity(streams.len());
        let mut failed = None;
        for &stream in streams {
            let made = self.events.get(&*self.driver, stream).and_then(|e| {
                self.driver
                    .event_record(e, stream)
                    .map(|()| e)
                    .inspect_err(|_| self.events.put(e))
            });
            match made {
                Ok(e) => recorded.push((e, addr)),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        self.state.lock().queue_events(pool, recorded);
        failed.map_or(Ok(()), |e| Err(e.into()))
    }

    /// `process_events` for `pool`: queries its oldest events until one is not ready (put
    /// back, oldest still) or none is left. Queries run in relaxed capture mode, so that a
    /// capture under way on this thread is not broken by querying events recorded outside
    /// it (one recorded inside a capture fails the query, as in PyTorch). A query that
    /// fails drops its event (its block is never reused) and ends the pass with the error,
    /// as PyTorch's throwing query does.
    pub(crate) fn process_events(&self, pool: PoolId) -> Result<(), AllocError> {
        if self
            .state
            .lock()
            .pool_mut(pool)
            .is_none_or(|p| p.events.is_empty())
        {
            return Ok(());
        }
        let previous = self.driver.exchange_capture_mode(CaptureMode::Relaxed)?;
        let processed = self.process_queue(pool);
        let restored = self.driver.exchange_capture_mode(previous);
        processed?;
        restored?;
        Ok(())
    }

    fn process_queue(&self, pool: PoolId) -> Result<(), AllocError> {
        loop {
            let oldest = self
                .state
                .lock()
                .pool_mut(pool)
                .and_then(|p| p.events.pop_back());
            let Some((event, addr)) = oldest else {
                return Ok(());
            };
            match self.driver.event_query(event) {
                Ok(true) => {}
                Ok(false) => {
                    if let Some(p) = self.state.lock().pool_mut(pool) {
                        p.events.push_back((event, addr));
                    }
                    return Ok(());
                }
                Err(e) => {
                    let _ = self.driver.event_destroy(event);
                    return Err(e.into());
                }
            }
            let freed = self.state.lock().event_done(addr);
            self.events.put(event);
            if let Freed::Release(block) = freed {
                self.release(block)?;
            }
        }
    }
}
