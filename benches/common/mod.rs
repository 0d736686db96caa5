//! What the root crate's benches share: the driver they measure over.
use ferrocuda::driver::{CudaDriver, Driver, FakeDriver};
use std::sync::Arc;

/// The real driver when a GPU is usable; else the fake device, or, in the GPU bundle
/// (`FERROCUDA_REQUIRE_GPU=1`), a failure: a bench that quietly measured host memory there
/// would report nothing about the GPU.
pub(crate) fn driver(bench: &str) -> Arc<dyn Driver> {
    let cuda = CudaDriver::new();
    match cuda.unavailable_reason() {
        None => Arc::new(cuda),
        Some(reason) => {
            if std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                eprintln!("{bench} bench: no usable GPU ({reason})");
                std::process::exit(1);
            }
            eprintln!("{bench} bench: no GPU ({reason}); measuring over the fake device");
            Arc::new(FakeDriver::default())
        }
    }
}
