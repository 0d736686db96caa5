//! What can go wrong in the math-library layer.
use ferrocuda_alloc::AllocError;
use ferrocuda_amp::precision::PrecisionError;
use ferrocuda_driver::cublas::BlasError;
use ferrocuda_driver::cufft::FftError;
use ferrocuda_types::DType;

/// An error of the math-library layer: the library's own, the allocator's (a workspace),
/// the precision rules', or a call this layer refuses before reaching the library.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MathLibError {
    /// cuBLAS failed, or is not available (a typed "unavailable", never a panic).
    #[error(transparent)]
    Blas(#[from] BlasError),
    /// cuFFT failed, or is not available.
    #[error(transparent)]
    Fft(#[from] FftError),
    /// A workspace could not be allocated.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The precision settings refuse the call (PyTorch's errors, e.g. split-K disallowed
    /// on the classic cuBLAS path).
    #[error(transparent)]
    Precision(#[from] PrecisionError),
    /// A workspace variable that cannot be used (PyTorch throws on it, or would make an
    /// absurd size of it).
    #[error("{0}")]
    WorkspaceConfig(String),
    /// A GEMM that does not describe matrices (a leading dimension below the rows, C's type
    /// unlike A's, an element type with no GEMM).
    #[error("invalid GEMM: {0}")]
    InvalidGemm(String),
    /// A TunableOp results file that cannot be used (a line that is neither a validator nor
    /// a result; a validator that rejects it), or cannot be read or written.
    #[error("TunableOp: {0}")]
    TunableOp(String),
    /// A handle the backend does not hold (destroyed, or never made).
    #[error("no live cuBLAS handle {0}")]
    UnknownHandle(u64),
    /// An element type this path has no GEMM for.
    #[error("no GEMM for {0:?}")]
    UnsupportedDtype(DType),
}
