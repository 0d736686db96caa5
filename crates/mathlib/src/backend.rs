//! The seam under the handle pool: [`BlasBackend`], one cuBLAS act at a time, with two
//! implementations: [`CudaBlas`] over the real library (`ferrocuda_driver::cublas`) and
//! [`FakeBlas`](crate::FakeBlas) over the fake device, so the pool's policy (a handle per
//! thread, the stream, math mode and workspace set at each acquisition) is tested in CI.
use crate::MathLibError;
use ferrocuda_driver::cublas::{CublasHandle, GemmCall, MathMode};
use ferrocuda_driver::cublaslt::LtAlgo;
use ferrocuda_driver::{CudaDriver, Driver};
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use parking_lot::RwLock;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A cuBLAS handle, as its backend names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct HandleId(pub u64);

/// One cuBLAS act at a time. Policy (which handle, mode and workspace) is the caller's.
pub trait BlasBackend: Send + Sync + std::fmt::Debug {
    /// The compute capability's major version of `device` (it picks defaults and types).
    fn sm_major(&self, device: DeviceIndex) -> Result<u32, MathLibError>;
    /// A new handle on `device` (`cublasCreate`).
    fn create_handle(&self, device: DeviceIndex) -> Result<HandleId, MathLibError>;
    /// Destroys a handle (`cublasDestroy`); an unknown one is ignored.
    fn destroy_handle(&self, handle: HandleId);
    /// `cublasSetStream`.
    fn set_stream(&self, handle: HandleId, stream: StreamHandle) -> Result<(), MathLibError>;
    /// `cublasSetMathMode`.
    fn set_math_mode(&self, handle: HandleId, mode: MathMode) -> Result<(), MathLibError>;
    /// `cublasSetWorkspace`.
    fn set_workspace(
        &self,
        handle: HandleId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), MathLibError>;
    /// Enqueues a GEMM on the handle's stream (`cublasGemmEx` or its strided batch).
    fn gemm(&self, handle: HandleId, call: &GemmCall) -> Result<(), MathLibError>;
    /// Up to `max` cuBLASLt algorithms for `call` within `workspace` bytes, best first.
    fn lt_candidates(
        &self,
        handle: HandleId,
        call: &GemmCall,
        workspace: u64,
        reduction_mask: Option<u32>,
        max: usize,
    ) -> Result<Vec<LtCandidate>, MathLibError>;
    /// Enqueues `call` through cuBLASLt with `candidate` on `stream`.
    fn lt_gemm(
        &self,
        handle: HandleId,
        call: &LtCall<'_>,
        stream: StreamHandle,
    ) -> Result<(), MathLibError>;
    /// Waits for `stream` (the tuner times candidates between two waits).
    fn synchronize(&self, stream: StreamHandle) -> Result<(), MathLibError>;
    /// The cuBLASLt version, as the TunableOp validator records it.
    fn lt_version(&self) -> String;
}

/// One of cuBLASLt's algorithms for a GEMM, as the heuristic ranked it.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct LtCandidate {
    /// Its rank in the heuristic's answer (0 is the best guess).
    pub index: usize,
    /// Bytes of workspace it needs.
    pub workspace: u64,
    /// The real algorithm (the fake backend has none).
    pub algo: Option<LtAlgo>,
}

/// A GEMM through cuBLASLt: the call, the candidate, the workspace and reduction mask.
#[derive(Copy, Clone, Debug)]
pub struct LtCall<'a> {
    /// The GEMM.
    pub call: &'a GemmCall,
    /// The algorithm.
    pub candidate: &'a LtCandidate,
    /// The workspace (address and bytes).
    pub workspace: (DevicePtr, u64),
    /// `CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK`, given.
    pub reduction_mask: Option<u32>,
}

/// The real cuBLAS, on a [`CudaDriver`]'s devices.
#[derive(Debug)]
pub struct CudaBlas {
    driver: Arc<CudaDriver>,
    handles: RwLock<FxHashMap<u64, CublasHandle>>,
    next: AtomicU64,
}

impl CudaBlas {
    /// cuBLAS on `driver`'s devices. Fails with [`MathLibError::Blas`] (`Unavailable`) when
    /// libcublas cannot be found (see [`ferrocuda_driver::LIBRARY_PATH_VAR`]).
    pub fn new(driver: Arc<CudaDriver>) -> Result<CudaBlas, MathLibError> {
        ferrocuda_driver::cublas::available()?;
        Ok(CudaBlas {
            driver,
            handles: RwLock::new(FxHashMap::default()),
            next: AtomicU64::new(1),
        })
    }

    fn with<R>(
        &self,
        handle: HandleId,
        f: impl FnOnce(&CublasHandle) -> Result<R, ferrocuda_driver::cublas::BlasError>,
    ) -> Result<R, MathLibError> {
        let handles = self.handles.read();
        let h = handles
            .get(&handle.0)
            .ok_or(MathLibError::UnknownHandle(handle.0))?;
        Ok(f(h)?)
    }
}

impl BlasBackend for CudaBlas {
    fn sm_major(&self, device: DeviceIndex) -> Result<u32, MathLibError> {
        let props = self
            .driver
            .device_properties(device)
            .map_err(ferrocuda_driver::cublas::BlasError::from)?;
        Ok(props.major)
    }

    fn create_handle(&self, device: DeviceIndex) -> Result<HandleId, MathLibError> {
        let handle = CublasHandle::create(&self.driver, device)?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.handles.write().insert(id, handle);
        Ok(HandleId(id))
    }

    fn destroy_handle(&self, handle: HandleId) {
        let removed = self.handles.write().remove(&handle.0);
        drop(removed);
    }

    fn set_stream(&self, handle: HandleId, stream: StreamHandle) -> Result<(), MathLibError> {
        self.with(handle, |h| h.set_stream(stream))
    }

    fn set_math_mode(&self, handle: HandleId, mode: MathMode) -> Result<(), MathLibError> {
        self.with(handle, |h| h.set_math_mode(mode))
    }

    fn set_workspace(
        &self,
        handle: HandleId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), MathLibError> {
        self.with(handle, |h| h.set_workspace(ptr, bytes))
    }

    fn gemm(&self, handle: HandleId, call: &GemmCall) -> Result<(), MathLibError> {
        self.with(handle, |h| h.gemm(call))
    }

    fn lt_candidates(
        &self,
        handle: HandleId,
        call: &GemmCall,
        workspace: u64,
        reduction_mask: Option<u32>,
        max: usize,
    ) -> Result<Vec<LtCandidate>, MathLibError> {
        let algos = self.with(handle, |h| {
            h.lt_heuristics(call, workspace, reduction_mask, max)
        })?;
        Ok(algos
            .into_iter()
            .enumerate()
            .map(|(index, a)| LtCandidate {
                index,
                workspace: a.workspace,
                algo: Some(a),
            })
            .collect())
    }

    fn lt_gemm(
        &self,
        handle: HandleId,
        lt: &LtCall<'_>,
        stream: StreamHandle,
    ) -> Result<(), MathLibError> {
        let algo = lt.candidate.algo.ok_or_else(|| {
            MathLibError::InvalidGemm("a cuBLASLt candidate without its algorithm".into())
        })?;
        self.with(handle, |h| {
            h.lt_matmul(lt.call, &algo, lt.workspace, lt.reduction_mask, stream)
        })
    }

    fn lt_version(&self) -> String {
        ferrocuda_driver::cublaslt::version()
            .map_or_else(|e| format!("unavailable ({e})"), |v| v.to_string())
    }

    fn synchronize(&self, stream: StreamHandle) -> Result<(), MathLibError> {
        self.driver
            .stream_synchronize(stream)
            .map_err(|e| ferrocuda_driver::cublas::BlasError::from(e).into())
    }
}
