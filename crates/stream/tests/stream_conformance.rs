//! The conformance suite (`ferrocuda_testkit::suite`) on both backends: `fake::` on the fake
//! device (manual completion), as CI runs it; `cuda::` on the real CUDA driver. Without a GPU
//! the `cuda::` tests are reported as ignored (skipped, with the reason); the GPU bundle runs
//! them with `--include-ignored`, where a missing GPU fails every one. Run with
//! `--test-threads=1` there (capture modes are process-wide).
#![forbid(unsafe_code)]
mod fake {
    ferrocuda_testkit::conformance_tests!(ferrocuda_testkit::fake_harness);
}

mod cuda {
    ferrocuda_testkit::conformance_tests!(
        ferrocuda_testkit::cuda_harness,
        #[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
    );
}
