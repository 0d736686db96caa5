//! CUDA's math libraries for ferrocuda: cuBLAS handles and workspaces on the caching
//! allocator, GEMM under PyTorch's precision settings, and cuFFT through a plan cache.
//!
//! # Example
//! A GEMM on the fake device (the same code runs on a GPU with [`CudaBlas`]):
//! ```
//! use ferrocuda_alloc::{Caching, CachingAllocator};
//! use ferrocuda_driver::{Driver, FakeDriver};
//! use ferrocuda_mathlib::{Blas, FakeBlas, Gemm};
//! use ferrocuda_types::{AllocatorConfig, DType, DeviceIndex, StreamHandle};
//! use std::sync::Arc;
//!
//! let fake = Arc::new(FakeDriver::default());
//! let dev = DeviceIndex(0);
//! let alloc = Arc::new(CachingAllocator::new(fake.clone(), dev, AllocatorConfig::default(), Caching::On)?);
//! let blas = Blas::new(Arc::new(FakeBlas::new(fake.clone(), 9)), alloc.clone())?;
//! let stream = StreamHandle::legacy(dev);
//! // 2×2 matrices, column-major: A = [[1, 2], [3, 4]], B = identity.
//! let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
//! let (a, b, c) = (alloc.allocate(16, stream)?, alloc.allocate(16, stream)?, alloc.allocate(16, stream)?);
//! fake.memcpy_htod_async(a.ptr, &bytes(&[1.0, 3.0, 2.0, 4.0]), stream)?;
//! fake.memcpy_htod_async(b.ptr, &bytes(&[1.0, 0.0, 0.0, 1.0]), stream)?;
//! blas.gemm(stream, &Gemm::plain(DType::F32, 2, 2, 2, a.ptr, b.ptr, c.ptr))?;
//! let mut out = [0u8; 16];
//! fake.memcpy_dtoh(&mut out, c.ptr, stream)?;
//! assert_eq!(out.to_vec(), bytes(&[1.0, 3.0, 2.0, 4.0]));
//! // The workspace (32 MiB on a Hopper) came from the allocator, on that stream.
//! assert_eq!(blas.workspace_bytes(), 32 << 20);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Design choices
//! - **Finding the libraries is the driver's** ([`ferrocuda_driver::cublas::available`]):
//!   their usual names on the loader's path, then the folders of
//!   [`ferrocuda_driver::LIBRARY_PATH_VAR`]; a machine without them gets
//!   [`MathLibError::Blas`] with `BlasError::Unavailable`, never a panic.
//! - **Policy here, acts below**: [`BlasBackend`] makes one cuBLAS call at a time;
//!   [`Blas`] decides which handle, stream, workspace and math mode (PyTorch's
//!   `CublasHandlePool.cpp`), and [`Blas::gemm`] the compute types (`CUDABlas.cpp`, through
//!   `ferrocuda_amp::precision`). [`FakeBlas`] plays cuBLAS on the fake device, so all of
//!   it is tested without a GPU.
//! - **Workspaces are allocator memory**: they count in `memory_stats` and snapshots, and
//!   go back with [`Blas::clear_workspaces`] or when their thread ends. Given the
//!   allocators CUDA graphs capture through ([`DeviceMemory`]), a GEMM recorded into a
//!   capture takes a workspace of its own from the graph's private pool, so no two graphs
//!   share one (PyTorch binds the stream's).
//! - **Sizes as PyTorch 2.11 reads them** ([`WorkspaceSizes`]), its warnings as data.
//! - **cuFFT plans are cached per device** ([`Fft`]), PyTorch's LRU with its 4 096 default,
//!   plus a byte budget of ours; every execution's work area is allocator memory.
#![forbid(unsafe_code)]

mod backend;
mod device_memory;
mod error;
mod fake;
mod fake_fft;
mod fake_kernel;
mod fft;
mod fft_backend;
mod gemm;
mod handles;
mod library_choice;
mod plan_cache;
pub mod tunable;
mod tuning;
pub mod workspace_config;

pub use backend::{BlasBackend, CudaBlas, HandleId, LtCall, LtCandidate};
pub use device_memory::DeviceMemory;
pub use error::MathLibError;
pub use fake::{FAKE_LT_CANDIDATES, FakeBlas, FakeGemm, FakeHandleState};
pub use fake_fft::{FakeFft, FakeFftCounts, FakePlan};
pub use ferrocuda_driver::cublas::{Batch, MathMode};
pub use ferrocuda_driver::cufft::{FftDesc, FftKind, FftLayout};
pub use fft::Fft;
pub use fft_backend::{CudaFft, FftBackend};
pub use gemm::Gemm;
pub use handles::Blas;
pub use library_choice::BlasLibrary;
pub use plan_cache::DEFAULT_MAX_SIZE as DEFAULT_PLAN_CACHE_SIZE;
pub use workspace_config::WorkspaceSizes;
