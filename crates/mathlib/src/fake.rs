//! [`FakeBlas`]: cuBLAS played on the fake device, for the tests that need no GPU. Handles
//! keep what was set on them (stream, math mode, workspace), every GEMM is recorded with
//! the state it ran under, and its arithmetic is done on the host, in f64 from the operands'
//! values and rounded once to C's type: a reference, not a model of the GPU's rounding.
//!
//! A GEMM reads its operands in stream order (`memcpy_dtoh` waits for the stream) and
//! writes C with an ordered copy, so on the fake it completes by the time the stream does;
//! inside a stream capture it fails as any synchronous copy does.
use crate::MathLibError;
use crate::backend::{BlasBackend, HandleId, LtCall, LtCandidate};
use ferrocuda_driver::cublas::{BlasError, DataType, GemmCall, MathMode};
use ferrocuda_driver::{Driver, FakeDriver};
use ferrocuda_types::{DeviceIndex, DevicePtr, StreamHandle};
use half::{bf16, f16};
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
        self.fake.stream_query(stream).map_err(BlasError::from)?;
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
        host_gemm(&*self.fake, state.stream, call).map_err(BlasError::from)?;
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
        self.edit(handle, |_| {})?;
        if lt.workspace.1 < lt.candidate.workspace {
            return Err(BlasError::Cublas {
                code: 7,
                name: "CUBLAS_STATUS_INVALID_VALUE",
            }
            .into());
        }
        host_gemm(&*self.fake, stream, lt.call).map_err(BlasError::from)?;
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

/// Elements of `t`, read from and written to bytes.
fn read_elems(t: DataType, bytes: &[u8]) -> Vec<f64> {
    match t {
        DataType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DataType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DataType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        DataType::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect(),
    }
}

fn write_elems(t: DataType, values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match t {
            DataType::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
            DataType::BF16 => bf16::from_f64(v).to_le_bytes().to_vec(),
            DataType::F32 => (v as f32).to_le_bytes().to_vec(),
            DataType::F64 => v.to_le_bytes().to_vec(),
        })
        .collect()
}

fn size_of(t: DataType) -> usize {
    match t {
        DataType::F16 | DataType::BF16 => 2,
        DataType::F32 => 4,
        DataType::F64 => 8,
    }
}

/// Reads the column-major matrix at `ptr` (leading dimension `ld`, `cols` columns of
/// `rows` used rows).
fn read_matrix(
    d: &dyn Driver,
    stream: StreamHandle,
    t: DataType,
    ptr: DevicePtr,
    ld: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<f64>, ferrocuda_driver::DriverError> {
    if cols == 0 {
        return Ok(Vec::new());
    }
    let mut bytes = vec![0u8; (ld * (cols - 1) + rows) * size_of(t)];
    d.memcpy_dtoh(&mut bytes, ptr, stream)?;
    Ok(read_elems(t, &bytes))
}

/// The GEMM (or each GEMM of a batch) on the host: `C = alpha op(A) op(B) + beta C`.
fn host_gemm(
    d: &dyn Driver,
    stream: StreamHandle,
    call: &GemmCall,
) -> Result<(), ferrocuda_driver::DriverError> {
    let (m, n, k) = (call.m, call.n, call.k);
    let [lda, ldb, ldc] = call.lds;
    let (a_rows, a_cols) = if call.transa { (k, m) } else { (m, k) };
    let (b_rows, b_cols) = if call.transb { (n, k) } else { (k, n) };
    let (count, strides) = call.batch.map_or((1, [0; 3]), |b| (b.count, b.strides));
    let at = |p: DevicePtr, i: usize, stride: i64, t: DataType| {
        DevicePtr(p.0.wrapping_add((i as i64 * stride) as u64 * size_of(t) as u64))
    };
    for i in 0..count {
        let a_ptr = at(call.a, i, strides[0], call.ab_type);
        let b_ptr = at(call.b, i, strides[1], call.ab_type);
        let c_ptr = at(call.c, i, strides[2], call.c_type);
        let a = read_matrix(d, stream, call.ab_type, a_ptr, lda, a_rows, a_cols)?;
        let b = read_matrix(d, stream, call.ab_type, b_ptr, ldb, b_rows, b_cols)?;
        let mut c = read_matrix(d, stream, call.c_type, c_ptr, ldc, m, n)?;
        let a_at = |r: usize, col: usize| {
            if call.transa {
                a[r * lda + col]
            } else {
                a[col * lda + r]
            }
        };
        let b_at = |r: usize, col: usize| {
            if call.transb {
                b[r * ldb + col]
            } else {
                b[col * ldb + r]
            }
        };
        for col in 0..n {
            for r in 0..m {
                let dot: f64 = (0..k).map(|x| a_at(r, x) * b_at(x, col)).sum();
                let old = if call.beta == 0.0 {
                    0.0
                } else {
                    c[col * ldc + r]
                };
                c[col * ldc + r] = call.alpha * dot + call.beta * old;
            }
        }
        if !c.is_empty() {
            d.memcpy_htod_async(c_ptr, &write_elems(call.c_type, &c), stream)?;
        }
    }
    Ok(())
}
