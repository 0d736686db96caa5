//! How fp32 (and fp16/bf16) matmuls and convolutions may trade precision for speed: one
//! settings object as the single source of truth.
//!
//! PyTorch 2.9+ keeps two APIs side by side (`aten/src/ATen/Context.cpp`): the new
//! hierarchical `fp32_precision` table (backend × op → ieee / tf32 / bf16, `none` = inherit)
//! and the legacy flags (`allow_tf32`, `set_float32_matmul_precision`, `cudnn.allow_tf32`),
//! synchronised on write; its legacy *getters* raise when the two disagree. Here the legacy
//! setters write into the table exactly as PyTorch 2.11's do, and the legacy getters return
//! PyTorch's error where its getters raise (checked against programs recorded from
//! PyTorch 2.11 by `xtask/torch/precision_oracle.py`). GEMM paths never call them: they
//! read the resolved table, as PyTorch's kernels do.
//!
//! - [`settings`](mod@settings): the table, its resolution, the legacy setters and getters.
//! - [`gemm`]: the cuBLAS math mode / cuBLASLt compute type a GEMM gets, and cuDNN's TF32 rule.
//! - [`guard`]: the thread-local "no reduced precision" guard (`NoTF32Guard`).
pub mod gemm;
pub mod guard;
pub mod settings;

use parking_lot::RwLock;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};

pub use gemm::{
    CublasComputeType, CublasGemm, CublasLtGemm, CublasLtReductionScheme, CublasMathMode,
    CudaDataType, CudnnOp, cublas_gemm, cublas_handle_math_mode, cublaslt_gemm, cudnn_allows_tf32,
};
pub use guard::{NoTf32Guard, reduced_precision_disabled};
pub use settings::{
    Backend, Fp32Precision, MatmulPrecision, PrecisionError, PrecisionOp, PrecisionSettings,
    ReductionOption,
};

/// PyTorch's defaults, or "high" when `TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1` (read once, as
/// PyTorch reads it when its context is made).
static GLOBAL: LazyLock<RwLock<PrecisionSettings>> =
    LazyLock::new(|| RwLock::new(PrecisionSettings::from_env(|name| std::env::var(name).ok())));
/// Bumped by every [`update_global`], after the change is in place.
static VERSION: AtomicU64 = AtomicU64::new(0);

/// A copy of the process-wide settings (`at::globalContext()`'s flags).
pub fn global() -> PrecisionSettings {
    *GLOBAL.read()
}

/// Changes the process-wide settings; `f`'s result is returned.
pub fn update_global<R>(f: impl FnOnce(&mut PrecisionSettings) -> R) -> R {
    let mut settings = GLOBAL.write();
    let result = f(&mut settings);
    VERSION.fetch_add(1, Ordering::Release);
    result
}

/// How many times the process-wide settings were changed: a reader that keeps what it
/// derived from [`global`] with the version it read before may reuse it while the version
/// is unchanged (the guards of a graph cache do, to skip the lock on every call).
pub fn global_version() -> u64 {
    VERSION.load(Ordering::Acquire)
}
