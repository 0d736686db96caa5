//! The seam under the handle pool: [`BlasBackend`], one cuBLAS act at a time, with two
//! implementations: [`CudaBlas`] over the real library (`ferrocuda_driver::cublas`) and
//! [`FakeBlas`](crate::FakeBlas) over the fake device, so the pool's policy (a handle per
//! thread, the stream, math mode and workspace set at each acquisition) is tested in CI.
use crate::MathLibError;
use ferrocuda_driver::cublas::{CublasHandle, GemmCall, MathMode};
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
}
