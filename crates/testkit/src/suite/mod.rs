//! The conformance suite: each `pub fn(&Harness) -> TestResult` one behaviour of devices,
//! streams, events, kernels, memory or captures that every backend must show.
use super::*;

fn module(h: &Harness) -> Result<Module, StreamError> {
    h.module()
}

/// Names the step under way, so that a failure on a GPU run says where it stopped.
macro_rules! step {
    ($($t:tt)*) => { eprintln!("step: {}", format_args!($($t)*)) };
}

fn launch_spin(h: &Harness, stream: &ferrocuda_stream::Stream, ms: u64) -> TestResult {
    let spin = module(h)?.function("spin")?;
    let cycles = ms * SPIN_CYCLES_PER_MS;
    stream.launch(
        &spin,
        &LaunchConfig::for_elements(1, 1),
        &[KernelArg::value(&cycles)],
    )?;
    Ok(())
}

fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, 256)
}

fn driver_err<T: std::fmt::Debug>(r: Result<T, DriverError>) -> Option<DriverError> {
    r.err()
}

// ---- devices ---------------------------------------------------------------------------

mod captures;
mod devices;
mod events;
mod kernels;
mod memory;
mod streams;
pub use captures::*;
pub use devices::*;
pub use events::*;
pub use kernels::*;
pub use memory::*;
pub use streams::*;
