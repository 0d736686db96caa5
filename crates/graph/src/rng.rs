//! Graph-safe Philox random numbers (graphs spec §5).
//!
//! An eager draw passes `(seed, offset)` to the kernel by value. A captured draw instead
//! passes a pointer to a 16-byte device state `[seed, base offset]` and its offset inside the
//! graph by value; before each replay one host-to-device write of the current
//! `[seed, offset]` updates the state, and the offset then advances by the graph's total.
//! So replays draw exactly what eager calls would have, and a replay costs one small copy
//! per generator instead of PyTorch's two fill kernels (spec §10 item 9).
use crate::GraphError;
use ferrocuda_driver::{FakeDriver, KernelContext};
use ferrocuda_stream::{DeviceBuffer, Function, Module, Runtime, Stream};
use ferrocuda_types::{CaptureStatus, DeviceIndex, DevicePtr, KernelArg, LaunchConfig};
use parking_lot::Mutex;
use std::sync::Arc;

/// The Philox kernels, as CUDA C++. Element `i` of a draw uses the Philox4x32-10 block at
/// counter `(i, 0, offset/4)`: a draw consumes 4 units of offset, as PyTorch rounds to.
pub const PHILOX_KERNELS: &str = r#"
__device__ __forceinline__ unsigned int philox_first(unsigned long long counter_lo,
                                                      unsigned long long counter_hi,
                                                      unsigned long long key) {
    unsigned int c0 = (unsigned int)counter_lo, c1 = (unsigned int)(counter_lo >> 32);
    unsigned int c2 = (unsigned int)counter_hi, c3 = (unsigned int)(counter_hi >> 32);
    unsigned int k0 = (unsigned int)key, k1 = (unsigned int)(key >> 32);
    for (int r = 0; r < 10; ++r) {
        unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
        unsigned int hi0 = (unsigned int)(p0 >> 32), lo0 = (unsigned int)p0;
        unsigned int hi1 = (unsigned int)(p1 >> 32), lo1 = (unsigned int)p1;
        c0 = hi1 ^ c1 ^ k0; c1 = lo1; c2 = hi0 ^ c3 ^ k1; c3 = lo0;
        k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
    }
    return c0;
}
extern "C" __global__ void philox_uniform_f32(float* out, unsigned int n,
                                              unsigned long long seed,
                                              unsigned long long offset,
                                              const unsigned long long* state,
                                              unsigned long long offset_in_graph) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (state) { seed = state[0]; offset = state[1] + offset_in_graph; }
    unsigned int x = philox_first(i, offset / 4, seed);
    out[i] = (float)(x >> 8) * (1.0f / 16777216.0f);
}
"#;

/// Offset units one draw consumes.
const DRAW_INCREMENT: u64 = 4;

/// The first word of the Philox4x32-10 block at `(counter_lo, counter_hi)` under `key`:
/// the host twin of the kernel's `philox_first`, for the fake device.
fn philox_first(counter_lo: u64, counter_hi: u64, key: u64) -> u32 {
    let mut c = [
        counter_lo as u32,
        (counter_lo >> 32) as u32,
        counter_hi as u32,
        (counter_hi >> 32) as u32,
    ];
    let mut k = [key as u32, (key >> 32) as u32];
    for _ in 0..10 {
        let p0 = 0xD251_1F53u64 * u64::from(c[0]);
        let p1 = 0xCD9E_8D57u64 * u64::from(c[2]);
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
        k = [
            k[0].wrapping_add(0x9E37_79B9),
            k[1].wrapping_add(0xBB67_AE85),
        ];
    }
    c[0]
}

/// The host version of `philox_uniform_f32`, for the fake device.
fn philox_uniform_f32(k: &mut KernelContext<'_>) -> Result<(), String> {
    let (out, n) = (k.arg::<DevicePtr>(0)?, k.arg::<u32>(1)? as usize);
    let (mut seed, mut offset) = (k.arg::<u64>(2)?, k.arg::<u64>(3)?);
    let state = k.arg::<DevicePtr>(4)?;
    if state.0 != 0 {
        let s = k.read::<u64>(state, 2)?;
        seed = s[0];
        offset = s[1] + k.arg::<u64>(5)?;
    }
    let values: Vec<f32> = (0..n as u64)
        .map(|i| (philox_first(i, offset / 4, seed) >> 8) as f32 * (1.0 / 16_777_216.0))
        .collect();
    k.write(out, &values)
}

/// Registers the host version of [`PHILOX_KERNELS`] on a fake driver, replacing one
/// registered before. Not needed to use a [`PhiloxGenerator`]: making one on a fake device
/// provides it ([`FakeDriver::provide_kernel`]).
pub fn register_fake_philox(fake: &FakeDriver) {
    fake.register_kernel("philox_uniform_f32", philox_uniform_f32);
}

#[derive(Debug)]
struct CaptureState {
    /// The capture this generator is recording into.
    capture_id: u64,
    /// Offset units drawn so far inside the graph.
    offset_in_graph: u64,
}

#[derive(Debug)]
struct GeneratorState {
    seed: u64,
    offset: u64,
    /// `[seed, base offset]` on the device (int64, as PyTorch keeps them), made at the first
    /// registration with a graph.
    device_state: Option<DeviceBuffer<i64>>,
    capture: Option<CaptureState>,
}

/// A Philox generator whose draws can be captured (`torch.cuda` generator with graph-safe
/// state). Register it with each graph that draws from it
/// ([`CudaGraph::register_generator`](crate::CudaGraph::register_generator)).
#[derive(Debug)]
pub struct PhiloxGenerator {
    runtime: Arc<Runtime>,
    device: DeviceIndex,
    kernel: Function,
    state: Mutex<GeneratorState>,
}

impl PhiloxGenerator {
    /// A generator on `device` seeded with `seed`, offset 0.
    pub fn new(
        runtime: &Arc<Runtime>,
        device: DeviceIndex,
        seed: u64,
    ) -> Result<Arc<PhiloxGenerator>, GraphError> {
        if let Some(fake) = runtime.fake() {
            // The fake device runs the kernel's host version; one a test registered stays.
            fake.provide_kernel("philox_uniform_f32", philox_uniform_f32);
        }
        let module = Module::from_cuda_source(runtime, device, "philox", PHILOX_KERNELS)?;
        Ok(Arc::new(PhiloxGenerator {
            runtime: runtime.clone(),
            device,
            kernel: module.function("philox_uniform_f32")?,
            state: Mutex::new(GeneratorState {
                seed,
                offset: 0,
                device_state: None,
                capture: None,
            }),
        }))
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.state.lock().seed
    }

    /// The Philox offset (`philox_offset_per_thread`): units consumed so far outside graphs,
    /// plus each replay's total.
    pub fn offset(&self) -> u64 {
        self.state.lock().offset
    }

    /// Reseeds and rewinds (`manual_seed`). During a capture only the current seed is
    /// accepted, as in PyTorch.
    pub fn manual_seed(&self, seed: u64) -> Result<(), GraphError> {
        let mut st = self.state.lock();
        if st.capture.is_some() {
            if seed == st.seed {
                return Ok(());
            }
            return Err(GraphError::Rng(
                "manual_seed can be called during stream capture only if the new seed is the same as the original seed".into(),
            ));
        }
        st.seed = seed;
        st.offset = 0;
        Ok(())
    }

    /// Fills `out` with uniform numbers in [0, 1) on `stream`. Inside a capture the draw is
    /// recorded against the device state, so each replay draws fresh numbers.
    pub fn uniform(&self, out: &DeviceBuffer<f32>, stream: &Stream) -> Result<(), GraphError> {
        self.runtime.check_stream(stream)?;
        let n = u32::try_from(out.len())
            .map_err(|_| GraphError::Rng("more than 2^32 elements in one draw".into()))?;
        if n == 0 {
            return Ok(());
        }
        let capturing = match self
            .runtime
            .driver()
            .stream_capture_status(stream.handle())?
        {
            CaptureStatus::Active { id } => Some(id),
            CaptureStatus::None => None,
            CaptureStatus::Invalidated => return Err(GraphError::Invalidated),
        };
        let mut st = self.state.lock();
        let (seed, offset, state_ptr, offset_in_graph) = match (capturing, &mut st.capture) {
            (None, None) => {
                let offset = st.offset;
                st.offset += DRAW_INCREMENT;
                (st.seed, offset, DevicePtr(0), 0)
            }
            (Some(id), Some(c)) if c.capture_id == id => {
                let in_graph = c.offset_in_graph;
                c.offset_in_graph += DRAW_INCREMENT;
                (0, 0, device_state(&st.device_state)?.ptr(), in_graph)
            }
            (Some(_), _) => {
                return Err(GraphError::Rng(
                    "RNG op during graph capture on a generator not registered with the capturing graph (CudaGraph::register_generator)".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(GraphError::Rng(
                    "eager RNG op on a generator that a graph is capturing: draw on the capture stream, or after capture_end".into(),
                ));
            }
        };
        drop(st);
        let args = [
            out.arg(),
            KernelArg::value(&n),
            KernelArg::value(&seed),
            KernelArg::value(&offset),
            KernelArg::value(&state_ptr.0),
            KernelArg::value(&offset_in_graph),
        ];
        Ok(stream.launch(
            &self.kernel,
            &LaunchConfig::for_elements(n as usize, 256),
            &args,
        )?)
    }

    /// Makes the device state (at the first registration, outside any capture).
    pub(crate) fn prepare(&self) -> Result<(), GraphError> {
        let mut st = self.state.lock();
        if st.capture.is_some() {
            return Err(GraphError::Rng(
                "Cannot register the state during capturing stage.".into(),
            ));
        }
        if st.device_state.is_none() {
            let _default_stream = self
                .runtime
                .stream_guard(&self.runtime.default_stream(self.device)?)?;
            st.device_state = Some(DeviceBuffer::filled(&self.runtime, self.device, 2, 0i64)?);
        }
        Ok(())
    }

    /// Starts recording draws into capture `capture_id`.
    pub(crate) fn capture_prologue(&self, capture_id: u64) -> Result<(), GraphError> {
        let mut st = self.state.lock();
        if st.capture.is_some() {
            return Err(GraphError::Rng(
                "this generator is already recording into another capture".into(),
            ));
        }
        st.capture = Some(CaptureState {
            capture_id,
            offset_in_graph: 0,
        });
        Ok(())
    }

    /// Stops recording; returns the offset units one replay consumes.
    pub(crate) fn capture_epilogue(&self) -> u64 {
        self.state
            .lock()
            .capture
            .take()
            .map_or(0, |c| c.offset_in_graph)
    }

    /// Before a replay on `stream`: writes `[seed, offset]` to the device state in stream
    /// order, then advances the offset by `increment`.
    pub(crate) fn replay_prologue(
        &self,
        increment: u64,
        stream: &Stream,
    ) -> Result<(), GraphError> {
        let mut st = self.state.lock();
        let values = [st.seed, st.offset];
        let state = device_state(&st.device_state)?;
        let bytes: &[u8] = bytemuck::cast_slice(&values);
        // Pageable source: the driver stages it before returning, so a local is fine.
        self.runtime
            .driver()
            .memcpy_htod_async(state.ptr(), bytes, stream.handle())?;
        st.offset += increment;
        Ok(())
    }
}

/// The device state of a generator registered with a graph (made by `prepare`).
fn device_state(state: &Option<DeviceBuffer<i64>>) -> Result<&DeviceBuffer<i64>, GraphError> {
    state.as_ref().ok_or_else(|| {
        GraphError::Rng(
            "generator state missing: register the generator with the graph before capturing"
                .into(),
        )
    })
}
