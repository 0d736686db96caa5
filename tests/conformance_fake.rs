//! The conformance suite on the fake device (manual completion), as CI runs it.
ferrocuda_testkit::conformance_tests!(ferrocuda_testkit::fake_harness);
