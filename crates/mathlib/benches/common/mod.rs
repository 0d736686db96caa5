//! What the math-library benches share: the two ways they time a call.
use std::time::{Duration, Instant};

/// The host's time for `iters` calls, queued 100 at a time with a wait (`sync`) after each
/// hundred that is not timed: what a call costs the CPU, the GPU kept from filling up.
pub(crate) fn host_time(iters: u64, mut call: impl FnMut(), mut sync: impl FnMut()) -> Duration {
    let (mut host, mut left) = (Duration::ZERO, iters);
    while left > 0 {
        let batch = left.min(100);
        let t = Instant::now();
        for _ in 0..batch {
            call();
        }
        host += t.elapsed();
        sync();
        left -= batch;
    }
    host
}

/// The wall time of `iters` calls queued back to back and a wait after them: the GPU's
/// time per call once its queue is full.
pub(crate) fn back_to_back(iters: u64, mut call: impl FnMut(), mut sync: impl FnMut()) -> Duration {
    let t = Instant::now();
    for _ in 0..iters {
        call();
    }
    sync();
    t.elapsed()
}
