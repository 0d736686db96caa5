//! ferrocuda: the CUDA runtime layer of PyTorch (`torch.cuda`), in Rust.
//!
//! A first program, on the fake device (a device kept in host memory: no GPU needed): a
//! buffer, a kernel launch, a CUDA graph captured and replayed, an autocast region and one
//! gradient-scaler step.
//!
//! ```
//! use ferrocuda::alloc::{Caching, DeviceAllocators};
//! use ferrocuda::amp::autocast::{self, Autocast, CastPolicy, DeviceKind};
//! use ferrocuda::amp::{GradScaler, GradScalerConfig, TensorView, scaler::OptimizerId};
//! use ferrocuda::graph::{CaptureMode, CudaGraph};
//! use ferrocuda::stream::{DeviceBuffer, Module};
//! use ferrocuda::types::{AllocatorConfig, DType, DeviceIndex, KernelArg, LaunchConfig};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A runtime with PyTorch's caching allocator behind its buffers. With
//! // FERROCUDA_BACKEND=fake, `ferrocuda::runtime()` is one, configured from the environment.
//! let rt = ferrocuda::Backend::Fake.runtime();
//! let allocators = DeviceAllocators::new(rt.driver().clone(), AllocatorConfig::default(), Caching::On);
//! allocators.install(&rt);
//! let dev = DeviceIndex(0);
//!
//! // A kernel: NVRTC compiles the CUDA C++ on a GPU; the fake device runs a host version,
//! // registered for your own kernels (the library's own come registered).
//! const SCALE: &str = r#"extern "C" __global__ void scale(float* x, float a, unsigned n)
//!     { unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }"#;
//! rt.register_fake_kernel("scale", |k| {
//!     let (x, a, n) = (k.arg(0)?, k.arg::<f32>(1)?, k.arg::<u32>(2)? as usize);
//!     let v: Vec<f32> = k.read::<f32>(x, n)?.iter().map(|v| v * a).collect();
//!     k.write(x, &v)
//! });
//! let scale = Module::from_cuda_source(&rt, dev, "scale", SCALE)?.function("scale")?;
//!
//! // A buffer, and a launch on the current stream (`torch.cuda.current_stream()`).
//! let x = DeviceBuffer::from_slice(&rt, dev, &[1.0f32, 2.0, 3.0])?;
//! let (a, n, grid) = (2.0f32, 3u32, LaunchConfig::for_elements(3, 128));
//! let args = [x.arg(), KernelArg::value(&a), KernelArg::value(&n)];
//! rt.current_stream(dev)?.launch(&scale, &grid, &args)?;
//! assert_eq!(x.to_host()?, [2.0, 4.0, 6.0]);
//!
//! // The same launch captured into a graph (`with torch.cuda.graph(g)`), replayed twice.
//! let graph = CudaGraph::new(rt.clone(), &allocators, dev)?;
//! let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?;
//! capture.stream().launch(&scale, &grid, &args)?;
//! capture.end()?;
//! graph.replay(&rt.current_stream(dev)?)?;
//! graph.replay(&rt.current_stream(dev)?)?;
//! assert_eq!(x.to_host()?, [8.0, 16.0, 24.0]);
//!
//! // An autocast region: a tensor library asks, per op, what its inputs are cast to.
//! {
//!     let _region = Autocast::new(DeviceKind::Cuda).dtype(DType::F16).enter()?;
//!     let mm = autocast::policy_by_name(DeviceKind::Cuda, "mm");
//!     assert_eq!(mm, Some(CastPolicy::LowerPrecision)); // f16 here
//! }
//! assert!(!autocast::is_enabled(DeviceKind::Cuda));
//!
//! // One GradScaler step: scale the loss, then unscale and check the gradients, step
//! // (skipped on an inf/NaN), update the scale.
//! let mut scaler = GradScaler::new(&rt, dev, GradScalerConfig::default())?;
//! let loss = DeviceBuffer::from_slice(&rt, dev, &[0.5f32])?;
//! scaler.scale_in_place(&TensorView::of(&loss))?; // backward starts from the scaled loss
//! let grad = DeviceBuffer::from_slice(&rt, dev, &[65536.0f32])?; // what backward gave
//! let grads = [TensorView::of(&grad)];
//! let stepped = scaler.step(OptimizerId::fresh(), &grads, || "optimizer.step()")?;
//! assert_eq!((stepped, grad.to_host()?), (Some("optimizer.step()"), vec![1.0]));
//! scaler.update()?;
//! # Ok(())
//! # }
//! ```
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
//! - Kernels on the fake device are host functions registered under the kernel's name. The
//!   library's own (the gradient scaler's, the optimizers', the Philox generator's) are
//!   registered by the crate that owns them when it loads them, on any fake device; a
//!   program registers its own with [`register_fake_kernel`] (the global runtime) or
//!   [`stream::Runtime::register_fake_kernel`]. One missing is an error that names it.
//! - Streams, events and kernels belong to the runtime that made them: another runtime
//!   refuses them ([`stream::StreamError::OtherRuntime`]) rather than use its own stream of
//!   the same number.
//!
//! # What users are responsible for
//! Telling the allocator which other streams use a buffer, as in PyTorch: a
//! [`DeviceBuffer`](stream::DeviceBuffer) is allocated for its device's current stream, and
//! one also used on another stream needs
//! [`DeviceBuffer::record_stream`](stream::DeviceBuffer::record_stream) (`Tensor.record_stream`)
//! for that stream, or the caching allocator may hand its memory out again, once it is
//! dropped, before that stream's work is done.
#![forbid(unsafe_code)]

pub use ferrocuda_alloc as alloc;
pub use ferrocuda_amp as amp;
pub use ferrocuda_dist as dist;
pub use ferrocuda_driver as driver;
pub use ferrocuda_graph as graph;
pub use ferrocuda_mathlib as mathlib;
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

/// Registers `kernel` as the host function the fake device runs for the kernel called
/// `name`, on the global runtime (`FERROCUDA_BACKEND=fake`), replacing one registered
/// before: [`stream::Runtime::register_fake_kernel`]. Returns `false`, registering nothing,
/// on the real driver, where the kernel's CUDA source runs: a program for both backends can
/// call it unconditionally. The library's own kernels need no registration.
pub fn register_fake_kernel<F>(name: &str, kernel: F) -> bool
where
    F: Fn(&mut driver::KernelContext<'_>) -> Result<(), String> + Send + Sync + 'static,
{
    runtime().register_fake_kernel(name, kernel)
}
