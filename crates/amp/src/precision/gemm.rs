//! What the precision settings mean for one GEMM: the cuBLAS math mode and the cuBLASLt
//! compute type, scale type and reduction preference, as plain data named after the cuBLAS
//! constants (`CublasHandlePool.cpp`, `CUDABlas.cpp`), plus cuDNN's TF32 rule. No cuBLAS
//! call is made here; the math-library layer applies these values.
#![allow(non_camel_case_types)]

use ferrocuda_types::DType;

use super::settings::ReductionOption;
use super::settings::{Backend, Fp32Precision, PrecisionError, PrecisionOp, PrecisionSettings};

/// `cublasMath_t` values PyTorch sets.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CublasMathMode {
    /// `CUBLAS_DEFAULT_MATH`.
    CUBLAS_DEFAULT_MATH,
    /// `CUBLAS_TF32_TENSOR_OP_MATH`.
    CUBLAS_TF32_TENSOR_OP_MATH,
}

/// `cublasComputeType_t` values PyTorch uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CublasComputeType {
    /// `CUBLAS_COMPUTE_16F`.
    CUBLAS_COMPUTE_16F,
    /// `CUBLAS_COMPUTE_32F`.
    CUBLAS_COMPUTE_32F,
    /// `CUBLAS_COMPUTE_32F_FAST_TF32`.
    CUBLAS_COMPUTE_32F_FAST_TF32,
    /// `CUBLAS_COMPUTE_32F_EMULATED_16BFX9` (CUDA ≥ 12.9).
    CUBLAS_COMPUTE_32F_EMULATED_16BFX9,
    /// `CUBLAS_COMPUTE_64F`.
    CUBLAS_COMPUTE_64F,
}

/// `cudaDataType_t` values of GEMM operands and scalars.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CudaDataType {
    /// `CUDA_R_16F`.
    CUDA_R_16F,
    /// `CUDA_R_16BF`.
    CUDA_R_16BF,
    /// `CUDA_R_32F`.
    CUDA_R_32F,
    /// `CUDA_R_64F`.
    CUDA_R_64F,
}

/// `cublasLtReductionScheme_t` values OR-ed into `CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CublasLtReductionScheme {
    /// `CUBLASLT_REDUCTION_SCHEME_NONE`.
    CUBLASLT_REDUCTION_SCHEME_NONE,
    /// `CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE`.
    CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
}

/// A classic-cuBLAS GEMM (`cublasSgemm` / `cublasGemmEx` / `cublasDgemm`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct CublasGemm {
    /// The math mode set on the handle for the call (fp32 inherits the handle's).
    pub math_mode: CublasMathMode,
    /// Whether `CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION` is OR-ed into it.
    pub disallow_reduced_precision_reduction: bool,
    /// The compute type (`cublasGemmEx`; implied by the routine for S/Dgemm).
    pub compute_type: CublasComputeType,
    /// The type of A and B.
    pub ab_type: CudaDataType,
    /// The type of alpha and beta.
    pub scale_type: CudaDataType,
}

/// A cuBLASLt matmul descriptor's precision part.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct CublasLtGemm {
    /// The compute type.
    pub compute_type: CublasComputeType,
    /// The type of A and B.
    pub ab_type: CudaDataType,
    /// The scale type.
    pub scale_type: CudaDataType,
    /// `CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` (schemes OR-ed), `None` = left alone.
    pub reduction_scheme_mask: Option<&'static [CublasLtReductionScheme]>,
}

/// The math mode set at every cuBLAS handle acquisition: TF32 tensor ops iff CUDA matmul
/// resolves to tf32 and no [`NoTf32Guard`](super::NoTf32Guard) is alive (`no_tf32`).
pub fn cublas_handle_math_mode(s: &PrecisionSettings, no_tf32: bool) -> CublasMathMode {
    if s.resolve(Backend::Cuda, PrecisionOp::Matmul) == Fp32Precision::Tf32 && !no_tf32 {
        CublasMathMode::CUBLAS_TF32_TENSOR_OP_MATH
    } else {
        CublasMathMode::CUBLAS_DEFAULT_MATH
    }
}

/// The classic-cuBLAS settings of a GEMM whose A and B are `dtype`, on a device of compute
/// capability major `sm_major`, with `no_tf32` = a [`NoTf32Guard`](super::NoTf32Guard) alive.
pub fn cublas_gemm(
    s: &PrecisionSettings,
    dtype: DType,
    sm_major: u32,
    no_tf32: bool,
) -> Result<CublasGemm, PrecisionError> {
    use CublasComputeType::*;
    use CudaDataType::*;
    let plain = |math_mode, compute_type, ab_type, scale_type| CublasGemm {
        math_mode,
        disallow_reduced_precision_reduction: false,
        compute_type,
        ab_type,
        scale_type,
    };
    let default = CublasMathMode::CUBLAS_DEFAULT_MATH;
    Ok(match dtype {
        DType::F64 => plain(default, CUBLAS_COMPUTE_64F, CUDA_R_64F, CUDA_R_64F),
        DType::F32 => plain(
            cublas_handle_math_mode(s, no_tf32),
            CUBLAS_COMPUTE_32F,
            CUDA_R_32F,
            CUDA_R_32F,
        ),
        // Before sm 5.0 fp16 goes through cublasSgemmEx with fp32 math.
        DType::F16 if sm_major < 5 => plain(default, CUBLAS_COMPUTE_32F, CUDA_R_16F, CUDA_R_32F),
        DType::F16 | DType::BF16 => {
            let (option, name, ab) = if dtype == DType::F16 {
                (s.fp16_reduction(), "fp16", CUDA_R_16F)
            } else {
                (s.bf16_reduction(), "bf16", CUDA_R_16BF)
            };
            if option == ReductionOption::DisallowReducedPrecisionDisallowSplitK {
                return Err(PrecisionError::SplitKNeedsCublasLt(name));
            }
            let (compute_type, scale_type) = half_compute(s, dtype, sm_major);
            CublasGemm {
                math_mode: default,
                disallow_reduced_precision_reduction: option
                    != ReductionOption::AllowReducedPrecisionWithSplitK,
                compute_type,
                ab_type: ab,
                scale_type,
            }
        }
        other => return Err(PrecisionError::UnsupportedGemmDtype(other)),
    })
}

/// The cuBLASLt settings of a GEMM whose A and B are `dtype`. As in PyTorch, the TF32
/// compute type ignores `no_tf32` unless [`PrecisionSettings::lt_tf32_honours_guard`] is
/// set; the bf16x9 emulation honours it.
pub fn cublaslt_gemm(
    s: &PrecisionSettings,
    dtype: DType,
    sm_major: u32,
    no_tf32: bool,
) -> Result<CublasLtGemm, PrecisionError> {
    use CublasComputeType::*;
    use CudaDataType::*;
    let plain = |compute_type, ab_type, scale_type| CublasLtGemm {
        compute_type,
        ab_type,
        scale_type,
        reduction_scheme_mask: None,
    };
    Ok(match dtype {
        DType::F64 => plain(CUBLAS_COMPUTE_64F, CUDA_R_64F, CUDA_R_64F),
        DType::F32 => {
            let compute = match s.resolve(Backend::Cuda, PrecisionOp::Matmul) {
                Fp32Precision::Tf32 if !(no_tf32 && s.lt_tf32_honours_guard) => {
                    CUBLAS_COMPUTE_32F_FAST_TF32
                }
                Fp32Precision::Bf16x9 if !no_tf32 => CUBLAS_COMPUTE_32F_EMULATED_16BFX9,
                _ => CUBLAS_COMPUTE_32F,
            };
            plain(compute, CUDA_R_32F, CUDA_R_32F)
        }
        DType::F16 | DType::BF16 => {
            let (option, ab) = if dtype == DType::F16 {
                (s.fp16_reduction(), CUDA_R_16F)
            } else {
                (s.bf16_reduction(), CUDA_R_16BF)
            };
            let (compute_type, scale_type) = half_compute(s, dtype, sm_major);
            CublasLtGemm {
                compute_type,
                ab_type: ab,
                scale_type,
                reduction_scheme_mask: reduction_mask(option),
            }
        }
        other => return Err(PrecisionError::UnsupportedGemmDtype(other)),
    })
}

/// fp16 accumulates in fp16 (with fp16 alpha/beta) only when allowed and on sm ≥ 7.0.
fn half_compute(
    s: &PrecisionSettings,
    dtype: DType,
    sm_major: u32,
) -> (CublasComputeType, CudaDataType) {
    if dtype == DType::F16 && s.allow_fp16_accumulation() && sm_major >= 7 {
        (
            CublasComputeType::CUBLAS_COMPUTE_16F,
            CudaDataType::CUDA_R_16F,
        )
    } else {
        (
            CublasComputeType::CUBLAS_COMPUTE_32F,
            CudaDataType::CUDA_R_32F,
        )
    }
}

fn reduction_mask(option: ReductionOption) -> Option<&'static [CublasLtReductionScheme]> {
    use CublasLtReductionScheme::*;
    match option {
        ReductionOption::AllowReducedPrecisionWithSplitK => None,
        ReductionOption::DisallowReducedPrecisionAllowSplitK => Some(&[
            CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
            CUBLASLT_REDUCTION_SCHEME_NONE,
        ]),
        ReductionOption::DisallowReducedPrecisionDisallowSplitK => {
            Some(&[CUBLASLT_REDUCTION_SCHEME_NONE])
        }
    }
}

/// The cuDNN op classes with their own TF32 flag.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CudnnOp {
    /// Convolutions (`torch.backends.cudnn.conv.fp32_precision`).
    Conv,
    /// RNNs (`torch.backends.cudnn.rnn.fp32_precision`).
    Rnn,
}

/// `allowTF32CuDNN(op)`: whether fp32 cuDNN `op`s may use TF32 tensor-core engines.
pub fn cudnn_allows_tf32(s: &PrecisionSettings, op: CudnnOp) -> bool {
    let op = match op {
        CudnnOp::Conv => PrecisionOp::Conv,
        CudnnOp::Rnn => PrecisionOp::Rnn,
    };
    s.resolve(Backend::Cuda, op) == Fp32Precision::Tf32
}
