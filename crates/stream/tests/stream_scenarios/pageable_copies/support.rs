//! What the adversarial scenarios share: each runs on a thread of its own with a time limit
//! (a hang shows as a failure), over a fake device, against the driver's copy (0 threads).
pub(super) use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver, fake::Completion};
pub(super) use ferrocuda_stream::{
    CHUNK, DEPTH, DeviceBuffer, KernelCache, Module, READ_MIN_THREADS, Runtime, STAGED_MIN,
    STAGED_READ_MIN, Stream, StreamError,
};
pub(super) use ferrocuda_testkit::{KERNELS, StagedCopies, register_fake_kernels};
pub(super) use ferrocuda_types::{
    CaptureMode, DeviceIndex, KernelArg, LaunchConfig, MemsetValue, StreamFlags,
};
pub(super) use std::sync::mpsc;
pub(super) use std::sync::{Arc, Barrier, Mutex};
pub(super) use std::time::Duration;

pub(super) type Err = Box<dyn std::error::Error + Send + Sync>;
pub(super) type R = Result<(), Err>;

pub(super) const D0: DeviceIndex = DeviceIndex(0);
pub(super) const D1: DeviceIndex = DeviceIndex(1);

/// Runs `f` on a thread of its own; a scenario that does not finish in `secs` is a hang.
pub(super) fn timed(name: &str, secs: u64, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    let n = name.to_string();
    std::thread::Builder::new().name(n.clone()).spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    })?;
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(r)) => r,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(format!("HANG: scenario `{n}` did not finish within {secs} s").into()),
    }
}

pub(super) fn fake_n(completion: Completion, devices: usize) -> Arc<FakeDriver> {
    Arc::new(
        FakeDriver::builder()
            .completion(completion)
            .devices(devices)
            .build(),
    )
}

pub(super) fn runtime(fake: &Arc<FakeDriver>, threads: usize) -> Arc<Runtime> {
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    StagedCopies::install(&rt, threads);
    rt
}

pub(super) fn pattern(bytes: usize, seed: usize) -> Vec<u8> {
    let mut x = (seed as u32)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(12345);
    (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 11) as u8
        })
        .collect()
}

/// `bytes` of values that never repeat at a chunk's period (a pattern of CHUNK + 13 bytes,
/// repeated by memcpy: fast in a debug build, where `pattern` takes some 16 ns a byte).
pub(super) fn values(bytes: usize, seed: usize) -> Vec<u8> {
    let period = pattern(CHUNK + 13, seed);
    let mut out = Vec::with_capacity(bytes + period.len());
    while out.len() < bytes {
        out.extend_from_slice(&period);
    }
    out.truncate(bytes);
    out
}

pub(super) fn first_diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(usize::MAX);
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

pub(super) fn add_one_and_fill(rt: &Arc<Runtime>, fake: &FakeDriver) -> Result<Module, Err> {
    register_fake_kernels(fake);
    Ok(Module::from_cuda_source(rt, D0, "attack", KERNELS)?)
}

pub(super) fn launch_fill(s: &Stream, m: &Module, buf: &DeviceBuffer<f32>, v: f32) -> R {
    let n = buf.len();
    s.launch(
        &m.function("fill_f32")?,
        &LaunchConfig::for_elements(n, 256),
        &[
            buf.arg(),
            KernelArg::value(&v),
            KernelArg::value(&(n as u32)),
        ],
    )?;
    Ok(())
}

pub(super) fn launch_add_one(s: &Stream, m: &Module, buf: &DeviceBuffer<f32>) -> R {
    let n = buf.len();
    s.launch(
        &m.function("add_one_f32")?,
        &LaunchConfig::for_elements(n, 256),
        &[buf.arg(), KernelArg::value(&(n as u32))],
    )?;
    Ok(())
}

/// `buf`'s bytes through the driver's own copy (never staged), after `s`'s work: for
/// scenarios that count the staged copies' calls to the device.
pub(super) fn driver_read(
    fake: &FakeDriver,
    buf: &DeviceBuffer<u8>,
    s: &Stream,
) -> Result<Vec<u8>, Err> {
    let mut out = vec![0u8; buf.len()];
    fake.memcpy_dtoh(&mut out, buf.ptr(), s.handle())?;
    Ok(out)
}

/// The driver's own copies to the host and the transfers into slots made on `fake` so far
/// (`[MemcpyDtoH, MemcpyDtoHPinned]`): what tells a read the driver did from a staged one.
pub(super) fn dtoh_calls(fake: &FakeDriver) -> [u64; 2] {
    [
        fake.calls(Call::MemcpyDtoH),
        fake.calls(Call::MemcpyDtoHPinned),
    ]
}
