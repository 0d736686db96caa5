//! ferrocuda: the CUDA runtime layer of PyTorch (`torch.cuda`), in Rust.
//!
//! This facade re-exports the layers and holds the process-wide runtime:
//! - [`types`]: plain data (device indices, handles, dtypes, launch and capture descriptions);
//! - [`driver`]: the [`Driver`](driver::Driver) seam with the real CUDA backend and the fake
//!   device;
//! - [`stream`]: devices, streams, events, kernels and buffers with `torch.cuda` semantics;
//! - [`alloc`]: the caching allocator and the pinned host allocator; [`memory`] mirrors
//!   `torch.cuda.memory` over them (`host_memory_stats`, `host_empty_cache` included);
//! - [`graph`]: CUDA graph capture with private memory pools (`torch.cuda.CUDAGraph`).
//! - [`amp`]: mixed precision (`torch.amp`): autocast, the gradient scaler, precision flags.
//!
//! # Design choices
//! - One global [`Runtime`](stream::Runtime), made on first use: the real driver, unless
//!   `FERROCUDA_BACKEND=fake` asks for the fake device. Without a driver the runtime exists
//!   and reports `is_available() == false`, as `torch.cuda` does. Making it initialises no
//!   CUDA: that waits for the first call that needs a device ([`init`], [`is_initialized`]).
//! - [`is_available`] is checked as `torch.cuda.is_available()` is: by the driver, which
//!   runs `cuInit` (a child forked afterwards gets PyTorch's "Cannot re-initialize CUDA
//!   in forked subprocess" on its first CUDA call) but, as PyTorch's, leaves
//!   [`is_initialized`] false, or, with
//!   `FERROCUDA_NVML_BASED_CUDA_CHECK=1` (else `PYTORCH_NVML_BASED_CUDA_CHECK=1`), by NVML,
//!   leaving CUDA uninitialised and the process safe to fork, with the driver as fallback.
//! - One caching allocator per device behind it, configured from `FERROCUDA_ALLOC_CONF`
//!   (else `PYTORCH_CUDA_ALLOC_CONF`) and installed as the runtime's memory resource, so
//!   every [`DeviceBuffer`](stream::DeviceBuffer) allocates through it (and every
//!   [`PinnedBuffer`](stream::PinnedBuffer) through the pinned host allocator). A malformed
//!   configuration is not ignored: every allocation then fails with the parse error.
//! - Programs and tests that want a particular backend build their own runtime with
//!   [`stream::Runtime::new`]; nothing here is hidden state they depend on.
//!
//! # What users are responsible for
//! Keeping buffers alive until the streams that use them are done (until the caching
//! allocator's `record_stream` arrives).
#![forbid(unsafe_code)]

pub use ferrocuda_alloc as alloc;
pub use ferrocuda_amp as amp;
pub use ferrocuda_dist as dist;
pub use ferrocuda_driver as driver;
pub use ferrocuda_graph as graph;
pub use ferrocuda_stream as stream;
pub use ferrocuda_types as types;

pub mod memory;

use std::sync::{Arc, OnceLock};

/// Which backend the global runtime uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The real CUDA driver (libcuda, loaded at run time).
    Cuda,
    /// The fake device in host memory (eager completion).
    Fake,
}

impl Backend {
    /// From `FERROCUDA_BACKEND` (`cuda`, the default, or `fake`; any other value means
    /// `cuda`). Set to a value that is not valid UTF-8, it is an error naming it, not a
    /// variable taken for unset.
    pub fn from_env() -> Result<Backend, types::EnvError> {
        Backend::from_var(std::env::var("FERROCUDA_BACKEND"))
    }

    /// [`Backend::from_env`] over what `std::env::var("FERROCUDA_BACKEND")` gave.
    pub fn from_var(got: Result<String, std::env::VarError>) -> Result<Backend, types::EnvError> {
        Ok(
            match types::env_value("FERROCUDA_BACKEND", got)?.as_deref() {
                Some("fake") => Backend::Fake,
                _ => Backend::Cuda,
            },
        )
    }

    /// A new runtime over this backend, without an allocator installed (buffers use the
    /// driver directly until one is: see [`memory::install`]).
    pub fn runtime(self) -> Arc<stream::Runtime> {
        match self {
            Backend::Cuda => stream::Runtime::new(Arc::new(driver::CudaDriver::new())),
            Backend::Fake => stream::Runtime::new(Arc::new(driver::FakeDriver::default())),
        }
    }
}

/// `FERROCUDA_BACKEND`, read once per process.
fn backend_choice() -> &'static Result<Backend, types::EnvError> {
    static BACKEND: OnceLock<Result<Backend, types::EnvError>> = OnceLock::new();
    BACKEND.get_or_init(Backend::from_env)
}

/// The process-wide runtime (see [`Backend::from_env`]), with the caching allocators of
/// [`memory`] installed. When `FERROCUDA_BACKEND` cannot be read (not valid UTF-8), the
/// runtime is the real driver's and every allocation, and every [`memory`] function, fails
/// with that error, which [`try_runtime`] returns.
pub fn runtime() -> &'static Arc<stream::Runtime> {
    static RUNTIME: OnceLock<Arc<stream::Runtime>> = OnceLock::new();
    RUNTIME.get_or_init(|| match backend_choice() {
        Ok(backend) => {
            let rt = backend.runtime();
            memory::install(&rt);
            rt
        }
        Err(e) => {
            let rt = Backend::Cuda.runtime();
            memory::install_refusal(&rt, alloc::AllocError::Env(e.clone()));
            rt
        }
    })
}

/// [`runtime`], or why `FERROCUDA_BACKEND` cannot be read.
pub fn try_runtime() -> Result<&'static Arc<stream::Runtime>, types::EnvError> {
    let rt = runtime();
    backend_choice().clone().map(|_| rt)
}

/// `torch.cuda.is_available()` for the global runtime (see [`stream::AvailabilityCheck`]).
pub fn is_available() -> bool {
    runtime().is_available()
}

/// `torch.cuda.device_count()` for the global runtime: NVML's count until CUDA is
/// initialised (where NVML answers), the driver's after.
pub fn device_count() -> usize {
    runtime().device_count()
}

/// `torch.cuda.is_initialized()` for the global runtime: false until CUDA is initialised, and
/// in a child forked after that.
pub fn is_initialized() -> bool {
    runtime().is_initialized()
}

/// `torch.cuda.init()` for the global runtime: initialises CUDA now, and the current
/// allocator with it (the caching allocators' device slots, or a pluggable allocator's
/// `init` hook: after this, [`memory::change_current_allocator`] refuses).
pub fn init() -> Result<(), stream::StreamError> {
    runtime().init()?;
    memory::init_current();
    Ok(())
}
