//! GEMM through classic cuBLAS under PyTorch's precision settings (`at::cuda::blas::gemm`
//! and `bgemm` in `aten/src/ATen/cuda/CUDABlas.cpp`): the compute and scale types and the
//! math mode come from [`ferrocuda_amp::precision::cublas_gemm`], which also raises
//! PyTorch's errors.
use crate::MathLibError;
use crate::backend::{HandleId, LtCall, LtCandidate};
use crate::handles::{Blas, Bound};
use crate::library_choice::{BlasLibrary, LT_QUERY, LtKey};
use ferrocuda_amp::precision::{self, CublasComputeType, CublasLtReductionScheme, CudaDataType};
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
        let invalid = |why: String| Err(MathLibError::InvalidGemm(why));
        let a_rows = if self.transa { self.k } else { self.m };
        let b_rows = if self.transb { self.n } else { self.k };
        for (name, ld, rows) in [
            ("lda", self.lda, a_rows),
            ("ldb", self.ldb, b_rows),
            ("ldc", self.ldc, self.m),
        ] {
            if ld < rows.max(1) {
                return invalid(format!("{name} = {ld} is below the matrix's {rows} rows"));
            }
        }
        // cuBLAS takes dimensions, leading dimensions and the batch count as `int`.
        let count = self.batch.map_or(1, |b| b.count);
        let dims = [self.m, self.n, self.k, self.lda, self.ldb, self.ldc, count];
        if dims.iter().any(|&d| i32::try_from(d).is_err()) {
            return invalid(format!("{dims:?}: cuBLAS takes each as a 32-bit int"));
        }
        let a_cols = if self.transa { self.m } else { self.k };
        let b_cols = if self.transb { self.k } else { self.n };
        let strides = self.batch.map_or([0; 3], |b| b.strides);
        let elem = self.dtype.size() as u64;
        for (name, ld, cols, stride) in [
            ("A", self.lda, a_cols, strides[0]),
            ("B", self.ldb, b_cols, strides[1]),
            ("C", self.ldc, self.n, strides[2]),
        ] {
            let Ok(stride) = u64::try_from(stride) else {
                return invalid(format!("{name}'s batch stride {stride} is negative"));
            };
            let extent = (ld as u64)
                .checked_mul(cols as u64)
                .and_then(|one| {
                    stride
                        .checked_mul(count.saturating_sub(1) as u64)?
                        .checked_add(one)
                })
                .and_then(|elements| elements.checked_mul(elem));
            if extent.is_none_or(|bytes| bytes > i64::MAX as u64) {
                return invalid(format!("{name}'s extent does not fit in 64 bits"));
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

impl Gemm {
    /// The driver's call for this GEMM with the given types, writing `c`.
    pub(crate) fn call(
        &self,
        c: DevicePtr,
        (ab, scale, compute): (CudaDataType, CudaDataType, CublasComputeType),
    ) -> GemmCall {
        GemmCall {
            transa: self.transa,
            transb: self.transb,
            m: self.m,
            n: self.n,
            k: self.k,
            a: self.a,
            b: self.b,
            c,
            lds: [self.lda, self.ldb, self.ldc],
            ab_type: data_type(ab),
            c_type: data_type(ab),
            scale_type: data_type(scale),
            compute: compute_type(compute),
            alpha: self.alpha,
            beta: self.beta,
            batch: self.batch,
        }
    }

    /// Elements C spans (the last matrix of a batch included).
    pub(crate) fn c_elements(&self) -> usize {
        let one = self.ldc * self.n.saturating_sub(1) + self.m;
        match self.batch {
            Some(b) => (b.strides[2].max(0) as usize) * b.count.saturating_sub(1) + one,
            None => one,
        }
    }
}

/// How one GEMM runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    Classic,
    Lt(usize),
}

impl Blas {
    /// Enqueues `gemm` on `stream` through this thread's handle: the tuned solution when
    /// TunableOp is on (tuning a new signature first if tuning is on), else the preferred
    /// library.
    ///
    /// Classic path: fp32 takes the handle's math mode (TF32 tensor ops when CUDA matmul
    /// resolves to tf32 and no [`NoTf32Guard`](precision::NoTf32Guard) is alive); fp16
    /// and bf16 set `CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION` for the call unless
    /// reduced precision reductions are allowed, and put the default math back after it,
    /// as PyTorch does; split-K disallowed is PyTorch's error there. cuBLASLt path: the
    /// compute type and reduction-scheme mask of [`precision::cublaslt_gemm`], the
    /// handle's workspace (unified, as PyTorch's default).
    pub fn gemm(&self, stream: StreamHandle, gemm: &Gemm) -> Result<(), MathLibError> {
        gemm.check()?;
        if self.allocator()?.routed_capture(stream)?.is_some() {
            return self.gemm_in_capture(stream, gemm);
        }
        let bound = self.acquire_with(stream, |handle| self.workspace(handle, stream))?;
        let path = self.path_for(&bound, gemm, true)?;
        self.run_path(&bound, gemm, gemm.c, path)
    }

    /// TunableOp's path for `gemm` (tuning it first if `may_tune`), else the preferred
    /// library's.
    fn path_for(&self, bound: &Bound, gemm: &Gemm, may_tune: bool) -> Result<Path, MathLibError> {
        Ok(match self.tuned_path(bound, gemm, may_tune)? {
            Some(p) => p,
            None => match self.preferred_blas_library() {
                BlasLibrary::Cublas => Path::Classic,
                BlasLibrary::CublasLt => Path::Lt(0),
            },
        })
    }

    /// A GEMM recorded into a CUDA graph capture gets a workspace of its own, allocated on
    /// the capture stream (so from the graph's private pool) and freed right after the
    /// call is recorded, as a temporary tensor of the capture would be: the pool keeps it
    /// for the graph's replays and a later allocation of the same capture reuses it in
    /// stream order. Graphs with pools of their own therefore never share a workspace
    /// (PyTorch binds the stream's one to every capture on that stream, PyTorch issue
    /// 193402), and the workspace goes with the graph's pool. TunableOp does not tune
    /// here (timing synchronizes, which a capture forbids): a signature with a result
    /// takes it, a new one the untuned path.
    fn gemm_in_capture(&self, stream: StreamHandle, gemm: &Gemm) -> Result<(), MathLibError> {
        let allocator = self.allocator()?;
        let bytes = self.cublas_workspace_size();
        let workspace = allocator.allocate(bytes, stream)?;
        let result = self
            .acquire_with(stream, |_| Ok((workspace.ptr, bytes)))
            .and_then(|bound| {
                let path = self.path_for(&bound, gemm, false)?;
                self.run_path(&bound, gemm, gemm.c, path)
            });
        let freed = allocator.free(workspace.ptr);
        result?;
        Ok(freed?)
    }

    /// Runs `gemm` (writing `c`) the way `path` says, on the handle `bound` set up.
    pub(crate) fn run_path(
        &self,
        bound: &Bound,
        gemm: &Gemm,
        c: DevicePtr,
        path: Path,
    ) -> Result<(), MathLibError> {
        let handle = bound.handle;
        let settings = precision::global();
        let no_tf32 = precision::reduced_precision_disabled();
        match path {
            Path::Classic => {
                let plan = precision::cublas_gemm(&settings, gemm.dtype, self.sm_major(), no_tf32)?;
                let call = gemm.call(c, (plan.ab_type, plan.scale_type, plan.compute_type));
                let half = matches!(gemm.dtype, DType::F16 | DType::BF16);
                if half {
                    let mode = if plan.disallow_reduced_precision_reduction {
                        MathMode::DisallowReducedPrecisionReduction
                    } else {
                        MathMode::Default
                    };
                    self.set_math_mode(handle, mode)?;
                }
                let result = self.backend().gemm(handle, &call);
                if half {
                    self.set_math_mode(handle, MathMode::Default)?;
                }
                result
            }
            Path::Lt(rank) => {
                let plan =
                    precision::cublaslt_gemm(&settings, gemm.dtype, self.sm_major(), no_tf32)?;
                let call = gemm.call(c, (plan.ab_type, plan.scale_type, plan.compute_type));
                let mask = plan.reduction_scheme_mask.map(reduction_mask);
                let workspace = bound.workspace;
                let candidates = self.lt_candidates(handle, &call, workspace.1, mask)?;
                let candidate = candidates.get(rank).ok_or_else(|| {
                    MathLibError::InvalidGemm(format!(
                        "cuBLASLt proposes {} algorithms for this GEMM, none of rank {rank}",
                        candidates.len()
                    ))
                })?;
                let lt = LtCall {
                    call: &call,
                    candidate,
                    workspace,
                    reduction_mask: mask,
                };
                self.backend().lt_gemm(handle, &lt, bound.stream)
            }
        }
    }
}

impl Blas {
    /// cuBLASLt's candidates for `call`, asked once per [`LtKey`] (PyTorch asks the
    /// heuristic at every call; the answer depends only on the key).
    fn lt_candidates(
        &self,
        handle: HandleId,
        call: &GemmCall,
        workspace: u64,
        mask: Option<u32>,
    ) -> Result<Vec<LtCandidate>, MathLibError> {
        let key = LtKey::of(call, workspace, mask);
        if let Some(found) = self.lt_cache().lock().get(&key) {
            return Ok(found.clone());
        }
        let found = self
            .backend()
            .lt_candidates(handle, call, workspace, mask, LT_QUERY)?;
        self.lt_cache().lock().insert(key, found.clone());
        Ok(found)
    }
}

/// `CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK`: the schemes OR-ed
/// (`cublasLtReductionScheme_t`: none 0, compute type 2).
fn reduction_mask(schemes: &[CublasLtReductionScheme]) -> u32 {
    schemes
        .iter()
        .map(|s| match s {
            CublasLtReductionScheme::CUBLASLT_REDUCTION_SCHEME_NONE => 0,
            CublasLtReductionScheme::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE => 2,
        })
        .fold(0, |a, b| a | b)
}
