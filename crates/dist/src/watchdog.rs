//! PyTorch's `ProcessGroupNCCL` watchdog (`TORCH_NCCL_ASYNC_ERROR_HANDLING`): a thread per
//! group that watches every collective in flight and the backend's asynchronous error; a
//! collective past the group's timeout, or an asynchronous error, aborts the backend's
//! communicator (so NCCL's kernels return instead of waiting for a dead peer) and fails
//! the group: every later call, and every host wait for work in flight, is a typed error
//! instead of a hang. Unlike PyTorch's default, the process is not torn down: the caller
//! decides (make a new group, or exit).
use crate::{Collective, DistError};
use ferrocuda_driver::Driver;
use ferrocuda_stream::Event;
use ferrocuda_types::CaptureMode;
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A collective in flight, as the watchdog sees it.
pub(crate) struct InFlight {
    pub(crate) seq: u64,
    pub(crate) what: String,
    pub(crate) started: Instant,
    pub(crate) done: Event,
}

/// What the group and its watchdog share: why it failed, if it did, and the collectives in
/// flight.
#[derive(Default)]
pub(crate) struct Health {
    failed: Mutex<Option<DistError>>,
    in_flight: Mutex<Vec<InFlight>>,
}

impl Health {
    /// The error that failed the group, if one did.
    pub(crate) fn failed(&self) -> Option<DistError> {
        self.failed.lock().clone()
    }

    /// Fails the group with `e` (the first failure stays) and forgets the work in flight.
    pub(crate) fn fail(&self, e: DistError) {
        self.failed.lock().get_or_insert(e);
        self.in_flight.lock().clear();
    }

    pub(crate) fn watch(&self, work: InFlight) {
        self.in_flight.lock().push(work);
    }
}

/// The watchdog thread of one group; stopped and joined when dropped.
pub(crate) struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").finish_non_exhaustive()
    }
}

impl Watchdog {
    /// Starts watching `health` for `comm`: collectives older than `timeout` fail the group.
    pub(crate) fn start(
        driver: Arc<dyn Driver>,
        comm: Arc<dyn Collective>,
        health: Arc<Health>,
        timeout: Duration,
    ) -> Result<Watchdog, DistError> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        // PyTorch's watchdog wakes every 100 ms; a short timeout is looked at more often.
        let every = (timeout / 10).clamp(Duration::from_millis(1), Duration::from_millis(100));
        let thread = std::thread::Builder::new()
            .name("ferrocuda-watchdog".into())
            .spawn(move || {
                // Relaxed: its event queries must not invalidate another thread's global
                // capture.
                let _ = driver.exchange_capture_mode(CaptureMode::Relaxed);
                while !stopping.load(Ordering::Acquire) {
                    std::thread::sleep(every);
                    if health.failed().is_none() {
                        look(&*comm, &health, timeout);
                    }
                }
            })
            .map_err(|e| DistError::Reducer(format!("could not start the watchdog: {e}")))?;
        Ok(Watchdog {
            stop,
            thread: Some(thread),
        })
    }
}

/// One look: the asynchronous error, then each collective in flight.
fn look(comm: &dyn Collective, health: &Health, timeout: Duration) {
    // The group fails before the communicator is aborted: `ncclCommAbort` may wait for the
    // stream's work, and waiters must not wait with it.
    if let Err(e) = comm.async_error() {
        health.fail(DistError::Aborted {
            reason: format!("the communicator reported an asynchronous error: {e}"),
        });
        let _ = comm.abort();
        return;
    }
    let late = {
        let mut in_flight = health.in_flight.lock();
        // A query that fails counts as not done: the timeout then decides.
        in_flight.retain(|w| !w.done.query().unwrap_or(false));
        in_flight
            .iter()
            .find(|w| w.started.elapsed() > timeout)
            .map(|w| DistError::CollectiveTimeout {
                seq: w.seq,
                what: w.what.clone(),
                after: w.started.elapsed(),
                timeout,
            })
    };
    if let Some(e) = late {
        health.fail(e);
        let _ = comm.abort();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
