//! [`FakeBlas`]: cuBLAS played on the fake device, for the tests that need no GPU. Handles
//! keep what was set on them (stream, math mode, workspace), every GEMM is recorded with
//! the state it ran under, and its arithmetic is done on the host, in f64 from the operands'
//! values and rounded once to C's type: a reference, not a model of the GPU's rounding.
//!
//! A GEMM is a kernel of the fake device (`fake_kernel.rs`), launched on the handle's
//! stream (cuBLASLt's: on the call's): it runs in stream order, and a stream capture
//! records it for the graph's replays. The first handle made on a device loads it, as
//! cuBLAS's handle creation loads its kernels (so, as there, not inside a capture).
use crate::MathLibError;
use crate::backend::{BlasBackend, HandleId, LtCall, LtCandidate};
use crate::fake_kernel;
use ferrocuda_driver::cublas::{BlasError, GemmCall, MathMode};
use ferrocuda_driver::{Driver, FakeDriver};
use ferrocuda_types::{DeviceIndex, DevicePtr, FunctionHandle, StreamHandle};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// What a fake handle holds.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FakeHandleState {
    /// The device it was made on.
    pub device: DeviceIndex,
    /// The stream last set (the legacy stream at creation, as cuBLAS's default).
    pub stream: StreamHandle,
    /// The math mode last set.
    pub math_mode: MathMode,
    /// The workspace last set.
    pub workspace: Option<(DevicePtr, u64)>,
}

/// A GEMM the fake ran, with the handle's state at the time.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct FakeGemm {
    /// The handle it ran on.
    pub handle: HandleId,
    /// The handle's state (stream, math mode, workspace).
    pub state: FakeHandleState,
    /// The call.
    pub call: GemmCall,
}

#[derive(Debug, Default)]
struct Books {
    handles: FxHashMap<u64, FakeHandleState>,
    next: u64,
    gemms: Vec<FakeGemm>,
    created: u64,
    /// cuBLASLt GEMMs run: the candidate's rank for each.
    lt_runs: Vec<usize>,
    /// The GEMM kernel, per device it was loaded on.
    kernels: FxHashMap<DeviceIndex, FunctionHandle>,
}

/// How many algorithms the fake cuBLASLt's heuristic proposes, at most.
pub const FAKE_LT_CANDIDATES: usize = 4;

/// cuBLAS on a [`FakeDriver`].
#[derive(Debug)]
pub struct FakeBlas {
    fake: Arc<FakeDriver>,
    sm_major: u32,
    books: Mutex<Books>,
}

impl FakeBlas {
    /// cuBLAS on `fake`, whose devices report compute capability major `sm_major` to the
    /// math-library layer (9, a Hopper, picks PyTorch's 32 MiB workspace).
    pub fn new(fake: Arc<FakeDriver>, sm_major: u32) -> FakeBlas {
        FakeBlas {
            fake,
            sm_major,
            books: Mutex::new(Books::default()),
        }
    }

    /// The live handles and their state.
    pub fn handles(&self) -> Vec<(HandleId, FakeHandleState)> {
        let mut v: Vec<_> = self
            .books
            .lock()
            .handles
            .iter()
            .map(|(&id, &s)| (HandleId(id), s))
            .collect();
        v.sort_by_key(|(id, _)| id.0);
        v
    }

    /// Handles created so far (destroyed ones included).
    pub fn handles_created(&self) -> u64 {
        self.books.lock().created
    }

    /// The cuBLASLt GEMMs run so far: the rank of the candidate each used.
    pub fn lt_runs(&self) -> Vec<usize> {
        self.books.lock().lt_runs.clone()
    }

    /// Every GEMM run so far, in order.
    pub fn gemms(&self) -> Vec<FakeGemm> {
        self.books.lock().gemms.clone()
    }

    /// Launches the GEMM kernel of `device` (loaded with the device's first handle).
    fn launch(
        &self,
        device: DeviceIndex,
        stream: StreamHandle,
        call: &GemmCall,
        workspace: Option<(DevicePtr, u64)>,
    ) -> Result<(), MathLibError> {
        let kernel = self.books.lock().kernels.get(&device).copied();
        let kernel = kernel.ok_or(MathLibError::UnknownHandle(0))?;
        fake_kernel::launch(&self.fake, kernel, stream, call, workspace)
            .map_err(BlasError::from)?;
        Ok(())
    }

    fn edit(
        &self,
        handle: HandleId,
        f: impl FnOnce(&mut FakeHandleState),
    ) -> Result<FakeHandleState, MathLibError> {
        let mut books = self.books.lock();
        let state = books
            .handles
            .get_mut(&handle.0)
            .ok_or(MathLibError::UnknownHandle(handle.0))?;
        f(state);
        Ok(*state)
    }
}

impl BlasBackend for FakeBlas {
    fn sm_major(&self, device: DeviceIndex) -> Result<u32, MathLibError> {
        self.fake
            .device_properties(device)
            .map_err(BlasError::from)?;
        Ok(self.sm_major)
    }

    fn create_handle(&self, device: DeviceIndex) -> Result<HandleId, MathLibError> {
        self.fake
            .device_properties(device)
            .map_err(BlasError::from)?;
        let loaded = self.books.lock().kernels.get(&device).copied();
        if loaded.is_none() {
            let kernel = fake_kernel::load(&self.fake, device).map_err(BlasError::from)?;
            self.books.lock().kernels.insert(device, kernel);
        }
        let mut books = self.books.lock();
        books.next += 1;
        books.created += 1;
        let id = books.next;
        books.handles.insert(
            id,
            FakeHandleState {
                device,
                stream: StreamHandle::legacy(device),
                math_mode: MathMode::Default,
                workspace: None,
            },
        );
        Ok(HandleId(id))
    }

    fn destroy_handle(&self, handle: HandleId) {
        self.books.lock().handles.remove(&handle.0);
    }

    fn set_stream(&self, handle: HandleId, stream: StreamHandle) -> Result<(), MathLibError> {
        let device = self.edit(handle, |_| {})?.device;
        if stream.device != device {
            return Err(BlasError::DeviceMismatch {
                expected: device,
                found: stream.device,
            }
            .into());
        }
        // The stream must exist; a capturing one is fine (`cublasSetStream` makes no stream
        // call, and PyTorch sets the stream at every acquisition, captures included).
        self.fake
            .stream_capture_status(stream)
            .map_err(BlasError::from)?;
        self.edit(handle, |s| s.stream = stream).map(drop)
    }

    fn set_math_mode(&self, handle: HandleId, mode: MathMode) -> Result<(), MathLibError> {
        self.edit(handle, |s| s.math_mode = mode).map(drop)
    }

    fn set_workspace(
        &self,
        handle: HandleId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), MathLibError> {
        self.edit(handle, |s| s.workspace = Some((ptr, bytes)))
            .map(drop)
    }

    fn gemm(&self, handle: HandleId, call: &GemmCall) -> Result<(), MathLibError> {
        let state = self.edit(handle, |_| {})?;
        self.launch(state.device, state.stream, call, state.workspace)?;
        self.books.lock().gemms.push(FakeGemm {
            handle,
            state,
            call: *call,
        });
        Ok(())
    }

    /// [`FAKE_LT_CANDIDATES`] candidates (fewer if `max` is smaller), each needing 1 MiB
    /// more workspace than the one before, none over `workspace`.
    fn lt_candidates(
        &self,
        handle: HandleId,
        _call: &GemmCall,
        workspace: u64,
        _reduction_mask: Option<u32>,
        max: usize,
    ) -> Result<Vec<LtCandidate>, MathLibError> {
        self.edit(handle, |_| {})?;
        Ok((0..FAKE_LT_CANDIDATES.min(max))
            .map(|index| LtCandidate {
                index,
                workspace: index as u64 * (1 << 20),
                algo: None,
            })
            .filter(|c| c.workspace <= workspace)
            .collect())
    }

    fn lt_gemm(
        &self,
        handle: HandleId,
        lt: &LtCall<'_>,
        stream: StreamHandle,
    ) -> Result<(), MathLibError> {
        let device = self.edit(handle, |_| {})?.device;
        if lt.workspace.1 < lt.candidate.workspace {
            return Err(BlasError::Cublas {
                code: 7,
                name: "CUBLAS_STATUS_INVALID_VALUE",
            }
            .into());
        }
        self.launch(device, stream, lt.call, Some(lt.workspace))?;
        self.books.lock().lt_runs.push(lt.candidate.index);
        Ok(())
    }

    fn synchronize(&self, stream: StreamHandle) -> Result<(), MathLibError> {
        self.fake
            .stream_synchronize(stream)
            .map_err(BlasError::from)?;
        Ok(())
    }

    fn lt_version(&self) -> String {
        "fake".into()
    }
}
