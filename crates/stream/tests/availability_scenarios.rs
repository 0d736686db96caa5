//! `is_available()` by NVML or by the driver, and when a runtime initialises CUDA, on the
//! fake device (CI has no NVML; the fake models one when built with `FakeDriverBuilder::nvml`).
//! The NVML-based check must answer without initialising CUDA when NVML answers, and fall
//! back to the driver, answering as it does, when NVML is missing or fails. Forks are in
//! `tests/fork_process.rs`.
//!
//! The last test is the real driver's: ignored (skipped, with the reason) without a GPU, run
//! by the GPU bundle with `--include-ignored`, where a missing GPU or NVML fails it.
#![forbid(unsafe_code)]
use ferrocuda_driver::{Call, CudaDriver, Driver, FakeDriver, NvmlError};
use ferrocuda_stream::{AvailabilityCheck, DeviceBuffer, KernelCache, Runtime};
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

/// A runtime over a fake with `devices` devices and `nvml` as NVML's answer.
fn fake(devices: usize, nvml: Option<Result<usize, NvmlError>>) -> (Arc<FakeDriver>, Arc<Runtime>) {
    let builder = FakeDriver::builder().devices(devices);
    let fake = Arc::new(match nvml {
        Some(answer) => builder.nvml(answer).build(),
        None => builder.build(),
    });
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    (fake, rt)
}

fn nvml_failure() -> NvmlError {
    NvmlError::Call {
        function: "nvmlInit_v2",
        code: 9,
        message: "Driver Not Loaded".into(),
    }
}

#[test]
fn making_a_runtime_initialises_nothing_and_its_first_device_use_does() -> TestResult {
    let (fake, rt) = fake(1, None);
    assert!(!fake.is_initialized() && !rt.is_initialized());
    assert_eq!(fake.calls(Call::DeviceCount), 0);
    let x = DeviceBuffer::from_slice(&rt, D0, &[1.0f32, 2.0])?;
    assert!(fake.is_initialized() && rt.is_initialized());
    assert_eq!(x.to_host()?, [1.0, 2.0]);
    Ok(())
}

/// The driver's check runs `cuInit` (a later fork is bad), but, as PyTorch's
/// `_cuda_getDeviceCount`, it is not `_lazy_init`: `is_initialized()` stays false (and the
/// statistics empty) until something needs a device.
#[test]
fn the_driver_check_initialises_the_driver_but_not_the_runtime() -> TestResult {
    let (fake, rt) = fake(1, Some(Ok(1)));
    assert!(!rt.is_initialized());
    assert!(rt.is_available_by(AvailabilityCheck::Driver));
    assert!(fake.is_initialized() && !rt.is_initialized());
    assert_eq!(fake.calls(Call::NvmlDeviceCount), 0, "NVML is not asked");
    rt.current_stream(D0)?;
    assert!(rt.is_initialized());
    assert_eq!(fake.calls(Call::DeviceCount), 1, "the first count is kept");
    Ok(())
}

#[test]
fn the_nvml_check_answers_from_nvml_without_initialising_cuda() -> TestResult {
    let (fake, rt) = fake(1, Some(Ok(1)));
    assert!(rt.is_available_by(AvailabilityCheck::Nvml));
    assert!(!rt.is_initialized() && !fake.is_initialized());
    assert_eq!(fake.calls(Call::NvmlDeviceCount), 1);
    assert_eq!(fake.calls(Call::DeviceCount), 0);
    rt.init()?;
    assert!(rt.is_initialized() && fake.is_initialized());
    Ok(())
}

/// PyTorch believes NVML's zero (only a failure falls back): not available, and CUDA is
/// left alone although the driver would have found a device.
#[test]
fn the_nvml_check_believes_nvml_reporting_no_device() {
    let (fake, rt) = fake(1, Some(Ok(0)));
    assert!(!rt.is_available_by(AvailabilityCheck::Nvml));
    assert!(!rt.is_initialized() && !fake.is_initialized());
    assert!(rt.is_available_by(AvailabilityCheck::Driver));
}

#[test]
fn the_nvml_check_without_nvml_falls_back_and_answers_as_the_driver() {
    for devices in [0, 1, 2] {
        let (nvml_fake, nvml_rt) = fake(devices, None);
        let (_, driver_rt) = fake(devices, None);
        assert_eq!(
            nvml_rt.is_available_by(AvailabilityCheck::Nvml),
            driver_rt.is_available_by(AvailabilityCheck::Driver),
            "{devices} device(s)"
        );
        assert_eq!(
            nvml_rt.is_available_by(AvailabilityCheck::Nvml),
            devices > 0
        );
        assert_eq!(
            nvml_fake.calls(Call::NvmlDeviceCount),
            2,
            "NVML asked first, at each check"
        );
        assert!(nvml_fake.is_initialized(), "the fallback asked the driver");
        assert!(!nvml_rt.is_initialized(), "counting is not _lazy_init");
        assert_eq!(nvml_fake.calls(Call::DeviceCount), 1);
        assert_eq!(nvml_rt.device_count(), devices);
        assert_eq!(
            nvml_fake.calls(Call::DeviceCount),
            1,
            "the driver's count is kept"
        );
    }
}

#[test]
fn the_nvml_check_falls_back_when_nvml_fails() {
    let (fake, rt) = fake(1, Some(Err(nvml_failure())));
    assert!(rt.is_available_by(AvailabilityCheck::Nvml));
    assert_eq!(fake.calls(Call::NvmlDeviceCount), 1);
    assert!(fake.is_initialized() && !rt.is_initialized());
}

/// `torch.cuda.device_count()` asks NVML until CUDA is initialised (so counting does not
/// initialise it), then gives the count found at initialisation without asking again.
#[test]
fn device_count_asks_nvml_until_initialised() -> TestResult {
    let (fake, rt) = fake(1, Some(Ok(2)));
    assert_eq!(rt.device_count(), 2);
    assert!(!rt.is_initialized());
    // The driver's check counts without initialising: NVML is still asked after it, at
    // every call, as PyTorch does before `_lazy_init`.
    assert!(rt.is_available_by(AvailabilityCheck::Driver));
    assert_eq!(rt.device_count(), 2);
    assert_eq!(fake.calls(Call::NvmlDeviceCount), 2);
    rt.init()?;
    assert_eq!(rt.device_count(), 1);
    assert!(rt.is_available_by(AvailabilityCheck::Nvml));
    assert_eq!(
        fake.calls(Call::NvmlDeviceCount),
        2,
        "not asked once initialised"
    );
    Ok(())
}

/// On the GPU machine, which has libnvidia-ml, the NVML-based check answers true and leaves
/// CUDA uninitialised (no `cuInit`); the driver's check then agrees.
#[test]
#[ignore = "needs a GPU and NVML: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn cuda_the_nvml_check_answers_true_without_initialising_cuda() {
    let cuda = Arc::new(CudaDriver::new());
    let rt = Runtime::with_kernel_cache(cuda.clone(), KernelCache::at(None));
    let nvml = cuda.nvml_device_count();
    eprintln!("NVML: {nvml:?}");
    assert!(
        matches!(nvml, Ok(n) if n > 0),
        "NVML must see a GPU here: {nvml:?}"
    );
    assert!(
        rt.is_available_by(AvailabilityCheck::Nvml),
        "not available by NVML (CUDA_VISIBLE_DEVICES={:?})",
        std::env::var("CUDA_VISIBLE_DEVICES")
    );
    assert!(
        !cuda.is_initialized() && !rt.is_initialized(),
        "the NVML check initialised CUDA (CUDA_VISIBLE_DEVICES={:?}: a UUID list falls back to \
         the driver)",
        std::env::var("CUDA_VISIBLE_DEVICES")
    );
    assert!(rt.is_available_by(AvailabilityCheck::Driver));
    assert!(cuda.is_initialized() && !rt.is_initialized());
    rt.init().expect("init");
    assert!(rt.is_initialized());
}
