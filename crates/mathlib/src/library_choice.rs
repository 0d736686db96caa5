//! Which library a GEMM goes through, and what cuBLASLt's heuristic answer depends on (the
//! key its candidates are kept under).
use ferrocuda_driver::cublas::{ComputeType, DataType, GemmCall};
use ferrocuda_types::DevicePtr;

/// PyTorch's `torch.backends.cuda.preferred_blas_library()`: which library a GEMM goes
/// through when no tuned solution says otherwise.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum BlasLibrary {
    /// The classic API (`cublasGemmEx`), PyTorch 2.11's choice for `mm` on CUDA.
    #[default]
    Cublas,
    /// cuBLASLt with its heuristic's first algorithm (the only path for split-K
    /// disallowed).
    CublasLt,
}

/// How many candidates a cuBLASLt heuristic query asks for (the tuner tries at most this
/// many).
pub(crate) const LT_QUERY: usize = 16;

/// What cuBLASLt's heuristic answer depends on: the GEMM without its addresses and
/// scalars, the addresses' alignment, the workspace and the reduction mask.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LtKey {
    trans: (bool, bool),
    mnk: (usize, usize, usize),
    lds: [usize; 3],
    types: [DataType; 3],
    compute: ComputeType,
    batch: Option<(usize, [i64; 3])>,
    alignment: [u32; 3],
    workspace: u64,
    mask: Option<u32>,
}

impl LtKey {
    pub(crate) fn of(call: &GemmCall, workspace: u64, mask: Option<u32>) -> LtKey {
        let align = |p: DevicePtr| p.0.trailing_zeros().min(8);
        LtKey {
            trans: (call.transa, call.transb),
            mnk: (call.m, call.n, call.k),
            lds: call.lds,
            types: [call.ab_type, call.c_type, call.scale_type],
            compute: call.compute,
            batch: call.batch.map(|b| (b.count, b.strides)),
            alignment: [align(call.a), align(call.b), align(call.c)],
            workspace,
            mask,
        }
    }
}
