//! The event thread of `pinned_use_background_threads`: started at the first allocation
//! that misses the cache with the option on, it processes the default pool's events every
//! 100 µs (PyTorch's `getBackgroundThreadPool` loop), so allocations need not. It holds the
//! allocator weakly and ends once the allocator is dropped.
use super::HostAllocator;
use ferrocuda_types::PoolId;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The pause between two passes (PyTorch's `sleep_for(100us)`).
pub(crate) const PERIOD: Duration = Duration::from_micros(100);

impl HostAllocator {
    /// Starts the event thread, once per allocator.
    pub(crate) fn start_background(&self) {
        if self.background.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.me.clone();
        let spawned = std::thread::Builder::new()
            .name("ferrocuda-pinned-events".into())
            .spawn(move || {
                while let Some(allocator) = me.upgrade() {
                    // Nobody to report to: a failed query retires its block, and the next
                    // inline pass (or a later one) reports the driver's state.
                    let _ = allocator.process_events(PoolId::DEFAULT);
                    drop(allocator);
                    std::thread::sleep(PERIOD);
                }
            });
        if spawned.is_err() {
            // No thread: allocations keep processing events themselves.
            self.background.store(false, Ordering::Release);
        }
    }

    /// Whether the event thread was started.
    pub fn background_thread_started(&self) -> bool {
        self.background.load(Ordering::Acquire)
    }
}
