//! The conformance suite on the fake device (manual completion), as CI runs it.
ferrocuda_stream::conformance_tests!(ferrocuda_stream::conformance::fake_harness);
