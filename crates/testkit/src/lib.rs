//! ferrocuda's test harness, for tests and benches only: the backends under test (the fake
//! device in manual completion, the real driver, which fails rather than skips where there
//! is no GPU), the kernels tests launch with their host twins for the fake device,
//! [`both_backends!`] to run one test function over both, the conformance suite
//! ([`suite`]): one set of behaviours every backend must show, written once, and
//! [`fresh_process`], the `main` of a test whose scenarios each need a process of their own.
//!
//! CI runs the suite on the fake device (`crates/stream/tests/fake_conformance.rs`, manual
//! completion so that a missing synchronization shows up as wrong data); the GPU bundle runs
//! the same functions on the real driver (`crates/stream/tests/cuda_conformance.rs`). Run the
//! CUDA binary with `--test-threads=1`: a GLOBAL-mode capture test refuses other threads'
//! allocations, as CUDA does, and must not share the process with other tests.
//!
//! Use [`conformance_tests!`] to instantiate every test of the suite. Where tests live and
//! how their binaries are named (`<area>_<kind>`): docs/architecture.md, "Tests".
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use ferrocuda_driver::{CudaDriver, DriverError, FakeDriver, fake::Completion};
use ferrocuda_stream::{CacheOutcome, DeviceBuffer, KernelCache, Module, Runtime, StreamError};
use ferrocuda_types::{
    CaptureMode, CaptureStatus, Device, DeviceIndex, EventFlags, EventHandle, KernelArg,
    LaunchConfig, MemsetValue, StreamFlags, StreamHandle,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The device the suite and the harness use.
const DEV: DeviceIndex = DeviceIndex(0);

/// What a conformance test returns.
pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The kernels the suite launches, as CUDA C++.
pub const KERNELS: &str = r#"
extern "C" __global__ void fill_f32(float* x, float v, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
extern "C" __global__ void scale_f32(float* y, const float* x, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}
extern "C" __global__ void add_f32(float* z, const float* x, const float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) z[i] = x[i] + y[i];
}
extern "C" __global__ void add_one_f32(float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
extern "C" __global__ void spin(unsigned long long cycles) {
    long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) {}
}
extern "C" __global__ void tiny(float* x) {
    if (threadIdx.x == 0 && blockIdx.x == 0) x[0] += 1.0f;
}
"#;

/// Cycles the `spin` kernel counts per millisecond (about 2 GHz; the fake sleeps that long).
pub const SPIN_CYCLES_PER_MS: u64 = 2_000_000;

/// Registers host versions of [`KERNELS`] on a fake driver.
pub fn register_fake_kernels(fake: &FakeDriver) {
    fake.register_kernel("fill_f32", |k| {
        let (x, v, n) = (k.arg(0)?, k.arg::<f32>(1)?, k.arg::<u32>(2)? as usize);
        k.write(x, &vec![v; n])
    });
    fake.register_kernel("scale_f32", |k| {
        let (y, x, a, n) = (
            k.arg(0)?,
            k.arg(1)?,
            k.arg::<f32>(2)?,
            k.arg::<u32>(3)? as usize,
        );
        let out: Vec<f32> = k.read::<f32>(x, n)?.iter().map(|v| a * v).collect();
        k.write(y, &out)
    });
    fake.register_kernel("add_f32", |k| {
        let (z, x, y, n) = (k.arg(0)?, k.arg(1)?, k.arg(2)?, k.arg::<u32>(3)? as usize);
        let (xs, ys) = (k.read::<f32>(x, n)?, k.read::<f32>(y, n)?);
        let out: Vec<f32> = xs.iter().zip(&ys).map(|(a, b)| a + b).collect();
        k.write(z, &out)
    });
    fake.register_kernel("add_one_f32", |k| {
        let (x, n) = (k.arg(0)?, k.arg::<u32>(1)? as usize);
        let out: Vec<f32> = k.read::<f32>(x, n)?.iter().map(|v| v + 1.0).collect();
        k.write(x, &out)
    });
    fake.register_kernel("spin", |k| {
        let ms = (k.arg::<u64>(0)? / SPIN_CYCLES_PER_MS).min(200);
        std::thread::sleep(std::time::Duration::from_millis(ms));
        Ok(())
    });
    fake.register_kernel("tiny", |k| {
        let x = k.arg(0)?;
        let v = k.read::<f32>(x, 1)?[0] + 1.0;
        k.write(x, &[v])
    });
}

/// The driver's page-locked memory, with large copies from pageable memory staged by
/// `threads` threads (`pageable_copy_threads`, which the caching host allocator otherwise
/// carries): for tests of the stream layer without the allocators.
#[derive(Debug)]
pub struct StagedCopies {
    /// Where page-locked memory comes from.
    pub memory: ferrocuda_stream::DriverHostMemory,
    /// What `pageable_copy_threads` answers.
    pub threads: usize,
}

impl StagedCopies {
    /// Installs `threads` staging threads on `rt` (0: the driver copies).
    pub fn install(rt: &Runtime, threads: usize) {
        rt.set_host_memory(Arc::new(StagedCopies {
            memory: ferrocuda_stream::DriverHostMemory(rt.driver().clone()),
            threads,
        }));
    }
}

impl ferrocuda_stream::HostMemoryResource for StagedCopies {
    fn allocate_host(
        &self,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<ferrocuda_types::HostRange, StreamError> {
        self.memory.allocate_host(bytes, stream)
    }

    fn free_host(&self, range: ferrocuda_types::HostRange) -> Result<(), StreamError> {
        self.memory.free_host(range)
    }

    fn record_host_use(
        &self,
        range: ferrocuda_types::HostRange,
        stream: StreamHandle,
    ) -> Result<(), StreamError> {
        self.memory.record_host_use(range, stream)
    }

    fn pageable_copy_threads(&self) -> usize {
        self.threads
    }
}

/// One backend under test.
#[derive(Debug)]
pub struct Harness {
    /// The runtime over the backend.
    pub rt: Arc<Runtime>,
    /// The fake driver, when the backend is the fake one (for fake-only extra checks).
    pub fake: Option<Arc<FakeDriver>>,
    /// The real driver, when the backend is the real one (for libraries that call CUDA
    /// through it: cuBLAS, cuFFT, on the streams the runtime made).
    pub cuda: Option<Arc<CudaDriver>>,
    /// [`KERNELS`], loaded once: dropping the last handle unloads a module, and
    /// `cuModuleUnload` waits for its running kernels, which would hide asynchrony.
    module: std::sync::OnceLock<Module>,
}

impl Harness {
    /// A harness over `rt`.
    pub fn new(rt: Arc<Runtime>, fake: Option<Arc<FakeDriver>>) -> Harness {
        Harness {
            rt,
            fake,
            cuda: None,
            module: std::sync::OnceLock::new(),
        }
    }

    /// [`KERNELS`] on device 0, loaded once: compiled by NVRTC (through the runtime's kernel
    /// cache) on the real driver, the host versions registered by
    /// [`register_fake_kernels`] on the fake one.
    pub fn module(&self) -> Result<Module, StreamError> {
        if let Some(m) = self.module.get() {
            return Ok(m.clone());
        }
        let m = Module::from_cuda_source(&self.rt, DEV, "conformance", KERNELS)?;
        Ok(self.module.get_or_init(|| m).clone())
    }
}

/// A folder of its own under the system's temporary folder.
pub fn temp_dir(tag: &str) -> PathBuf {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("ferrocuda-{tag}-{}-{n}", std::process::id()))
}

/// The fake backend: one 80 GiB device, manual completion, the suite's kernels registered.
pub fn fake_harness() -> Harness {
    let fake = Arc::new(FakeDriver::builder().completion(Completion::Manual).build());
    register_fake_kernels(&fake);
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(Some(temp_dir("kernels"))));
    Harness::new(rt, Some(fake))
}

/// The real backend. Panics (fails the test) when no GPU is usable: on the GPU bundle a
/// missing device is a failure, never a skip.
pub fn cuda_harness() -> Harness {
    let driver = Arc::new(CudaDriver::new());
    if let Some(reason) = driver.unavailable_reason() {
        panic!("no usable CUDA device ({reason}): this test needs a GPU");
    }
    let rt = Runtime::with_kernel_cache(driver.clone(), KernelCache::at(Some(temp_dir("kernels"))));
    Harness {
        cuda: Some(driver),
        ..Harness::new(rt, None)
    }
}

/// Declares, for each named `fn(&Harness) -> TestResult` of the calling test file, a
/// `fake::<name>` test (CI) and a `cuda::<name>` test, ignored with its reason where there is
/// no GPU and run by the GPU bundle (where a skip counts as a failure). The caller defines
/// `TestResult`.
#[macro_export]
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod fake {
            $(
                #[test]
                fn $name() -> super::TestResult {
                    super::$name(&$crate::fake_harness())
                }
            )*
        }
        mod cuda {
            $(
                #[test]
                #[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
                fn $name() -> super::TestResult {
                    super::$name(&$crate::cuda_harness())
                }
            )*
        }
    };
}

pub mod examples;
pub mod fresh_process;
pub mod suite;

/// Instantiates every conformance test as a `#[test]` over a harness constructor.
///
/// `conformance_tests!(path::to::harness_fn);` or, with attributes on every test,
/// `conformance_tests!(path::to::harness_fn, #[ignore = "needs a GPU"]);`. Invoke it at the
/// root of a test binary: `launch_blocking` runs the binary again with
/// `--exact launch_blocking`.
#[macro_export]
macro_rules! conformance_tests {
    ($harness:path $(, #[$attr:meta])*) => {
        $crate::conformance_tests!(@each $harness, [$(#[$attr])*],
            devices_and_properties, device_guards_and_invalid_devices,
            current_stream_and_stream_guard, stream_pool_round_robin, stream_priorities,
            side_stream_fixed_with_wait_stream, cross_stream_wait_event,
            event_query_and_synchronize, event_timing, event_errors, launch_blocking,
            kernel_cache_hits_and_repairs, compile_error_carries_the_log,
            buffer_round_trips, buffer_kernel_launch, use_after_destroy_is_an_error,
            out_of_memory_is_a_typed_error, pinned_host_copies, pageable_copies_staged_by_threads,
            staged_copies_leave_a_capture_elsewhere_intact, pageable_reads_staged_by_threads,
            staged_reads_meet_a_capture_elsewhere_as_the_drivers_do,
            virtual_memory_map_and_access,
            capture_records_and_replays, capture_refuses_legacy_stream_and_nesting,
            capture_refuses_sync_and_captured_event_query, capture_modes_and_other_threads,
            device_synchronize_breaks_every_capture, capture_fork_join_and_unjoined
        );
    };
    (@each $harness:path, $attrs:tt, $($name:ident),* $(,)?) => {
        $( $crate::conformance_tests!(@one $harness, $attrs, $name); )*
    };
    (@one $harness:path, [$(#[$attr:meta])*], $name:ident) => {
        #[test]
        $(#[$attr])*
        fn $name() -> $crate::TestResult {
            $crate::suite::$name(&$harness())
        }
    };
}
