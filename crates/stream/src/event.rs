//! Events.
use crate::{Result, Stream, StreamError};
use ferrocuda_driver::Driver;
use ferrocuda_types::{DeviceIndex, EventFlags, EventHandle};
use parking_lot::Mutex;
use std::sync::Arc;

#[derive(Debug)]
struct EventInner {
    driver: Arc<dyn Driver>,
    /// [`Runtime::id`](crate::Runtime::id) of the runtime that made it.
    runtime: u64,
    flags: EventFlags,
    /// Created lazily at the first record, on the recording stream's device (as PyTorch).
    handle: Mutex<Option<EventHandle>>,
}

impl Drop for EventInner {
    fn drop(&mut self) {
        if let Some(h) = *self.handle.get_mut() {
            let _ = self.driver.event_destroy(h);
        }
    }
}

/// A CUDA event: a marker in a stream that can be waited for and timed (`torch.cuda.Event`).
#[derive(Clone, Debug)]
pub struct Event {
    inner: Arc<EventInner>,
}

impl Event {
    pub(crate) fn new(driver: Arc<dyn Driver>, runtime: u64, flags: EventFlags) -> Event {
        Event {
            inner: Arc::new(EventInner {
                driver,
                runtime,
                flags,
                handle: Mutex::new(None),
            }),
        }
    }

    /// The creation flags.
    pub fn flags(&self) -> EventFlags {
        self.inner.flags
    }

    /// The device, once recorded.
    pub fn device(&self) -> Option<DeviceIndex> {
        self.handle().map(|h| h.device)
    }

    /// The driver handle, once recorded.
    pub fn handle(&self) -> Option<EventHandle> {
        *self.inner.handle.lock()
    }

    /// [`Runtime::id`](crate::Runtime::id) of the runtime that made this event: it is
    /// recorded on, and waited for by, that runtime's streams only
    /// ([`StreamError::OtherRuntime`] otherwise).
    pub fn runtime_id(&self) -> u64 {
        self.inner.runtime
    }

    /// Records the event at the current end of `stream` (`Event.record`). An event belongs
    /// to the device of its first record; recording it on another device is an error, and
    /// on a stream of another runtime [`StreamError::OtherRuntime`].
    pub fn record(&self, stream: &Stream) -> Result<()> {
        stream.same_runtime(self.inner.runtime, "the event")?;
        let dev = stream.device();
        let handle = {
            let mut slot = self.inner.handle.lock();
            match *slot {
                Some(h) if h.device != dev => {
                    return Err(StreamError::EventDeviceMismatch {
                        event: h.device.0,
                        stream: dev.0,
                    });
                }
                Some(h) => h,
                None => *slot.insert(self.inner.driver.event_create(dev, self.inner.flags)?),
            }
        };
        Ok(self.inner.driver.event_record(handle, stream.handle())?)
    }

    /// Makes later work on `stream` wait for this event; a no-op if never recorded. A
    /// stream of another runtime is [`StreamError::OtherRuntime`], recorded or not.
    pub fn wait(&self, stream: &Stream) -> Result<()> {
        stream.same_runtime(self.inner.runtime, "the event")?;
        match self.handle() {
            Some(h) => Ok(stream.driver().stream_wait_event(stream.handle(), h)?),
            None => Ok(()),
        }
    }

    /// Whether the work before the last record has completed; `true` if never recorded.
    pub fn query(&self) -> Result<bool> {
        match self.handle() {
            Some(h) => Ok(self.inner.driver.event_query(h)?),
            None => Ok(true),
        }
    }

    /// Waits for the work before the last record; returns at once if never recorded.
    pub fn synchronize(&self) -> Result<()> {
        match self.handle() {
            Some(h) => Ok(self.inner.driver.event_synchronize(h)?),
            None => Ok(()),
        }
    }

    /// Milliseconds from this event to `end` (`Event.elapsed_time`). Both must be timing
    /// events, recorded, completed, and on one device.
    pub fn elapsed_time(&self, end: &Event) -> Result<f32> {
        crate::error::same_runtime(self.inner.runtime, end.inner.runtime, "the end event")?;
        if !self.inner.flags.timing || !end.inner.flags.timing {
            return Err(StreamError::TimingDisabled);
        }
        let (Some(a), Some(b)) = (self.handle(), end.handle()) else {
            return Err(StreamError::EventNotRecorded);
        };
        if a.device != b.device {
            return Err(StreamError::DeviceMismatch {
                expected: a.device,
                found: b.device,
                what: "the end event",
            });
        }
        if !(self.query()? && end.query()?) {
            return Err(StreamError::EventNotCompleted);
        }
        Ok(self.inner.driver.event_elapsed_ms(a, b)?)
    }
}
