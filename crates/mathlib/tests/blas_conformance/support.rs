//! The two backends of the suite, a recording wrapper around either, and the host side of
//! its data (encoding, a reproducible generator).
#![allow(unreachable_pub)]
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::cublas::{GemmCall, MathMode};
use ferrocuda_driver::{CudaDriver, Driver, FakeDriver};
use ferrocuda_mathlib::{
    Blas, BlasBackend, CudaBlas, FakeBlas, HandleId, LtCall, LtCandidate, MathLibError,
};
use ferrocuda_types::{AllocatorConfig, DType, DeviceIndex, DevicePtr, StreamFlags, StreamHandle};
use half::{bf16, f16};
use parking_lot::Mutex;
use std::sync::Arc;

pub type TestResult = Result<(), Box<dyn std::error::Error>>;
pub const DEV: DeviceIndex = DeviceIndex(0);

/// The precision settings are process-wide: the tests that read or change them take turns.
pub static PRECISION: Mutex<()> = Mutex::new(());

/// One cuBLAS act as the wrapper saw it.
#[derive(Clone, Debug, PartialEq)]
pub enum Act {
    Create(HandleId),
    Stream(HandleId, StreamHandle),
    Mode(HandleId, MathMode),
    Workspace(HandleId, DevicePtr, u64),
    /// A GEMM with the math mode in force on its handle at the call.
    Gemm(HandleId, MathMode, GemmCall),
    /// A cuBLASLt GEMM: the candidate's rank and the reduction mask.
    LtGemm(HandleId, usize, Option<u32>),
}

/// Records every act, then passes it on.
#[derive(Debug)]
pub struct Recording {
    inner: Arc<dyn BlasBackend>,
    pub acts: Mutex<Vec<Act>>,
    modes: Mutex<Vec<(HandleId, MathMode)>>,
}

impl Recording {
    pub fn new(inner: Arc<dyn BlasBackend>) -> Recording {
        Recording {
            inner,
            acts: Mutex::new(Vec::new()),
            modes: Mutex::new(Vec::new()),
        }
    }

    pub fn acts(&self) -> Vec<Act> {
        self.acts.lock().clone()
    }

    pub fn take(&self) -> Vec<Act> {
        std::mem::take(&mut *self.acts.lock())
    }

    fn mode(&self, h: HandleId) -> MathMode {
        self.modes
            .lock()
            .iter()
            .rev()
            .find(|(id, _)| *id == h)
            .map_or(MathMode::Default, |(_, m)| *m)
    }
}

impl BlasBackend for Recording {
    fn sm_major(&self, device: DeviceIndex) -> Result<u32, MathLibError> {
        self.inner.sm_major(device)
    }
    fn create_handle(&self, device: DeviceIndex) -> Result<HandleId, MathLibError> {
        let h = self.inner.create_handle(device)?;
        self.acts.lock().push(Act::Create(h));
        Ok(h)
    }
    fn destroy_handle(&self, handle: HandleId) {
        self.inner.destroy_handle(handle)
    }
    fn set_stream(&self, handle: HandleId, stream: StreamHandle) -> Result<(), MathLibError> {
        self.inner.set_stream(handle, stream)?;
        self.acts.lock().push(Act::Stream(handle, stream));
        Ok(())
    }
    fn set_math_mode(&self, handle: HandleId, mode: MathMode) -> Result<(), MathLibError> {
        self.inner.set_math_mode(handle, mode)?;
        self.modes.lock().push((handle, mode));
        self.acts.lock().push(Act::Mode(handle, mode));
        Ok(())
    }
    fn set_workspace(
        &self,
        handle: HandleId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), MathLibError> {
        self.inner.set_workspace(handle, ptr, bytes)?;
        self.acts.lock().push(Act::Workspace(handle, ptr, bytes));
        Ok(())
    }
    fn gemm(&self, handle: HandleId, call: &GemmCall) -> Result<(), MathLibError> {
        self.inner.gemm(handle, call)?;
        let mode = self.mode(handle);
        self.acts.lock().push(Act::Gemm(handle, mode, *call));
        Ok(())
    }
    fn lt_candidates(
        &self,
        handle: HandleId,
        call: &GemmCall,
        workspace: u64,
        reduction_mask: Option<u32>,
        max: usize,
    ) -> Result<Vec<LtCandidate>, MathLibError> {
        self.inner
            .lt_candidates(handle, call, workspace, reduction_mask, max)
    }
    fn lt_gemm(
        &self,
        handle: HandleId,
        lt: &LtCall<'_>,
        stream: StreamHandle,
    ) -> Result<(), MathLibError> {
        self.inner.lt_gemm(handle, lt, stream)?;
        self.acts
            .lock()
            .push(Act::LtGemm(handle, lt.candidate.index, lt.reduction_mask));
        Ok(())
    }
    fn synchronize(&self, stream: StreamHandle) -> Result<(), MathLibError> {
        self.inner.synchronize(stream)
    }
    fn lt_version(&self) -> String {
        self.inner.lt_version()
    }
}

/// A backend, the allocator its workspaces come from, and a [`Blas`] over both.
#[derive(Debug)]
pub struct Setup {
    pub driver: Arc<dyn Driver>,
    pub alloc: Arc<CachingAllocator>,
    pub rec: Arc<Recording>,
    pub blas: Blas,
    pub gpu: bool,
}

impl Setup {
    fn new(driver: Arc<dyn Driver>, backend: Arc<dyn BlasBackend>, gpu: bool) -> Setup {
        let alloc = Arc::new(
            CachingAllocator::new(driver.clone(), DEV, AllocatorConfig::default(), Caching::On)
                .expect("allocator"),
        );
        let rec = Arc::new(Recording::new(backend));
        let blas = Blas::new(rec.clone(), alloc.clone()).expect("blas");
        Setup {
            driver,
            alloc,
            rec,
            blas,
            gpu,
        }
    }

    pub fn stream(&self) -> Result<StreamHandle, Box<dyn std::error::Error>> {
        Ok(self.driver.stream_create(DEV, StreamFlags::default())?)
    }

    /// Device memory holding `values` as `dtype`.
    pub fn upload(
        &self,
        dtype: DType,
        values: &[f64],
        stream: StreamHandle,
    ) -> Result<DevicePtr, Box<dyn std::error::Error>> {
        let bytes = encode(dtype, values);
        let a = self.alloc.allocate(bytes.len().max(1) as u64, stream)?;
        self.driver.memcpy_htod_async(a.ptr, &bytes, stream)?;
        Ok(a.ptr)
    }

    pub fn download(
        &self,
        dtype: DType,
        ptr: DevicePtr,
        n: usize,
        stream: StreamHandle,
    ) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
        let mut bytes = vec![0u8; n * dtype.size()];
        self.driver.memcpy_dtoh(&mut bytes, ptr, stream)?;
        Ok(decode(dtype, &bytes))
    }
}

pub fn fake_setup() -> Setup {
    let fake = Arc::new(FakeDriver::default());
    Setup::new(fake.clone(), Arc::new(FakeBlas::new(fake, 9)), false)
}

/// The real backend: a missing GPU or libcublas fails the test (the bundle never skips).
pub fn cuda_setup() -> Setup {
    let cuda = Arc::new(CudaDriver::new());
    if let Some(reason) = cuda.unavailable_reason() {
        panic!("no usable CUDA device ({reason}): this test needs a GPU");
    }
    let backend = CudaBlas::new(cuda.clone()).unwrap_or_else(|e| panic!("{e}"));
    Setup::new(cuda, Arc::new(backend), true)
}

pub fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            DType::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
            DType::BF16 => bf16::from_f64(v).to_le_bytes().to_vec(),
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        })
        .collect()
}

pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f64(),
            DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f64(),
            DType::F32 => f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            _ => f64::from_le_bytes(c.try_into().expect("8 bytes")),
        })
        .collect()
}

/// `v` as `dtype` would hold it.
pub fn round(dtype: DType, v: f64) -> f64 {
    decode(dtype, &encode(dtype, &[v]))[0]
}

/// xorshift, for reproducible programs.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// In [-1, 1).
    pub fn unit(&mut self) -> f64 {
        (self.below(1 << 20) as f64 / (1 << 19) as f64) - 1.0
    }
}
