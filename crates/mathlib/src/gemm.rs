//! GEMM through classic cuBLAS under PyTorch's precision settings (`at::cuda::blas::gemm`
//! and `bgemm` in `aten/src/ATen/cuda/CUDABlas.cpp`): the compute and scale types and the
//! math mode come from [`ferrocuda_amp::precision::cublas_gemm`], which also raises
//! PyTorch's errors.
use crate::MathLibError;
use crate::handles::Blas;
use ferrocuda_amp::precision::{self, CublasComputeType, CudaDataType};
use ferrocuda_driver::cublas::{Batch, ComputeType, DataType, GemmCall, MathMode};
use ferrocuda_types::{DType, DevicePtr, StreamHandle};

/// A column-major GEMM, `C = alpha * op(A) * op(B) + beta * C`, with A, B and C of one
/// element type: `op(A)` is `m × k`, `op(B)` is `k × n`, `C` is `m × n`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Gemm {
    /// The element type of A, B and C.
    pub dtype: DType,
    /// Whether A is transposed.
    pub transa: bool,
    /// Whether B is transposed.
    pub transb: bool,
    /// Rows of `op(A)` and C.
    pub m: usize,
    /// Columns of `op(B)` and C.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// A.
    pub a: DevicePtr,
    /// Leading dimension of A (at least its stored rows).
    pub lda: usize,
    /// B.
    pub b: DevicePtr,
    /// Leading dimension of B.
    pub ldb: usize,
    /// C.
    pub c: DevicePtr,
    /// Leading dimension of C (at least `m`).
    pub ldc: usize,
    /// alpha.
    pub alpha: f64,
    /// beta (0: C is not read).
    pub beta: f64,
    /// `None`: one GEMM; else a strided batch (strides in elements).
    pub batch: Option<Batch>,
}

impl Gemm {
    /// `C = A * B` for contiguous column-major `m × k` A, `k × n` B and `m × n` C.
    pub fn plain(
        dtype: DType,
        m: usize,
        n: usize,
        k: usize,
        a: DevicePtr,
        b: DevicePtr,
        c: DevicePtr,
    ) -> Gemm {
        Gemm {
            dtype,
            transa: false,
            transb: false,
            m,
            n,
            k,
            a,
            lda: m.max(1),
            b,
            ldb: k.max(1),
            c,
            ldc: m.max(1),
            alpha: 1.0,
            beta: 0.0,
            batch: None,
        }
    }

    fn check(&self) -> Result<(), MathLibError> {
        let a_rows = if self.transa { self.k } else { self.m };
        let b_rows = if self.transb { self.n } else { self.k };
        for (name, ld, rows) in [
            ("lda", self.lda, a_rows),
            ("ldb", self.ldb, b_rows),
            ("ldc", self.ldc, self.m),
        ] {
            if ld < rows.max(1) {
                return Err(MathLibError::InvalidGemm(format!(
                    "{name} = {ld} is below the matrix's {rows} rows"
                )));
            }
        }
        Ok(())
    }
}

fn data_type(t: CudaDataType) -> DataType {
    match t {
        CudaDataType::CUDA_R_16F => DataType::F16,
        CudaDataType::CUDA_R_16BF => DataType::BF16,
        CudaDataType::CUDA_R_32F => DataType::F32,
        CudaDataType::CUDA_R_64F => DataType::F64,
    }
}

fn compute_type(t: CublasComputeType) -> ComputeType {
    match t {
        CublasComputeType::CUBLAS_COMPUTE_16F => ComputeType::F16,
        CublasComputeType::CUBLAS_COMPUTE_32F => ComputeType::F32,
        CublasComputeType::CUBLAS_COMPUTE_32F_FAST_TF32 => ComputeType::F32FastTf32,
        CublasComputeType::CUBLAS_COMPUTE_32F_EMULATED_16BFX9 => ComputeType::F32Emulated16bfx9,
        CublasComputeType::CUBLAS_COMPUTE_64F => ComputeType::F64,
    }
}

impl Blas {
    /// Enqueues `gemm` on `stream` through this thread's handle. fp32 takes the handle's
    /// math mode (TF32 tensor ops when CUDA matmul resolves to tf32 and no
    /// [`NoTf32Guard`](precision::NoTf32Guard) is alive); fp16 and bf16 set
    /// `CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION` for the call unless reduced
    /// precision reductions are allowed, and put the default math back after it, as PyTorch
    /// does; split-K disallowed is PyTorch's error on this path.
    pub fn gemm(&self, stream: StreamHandle, gemm: &Gemm) -> Result<(), MathLibError> {
        gemm.check()?;
        let plan = precision::cublas_gemm(
            &precision::global(),
            gemm.dtype,
            self.sm_major(),
            precision::reduced_precision_disabled(),
        )?;
        let handle = self.acquire(stream)?;
        let ab_type = data_type(plan.ab_type);
        let call = GemmCall {
            transa: gemm.transa,
            transb: gemm.transb,
            m: gemm.m,
            n: gemm.n,
            k: gemm.k,
            a: gemm.a,
            b: gemm.b,
            c: gemm.c,
            lds: [gemm.lda, gemm.ldb, gemm.ldc],
            ab_type,
            c_type: ab_type,
            scale_type: data_type(plan.scale_type),
            compute: compute_type(plan.compute_type),
            alpha: gemm.alpha,
            beta: gemm.beta,
            batch: gemm.batch,
        };
        let backend = self.backend();
        let half = matches!(gemm.dtype, DType::F16 | DType::BF16);
        if half {
            let mode = if plan.disallow_reduced_precision_reduction {
                MathMode::DisallowReducedPrecisionReduction
            } else {
                MathMode::Default
            };
            self.set_math_mode(handle, mode)?;
        }
        let result = backend.gemm(handle, &call);
        if half {
            self.set_math_mode(handle, MathMode::Default)?;
        }
        result
    }
}
