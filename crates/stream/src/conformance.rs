//! The conformance suite: one set of behaviours every backend must show, written once.
//!
//! CI runs it on the fake device (`tests/conformance_fake.rs`, manual completion so that a
//! missing synchronization shows up as wrong data); the GPU bundle runs the same functions on
//! the real driver (`tests/conformance_cuda.rs`). Run the CUDA binary with
//! `--test-threads=1`: a GLOBAL-mode capture test refuses other threads' allocations, as
//! CUDA does, and must not share the process with other tests.
//!
//! Use [`conformance_tests!`](crate::conformance_tests) to instantiate every test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use crate::{CacheOutcome, DeviceBuffer, KernelCache, Module, Runtime, StreamError};
use ferrocuda_driver::{CudaDriver, DriverError, FakeDriver, fake::Completion};
use ferrocuda_types::{
    CaptureMode, CaptureStatus, Device, DeviceIndex, EventFlags, EventHandle, KernelArg,
    LaunchConfig, MemsetValue, StreamFlags, StreamHandle,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// One backend under test.
#[derive(Debug)]
pub struct Harness {
    /// The runtime over the backend.
    pub rt: Arc<Runtime>,
    /// The fake driver, when the backend is the fake one (for fake-only extra checks).
    pub fake: Option<Arc<FakeDriver>>,
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
    let rt = Runtime::with_kernel_cache(driver, KernelCache::at(Some(temp_dir("kernels"))));
    Harness::new(rt, None)
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
                    super::$name(&$crate::conformance::fake_harness())
                }
            )*
        }
        mod cuda {
            $(
                #[test]
                #[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
                fn $name() -> super::TestResult {
                    super::$name(&$crate::conformance::cuda_harness())
                }
            )*
        }
    };
}

const DEV: DeviceIndex = DeviceIndex(0);

fn module(h: &Harness) -> Result<Module, StreamError> {
    h.module()
}

/// Names the step under way, so that a failure on a GPU run says where it stopped.
macro_rules! step {
    ($($t:tt)*) => { eprintln!("step: {}", format_args!($($t)*)) };
}

fn launch_spin(h: &Harness, stream: &crate::Stream, ms: u64) -> TestResult {
    let spin = module(h)?.function("spin")?;
    let cycles = ms * SPIN_CYCLES_PER_MS;
    stream.launch(
        &spin,
        &LaunchConfig::for_elements(1, 1),
        &[KernelArg::value(&cycles)],
    )?;
    Ok(())
}

fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, 256)
}

fn driver_err<T: std::fmt::Debug>(r: Result<T, DriverError>) -> Option<DriverError> {
    r.err()
}

// ---- devices ---------------------------------------------------------------------------

pub fn devices_and_properties(h: &Harness) -> TestResult {
    let rt = &h.rt;
    assert!(rt.is_available() && rt.device_count() >= 1);
    let p = rt.device_properties(DEV)?;
    assert!(!p.name.is_empty() && p.major >= 1 && p.total_memory > 0);
    assert!(
        p.multi_processor_count > 0 && p.warp_size == 32 && p.max_threads_per_multi_processor > 0
    );
    let (free, total) = rt.mem_get_info(DEV)?;
    assert!(total > 0 && free <= total, "free {free} total {total}");
    rt.synchronize(DEV)?;
    Ok(())
}

/// The nested device guard of the torch.cuda docs, on the devices present, and the errors
/// for devices that are not.
pub fn device_guards_and_invalid_devices(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let count = rt.device_count() as u16;
    let last = DeviceIndex(count - 1);
    assert_eq!(rt.current_device(), DEV);
    {
        let _outer = rt.device_guard(last)?;
        assert_eq!(rt.current_device(), last);
        {
            let inner = rt.device_guard(DEV)?;
            assert_eq!((rt.current_device(), inner.previous()), (DEV, last));
            assert_eq!(rt.resolve(&"cuda".parse::<Device>()?)?, DEV);
        }
        assert_eq!(rt.current_device(), last);
    }
    assert_eq!(rt.current_device(), DEV);
    let bad = DeviceIndex(count);
    let err = rt.device_guard(bad).expect_err("guard on a missing device");
    assert_eq!(
        err,
        StreamError::InvalidDevice {
            index: count,
            count: count as usize
        }
    );
    assert!(err.to_string().contains("invalid device ordinal"));
    assert!(rt.set_device(bad).is_err() && rt.device_properties(bad).is_err());
    assert_eq!(rt.current_device(), DEV, "a failed guard changes nothing");
    assert_eq!(
        rt.resolve(&"cpu".parse::<Device>()?),
        Err(StreamError::NotCuda)
    );
    assert!(rt.resolve(&Device::cuda(count)).is_err());
    assert!("cuda:-1".parse::<Device>().is_err());
    assert_eq!(
        driver_err(rt.driver().stream_create(bad, StreamFlags::default())),
        Some(DriverError::INVALID_DEVICE)
    );
    Ok(())
}

// ---- streams ---------------------------------------------------------------------------

pub fn current_stream_and_stream_guard(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let default = rt.default_stream(DEV)?;
    assert!(default.is_default());
    assert_eq!(rt.current_stream(DEV)?, default);
    let s = rt.new_stream(DEV, 0)?;
    {
        let _g = rt.stream_guard(&s)?;
        assert_eq!(rt.current_stream(DEV)?, s);
        let s2 = rt.stream_from_pool(DEV, false)?;
        {
            let _g2 = rt.stream_guard(&s2)?;
            assert_eq!(rt.current_stream(DEV)?, s2);
        }
        assert_eq!(rt.current_stream(DEV)?, s);
        let other_thread = std::thread::scope(|sc| sc.spawn(|| rt.current_stream(DEV)).join());
        assert_eq!(
            other_thread.expect("thread")?,
            default,
            "current streams are per thread"
        );
    }
    assert_eq!(rt.current_stream(DEV)?, default);
    rt.set_stream(&s)?;
    assert_eq!(rt.current_stream(DEV)?, s);
    rt.set_stream(&default)?;
    let external = rt.external_stream(s.handle())?;
    assert_eq!(external, s);
    let bogus = StreamHandle {
        device: DEV,
        raw: 0xdead_0000,
    };
    assert!(rt.external_stream(bogus).is_err());
    Ok(())
}

pub fn stream_pool_round_robin(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let low: Vec<_> = (0..crate::STREAMS_PER_POOL)
        .map(|_| rt.stream_from_pool(DEV, false))
        .collect::<Result<_, _>>()?;
    for (i, a) in low.iter().enumerate() {
        assert!(
            low[i + 1..].iter().all(|b| a != b),
            "pool streams are distinct"
        );
    }
    assert_eq!(
        rt.stream_from_pool(DEV, false)?,
        low[0],
        "the 33rd wraps around"
    );
    let high = rt.stream_from_pool(DEV, true)?;
    assert!(low.iter().all(|s| *s != high));
    assert!(
        high.priority() < low[0].priority(),
        "high priority is a lower number"
    );
    Ok(())
}

pub fn stream_priorities(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let (least, greatest) = rt.priority_range(DEV)?;
    assert!(greatest <= -1 && least == 0, "range {least}..{greatest}");
    assert_eq!(rt.new_stream(DEV, -1)?.priority(), -1);
    assert_eq!(rt.new_stream(DEV, -100)?.priority(), greatest);
    assert_eq!(rt.new_stream(DEV, 100)?.priority(), least);
    Ok(())
}

/// The torch.cuda docs' side-stream example, fixed with `wait_stream`.
pub fn side_stream_fixed_with_wait_stream(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let m = module(h)?;
    let (fill, scale) = (m.function("fill_f32")?, m.function("scale_f32")?);
    let n = 4096u32;
    let a = DeviceBuffer::<f32>::uninit(rt, DEV, n as usize)?;
    let b = DeviceBuffer::<f32>::uninit(rt, DEV, n as usize)?;
    let current = rt.current_stream(DEV)?;
    launch_spin(h, &current, 20)?;
    current.launch(
        &fill,
        &elementwise(n as usize),
        &[a.arg(), KernelArg::value(&3.0f32), KernelArg::value(&n)],
    )?;
    let side = rt.stream_from_pool(DEV, false)?;
    side.wait_stream(&current)?;
    {
        let _g = rt.stream_guard(&side)?;
        let s = rt.current_stream(DEV)?;
        s.launch(
            &scale,
            &elementwise(n as usize),
            &[
                b.arg(),
                a.arg(),
                KernelArg::value(&2.0f32),
                KernelArg::value(&n),
            ],
        )?;
    }
    rt.synchronize(DEV)?;
    assert!(b.to_host()?.iter().all(|&v| v == 6.0));
    Ok(())
}

pub fn cross_stream_wait_event(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let m = module(h)?;
    let n = 1000u32;
    let x = DeviceBuffer::<f32>::filled(rt, DEV, n as usize, 1.0)?;
    let y = DeviceBuffer::<f32>::uninit(rt, DEV, n as usize)?;
    rt.synchronize(DEV)?;
    let (producer, consumer) = (rt.new_stream(DEV, 0)?, rt.new_stream(DEV, 0)?);
    launch_spin(h, &producer, 20)?;
    producer.launch(
        &m.function("add_one_f32")?,
        &elementwise(n as usize),
        &[x.arg(), KernelArg::value(&n)],
    )?;
    let done = producer.record_event(None)?;
    consumer.wait_event(&done)?;
    consumer.launch(
        &m.function("scale_f32")?,
        &elementwise(n as usize),
        &[
            y.arg(),
            x.arg(),
            KernelArg::value(&10.0f32),
            KernelArg::value(&n),
        ],
    )?;
    consumer.synchronize()?;
    assert!(
        done.query()?,
        "the awaited event completed before the consumer"
    );
    assert!(y.to_host()?.iter().all(|&v| v == 20.0));
    Ok(())
}

// ---- events ----------------------------------------------------------------------------

pub fn event_query_and_synchronize(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let ev = rt.new_event(EventFlags::default())?;
    assert!(
        ev.query()? && ev.device().is_none(),
        "an unrecorded event is complete"
    );
    ev.synchronize()?;
    let s = rt.new_stream(DEV, 0)?;
    launch_spin(h, &s, 100)?;
    ev.record(&s)?;
    assert_eq!(ev.device(), Some(DEV));
    assert!(!ev.query()?, "recorded after a 100 ms kernel");
    assert!(!s.query()?);
    ev.synchronize()?;
    assert!(ev.query()? && s.query()?);
    Ok(())
}

/// The torch.cuda docs' event-timing example.
pub fn event_timing(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let timing = EventFlags {
        timing: true,
        ..EventFlags::default()
    };
    let (start, end) = (rt.new_event(timing)?, rt.new_event(timing)?);
    let s = rt.current_stream(DEV)?;
    start.record(&s)?;
    launch_spin(h, &s, 2)?;
    end.record(&s)?;
    rt.synchronize(DEV)?;
    let ms = start.elapsed_time(&end)?;
    assert!(ms > 0.2 && ms < 10_000.0, "elapsed {ms} ms");
    Ok(())
}

pub fn event_errors(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let timing = EventFlags {
        timing: true,
        ..EventFlags::default()
    };
    let (a, b) = (rt.new_event(timing)?, rt.new_event(timing)?);
    assert_eq!(a.elapsed_time(&b), Err(StreamError::EventNotRecorded));
    let plain = rt.new_event(EventFlags::default())?;
    let s = rt.current_stream(DEV)?;
    plain.record(&s)?;
    a.record(&s)?;
    assert_eq!(a.elapsed_time(&plain), Err(StreamError::TimingDisabled));
    let ipc = EventFlags {
        timing: true,
        interprocess: true,
        ..EventFlags::default()
    };
    assert_eq!(
        rt.new_event(ipc).err(),
        Some(StreamError::InterprocessTiming)
    );
    let ipc_ok = rt.new_event(EventFlags {
        interprocess: true,
        ..EventFlags::default()
    })?;
    ipc_ok.record(&s)?;
    ipc_ok.synchronize()?;
    Ok(())
}

/// `CUDA_LAUNCH_BLOCKING=1`: checked in a child process, because drivers read it at start.
pub fn launch_blocking(h: &Harness) -> TestResult {
    const CHILD: &str = "FERROCUDA_CONFORMANCE_CHILD";
    let s = h.rt.new_stream(DEV, 0)?;
    launch_spin(h, &s, 50)?;
    if std::env::var(CHILD).is_ok_and(|v| v == "launch_blocking") {
        assert!(
            s.query()?,
            "with CUDA_LAUNCH_BLOCKING=1 a launch returns after the kernel"
        );
        return Ok(());
    }
    assert!(
        !s.query()?,
        "without it a 50 ms kernel is still running after launch"
    );
    s.synchronize()?;
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "launch_blocking",
            "--include-ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env("CUDA_LAUNCH_BLOCKING", "1")
        .env(CHILD, "launch_blocking")
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child run failed:\n{text}"
    );
    Ok(())
}

// ---- kernels ---------------------------------------------------------------------------

pub fn kernel_cache_hits_and_repairs(h: &Harness) -> TestResult {
    let dir = temp_dir("cache-test");
    let driver = h.rt.driver().clone();
    let rt = Runtime::with_kernel_cache(driver.clone(), KernelCache::at(Some(dir.clone())));
    let load = || Module::from_cuda_source(&rt, DEV, "cache_test", KERNELS);
    assert_eq!(load()?.cache_outcome(), CacheOutcome::Miss);
    assert_eq!(load()?.cache_outcome(), CacheOutcome::Hit);
    let entries: Vec<_> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .collect();
    assert_eq!(entries.len(), 1, "one entry: {entries:?}");
    std::fs::write(&entries[0], b"not a kernel")?;
    assert_eq!(
        load()?.cache_outcome(),
        CacheOutcome::Repaired,
        "a damaged entry is recompiled"
    );
    assert_eq!(load()?.cache_outcome(), CacheOutcome::Hit, "and rewritten");
    // A well-formed entry whose image the driver refuses.
    use sha2::{Digest, Sha256};
    let junk = b"this is not PTX".to_vec();
    std::fs::write(
        &entries[0],
        [b"FCKERN01".as_slice(), &Sha256::digest(&junk), &junk].concat(),
    )?;
    let m = load()?;
    assert_eq!(m.cache_outcome(), CacheOutcome::Repaired);
    let x = DeviceBuffer::<f32>::filled(&rt, DEV, 10, 1.0)?;
    let s = rt.current_stream(DEV)?;
    s.launch(
        &m.function("add_one_f32")?,
        &elementwise(10),
        &[x.arg(), KernelArg::value(&10u32)],
    )?;
    assert!(x.to_host()?.iter().all(|&v| v == 2.0));
    let uncached = Runtime::with_kernel_cache(driver, KernelCache::at(None));
    assert_eq!(
        Module::from_cuda_source(&uncached, DEV, "c", KERNELS)?.cache_outcome(),
        CacheOutcome::Disabled
    );
    assert_eq!(
        m.function("no_such_kernel").err(),
        Some(StreamError::Driver(DriverError::NOT_FOUND))
    );
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

pub fn compile_error_carries_the_log(h: &Harness) -> TestResult {
    let src = "extern \"C\" __global__ void k() {}\n#error boom from the suite\n";
    match Module::from_cuda_source(&h.rt, DEV, "bad_kernel", src) {
        Err(StreamError::Compile(ferrocuda_driver::CompileError::Rejected { log })) => {
            assert!(log.contains("boom from the suite"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    Ok(())
}

// ---- buffers ---------------------------------------------------------------------------

pub fn buffer_round_trips(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 100.0).collect();
    let a = DeviceBuffer::from_slice(rt, DEV, &values)?;
    assert_eq!(a.to_host()?, values);
    let b = DeviceBuffer::<f32>::uninit(rt, DEV, values.len())?;
    b.copy_from(&a)?;
    assert_eq!(b.to_host()?, values);
    assert!(
        DeviceBuffer::<u8>::filled(rt, DEV, 333, 7)?
            .to_host()?
            .iter()
            .all(|&v| v == 7)
    );
    let f16 = half::f16::from_f32(-1.5);
    assert!(
        DeviceBuffer::filled(rt, DEV, 77, f16)?
            .to_host()?
            .iter()
            .all(|&v| v == f16)
    );
    let bf = half::bf16::from_f32(3.25);
    assert!(
        DeviceBuffer::filled(rt, DEV, 78, bf)?
            .to_host()?
            .iter()
            .all(|&v| v == bf)
    );
    assert!(
        DeviceBuffer::filled(rt, DEV, 79, -2.5f64)?
            .to_host()?
            .iter()
            .all(|&v| v == -2.5)
    );
    let longs: Vec<i64> = (0..50).map(|i| i64::MAX - i).collect();
    assert_eq!(DeviceBuffer::from_slice(rt, DEV, &longs)?.to_host()?, longs);
    assert_eq!(
        a.copy_from_host(&[1.0]),
        Err(StreamError::LengthMismatch {
            expected: 1000,
            found: 1
        })
    );
    let empty = DeviceBuffer::<f32>::uninit(rt, DEV, 0)?;
    assert!(empty.is_empty() && empty.to_host()?.is_empty());
    Ok(())
}

pub fn buffer_kernel_launch(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let n = 1000u32;
    let xs: Vec<f32> = (1..=n).map(|i| i as f32).collect();
    let x = DeviceBuffer::from_slice(rt, DEV, &xs)?;
    let y = DeviceBuffer::<f32>::uninit(rt, DEV, n as usize)?;
    let scale = module(h)?.function("scale_f32")?;
    rt.current_stream(DEV)?.launch(
        &scale,
        &elementwise(n as usize),
        &[
            y.arg(),
            x.arg(),
            KernelArg::value(&2.5f32),
            KernelArg::value(&n),
        ],
    )?;
    let want: Vec<f32> = xs.iter().map(|v| 2.5 * v).collect();
    assert_eq!(y.to_host()?, want);
    Ok(())
}

// ---- driver rules ----------------------------------------------------------------------

pub fn use_after_destroy_is_an_error(h: &Harness) -> TestResult {
    let d = h.rt.driver();
    let s = d.stream_create(
        DEV,
        StreamFlags {
            non_blocking: true,
            priority: 0,
        },
    )?;
    d.stream_destroy(s)?;
    assert_eq!(
        driver_err(d.stream_query(s)),
        Some(DriverError::INVALID_HANDLE)
    );
    assert_eq!(
        driver_err(d.stream_destroy(s)),
        Some(DriverError::INVALID_HANDLE)
    );
    let e = d.event_create(DEV, EventFlags::default())?;
    d.event_destroy(e)?;
    assert_eq!(
        driver_err(d.event_record(e, StreamHandle::legacy(DEV))),
        Some(DriverError::INVALID_HANDLE)
    );
    let made_up = EventHandle {
        device: DEV,
        raw: 0x1234_5678,
    };
    assert_eq!(
        driver_err(d.event_query(made_up)),
        Some(DriverError::INVALID_HANDLE)
    );
    let h1 = d.host_alloc(64)?;
    d.host_free(h1)?;
    assert!(d.host_free(h1).is_err() && d.host_read(h1, 0, &mut [0u8; 4]).is_err());
    Ok(())
}

pub fn out_of_memory_is_a_typed_error(h: &Harness) -> TestResult {
    let d = h.rt.driver();
    let (_, total) = d.mem_get_info(DEV)?;
    let err = d
        .malloc(DEV, total * 2)
        .expect_err("twice the device's memory");
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(err.to_string(), "CUDA_ERROR_OUT_OF_MEMORY (2)");
    let p = d.malloc(DEV, 1 << 20)?;
    d.free(DEV, p)?;
    Ok(())
}

pub fn pinned_host_copies(h: &Harness) -> TestResult {
    let (rt, d) = (&h.rt, h.rt.driver());
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let (src, dst) = (d.host_alloc(4096)?, d.host_alloc(4096)?);
    d.host_write(src, 0, &pattern)?;
    let dev = DeviceBuffer::<u8>::uninit(rt, DEV, 4096)?;
    let s = rt.new_stream(DEV, 0)?;
    d.memcpy_htod_pinned_async(dev.ptr(), (src, 0), 4096, s.handle())?;
    d.memcpy_dtoh_pinned_async((dst, 0), dev.ptr(), 4096, s.handle())?;
    s.synchronize()?;
    let mut back = vec![0u8; 4096];
    d.host_read(dst, 0, &mut back)?;
    assert_eq!(back, pattern);
    assert_eq!(
        driver_err(d.host_read(dst, 4000, &mut [0u8; 100])),
        Some(DriverError::INVALID_VALUE)
    );
    d.host_free(src)?;
    d.host_free(dst)?;
    Ok(())
}

pub fn virtual_memory_map_and_access(h: &Harness) -> TestResult {
    let (rt, d) = (&h.rt, h.rt.driver());
    let g = d.vm_granularity(DEV)?;
    assert_eq!(g, 2 << 20, "2 MiB granularity");
    let va = d.vm_reserve(DEV, 4 * g)?;
    let (c1, c2) = (d.vm_create(DEV, g)?, d.vm_create(DEV, 2 * g)?);
    d.vm_map(va.base, c1)?;
    d.vm_map(va.base.offset(g), c2)?;
    d.vm_set_access(DEV, va.base, 3 * g)?;
    let s = rt.new_stream(DEV, 0)?;
    d.memset_async(
        va.base,
        MemsetValue::U32(0xdead_beef),
        3 * g / 4,
        s.handle(),
    )?;
    let mut across = vec![0u8; 64];
    d.memcpy_dtoh(&mut across, va.base.offset(g - 32), s.handle())?;
    assert!(
        across.chunks(4).all(|w| w == 0xdead_beefu32.to_le_bytes()),
        "a copy across two mappings"
    );
    d.vm_unmap(DEV, va.base, g)?;
    d.vm_unmap(DEV, va.base.offset(g), 2 * g)?;
    d.vm_destroy(c1)?;
    d.vm_destroy(c2)?;
    assert_eq!(
        driver_err(d.vm_destroy(c1)),
        Some(DriverError::INVALID_HANDLE)
    );
    d.vm_release(va)?;
    Ok(())
}

// ---- capture ---------------------------------------------------------------------------

pub fn capture_records_and_replays(h: &Harness) -> TestResult {
    let (rt, d) = (&h.rt, h.rt.driver());
    let add = module(h)?.function("add_one_f32")?;
    let n = 256u32;
    let x = DeviceBuffer::<f32>::filled(rt, DEV, n as usize, 0.0)?;
    rt.synchronize(DEV)?;
    let s = rt.new_stream(DEV, 0)?;
    assert_eq!(d.stream_capture_status(s.handle())?, CaptureStatus::None);
    d.stream_begin_capture(s.handle(), CaptureMode::Global)?;
    assert!(
        matches!(d.stream_capture_status(s.handle())?, CaptureStatus::Active { id } if id != 0)
    );
    s.launch(
        &add,
        &elementwise(n as usize),
        &[x.arg(), KernelArg::value(&n)],
    )?;
    let graph = d.stream_end_capture(s.handle())?;
    assert_eq!(d.graph_node_count(graph)?, 1);
    let exec = d.graph_instantiate(graph)?;
    d.graph_upload(exec, s.handle())?;
    assert!(
        x.to_host()?.iter().all(|&v| v == 0.0),
        "captured work does not run"
    );
    for _ in 0..3 {
        d.graph_launch(exec, s.handle())?;
    }
    s.synchronize()?;
    assert!(x.to_host()?.iter().all(|&v| v == 3.0));
    let dot = temp_dir("graph").with_extension("dot");
    d.graph_debug_dot(graph, &dot)?;
    assert!(std::fs::read_to_string(&dot)?.contains("digraph"));
    let _ = std::fs::remove_file(dot);
    d.graph_exec_destroy(exec)?;
    d.graph_destroy(graph)?;
    assert_eq!(
        driver_err(d.graph_launch(exec, s.handle())),
        Some(DriverError::INVALID_HANDLE)
    );
    assert_eq!(
        driver_err(d.graph_node_count(graph)),
        Some(DriverError::INVALID_HANDLE)
    );
    Ok(())
}

pub fn capture_refuses_legacy_stream_and_nesting(h: &Harness) -> TestResult {
    let d = h.rt.driver();
    let legacy = StreamHandle::legacy(DEV);
    assert_eq!(
        driver_err(d.stream_begin_capture(legacy, CaptureMode::Global)),
        Some(DriverError::STREAM_CAPTURE_UNSUPPORTED)
    );
    let s = h.rt.new_stream(DEV, 0)?;
    assert!(
        d.stream_end_capture(s.handle()).is_err(),
        "end without begin"
    );
    d.stream_begin_capture(s.handle(), CaptureMode::ThreadLocal)?;
    assert_eq!(
        driver_err(d.stream_begin_capture(s.handle(), CaptureMode::ThreadLocal)),
        Some(DriverError::ILLEGAL_STATE)
    );
    let g = d.stream_end_capture(s.handle())?;
    assert_eq!(
        d.graph_node_count(g)?,
        0,
        "an empty capture is an empty graph"
    );
    d.graph_destroy(g)?;
    Ok(())
}

pub fn capture_refuses_sync_and_captured_event_query(h: &Harness) -> TestResult {
    let (rt, d) = (&h.rt, h.rt.driver());
    let add = module(h)?.function("add_one_f32")?;
    let x = DeviceBuffer::<f32>::filled(rt, DEV, 16, 0.0)?;
    rt.synchronize(DEV)?;
    let s = rt.new_stream(DEV, 0)?;
    let args = [x.arg(), KernelArg::value(&16u32)];
    d.stream_begin_capture(s.handle(), CaptureMode::Global)?;
    assert_eq!(
        s.synchronize(),
        Err(StreamError::Driver(DriverError::STREAM_CAPTURE_UNSUPPORTED))
    );
    assert_eq!(
        d.stream_capture_status(s.handle())?,
        CaptureStatus::Invalidated
    );
    assert_eq!(
        s.launch(&add, &elementwise(16), &args),
        Err(StreamError::Driver(DriverError::STREAM_CAPTURE_INVALIDATED))
    );
    assert_eq!(
        driver_err(d.stream_end_capture(s.handle())),
        Some(DriverError::STREAM_CAPTURE_INVALIDATED)
    );
    assert_eq!(
        d.stream_capture_status(s.handle())?,
        CaptureStatus::None,
        "ended even though it failed"
    );

    let ev = rt.new_event(EventFlags::default())?;
    ev.record(&s)?;
    s.synchronize()?;
    d.stream_begin_capture(s.handle(), CaptureMode::Global)?;
    s.launch(&add, &elementwise(16), &args)?;
    ev.record(&s)?;
    assert_eq!(
        ev.query(),
        Err(StreamError::Driver(DriverError::CAPTURED_EVENT))
    );
    assert_eq!(
        driver_err(d.stream_end_capture(s.handle())),
        Some(DriverError::STREAM_CAPTURE_INVALIDATED)
    );
    Ok(())
}

pub fn capture_modes_and_other_threads(h: &Harness) -> TestResult {
    let d = h.rt.driver();
    let stream = h.rt.new_stream(DEV, 0)?;
    let s = stream.handle();
    let other_thread_malloc = || {
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let p = d.malloc(DEV, 1 << 20)?;
                d.free(DEV, p)
            })
            .join()
            .expect("thread")
        })
    };
    step!("GLOBAL: another thread's malloc");
    d.stream_begin_capture(s, CaptureMode::Global)?;
    assert_eq!(
        other_thread_malloc(),
        Err(DriverError::STREAM_CAPTURE_UNSUPPORTED)
    );
    assert_eq!(d.stream_capture_status(s)?, CaptureStatus::Invalidated);
    assert_eq!(
        driver_err(d.stream_end_capture(s)),
        Some(DriverError::STREAM_CAPTURE_INVALIDATED)
    );
    step!("THREAD_LOCAL: other threads are free; this one is not");
    d.stream_begin_capture(s, CaptureMode::ThreadLocal)?;
    other_thread_malloc()?;
    assert!(matches!(
        d.stream_capture_status(s)?,
        CaptureStatus::Active { .. }
    ));
    assert_eq!(
        driver_err(d.malloc(DEV, 1 << 20)),
        Some(DriverError::STREAM_CAPTURE_UNSUPPORTED)
    );
    assert_eq!(
        driver_err(d.stream_end_capture(s)),
        Some(DriverError::STREAM_CAPTURE_INVALIDATED)
    );
    step!("RELAXED: nothing is refused");
    d.stream_begin_capture(s, CaptureMode::Relaxed)?;
    let p = d.malloc(DEV, 1 << 20)?;
    d.free(DEV, p)?;
    d.graph_destroy(d.stream_end_capture(s)?)?;
    step!("GLOBAL with this thread switched to RELAXED (what NCCL's watchdog does)");
    d.stream_begin_capture(s, CaptureMode::Global)?;
    let previous = d.exchange_capture_mode(CaptureMode::Relaxed)?;
    let p = d.malloc(DEV, 1 << 20);
    assert_eq!(d.exchange_capture_mode(previous)?, CaptureMode::Relaxed);
    step!("end from another thread");
    // Refused with WRONG_THREAD, and the capture is over all the same (seen on H100/H200):
    // the owner's end then finds no capture.
    let wrong_thread =
        std::thread::scope(|sc| sc.spawn(|| d.stream_end_capture(s)).join().expect("thread"));
    assert_eq!(
        driver_err(wrong_thread),
        Some(DriverError::STREAM_CAPTURE_WRONG_THREAD)
    );
    assert_eq!(d.stream_capture_status(s)?, CaptureStatus::None);
    assert_eq!(
        driver_err(d.stream_end_capture(s)),
        Some(DriverError::ILLEGAL_STATE)
    );
    d.free(DEV, p?)?;
    Ok(())
}

pub fn capture_fork_join_and_unjoined(h: &Harness) -> TestResult {
    let (rt, d) = (&h.rt, h.rt.driver());
    let m = module(h)?;
    let (add, scale) = (m.function("add_one_f32")?, m.function("scale_f32")?);
    let n = 512u32;
    let cfg = elementwise(n as usize);
    let x = DeviceBuffer::<f32>::filled(rt, DEV, n as usize, 1.0)?;
    let y = DeviceBuffer::<f32>::filled(rt, DEV, n as usize, 0.0)?;
    let z = DeviceBuffer::<f32>::filled(rt, DEV, n as usize, 1.0)?;
    rt.synchronize(DEV)?;
    let (s, side) = (rt.new_stream(DEV, 0)?, rt.new_stream(DEV, 0)?);
    d.stream_begin_capture(s.handle(), CaptureMode::Global)?;
    s.launch(&add, &cfg, &[x.arg(), KernelArg::value(&n)])?;
    side.wait_stream(&s)?;
    assert!(
        matches!(
            d.stream_capture_status(side.handle())?,
            CaptureStatus::Active { .. }
        ),
        "the fork joins the capture"
    );
    side.launch(
        &scale,
        &cfg,
        &[
            y.arg(),
            x.arg(),
            KernelArg::value(&2.0f32),
            KernelArg::value(&n),
        ],
    )?;
    s.launch(&add, &cfg, &[z.arg(), KernelArg::value(&n)])?;
    s.wait_stream(&side)?;
    let g = d.stream_end_capture(s.handle())?;
    assert_eq!(d.graph_node_count(g)?, 3);
    assert_eq!(d.stream_capture_status(side.handle())?, CaptureStatus::None);
    let e = d.graph_instantiate(g)?;
    d.graph_launch(e, s.handle())?;
    s.synchronize()?;
    assert!(x.to_host()?.iter().all(|&v| v == 2.0) && z.to_host()?.iter().all(|&v| v == 2.0));
    assert!(
        y.to_host()?.iter().all(|&v| v == 4.0),
        "the side branch ran after its dependency"
    );
    d.graph_exec_destroy(e)?;
    d.graph_destroy(g)?;

    d.stream_begin_capture(s.handle(), CaptureMode::Global)?;
    s.launch(&add, &cfg, &[x.arg(), KernelArg::value(&n)])?;
    side.wait_stream(&s)?;
    side.launch(&add, &cfg, &[z.arg(), KernelArg::value(&n)])?;
    assert_eq!(
        driver_err(d.stream_end_capture(s.handle())),
        Some(DriverError::STREAM_CAPTURE_UNJOINED)
    );
    Ok(())
}

/// Instantiates every conformance test as a `#[test]` over a harness constructor.
///
/// `conformance_tests!(path::to::harness_fn);` or, with attributes on every test,
/// `conformance_tests!(path::to::harness_fn, #[ignore = "needs a GPU"]);`.
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
            out_of_memory_is_a_typed_error, pinned_host_copies, virtual_memory_map_and_access,
            capture_records_and_replays, capture_refuses_legacy_stream_and_nesting,
            capture_refuses_sync_and_captured_event_query, capture_modes_and_other_threads,
            capture_fork_join_and_unjoined
        );
    };
    (@each $harness:path, $attrs:tt, $($name:ident),* $(,)?) => {
        $( $crate::conformance_tests!(@one $harness, $attrs, $name); )*
    };
    (@one $harness:path, [$(#[$attr:meta])*], $name:ident) => {
        #[test]
        $(#[$attr])*
        fn $name() -> $crate::conformance::TestResult {
            $crate::conformance::$name(&$harness())
        }
    };
}
