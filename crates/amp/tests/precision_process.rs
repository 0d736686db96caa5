//! The process-wide precision settings update in place and move their version.
//!
//! This test sits in its own binary: it writes the process-wide settings, which the other
//! precision tests read, and tests of one binary run on parallel threads.
#![forbid(unsafe_code)]
use ferrocuda_amp::precision::{
    Backend, Fp32Precision, MatmulPrecision, PrecisionOp, global, global_version, update_global,
};

#[test]
fn the_global_settings_update_in_place() {
    let was = global();
    let version = global_version();
    update_global(|s| s.set_float32_matmul_precision(MatmulPrecision::Medium));
    assert_eq!(
        global().resolve(Backend::Mkldnn, PrecisionOp::Matmul),
        Fp32Precision::Bf16
    );
    assert!(global_version() > version, "an update moves the version");
    update_global(|s| *s = was);
    assert_eq!(global(), was);
}
