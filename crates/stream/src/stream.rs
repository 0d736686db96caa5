//! Streams.
use crate::{Event, Function, Result, StreamError};
use ferrocuda_driver::{Driver, ForeignStream};
use ferrocuda_types::{DeviceIndex, EventFlags, KernelArg, LaunchConfig, StreamHandle};
use std::sync::Arc;

/// Who destroys the driver stream when the last clone drops.
#[derive(Debug)]
pub(crate) enum Ownership {
    /// We made it: destroyed.
    Owned,
    /// The device's own, or named by a handle the driver already knew: left alone.
    Borrowed,
    /// Another library's, adopted: the adoption ends (the stream is never destroyed), then
    /// the foreign stream, which keeps the stream alive, is dropped.
    Adopted(ForeignStream),
}

#[derive(Debug)]
struct StreamInner {
    driver: Arc<dyn Driver>,
    /// [`Runtime::id`](crate::Runtime::id) of the runtime that made it.
    runtime: u64,
    handle: StreamHandle,
    priority: i32,
    ownership: Ownership,
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // Work already enqueued still runs; an error here has no one to go to.
        let _ = match self.ownership {
            Ownership::Owned => self.driver.stream_destroy(self.handle),
            Ownership::Adopted(_) => self.driver.stream_forget(self.handle),
            Ownership::Borrowed => Ok(()),
        };
    }
}

/// A CUDA stream: an in-order queue of device work (`torch.cuda.Stream`).
///
/// Cheap to clone; streams the caller created are destroyed when the last clone drops.
/// Streams compare equal when they name the same driver stream.
#[derive(Clone, Debug)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl PartialEq for Stream {
    fn eq(&self, other: &Stream) -> bool {
        self.inner.handle == other.inner.handle
    }
}

impl Eq for Stream {}

impl Stream {
    pub(crate) fn wrap(
        driver: Arc<dyn Driver>,
        runtime: u64,
        handle: StreamHandle,
        priority: i32,
        ownership: Ownership,
    ) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                driver,
                runtime,
                handle,
                priority,
                ownership,
            }),
        }
    }

    /// The other library's stream this one adopted ([`Runtime::adopt_stream`]), if any.
    ///
    /// [`Runtime::adopt_stream`]: crate::Runtime::adopt_stream
    pub fn adopted_from(&self) -> Option<&ForeignStream> {
        match &self.inner.ownership {
            Ownership::Adopted(foreign) => Some(foreign),
            _ => None,
        }
    }

    /// The driver handle.
    pub fn handle(&self) -> StreamHandle {
        self.inner.handle
    }

    /// [`Runtime::id`](crate::Runtime::id) of the runtime that made this stream: every
    /// operation that takes a stream refuses one of another runtime
    /// ([`StreamError::OtherRuntime`]).
    pub fn runtime_id(&self) -> u64 {
        self.inner.runtime
    }

    /// [`StreamError::OtherRuntime`] unless `found` (the runtime of `what`) is this
    /// stream's runtime.
    pub(crate) fn same_runtime(&self, found: u64, what: &'static str) -> Result<()> {
        crate::error::same_runtime(self.inner.runtime, found, what)
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> DeviceIndex {
        self.inner.handle.device
    }

    /// The stream's priority (lower runs first).
    pub fn priority(&self) -> i32 {
        self.inner.priority
    }

    /// Whether this is the device's legacy default stream.
    pub fn is_default(&self) -> bool {
        self.inner.handle.is_legacy()
    }

    pub(crate) fn driver(&self) -> &Arc<dyn Driver> {
        &self.inner.driver
    }

    /// Whether all work enqueued so far has completed (`Stream.query()`).
    pub fn query(&self) -> Result<bool> {
        Ok(self.inner.driver.stream_query(self.inner.handle)?)
    }

    /// Waits for all work enqueued so far (`Stream.synchronize()`).
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.inner.driver.stream_synchronize(self.inner.handle)?)
    }

    /// Makes later work on this stream wait for `event` (`Stream.wait_event`). An event
    /// that was never recorded is a no-op, as in PyTorch.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        event.wait(self)
    }

    /// Makes later work on this stream wait for all work enqueued on `other` so far
    /// (`Stream.wait_stream`).
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        self.same_runtime(other.inner.runtime, "the stream to wait for")?;
        if other == self {
            return Ok(());
        }
        let event = Event::new(
            self.inner.driver.clone(),
            self.inner.runtime,
            EventFlags::default(),
        );
        event.record(other)?;
        event.wait(self)
    }

    /// Records `event` (or a new one) at the current end of this stream
    /// (`Stream.record_event`).
    pub fn record_event(&self, event: Option<&Event>) -> Result<Event> {
        match event {
            Some(e) => {
                e.record(self)?;
                Ok(e.clone())
            }
            None => {
                let e = Event::new(
                    self.inner.driver.clone(),
                    self.inner.runtime,
                    EventFlags::default(),
                );
                e.record(self)?;
                Ok(e)
            }
        }
    }

    /// Launches `function` on this stream. Every device-pointer argument and the function
    /// must belong to this stream's device, else [`StreamError::DeviceMismatch`]; the
    /// function must have been loaded by this stream's runtime, else
    /// [`StreamError::OtherRuntime`].
    pub fn launch(
        &self,
        function: &Function,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
    ) -> Result<()> {
        self.same_runtime(function.runtime_id(), "the kernel")?;
        let dev = self.inner.handle.device;
        if function.device() != dev {
            return Err(StreamError::DeviceMismatch {
                expected: dev,
                found: function.device(),
                what: "the kernel",
            });
        }
        for arg in args {
            if let KernelArg::Ptr { device, .. } = arg
                && *device != dev
            {
                return Err(StreamError::DeviceMismatch {
                    expected: dev,
                    found: *device,
                    what: "a buffer argument",
                });
            }
        }
        Ok(self
            .inner
            .driver
            .launch(function.handle(), config, args, self.inner.handle)?)
    }
}
