//! cuBLAS through cudarc's bindings (`cudarc::cublas::sys`, loaded at run time): handles on
//! the real driver's devices, their stream, math mode and workspace, and the GEMMs PyTorch
//! issues through the classic API (`cublasGemmEx`, `cublasGemmStridedBatchedEx`).
//!
//! - **A missing library is data.** cudarc's loader panics when libcublas or one of its
//!   symbols is missing; [`available`] finds the library (its usual names, then the folders
//!   of [`LIBRARY_PATH_VAR`](super::libraries::LIBRARY_PATH_VAR)) and every symbol used here
//!   once, before any call reaches cudarc, so every function here returns
//!   [`BlasError::Unavailable`] instead.
//! - **Streams are checked** against the driver's registry; device addresses are not
//!   dereferenced on the host (a wrong one faults on the device, as with a copy), so the
//!   layer above passes memory it owns.
//! - **Policy is above.** Which math mode, compute type and workspace a call gets is the
//!   math-library crate's business (PyTorch's `CublasHandlePool.cpp`, `CUDABlas.cpp`); this
//!   module makes the calls it is told to.
use super::CudaDriver;
use super::libraries;
use crate::DriverError;
use cudarc::cublas::sys;
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use half::f16;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// What can go wrong with cuBLAS.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlasError {
    /// libcublas (or a function this crate needs) could not be loaded.
    #[error("cuBLAS is not available: {0}")]
    Unavailable(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS error {code} ({name})")]
    Cublas {
        /// `cublasStatus_t`.
        code: u32,
        /// Its name.
        name: &'static str,
    },
    /// A driver call around cuBLAS failed (binding a context, finding a stream).
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    /// A stream of another device than the handle's.
    #[error("the stream is on device {found} but the cuBLAS handle on device {expected}")]
    DeviceMismatch {
        /// The handle's device.
        expected: DeviceIndex,
        /// The stream's.
        found: DeviceIndex,
    },
    /// An argument cuBLAS cannot take (a dimension past `i32`, a mode it has no value for).
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
}

/// The functions used here: all must be present before the first call.
const SYMBOLS: &[&str] = &[
    "cublasCreate_v2",
    "cublasDestroy_v2",
    "cublasSetStream_v2",
    "cublasSetMathMode",
    "cublasGetMathMode",
    "cublasSetWorkspace_v2",
    "cublasGemmEx",
    "cublasGemmStridedBatchedEx",
    "cublasGetVersion_v2",
];

/// Whether libcublas and every function used here can be loaded (looked for once).
pub fn available() -> Result<(), BlasError> {
    static FOUND: OnceLock<Result<(), BlasError>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            libraries::find(
                "cublas",
                &["cublasLt"],
                // SAFETY: only tries to open the library by its usual names.
                || unsafe { sys::is_culib_present() },
                // SAFETY: called once the library was found, so cudarc's loader opens it.
                || unsafe { sys::culib() },
                SYMBOLS,
            )
            .map_err(BlasError::Unavailable)
        })
        .clone()
}

fn check(r: sys::cublasStatus_t) -> Result<(), BlasError> {
    use sys::cublasStatus_t as S;
    let name = match r {
        S::CUBLAS_STATUS_SUCCESS => return Ok(()),
        S::CUBLAS_STATUS_NOT_INITIALIZED => "CUBLAS_STATUS_NOT_INITIALIZED",
        S::CUBLAS_STATUS_ALLOC_FAILED => "CUBLAS_STATUS_ALLOC_FAILED",
        S::CUBLAS_STATUS_INVALID_VALUE => "CUBLAS_STATUS_INVALID_VALUE",
        S::CUBLAS_STATUS_ARCH_MISMATCH => "CUBLAS_STATUS_ARCH_MISMATCH",
        S::CUBLAS_STATUS_MAPPING_ERROR => "CUBLAS_STATUS_MAPPING_ERROR",
        S::CUBLAS_STATUS_EXECUTION_FAILED => "CUBLAS_STATUS_EXECUTION_FAILED",
        S::CUBLAS_STATUS_INTERNAL_ERROR => "CUBLAS_STATUS_INTERNAL_ERROR",
        S::CUBLAS_STATUS_NOT_SUPPORTED => "CUBLAS_STATUS_NOT_SUPPORTED",
        S::CUBLAS_STATUS_LICENSE_ERROR => "CUBLAS_STATUS_LICENSE_ERROR",
    };
    Err(BlasError::Cublas {
        code: r as u32,
        name,
    })
}

/// The loaded cuBLAS's version (`cublasGetVersion`, e.g. 130100 for 13.1.0), asked through
/// a handle on `dev`.
pub fn version(driver: &Arc<CudaDriver>, dev: DeviceIndex) -> Result<i32, BlasError> {
    let handle = CublasHandle::create(driver, dev)?;
    let mut v = 0;
    // SAFETY: a live handle; writes through a valid pointer.
    check(unsafe { sys::cublasGetVersion_v2(handle.raw(), &mut v) })?;
    Ok(v)
}

/// The math modes PyTorch sets on a handle (`cublasMath_t`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MathMode {
    /// `CUBLAS_DEFAULT_MATH`.
    Default,
    /// `CUBLAS_TF32_TENSOR_OP_MATH`: fp32 GEMMs may use TF32 tensor cores.
    Tf32TensorOp,
    /// `CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`: half GEMMs
    /// reduce in their compute type.
    DisallowReducedPrecisionReduction,
}

impl MathMode {
    fn raw(self) -> sys::cublasMath_t {
        match self {
            MathMode::Default => sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
            MathMode::Tf32TensorOp => sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
            MathMode::DisallowReducedPrecisionReduction => {
                sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
            }
        }
    }
}

/// Element types of GEMM operands and scalars (`cudaDataType_t`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    /// `CUDA_R_16F`.
    F16,
    /// `CUDA_R_16BF`.
    BF16,
    /// `CUDA_R_32F`.
    F32,
    /// `CUDA_R_64F`.
    F64,
}

impl DataType {
    fn raw(self) -> sys::cudaDataType {
        match self {
            DataType::F16 => sys::cudaDataType::CUDA_R_16F,
            DataType::BF16 => sys::cudaDataType::CUDA_R_16BF,
            DataType::F32 => sys::cudaDataType::CUDA_R_32F,
            DataType::F64 => sys::cudaDataType::CUDA_R_64F,
        }
    }
}

/// How a GEMM accumulates (`cublasComputeType_t`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ComputeType {
    /// `CUBLAS_COMPUTE_16F`.
    F16,
    /// `CUBLAS_COMPUTE_32F`.
    F32,
    /// `CUBLAS_COMPUTE_32F_FAST_TF32`.
    F32FastTf32,
    /// `CUBLAS_COMPUTE_32F_EMULATED_16BFX9`.
    F32Emulated16bfx9,
    /// `CUBLAS_COMPUTE_64F`.
    F64,
}

impl ComputeType {
    fn raw(self) -> sys::cublasComputeType_t {
        use sys::cublasComputeType_t as C;
        match self {
            ComputeType::F16 => C::CUBLAS_COMPUTE_16F,
            ComputeType::F32 => C::CUBLAS_COMPUTE_32F,
            ComputeType::F32FastTf32 => C::CUBLAS_COMPUTE_32F_FAST_TF32,
            ComputeType::F32Emulated16bfx9 => C::CUBLAS_COMPUTE_32F_EMULATED_16BFX9,
            ComputeType::F64 => C::CUBLAS_COMPUTE_64F,
        }
    }
}

/// A strided batch: `count` GEMMs, operand `i` at `ptr + i * stride` elements.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Batch {
    /// How many GEMMs.
    pub count: usize,
    /// Elements between consecutive A, B and C matrices.
    pub strides: [i64; 3],
}

/// One column-major GEMM, `C = alpha * op(A) * op(B) + beta * C`, as `cublasGemmEx` takes it:
/// `op(A)` is `m × k`, `op(B)` is `k × n`, `C` is `m × n`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct GemmCall {
    /// Whether A is transposed (`CUBLAS_OP_T`).
    pub transa: bool,
    /// Whether B is transposed.
    pub transb: bool,
    /// Rows of `op(A)` and C.
    pub m: usize,
    /// Columns of `op(B)` and C.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// A, B and C.
    pub a: DevicePtr,
    /// B.
    pub b: DevicePtr,
    /// C (read when `beta` is not 0, written).
    pub c: DevicePtr,
    /// Leading dimensions of A, B and C.
    pub lds: [usize; 3],
    /// The type of A and B.
    pub ab_type: DataType,
    /// The type of C.
    pub c_type: DataType,
    /// The type of alpha and beta.
    pub scale_type: DataType,
    /// How it accumulates.
    pub compute: ComputeType,
    /// The scalars, converted to `scale_type`.
    pub alpha: f64,
    /// The scalars, converted to `scale_type`.
    pub beta: f64,
    /// `None`: one GEMM; else a strided batch.
    pub batch: Option<Batch>,
}

/// alpha or beta as `scale_type`, in the bytes cuBLAS reads through its pointer.
#[derive(Copy, Clone)]
pub(crate) enum Scalar {
    F16(f16),
    F32(f32),
    F64(f64),
}

impl Scalar {
    fn new(v: f64, t: DataType) -> Result<Scalar, BlasError> {
        Ok(match t {
            DataType::F16 => Scalar::F16(f16::from_f64(v)),
            DataType::F32 => Scalar::F32(v as f32),
            DataType::F64 => Scalar::F64(v),
            DataType::BF16 => return Err(BlasError::InvalidArgument("bf16 scalars")),
        })
    }

    pub(crate) fn ptr(&self) -> *const c_void {
        match self {
            Scalar::F16(v) => (v as *const f16).cast(),
            Scalar::F32(v) => (v as *const f32).cast(),
            Scalar::F64(v) => (v as *const f64).cast(),
        }
    }
}

impl GemmCall {
    pub(crate) fn alpha_scalar(&self) -> Result<Scalar, BlasError> {
        Scalar::new(self.alpha, self.scale_type)
    }

    pub(crate) fn beta_scalar(&self) -> Result<Scalar, BlasError> {
        Scalar::new(self.beta, self.scale_type)
    }
}

fn c_int(v: usize, what: &'static str) -> Result<i32, BlasError> {
    i32::try_from(v).map_err(|_| BlasError::InvalidArgument(what))
}

fn op(t: bool) -> sys::cublasOperation_t {
    if t {
        sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        sys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// A cuBLAS handle on one device of a [`CudaDriver`]. Destroyed (`cublasDestroy`) when
/// dropped. Not for two threads at once (cuBLAS's rule): the layer above keeps one per
/// thread, as PyTorch's handle pool does.
pub struct CublasHandle {
    driver: Arc<CudaDriver>,
    /// The `cublasHandle_t`, as an address (raw pointers are neither `Send` nor `Sync`).
    handle: usize,
    device: DeviceIndex,
}

impl std::fmt::Debug for CublasHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CublasHandle")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl CublasHandle {
    /// A new handle on `dev` (`cublasCreate`, with `dev`'s primary context current).
    pub fn create(driver: &Arc<CudaDriver>, dev: DeviceIndex) -> Result<CublasHandle, BlasError> {
        available()?;
        driver.bind(dev)?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: the library is present; `dev`'s context is current; writes through a
        // valid pointer.
        check(unsafe { sys::cublasCreate_v2(&mut handle) })?;
        Ok(CublasHandle {
            driver: driver.clone(),
            handle: handle as usize,
            device: dev,
        })
    }

    /// The device it was made on.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    fn raw(&self) -> sys::cublasHandle_t {
        self.handle as sys::cublasHandle_t
    }

    /// The handle's address (cuBLASLt takes it as its own handle type).
    pub(crate) fn raw_address(&self) -> usize {
        self.handle
    }

    /// Binds the handle's context (cuBLAS runs on the current one).
    pub(crate) fn bind(&self) -> Result<(), BlasError> {
        self.driver.bind(self.device)?;
        Ok(())
    }

    /// `stream` as the driver knows it, if it is a live stream of the handle's device.
    pub(crate) fn checked_stream(
        &self,
        stream: StreamHandle,
    ) -> Result<cudarc::driver::sys::CUstream, BlasError> {
        if stream.device != self.device {
            return Err(BlasError::DeviceMismatch {
                expected: self.device,
                found: stream.device,
            });
        }
        Ok(self.driver.stream(stream)?)
    }

    /// Work is enqueued on `stream` from now on (`cublasSetStream`).
    pub fn set_stream(&self, stream: StreamHandle) -> Result<(), BlasError> {
        let s = self.checked_stream(stream)?;
        // SAFETY: a live handle and a registered stream of its device.
        check(unsafe { sys::cublasSetStream_v2(self.raw(), s as sys::cudaStream_t) })
    }

    /// `cublasSetMathMode`.
    pub fn set_math_mode(&self, mode: MathMode) -> Result<(), BlasError> {
        self.bind()?;
        // SAFETY: a live handle.
        check(unsafe { sys::cublasSetMathMode(self.raw(), mode.raw()) })
    }

    /// `cublasGetMathMode`, as the raw `cublasMath_t` value (for tests that check what
    /// was set).
    pub fn math_mode_raw(&self) -> Result<u32, BlasError> {
        self.bind()?;
        let mut mode = sys::cublasMath_t::CUBLAS_DEFAULT_MATH;
        // SAFETY: a live handle; cuBLAS writes one of its own values through the pointer.
        check(unsafe { sys::cublasGetMathMode(self.raw(), &mut mode) })?;
        Ok(mode as u32)
    }

    /// `cublasSetWorkspace`: the handle's GEMMs use `bytes` at `ptr` (device memory the
    /// caller keeps alive, and unused by other streams, while the handle may use it).
    pub fn set_workspace(&self, ptr: DevicePtr, bytes: u64) -> Result<(), BlasError> {
        self.bind()?;
        let bytes = usize::try_from(bytes).map_err(|_| BlasError::InvalidArgument("bytes"))?;
        // SAFETY: a live handle; the address is only used on the device.
        check(unsafe { sys::cublasSetWorkspace_v2(self.raw(), ptr.0 as *mut c_void, bytes) })
    }

    /// Enqueues `call` on the handle's stream (`cublasGemmEx`, or
    /// `cublasGemmStridedBatchedEx` for a batch), with cuBLAS's default algorithm choice.
    pub fn gemm(&self, call: &GemmCall) -> Result<(), BlasError> {
        self.bind()?;
        let (m, n, k) = (
            c_int(call.m, "m")?,
            c_int(call.n, "n")?,
            c_int(call.k, "k")?,
        );
        let [lda, ldb, ldc] = call.lds;
        let (lda, ldb, ldc) = (c_int(lda, "lda")?, c_int(ldb, "ldb")?, c_int(ldc, "ldc")?);
        let (alpha, beta) = (call.alpha_scalar()?, call.beta_scalar()?);
        let (a, b, c) = (
            call.a.0 as *const c_void,
            call.b.0 as *const c_void,
            call.c.0 as *mut c_void,
        );
        let (ta, tb, ab, ct, compute) = (
            op(call.transa),
            op(call.transb),
            call.ab_type.raw(),
            call.c_type.raw(),
            call.compute.raw(),
        );
        let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT;
        match call.batch {
            // SAFETY: a live handle; alpha and beta live through the call and match the
            // scale type; device addresses are only used on the device.
            None => check(unsafe {
                sys::cublasGemmEx(
                    self.raw(),
                    ta,
                    tb,
                    m,
                    n,
                    k,
                    alpha.ptr(),
                    a,
                    ab,
                    lda,
                    b,
                    ab,
                    ldb,
                    beta.ptr(),
                    c,
                    ct,
                    ldc,
                    compute,
                    algo,
                )
            }),
            Some(batch) => {
                let count = c_int(batch.count, "batch count")?;
                let [sa, sb, sc] = batch.strides;
                // SAFETY: as above, for each of the batch's matrices.
                check(unsafe {
                    sys::cublasGemmStridedBatchedEx(
                        self.raw(),
                        ta,
                        tb,
                        m,
                        n,
                        k,
                        alpha.ptr(),
                        a,
                        ab,
                        lda,
                        sa,
                        b,
                        ab,
                        ldb,
                        sb,
                        beta.ptr(),
                        c,
                        ct,
                        ldc,
                        sc,
                        count,
                        compute,
                        algo,
                    )
                })
            }
        }
    }
}

impl Drop for CublasHandle {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        // SAFETY: the handle was created by cuBLAS and is destroyed once, here. Nothing to
        // report a failure to.
        let _ = unsafe { sys::cublasDestroy_v2(self.raw()) };
    }
}
