//! cuBLASLt through cudarc's bindings (`cudarc::cublaslt::sys`, loaded at run time), on a
//! [`CublasHandle`] (a cuBLAS handle is a valid cuBLASLt handle, cuBLAS's documented rule):
//! the heuristic's candidate algorithms for a GEMM, and the GEMM run with one of them, a
//! workspace of the caller's, and optionally the reduction schemes it may use (PyTorch's
//! `CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` for split-K disallowed). Descriptors are
//! made and destroyed per call, as PyTorch's `CuBlasLtMatmulDescriptor` and friends are.
use super::cublas::{BlasError, ComputeType, CublasHandle, DataType, GemmCall};
use super::libraries;
use cudarc::cublaslt::sys as lt;
use ferrocuda_types::{DevicePtr, StreamHandle};
use std::ffi::c_void;
use std::sync::OnceLock;

const SYMBOLS: &[&str] = &[
    "cublasLtMatmulDescCreate",
    "cublasLtMatmulDescDestroy",
    "cublasLtMatmulDescSetAttribute",
    "cublasLtMatrixLayoutCreate",
    "cublasLtMatrixLayoutDestroy",
    "cublasLtMatrixLayoutSetAttribute",
    "cublasLtMatmulPreferenceCreate",
    "cublasLtMatmulPreferenceDestroy",
    "cublasLtMatmulPreferenceSetAttribute",
    "cublasLtMatmulAlgoGetHeuristic",
    "cublasLtMatmul",
    "cublasLtGetVersion",
];

/// Whether libcublasLt and every function used here can be loaded (looked for once).
pub fn available() -> Result<(), BlasError> {
    static FOUND: OnceLock<Result<(), BlasError>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            libraries::find(
                "cublasLt",
                &[],
                // SAFETY: only tries to open the library by its usual names.
                || unsafe { lt::is_culib_present() },
                // SAFETY: called once the library was found, so cudarc's loader opens it.
                || unsafe { lt::culib() },
                SYMBOLS,
            )
            .map_err(BlasError::Unavailable)
        })
        .clone()
}

/// The loaded cuBLASLt's version (`cublasLtGetVersion`, e.g. 130100).
pub fn version() -> Result<usize, BlasError> {
    available()?;
    // SAFETY: the library is present.
    Ok(unsafe { lt::cublasLtGetVersion() })
}

fn check(r: lt::cublasStatus_t) -> Result<(), BlasError> {
    if r == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(BlasError::Cublas {
            code: r as u32,
            name: "cuBLASLt status (see cublasStatus_t)",
        })
    }
}

/// One of the heuristic's algorithms for a GEMM: opaque, valid for the GEMM it was found
/// for with at least its workspace.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct LtAlgo {
    raw: [u64; 8],
    /// Bytes of workspace it needs.
    pub workspace: u64,
    /// The heuristic's waves count (how well it fills the GPU).
    pub waves: f32,
}

fn data_type(t: DataType) -> lt::cudaDataType {
    match t {
        DataType::F16 => lt::cudaDataType::CUDA_R_16F,
        DataType::BF16 => lt::cudaDataType::CUDA_R_16BF,
        DataType::F32 => lt::cudaDataType::CUDA_R_32F,
        DataType::F64 => lt::cudaDataType::CUDA_R_64F,
    }
}

fn compute_type(t: ComputeType) -> lt::cublasComputeType_t {
    use lt::cublasComputeType_t as C;
    match t {
        ComputeType::F16 => C::CUBLAS_COMPUTE_16F,
        ComputeType::F32 => C::CUBLAS_COMPUTE_32F,
        ComputeType::F32FastTf32 => C::CUBLAS_COMPUTE_32F_FAST_TF32,
        ComputeType::F32Emulated16bfx9 => C::CUBLAS_COMPUTE_32F_EMULATED_16BFX9,
        ComputeType::F64 => C::CUBLAS_COMPUTE_64F,
    }
}

/// The descriptors of one GEMM, destroyed when dropped.
struct Descriptors {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    pref: lt::cublasLtMatmulPreference_t,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created once by cuBLASLt (null ones skipped) and is destroyed
        // once, here.
        unsafe {
            if !self.desc.is_null() {
                let _ = lt::cublasLtMatmulDescDestroy(self.desc);
            }
            for l in self.layouts {
                if !l.is_null() {
                    let _ = lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.pref.is_null() {
                let _ = lt::cublasLtMatmulPreferenceDestroy(self.pref);
            }
        }
    }
}

/// Sets a descriptor attribute from `v`, whose type is the attribute's (the callers pass
/// i32, i64, u32 or u64 as cuBLASLt documents each).
fn set_desc<T>(
    desc: lt::cublasLtMatmulDesc_t,
    attr: lt::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<(), BlasError> {
    // SAFETY: a live descriptor; cuBLASLt reads `size_of::<T>()` bytes from `v`.
    check(unsafe {
        lt::cublasLtMatmulDescSetAttribute(desc, attr, (v as *const T).cast(), size_of::<T>())
    })
}

/// [`set_desc`] for a matrix layout.
fn set_layout<T>(
    layout: lt::cublasLtMatrixLayout_t,
    attr: lt::cublasLtMatrixLayoutAttribute_t,
    v: &T,
) -> Result<(), BlasError> {
    // SAFETY: a live layout; cuBLASLt reads `size_of::<T>()` bytes from `v`.
    check(unsafe {
        lt::cublasLtMatrixLayoutSetAttribute(layout, attr, (v as *const T).cast(), size_of::<T>())
    })
}

/// [`set_desc`] for a preference.
fn set_pref<T>(
    pref: lt::cublasLtMatmulPreference_t,
    attr: lt::cublasLtMatmulPreferenceAttributes_t,
    v: &T,
) -> Result<(), BlasError> {
    // SAFETY: a live preference; cuBLASLt reads `size_of::<T>()` bytes from `v`.
    check(unsafe {
        lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, (v as *const T).cast(), size_of::<T>())
    })
}

/// The descriptors of `call` (operations, layouts with their batch, compute and scale
/// types), with a preference for at most `workspace` bytes and, given, the reduction mask.
fn describe(
    call: &GemmCall,
    workspace: u64,
    reduction_mask: Option<u32>,
) -> Result<Descriptors, BlasError> {
    let mut d = Descriptors {
        desc: std::ptr::null_mut(),
        layouts: [std::ptr::null_mut(); 3],
        pref: std::ptr::null_mut(),
    };
    // SAFETY: writes a new descriptor through a valid pointer.
    check(unsafe {
        lt::cublasLtMatmulDescCreate(
            &mut d.desc,
            compute_type(call.compute),
            data_type(call.scale_type),
        )
    })?;
    for (attr, t) in [
        (
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            call.transa,
        ),
        (
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            call.transb,
        ),
    ] {
        let op: i32 = i32::from(t);
        set_desc(d.desc, attr, &op)?;
    }
    let (a_rows, a_cols) = if call.transa {
        (call.k, call.m)
    } else {
        (call.m, call.k)
    };
    let (b_rows, b_cols) = if call.transb {
        (call.n, call.k)
    } else {
        (call.k, call.n)
    };
    let shapes = [
        (call.ab_type, a_rows, a_cols, call.lds[0]),
        (call.ab_type, b_rows, b_cols, call.lds[1]),
        (call.c_type, call.m, call.n, call.lds[2]),
    ];
    for (i, (t, rows, cols, ld)) in shapes.into_iter().enumerate() {
        // SAFETY: writes a new layout through a valid pointer.
        check(unsafe {
            lt::cublasLtMatrixLayoutCreate(
                &mut d.layouts[i],
                data_type(t),
                rows as u64,
                cols as u64,
                ld as i64,
            )
        })?;
        if let Some(batch) = call.batch {
            let count = i32::try_from(batch.count)
                .map_err(|_| BlasError::InvalidArgument("batch count"))?;
            let layout = d.layouts[i];
            use lt::cublasLtMatrixLayoutAttribute_t as L;
            set_layout(layout, L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)?;
            set_layout(
                layout,
                L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &batch.strides[i],
            )?;
        }
    }
    // SAFETY: writes a new preference through a valid pointer.
    check(unsafe { lt::cublasLtMatmulPreferenceCreate(&mut d.pref) })?;
    use lt::cublasLtMatmulPreferenceAttributes_t as P;
    let pref = d.pref;
    set_pref(
        pref,
        P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &workspace,
    )?;
    if let Some(mask) = reduction_mask {
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask)?;
    }
    Ok(d)
}

impl CublasHandle {
    fn lt(&self) -> lt::cublasLtHandle_t {
        self.raw_address() as lt::cublasLtHandle_t
    }

    /// Up to `max` algorithms cuBLASLt's heuristic proposes for `call` with at most
    /// `workspace` bytes of workspace (`cublasLtMatmulAlgoGetHeuristic`), best first.
    pub fn lt_heuristics(
        &self,
        call: &GemmCall,
        workspace: u64,
        reduction_mask: Option<u32>,
        max: usize,
    ) -> Result<Vec<LtAlgo>, BlasError> {
        available()?;
        self.bind()?;
        let d = describe(call, workspace, reduction_mask)?;
        let want = i32::try_from(max.max(1)).map_err(|_| BlasError::InvalidArgument("max"))?;
        // SAFETY: plain data, every field valid when zeroed; cuBLASLt overwrites the first
        // `found` entries.
        let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            (0..want).map(|_| unsafe { std::mem::zeroed() }).collect();
        let mut found = 0;
        // SAFETY: live handle and descriptors; `results` has room for `want` entries.
        check(unsafe {
            lt::cublasLtMatmulAlgoGetHeuristic(
                self.lt(),
                d.desc,
                d.layouts[0],
                d.layouts[1],
                d.layouts[2],
                d.layouts[2],
                d.pref,
                want,
                results.as_mut_ptr(),
                &mut found,
            )
        })?;
        Ok(results
            .into_iter()
            .take(found.max(0) as usize)
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| LtAlgo {
                raw: r.algo.data,
                workspace: r.workspaceSize as u64,
                waves: r.wavesCount,
            })
            .collect())
    }

    /// Enqueues `call` on `stream` with `algo` (found for this GEMM) and `workspace`
    /// (address and bytes, at least the algorithm's), D written over C (`cublasLtMatmul`).
    pub fn lt_matmul(
        &self,
        call: &GemmCall,
        algo: &LtAlgo,
        workspace: (DevicePtr, u64),
        reduction_mask: Option<u32>,
        stream: StreamHandle,
    ) -> Result<(), BlasError> {
        available()?;
        let s = self.checked_stream(stream)?;
        let d = describe(call, workspace.1, reduction_mask)?;
        let (alpha, beta) = (call.alpha_scalar()?, call.beta_scalar()?);
        let raw = lt::cublasLtMatmulAlgo_t { data: algo.raw };
        let bytes =
            usize::try_from(workspace.1).map_err(|_| BlasError::InvalidArgument("workspace"))?;
        // SAFETY: live handle, descriptors and stream; alpha and beta live through the call
        // and match the scale type; device addresses are only used on the device.
        check(unsafe {
            lt::cublasLtMatmul(
                self.lt(),
                d.desc,
                alpha.ptr(),
                call.a.0 as *const c_void,
                d.layouts[0],
                call.b.0 as *const c_void,
                d.layouts[1],
                beta.ptr(),
                call.c.0 as *const c_void,
                d.layouts[2],
                call.c.0 as *mut c_void,
                d.layouts[2],
                &raw,
                workspace.0.0 as *mut c_void,
                bytes,
                s as lt::cudaStream_t,
            )
        })
    }
}
