//! The fp32-precision table (backend × op), its resolution, and the legacy flags written into
//! it as `aten/src/ATen/Context.cpp` does (2.15; the legacy getters checked against 2.11).
use std::fmt;
use std::str::FromStr;

/// A backend of the precision table (`torch.backends.{fp32_precision, cuda, mkldnn}`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// `generic`: the fallback of every backend.
    Generic,
    /// `cuda`: cuBLAS matmuls (`cuda.matmul`) and cuDNN (`cudnn.conv`, `cudnn.rnn`).
    Cuda,
    /// `mkldnn`: oneDNN on CPU / XPU.
    Mkldnn,
}

/// An op class of the precision table.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum PrecisionOp {
    /// `all`: the backend-wide fallback.
    All,
    /// `conv`.
    Conv,
    /// `rnn`.
    Rnn,
    /// `matmul`.
    Matmul,
}

/// How fp32 math may be computed.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Fp32Precision {
    /// `none`: inherit from (backend, all), then (generic, all).
    Inherit,
    /// `ieee`: full fp32.
    Ieee,
    /// `tf32`: TensorFloat-32 tensor cores.
    Tf32,
    /// `bf16`: bf16 tensor cores (mkldnn only).
    Bf16,
    /// cuBLAS fp32 emulation with three bf16 products (`CUBLAS_COMPUTE_32F_EMULATED_16BFX9`,
    /// CUDA ≥ 12.9); PyTorch has it internally but does not accept it by name.
    Bf16x9,
}

/// The reduced-precision-reduction option of fp16 / bf16 GEMMs (`CuBLASReductionOption`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReductionOption {
    /// Reduced-precision reductions and split-K allowed (the default).
    AllowReducedPrecisionWithSplitK = 0,
    /// No reduced-precision reductions; split-K allowed.
    DisallowReducedPrecisionAllowSplitK = 1,
    /// Neither (cuBLASLt only).
    DisallowReducedPrecisionDisallowSplitK = 2,
}

/// The legacy `torch.set_float32_matmul_precision` values.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum MatmulPrecision {
    /// `"highest"`: ieee.
    Highest,
    /// `"high"`: tf32.
    High,
    /// `"medium"`: tf32 on CUDA, bf16 on mkldnn.
    Medium,
}

/// What the precision API refuses (PyTorch's texts).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrecisionError {
    /// An unknown backend name.
    #[error("Unknown backend: {0}")]
    UnknownBackend(String),
    /// An unknown op name.
    #[error("Unknown op: {0}")]
    UnknownOp(String),
    /// An unknown precision name.
    #[error("Unknown precision: {0}")]
    UnknownPrecision(String),
    /// A (backend, op) pair the table does not have.
    #[error("Invalid (backend, op) pair: ({backend}, {op})")]
    InvalidPair {
        /// The backend.
        backend: Backend,
        /// The op.
        op: PrecisionOp,
    },
    /// A precision the backend cannot use.
    #[error("backend '{backend}' does not support precision '{precision}'")]
    UnsupportedPrecision {
        /// The backend.
        backend: Backend,
        /// The precision.
        precision: Fp32Precision,
    },
    /// Not one of "highest", "high", "medium" (PyTorch only warns and ignores the call).
    #[error(
        "{0} is not one of 'highest', 'high', or 'medium'; the current\
         setFloat32MatmulPrecision call has no effect."
    )]
    UnknownMatmulPrecision(String),
    /// `allow_*_reduced_precision_reduction = (True, False)`.
    #[error("allow_splitk=False is not supported when reduced precision reductions are enabled")]
    SplitKWithReducedPrecision,
    /// The classic cuBLAS path cannot disallow split-K.
    #[error(
        "torch.backends.cuda.matmul.allow_{0}_reduced_precision_reduction(..., allow_splitk=False) \
         requires the cuBLASLt backend"
    )]
    SplitKNeedsCublasLt(&'static str),
    /// `torch.backends.cuda.matmul.allow_tf32` read while the legacy matmul precision and
    /// the new CUDA matmul precision disagree (PyTorch's getter raises this).
    #[error("{}", MIXED_MATMUL_TF32)]
    MixedMatmulTf32,
    /// `torch.get_float32_matmul_precision()` read while the legacy value and the new
    /// CUDA or mkldnn matmul precision disagree.
    #[error("{}", MIXED_MATMUL_PRECISION)]
    MixedMatmulPrecision,
    /// `torch.backends.cudnn.allow_tf32` read while cuDNN conv, cuDNN rnn and the legacy
    /// cuDNN flag disagree.
    #[error("{}", MIXED_CUDNN_TF32)]
    MixedCudnnTf32,
    /// A GEMM of a dtype cuBLAS has no floating path for.
    #[error("no cuBLAS floating-point GEMM for {0:?}")]
    UnsupportedGemmDtype(ferrocuda_types::DType),
}

/// PyTorch's legacy getter messages (`Context.cpp`).
const MIXED_MATMUL_TF32: &str = "PyTorch is checking whether allow_tf32_new is enabled for cuBlas matmul,Current status indicate that you have used mix of the legacy and new APIs to set the TF32 status for cublas matmul. We suggest only using the new API to set the TF32 flag. See also: https://pytorch.org/docs/main/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices";
const MIXED_MATMUL_PRECISION: &str = "PyTorch is checking the matmul precision without a specific backend name,Current status indicate that you have used mix of the legacy and new APIs to set the matmul precision. We suggest only using the new API for matmul precision. See also: https://pytorch.org/docs/main/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices";
const MIXED_CUDNN_TF32: &str = "PyTorch is checking whether allow_tf32 is enabled for cuDNN without a specific operator name,but the current flag(s) indicate that cuDNN conv and cuDNN RNN have different TF32 flags.This combination indicates that you have used a mix of the legacy and new APIs to set the TF32 flags. We suggest only using the new API to set the TF32 flag(s). See also: https://pytorch.org/docs/main/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices";

const BACKENDS: usize = 3;
const OPS: usize = 4;

/// Every precision flag of the process in one value. `Copy`, so a GEMM path can read a
/// consistent snapshot.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PrecisionSettings {
    table: [[Fp32Precision; OPS]; BACKENDS],
    legacy_matmul: MatmulPrecision,
    fp16_reduction: ReductionOption,
    bf16_reduction: ReductionOption,
    fp16_accumulation: bool,
    /// The legacy `torch.backends.cudnn.allow_tf32` flag, kept beside the table as PyTorch
    /// keeps it (`Context::allow_tf32_cudnn`): its getter answers with it.
    legacy_cudnn_tf32: bool,
    /// Whether the cuBLASLt TF32 compute type honours the no-reduced-precision guard
    /// (PyTorch's does not: off by default).
    pub lt_tf32_honours_guard: bool,
}

impl Default for PrecisionSettings {
    fn default() -> Self {
        PrecisionSettings::PYTORCH_DEFAULT
    }
}

impl PrecisionSettings {
    /// PyTorch 2.15's defaults: cuda matmul inherits (ieee), cuDNN conv and rnn tf32,
    /// legacy "highest", reduced-precision reductions allowed, no fp16 accumulation.
    pub const PYTORCH_DEFAULT: PrecisionSettings = {
        use Fp32Precision::{Inherit as N, Tf32};
        PrecisionSettings {
            // rows: generic, cuda, mkldnn; columns: all, conv, rnn, matmul
            table: [[N; OPS], [N, Tf32, Tf32, N], [N; OPS]],
            legacy_matmul: MatmulPrecision::Highest,
            fp16_reduction: ReductionOption::AllowReducedPrecisionWithSplitK,
            bf16_reduction: ReductionOption::AllowReducedPrecisionWithSplitK,
            fp16_accumulation: false,
            legacy_cudnn_tf32: true,
            lt_tf32_honours_guard: false,
        }
    };

    /// The defaults when `TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`: the legacy matmul precision
    /// "high" and CUDA matmul tf32; mkldnn matmul stays unset (PyTorch 2.11).
    pub fn with_tf32_cublas_override() -> PrecisionSettings {
        let mut s = PrecisionSettings::PYTORCH_DEFAULT;
        s.legacy_matmul = MatmulPrecision::High;
        s.table[Backend::Cuda as usize][PrecisionOp::Matmul as usize] = Fp32Precision::Tf32;
        s
    }

    /// The defaults, or [`PrecisionSettings::with_tf32_cublas_override`] when `var` (a
    /// reader of the environment) says `TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> PrecisionSettings {
        match var("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE").as_deref() {
            Some("1") => PrecisionSettings::with_tf32_cublas_override(),
            _ => PrecisionSettings::PYTORCH_DEFAULT,
        }
    }

    /// The stored value of (backend, op), `Inherit` included.
    pub fn get(&self, backend: Backend, op: PrecisionOp) -> Result<Fp32Precision, PrecisionError> {
        check_pair(backend, op)?;
        Ok(self.table[backend as usize][op as usize])
    }

    /// Sets (backend, op) (`torch.backends.<backend>.<op>.fp32_precision = ...`).
    pub fn set(
        &mut self,
        backend: Backend,
        op: PrecisionOp,
        precision: Fp32Precision,
    ) -> Result<(), PrecisionError> {
        check_pair(backend, op)?;
        let refused = match precision {
            Fp32Precision::Bf16 => backend == Backend::Cuda,
            Fp32Precision::Bf16x9 => backend != Backend::Cuda,
            _ => false,
        };
        if refused {
            return Err(PrecisionError::UnsupportedPrecision { backend, precision });
        }
        self.table[backend as usize][op as usize] = precision;
        Ok(())
    }

    /// `torch.backends.<backend>.<op>.fp32_precision` as PyTorch reads it
    /// (`Context::float32Precision`): the stored value, else (backend, all), else
    /// (generic, all); `Inherit` ("none") when none is set, and for a bf16 that reaches CUDA.
    pub fn fp32_precision(
        &self,
        backend: Backend,
        op: PrecisionOp,
    ) -> Result<Fp32Precision, PrecisionError> {
        check_pair(backend, op)?;
        Ok(self.inherited(backend, op))
    }

    /// [`PrecisionSettings::fp32_precision`] of a valid pair.
    fn inherited(&self, backend: Backend, op: PrecisionOp) -> Fp32Precision {
        let row = &self.table[backend as usize];
        let set = [
            row[op as usize],
            row[PrecisionOp::All as usize],
            self.table[Backend::Generic as usize][PrecisionOp::All as usize],
        ]
        .into_iter()
        .find(|p| *p != Fp32Precision::Inherit)
        .unwrap_or(Fp32Precision::Inherit);
        if backend == Backend::Cuda && set == Fp32Precision::Bf16 {
            return Fp32Precision::Inherit;
        }
        set
    }

    /// The precision kernels use for (backend, op): [`PrecisionSettings::fp32_precision`],
    /// ieee when that is unset.
    pub fn resolve(&self, backend: Backend, op: PrecisionOp) -> Fp32Precision {
        match self.inherited(backend, op) {
            Fp32Precision::Inherit => Fp32Precision::Ieee,
            p => p,
        }
    }

    /// `torch.set_float32_matmul_precision`: the legacy value, cuda matmul and mkldnn matmul.
    pub fn set_float32_matmul_precision(&mut self, p: MatmulPrecision) {
        use Fp32Precision::{Bf16, Ieee, Tf32};
        let (cuda, mkldnn) = match p {
            MatmulPrecision::Highest => (Ieee, Ieee),
            MatmulPrecision::High => (Tf32, Tf32),
            MatmulPrecision::Medium => (Tf32, Bf16),
        };
        self.legacy_matmul = p;
        self.table[Backend::Cuda as usize][PrecisionOp::Matmul as usize] = cuda;
        self.table[Backend::Mkldnn as usize][PrecisionOp::Matmul as usize] = mkldnn;
    }

    /// `torch.get_float32_matmul_precision()`: the stored legacy value, not one derived
    /// from the table (after "medium" and then CUDA matmul set to ieee, still "medium"). As
    /// PyTorch's `Context::float32MatmulPrecision`, an error when the new API contradicts it:
    /// CUDA matmul tf32 under "highest", mkldnn matmul bf16 other than under "medium",
    /// mkldnn matmul tf32 other than under "high".
    pub fn float32_matmul_precision(&self) -> Result<MatmulPrecision, PrecisionError> {
        let legacy = self.legacy_matmul;
        let cuda = self.inherited(Backend::Cuda, PrecisionOp::Matmul);
        let mkldnn = self.inherited(Backend::Mkldnn, PrecisionOp::Matmul);
        let mixed = (cuda == Fp32Precision::Tf32 && legacy == MatmulPrecision::Highest)
            || (mkldnn == Fp32Precision::Bf16 && legacy != MatmulPrecision::Medium)
            || (mkldnn == Fp32Precision::Tf32 && legacy != MatmulPrecision::High);
        if mixed {
            return Err(PrecisionError::MixedMatmulPrecision);
        }
        Ok(legacy)
    }

    /// `torch.backends.cuda.matmul.allow_tf32 = b`: legacy high / highest, cuda matmul
    /// tf32 / ieee (mkldnn untouched).
    pub fn set_allow_tf32_matmul(&mut self, allow: bool) {
        self.legacy_matmul = if allow {
            MatmulPrecision::High
        } else {
            MatmulPrecision::Highest
        };
        self.table[Backend::Cuda as usize][PrecisionOp::Matmul as usize] = if allow {
            Fp32Precision::Tf32
        } else {
            Fp32Precision::Ieee
        };
    }

    /// `torch.backends.cuda.matmul.allow_tf32`: whether CUDA matmuls resolve to tf32; an
    /// error when the legacy matmul precision says otherwise (`Context::allowTF32CuBLAS`).
    pub fn allow_tf32_matmul(&self) -> Result<bool, PrecisionError> {
        let new = self.resolve(Backend::Cuda, PrecisionOp::Matmul) == Fp32Precision::Tf32;
        if new != (self.legacy_matmul != MatmulPrecision::Highest) {
            return Err(PrecisionError::MixedMatmulTf32);
        }
        Ok(new)
    }

    /// `torch.backends.cudnn.allow_tf32 = b`: cuDNN conv and rnn tf32, or inherit, and the
    /// legacy flag.
    pub fn set_allow_tf32_cudnn(&mut self, allow: bool) {
        let p = if allow {
            Fp32Precision::Tf32
        } else {
            Fp32Precision::Inherit
        };
        self.table[Backend::Cuda as usize][PrecisionOp::Conv as usize] = p;
        self.table[Backend::Cuda as usize][PrecisionOp::Rnn as usize] = p;
        self.legacy_cudnn_tf32 = allow;
    }

    /// `torch.backends.cudnn.allow_tf32`: the legacy flag; an error unless cuDNN conv and
    /// rnn both resolve to tf32 as it says, or both do not (`Context::allowTF32CuDNN`).
    pub fn allow_tf32_cudnn(&self) -> Result<bool, PrecisionError> {
        let tf32 = |op| self.resolve(Backend::Cuda, op) == Fp32Precision::Tf32;
        let (conv, rnn) = (tf32(PrecisionOp::Conv), tf32(PrecisionOp::Rnn));
        if conv != rnn || conv != self.legacy_cudnn_tf32 {
            return Err(PrecisionError::MixedCudnnTf32);
        }
        Ok(self.legacy_cudnn_tf32)
    }

    /// `allow_fp16_reduced_precision_reduction = allow` or `= (allow, allow_splitk)`.
    pub fn set_allow_fp16_reduced_precision_reduction(
        &mut self,
        allow: bool,
        allow_splitk: Option<bool>,
    ) -> Result<(), PrecisionError> {
        self.fp16_reduction = reduction_option(allow, allow_splitk)?;
        Ok(())
    }

    /// `allow_bf16_reduced_precision_reduction = allow` or `= (allow, allow_splitk)`.
    pub fn set_allow_bf16_reduced_precision_reduction(
        &mut self,
        allow: bool,
        allow_splitk: Option<bool>,
    ) -> Result<(), PrecisionError> {
        self.bf16_reduction = reduction_option(allow, allow_splitk)?;
        Ok(())
    }

    /// The fp16 GEMM reduction option.
    pub fn fp16_reduction(&self) -> ReductionOption {
        self.fp16_reduction
    }

    /// The bf16 GEMM reduction option.
    pub fn bf16_reduction(&self) -> ReductionOption {
        self.bf16_reduction
    }

    /// `allow_fp16_reduced_precision_reduction` (the first bool).
    pub fn allow_fp16_reduced_precision_reduction(&self) -> bool {
        self.fp16_reduction == ReductionOption::AllowReducedPrecisionWithSplitK
    }

    /// `allow_fp16_reduced_precision_reduction_split_k` (the second bool).
    pub fn allow_fp16_reduced_precision_reduction_split_k(&self) -> bool {
        self.fp16_reduction != ReductionOption::DisallowReducedPrecisionDisallowSplitK
    }

    /// `allow_bf16_reduced_precision_reduction` (the first bool).
    pub fn allow_bf16_reduced_precision_reduction(&self) -> bool {
        self.bf16_reduction == ReductionOption::AllowReducedPrecisionWithSplitK
    }

    /// `allow_bf16_reduced_precision_reduction_split_k` (the second bool).
    pub fn allow_bf16_reduced_precision_reduction_split_k(&self) -> bool {
        self.bf16_reduction != ReductionOption::DisallowReducedPrecisionDisallowSplitK
    }

    /// `torch.backends.cuda.matmul.allow_fp16_accumulation = b`.
    pub fn set_allow_fp16_accumulation(&mut self, allow: bool) {
        self.fp16_accumulation = allow;
    }

    /// `torch.backends.cuda.matmul.allow_fp16_accumulation`.
    pub fn allow_fp16_accumulation(&self) -> bool {
        self.fp16_accumulation
    }
}

fn check_pair(backend: Backend, op: PrecisionOp) -> Result<(), PrecisionError> {
    if backend == Backend::Generic && op != PrecisionOp::All {
        return Err(PrecisionError::InvalidPair { backend, op });
    }
    Ok(())
}

fn reduction_option(
    allow: bool,
    allow_splitk: Option<bool>,
) -> Result<ReductionOption, PrecisionError> {
    match (allow, allow_splitk.unwrap_or(true)) {
        (true, true) => Ok(ReductionOption::AllowReducedPrecisionWithSplitK),
        (true, false) => Err(PrecisionError::SplitKWithReducedPrecision),
        (false, true) => Ok(ReductionOption::DisallowReducedPrecisionAllowSplitK),
        (false, false) => Ok(ReductionOption::DisallowReducedPrecisionDisallowSplitK),
    }
}

macro_rules! names {
    ($ty:ty, $err:ident, $($variant:path => $name:literal),+ $(,)?) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(match self { $($variant => $name),+ })
            }
        }
        impl FromStr for $ty {
            type Err = PrecisionError;
            fn from_str(s: &str) -> Result<Self, PrecisionError> {
                match s { $($name => Ok($variant),)+ _ => Err(PrecisionError::$err(s.to_owned())) }
            }
        }
    };
}

names!(Backend, UnknownBackend,
    Backend::Generic => "generic", Backend::Cuda => "cuda", Backend::Mkldnn => "mkldnn");
names!(PrecisionOp, UnknownOp,
    PrecisionOp::All => "all", PrecisionOp::Conv => "conv", PrecisionOp::Rnn => "rnn",
    PrecisionOp::Matmul => "matmul");
names!(MatmulPrecision, UnknownMatmulPrecision,
    MatmulPrecision::Highest => "highest", MatmulPrecision::High => "high",
    MatmulPrecision::Medium => "medium");

impl fmt::Display for Fp32Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fp32Precision::Inherit => "none",
            Fp32Precision::Ieee => "ieee",
            Fp32Precision::Tf32 => "tf32",
            Fp32Precision::Bf16 => "bf16",
            Fp32Precision::Bf16x9 => "bf16x9",
        })
    }
}

impl FromStr for Fp32Precision {
    type Err = PrecisionError;
    /// The names PyTorch accepts: `none`, `ieee`, `tf32`, `bf16` (not `bf16x9`).
    fn from_str(s: &str) -> Result<Self, PrecisionError> {
        match s {
            "none" => Ok(Fp32Precision::Inherit),
            "ieee" => Ok(Fp32Precision::Ieee),
            "tf32" => Ok(Fp32Precision::Tf32),
            "bf16" => Ok(Fp32Precision::Bf16),
            _ => Err(PrecisionError::UnknownPrecision(s.to_owned())),
        }
    }
}

impl MatmulPrecision {
    /// Parses as `torch.set_float32_matmul_precision` does: exact, else lower-cased.
    pub fn parse_lenient(s: &str) -> Result<MatmulPrecision, PrecisionError> {
        s.parse()
            .or_else(|_| s.to_lowercase().parse())
            .map_err(|_| PrecisionError::UnknownMatmulPrecision(s.to_owned()))
    }
}
