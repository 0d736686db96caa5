//! Peer access on the real driver with one GPU (the GPU bundle's `test_peer_gpu`): a device
//! and itself cannot "access a peer" but `get_p2p_access` answers `true` for it, bad indices are
//! typed errors, enabling access to itself is refused with a driver code, and a copy within
//! one device through `copy_between_devices` is a plain copy. Ignored without a GPU; the
//! bundle runs it with `--include-ignored`, where a missing GPU fails it. (Two devices:
//! crates/dist/tests/dist_multigpu.rs.)
#![forbid(unsafe_code)]
use ferrocuda_driver::{CudaDriver, Driver, DriverError};
use ferrocuda_stream::{DeviceBuffer, Runtime, StreamError};
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

#[test]
#[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_peer_access_rules_on_one_device() -> TestResult {
    let driver = Arc::new(CudaDriver::new());
    if let Some(reason) = driver.unavailable_reason() {
        return Err(format!("no usable CUDA device ({reason}): this test needs a GPU").into());
    }
    let rt = Runtime::new(driver.clone());
    let n = rt.device_count();
    assert!(!rt.can_device_access_peer(D0, D0)?);
    assert!(rt.get_p2p_access(D0, D0)?);
    let past = DeviceIndex(n as u16);
    assert_eq!(
        rt.can_device_access_peer(D0, past),
        Err(StreamError::InvalidDevice {
            index: past.0,
            count: n
        })
    );
    assert_eq!(
        driver.enable_peer_access(D0, D0),
        Err(DriverError::INVALID_DEVICE)
    );
    let a = DeviceBuffer::from_slice(&rt, D0, &[1.0f32, 2.0, 3.0])?;
    let b = DeviceBuffer::<f32>::filled(&rt, D0, 3, 0.0)?;
    let stream = rt.copy_between_devices((D0, b.ptr()), (D0, a.ptr()), 12)?;
    assert_eq!(stream, rt.current_stream(D0)?);
    assert_eq!(b.to_host()?, vec![1.0, 2.0, 3.0]);
    Ok(())
}
