//! The stream conformance tests that allocate buffers, with every buffer served by the
//! `backend:cudaMallocAsync` allocator (`AsyncAllocator` as the runtime's memory): on the
//! fake device in CI, on the real driver in the GPU bundle (ignored without a GPU; run with
//! `--include-ignored --test-threads=1` there, as `cuda_conformance`).
#![forbid(unsafe_code)]
use ferrocuda_alloc::AsyncAllocator;
use ferrocuda_testkit::{Harness, cuda_harness, fake_harness};

fn with_async(h: Harness) -> Harness {
    h.rt.set_memory(AsyncAllocator::new(h.rt.driver().clone()));
    h
}

fn fake_async() -> Harness {
    with_async(fake_harness())
}

fn cuda_async() -> Harness {
    with_async(cuda_harness())
}

/// The tests whose buffers go through the runtime's memory.
macro_rules! buffer_tests {
    ($harness:path $(, #[$attr:meta])*) => {
        ferrocuda_testkit::conformance_tests!(@each $harness, [$(#[$attr])*],
            buffer_round_trips, buffer_kernel_launch, side_stream_fixed_with_wait_stream,
            cross_stream_wait_event, kernel_cache_hits_and_repairs, pinned_host_copies,
            capture_records_and_replays, capture_refuses_sync_and_captured_event_query,
            capture_fork_join_and_unjoined
        );
    };
}

mod fake {
    buffer_tests!(super::fake_async);
}

mod cuda {
    buffer_tests!(
        super::cuda_async,
        #[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
    );
}
