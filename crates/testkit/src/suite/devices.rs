//! Devices: their count and properties, device guards, invalid indices.
use super::*;

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
