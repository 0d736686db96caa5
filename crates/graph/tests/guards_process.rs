//! A change of the process-wide precision flags between two reads shows in the global guard.
//!
//! This test sits in its own binary: it writes the process-wide settings, which every other
//! guard test reads, and tests of one binary run on parallel threads.
#![forbid(unsafe_code)]
use ferrocuda_amp::precision::{self, MatmulPrecision};
use ferrocuda_graph::guards::{GlobalState, LibraryState};

#[test]
fn current_sees_a_precision_update_after_an_earlier_read() {
    let lib = LibraryState::default();
    let before = GlobalState::current(lib);
    let was = precision::global();
    precision::update_global(|s| s.set_float32_matmul_precision(MatmulPrecision::High));
    let after = GlobalState::current(lib);
    precision::update_global(|s| *s = was);
    assert_eq!(before.reason(&after), "allow_tf32 ");
    assert_eq!(GlobalState::current(lib), before, "and the restore too");
}
