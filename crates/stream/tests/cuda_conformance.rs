//! The conformance suite (`ferrocuda_testkit::suite`) on the real CUDA driver. Without a GPU
//! these tests are reported as ignored (skipped, with the reason); the GPU bundle runs them
//! with `--include-ignored`, where a missing GPU fails every test. Run with
//! `--test-threads=1` (capture modes are process-wide). Its fake-device twin is
//! `fake_conformance.rs`: `launch_blocking` runs this binary again with `--exact
//! launch_blocking`, so each backend's suite sits at the root of a binary of its own.
#![forbid(unsafe_code)]
ferrocuda_testkit::conformance_tests!(
    ferrocuda_testkit::cuda_harness,
    #[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
);
