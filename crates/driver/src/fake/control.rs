//! What tests steer and observe on the fake device: the call counts and injected failures,
//! when work completes ([`Completion`], [`FakeDriver::advance`]), what is still queued, the
//! malloc log, the address plan in use and the host memory backing device memory.
use super::addresses::PlanUse;
use super::calls::Call;
use super::{Completion, Failure, FakeDriver};
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use std::sync::atomic::Ordering;

impl FakeDriver {
    /// How many times `call` was made.
    pub fn calls(&self, call: Call) -> u64 {
        self.calls[call as usize].load(Ordering::Relaxed)
    }

    /// Runs `hook` at the start of the next call of kind `call`, on the calling thread and
    /// before the fake takes its own lock: for tests in which another thread must act while
    /// a caller is inside the driver (an allocator's lock is released around `malloc`).
    pub fn before_next(&self, call: Call, hook: impl FnOnce() + Send + 'static) {
        self.hooks.lock().push((call, Box::new(hook)));
        self.hooked.store(true, Ordering::Release);
    }

    /// Makes the `nth` next call of kind `call` (1 = the very next) fail with `error`.
    pub fn fail_nth(&self, call: Call, nth: u64, error: DriverError) {
        self.state.lock().failures.push(Failure {
            call,
            remaining: nth.max(1),
            error,
        });
    }

    /// Switches between eager and manual completion.
    pub fn set_completion(&self, completion: Completion) {
        self.state.lock().completion = completion;
    }

    /// Completes up to `max_items` items of work on `stream` (all when `None`), stopping at
    /// a wait for an event that has not completed. Returns how many completed.
    pub fn advance(
        &self,
        stream: StreamHandle,
        max_items: Option<usize>,
    ) -> Result<usize, DriverError> {
        let mut st = self.state.lock();
        let key = st.stream_key(stream)?;
        Ok(st.run(key, None, max_items.unwrap_or(usize::MAX), false))
    }

    /// Completes everything that can complete without forcing, on every stream.
    pub fn advance_all(&self) -> usize {
        let mut st = self.state.lock();
        let mut total = 0;
        loop {
            let keys = st.busy.queued_anywhere();
            let done: usize = keys
                .into_iter()
                .map(|k| st.run(k, None, usize::MAX, false))
                .sum();
            if done == 0 {
                return total;
            }
            total += done;
        }
    }

    /// Items of work enqueued on `stream` and not completed.
    pub fn pending(&self, stream: StreamHandle) -> Result<usize, DriverError> {
        let st = self.state.lock();
        let key = st.stream_key(stream)?;
        Ok(st.streams.get(&key).map_or(0, |s| s.queue.len()))
    }

    /// Starts (`true`) or stops keeping the address of every successful `malloc`, in
    /// order, as [`CudaDriver::log_mallocs`](crate::CudaDriver::log_mallocs) does.
    pub fn log_mallocs(&self, on: bool) {
        self.mallocs.set(on);
    }

    /// The addresses kept since [`log_mallocs`](Self::log_mallocs) or the last call, in
    /// `malloc` order, each with its device.
    pub fn take_malloc_log(&self) -> Vec<(DeviceIndex, DevicePtr)> {
        self.mallocs.take()
    }

    /// How device `dev`'s `malloc`s used its address plan so far (`None` without one).
    pub fn address_plan_use(&self, dev: DeviceIndex) -> Option<PlanUse> {
        self.state.lock().memory.plan_use(dev)
    }

    /// Host bytes that back touched device memory.
    pub fn backed_bytes(&self) -> u64 {
        self.state.lock().memory.backed_bytes()
    }
}
