//! The conformance suite (`ferrocuda_testkit::suite`) on the fake device (manual completion),
//! as CI runs it. Its real-driver twin is `cuda_conformance.rs`.
#![forbid(unsafe_code)]
ferrocuda_testkit::conformance_tests!(ferrocuda_testkit::fake_harness);
