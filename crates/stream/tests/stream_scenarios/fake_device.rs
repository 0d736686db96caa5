//! Behaviours only the fake device can show deterministically, or that need more devices
//! than the GPU machine has: multi-device rules, held events, injected failures, call counts,
//! lazy backing, and what happens with no driver at all.
use ferrocuda_driver::{Call, CudaDriver, Driver, DriverError, FakeDriver, fake::Completion};
use ferrocuda_stream::{DeviceBuffer, KernelCache, Module, Runtime, StreamError};
use ferrocuda_testkit::{KERNELS, register_fake_kernels};
use ferrocuda_types::{
    CaptureMode, Device, DeviceIndex, EventFlags, KernelArg, LaunchConfig, MemsetValue,
    StreamFlags, StreamHandle,
};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn fake(devices: usize, completion: Completion) -> (Arc<FakeDriver>, Arc<Runtime>) {
    let fake = Arc::new(
        FakeDriver::builder()
            .devices(devices)
            .completion(completion)
            .build(),
    );
    register_fake_kernels(&fake);
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    (fake, rt)
}

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);
const D2: DeviceIndex = DeviceIndex(2);

/// The torch.cuda docs' device-semantics example, on three fake devices.
#[test]
fn nested_device_guard_example_on_three_devices() -> TestResult {
    let (_, rt) = fake(3, Completion::Eager);
    let x = DeviceBuffer::from_slice(
        &rt,
        rt.resolve(&"cuda:0".parse::<Device>()?)?,
        &[1.0f32, 2.0],
    )?;
    {
        let _g = rt.device_guard(D1)?;
        let cuda = rt.resolve(&"cuda".parse::<Device>()?)?;
        assert_eq!(cuda, D1, "`cuda` is the current device inside the guard");
        let a = DeviceBuffer::from_slice(&rt, cuda, &[1.0f32, 2.0])?;
        assert_eq!(a.device(), D1);
        let b = DeviceBuffer::<f32>::uninit(&rt, cuda, 2)?;
        b.copy_from(&x)?; // an explicit transfer across devices
        assert_eq!(b.to_host()?, vec![1.0, 2.0]);
        {
            let _g2 = rt.device_guard(D2)?;
            let d =
                DeviceBuffer::<f32>::filled(&rt, rt.resolve(&"cuda".parse::<Device>()?)?, 2, 0.0)?;
            assert_eq!(d.device(), D2);
        }
        assert_eq!(rt.current_device(), D1);
        // Within a guard one can still name a device explicitly.
        let z = DeviceBuffer::<f32>::uninit(&rt, D0, 2)?;
        assert_eq!(z.device(), D0);
    }
    assert_eq!(rt.current_device(), D0);
    Ok(())
}

#[test]
fn launches_that_mix_devices_are_refused() -> TestResult {
    let (_, rt) = fake(2, Completion::Eager);
    let m1 = Module::from_cuda_source(&rt, D1, "k", KERNELS)?;
    let x0 = DeviceBuffer::<f32>::filled(&rt, D0, 4, 1.0)?;
    let s1 = rt.new_stream(D1, 0)?;
    let err = s1.launch(
        &m1.function("add_one_f32")?,
        &LaunchConfig::for_elements(4, 32),
        &[x0.arg(), KernelArg::value(&4u32)],
    );
    assert_eq!(
        err,
        Err(StreamError::DeviceMismatch {
            expected: D1,
            found: D0,
            what: "a buffer argument"
        })
    );
    let m0 = Module::from_cuda_source(&rt, D0, "k", KERNELS)?;
    let err = s1.launch(
        &m0.function("tiny")?,
        &LaunchConfig::for_elements(1, 1),
        &[],
    );
    assert!(matches!(
        err,
        Err(StreamError::DeviceMismatch {
            what: "the kernel",
            ..
        })
    ));
    assert_eq!(x0.to_host()?, vec![1.0; 4], "nothing ran");
    Ok(())
}

#[test]
fn stream_guard_switches_device_and_restores_both() -> TestResult {
    let (_, rt) = fake(3, Completion::Eager);
    let s2 = rt.new_stream(D2, 0)?;
    let before0 = rt.current_stream(D0)?;
    {
        let _g = rt.stream_guard(&s2)?;
        assert_eq!(rt.current_device(), D2);
        assert_eq!(rt.current_stream(D2)?, s2);
        assert_eq!(rt.current_stream(D0)?, before0);
    }
    assert_eq!(rt.current_device(), D0);
    assert!(rt.current_stream(D2)?.is_default());
    Ok(())
}

/// `set_stream` of a stream on another device makes that device current too, as
/// `torch.cuda.set_stream` does (it sets the stream's device first): work on "the current
/// stream of the current device" then goes to the stream just set.
#[test]
fn set_stream_makes_the_streams_device_current() -> TestResult {
    let (_, rt) = fake(2, Completion::Eager);
    let s1 = rt.new_stream(D1, 0)?;
    assert_eq!(rt.current_device(), D0);
    rt.set_stream(&s1)?;
    assert_eq!(rt.current_device(), D1, "the stream's device is current");
    let current = rt.current_stream(rt.current_device())?;
    assert_eq!(current, s1, "the current device's current stream is s1");
    assert!(
        rt.current_stream(D0)?.is_default(),
        "device 0's stream is untouched"
    );
    let x = DeviceBuffer::<f32>::filled(&rt, rt.resolve(&"cuda".parse::<Device>()?)?, 4, 1.0)?;
    assert_eq!(x.device(), D1, "`cuda` now means device 1");
    let s0 = rt.new_stream(D0, 0)?;
    rt.set_stream(&s0)?;
    assert_eq!(rt.current_device(), D0, "and back");
    assert_eq!(
        rt.current_stream(D1)?,
        s1,
        "device 1 keeps its current stream"
    );
    Ok(())
}

#[test]
fn events_across_devices_are_refused() -> TestResult {
    let (_, rt) = fake(2, Completion::Eager);
    let timing = EventFlags {
        timing: true,
        ..EventFlags::default()
    };
    let (a, b) = (rt.new_event(timing)?, rt.new_event(timing)?);
    a.record(&rt.current_stream(D0)?)?;
    b.record(&rt.current_stream(D1)?)?;
    assert!(matches!(
        a.elapsed_time(&b),
        Err(StreamError::DeviceMismatch { .. })
    ));
    assert_eq!(
        a.record(&rt.current_stream(D1)?)
            .map_err(|e| e.to_string())
            .err()
            .as_deref(),
        Some("Event device 0 does not match recording stream's device 1.")
    );
    // Waiting across devices is fine.
    rt.current_stream(D1)?.wait_event(&a)?;
    Ok(())
}

/// The docs' *incorrect* side-stream example: without `wait_stream` the side stream reads
/// `a` before the fill. Manual completion makes the race deterministic.
#[test]
fn side_stream_without_wait_stream_races() -> TestResult {
    let (fake, rt) = fake(1, Completion::Manual);
    let m = Module::from_cuda_source(&rt, D0, "k", KERNELS)?;
    let a = DeviceBuffer::<f32>::uninit(&rt, D0, 8)?;
    let b = DeviceBuffer::<f32>::uninit(&rt, D0, 8)?;
    let current = rt.current_stream(D0)?;
    current.launch(
        &m.function("fill_f32")?,
        &LaunchConfig::for_elements(8, 8),
        &[a.arg(), KernelArg::value(&3.0f32), KernelArg::value(&8u32)],
    )?;
    let side = rt.stream_from_pool(D0, false)?;
    side.launch(
        &m.function("scale_f32")?,
        &LaunchConfig::for_elements(8, 8),
        &[
            b.arg(),
            a.arg(),
            KernelArg::value(&2.0f32),
            KernelArg::value(&8u32),
        ],
    )?;
    assert_eq!(
        fake.advance(side.handle(), None)?,
        1,
        "the side stream runs first"
    );
    rt.synchronize(D0)?;
    assert_eq!(
        b.to_host()?,
        vec![0.0; 8],
        "b was computed from unfilled memory"
    );
    Ok(())
}

#[test]
fn held_events_complete_when_the_test_advances() -> TestResult {
    let (fake, rt) = fake(1, Completion::Manual);
    let s = rt.new_stream(D0, 0)?;
    let x = DeviceBuffer::<i32>::uninit(&rt, D0, 4)?;
    let d = rt.driver();
    d.memset_async(x.ptr(), MemsetValue::U32(5), 4, s.handle())?;
    let ev = s.record_event(None)?;
    let waiter = rt.new_stream(D0, 0)?;
    waiter.wait_event(&ev)?;
    d.memset_async(x.ptr(), MemsetValue::U32(9), 2, waiter.handle())?;
    assert!(!ev.query()? && fake.pending(s.handle())? == 2);
    assert_eq!(
        fake.advance(waiter.handle(), None)?,
        0,
        "the waiter is blocked on the event"
    );
    assert_eq!(fake.advance(s.handle(), Some(1))?, 1);
    assert!(!ev.query()?, "the record itself has not completed yet");
    fake.advance(s.handle(), None)?;
    assert!(ev.query()?);
    assert_eq!(fake.advance_all(), 2);
    assert_eq!(x.to_host()?, vec![9, 9, 5, 5]);
    Ok(())
}

#[test]
fn injected_out_of_memory_and_call_counts() -> TestResult {
    let (fake, _) = fake(1, Completion::Eager);
    fake.fail_nth(Call::Malloc, 2, DriverError::OUT_OF_MEMORY);
    let a = fake.malloc(D0, 1 << 20)?;
    assert_eq!(fake.malloc(D0, 1 << 20), Err(DriverError::OUT_OF_MEMORY));
    let b = fake.malloc(D0, 1 << 20)?;
    fake.free(D0, a)?;
    fake.free(D0, b)?;
    assert_eq!((fake.calls(Call::Malloc), fake.calls(Call::Free)), (3, 2));
    fake.fail_nth(Call::VmMap, 1, DriverError::OUT_OF_MEMORY);
    let va = fake.vm_reserve(D0, 4 << 20)?;
    let h = fake.vm_create(D0, 2 << 20)?;
    assert_eq!(fake.vm_map(va.base, h), Err(DriverError::OUT_OF_MEMORY));
    fake.vm_map(va.base, h)?;
    assert_eq!(fake.calls(Call::VmMap), 2);
    Ok(())
}

#[test]
fn capacity_limits_and_lazy_backing() -> TestResult {
    let fake = FakeDriver::builder().capacity(64 << 30).build();
    let big = fake.malloc(D0, 60 << 30)?;
    assert_eq!(
        fake.backed_bytes(),
        0,
        "a 60 GiB allocation costs no host memory"
    );
    assert_eq!(fake.malloc(D0, 8 << 30), Err(DriverError::OUT_OF_MEMORY));
    assert_eq!(fake.mem_get_info(D0)?, (4 << 30, 64 << 30));
    fake.memcpy_htod_async(
        big.offset(30 << 30),
        &[1, 2, 3, 4],
        StreamHandle::legacy(D0),
    )?;
    assert_eq!(fake.backed_bytes(), 64 << 10, "one touched page");
    let mut back = [0u8; 4];
    fake.memcpy_dtoh(&mut back, big.offset(30 << 30), StreamHandle::legacy(D0))?;
    assert_eq!(back, [1, 2, 3, 4]);
    fake.free(D0, big)?;
    assert_eq!(fake.mem_get_info(D0)?.0, 64 << 30);
    Ok(())
}

#[test]
fn legacy_stream_orders_with_blocking_streams() -> TestResult {
    let fake = FakeDriver::builder().completion(Completion::Manual).build();
    let blocking = fake.stream_create(
        D0,
        StreamFlags {
            non_blocking: false,
            priority: 0,
        },
    )?;
    let legacy = StreamHandle::legacy(D0);
    let p = fake.malloc(D0, 16)?;
    fake.memset_async(p, MemsetValue::U8(1), 16, blocking)?;
    fake.memset_async(p, MemsetValue::U8(2), 16, legacy)?;
    assert_eq!(
        fake.advance(legacy, None)?,
        0,
        "legacy work waits for the blocking stream"
    );
    fake.advance(blocking, None)?;
    fake.advance(legacy, None)?;
    let mut back = [0u8; 16];
    fake.memcpy_dtoh(&mut back, p, legacy)?;
    assert_eq!(back, [2; 16]);
    // Legacy work while a blocking stream captures breaks the capture (implicit dependency).
    fake.stream_begin_capture(blocking, CaptureMode::Global)?;
    assert_eq!(
        fake.memset_async(p, MemsetValue::U8(3), 16, legacy),
        Err(DriverError::STREAM_CAPTURE_IMPLICIT)
    );
    assert_eq!(
        fake.stream_end_capture(blocking),
        Err(DriverError::STREAM_CAPTURE_INVALIDATED)
    );
    Ok(())
}

#[test]
fn a_failed_kernel_is_a_sticky_error_at_the_next_sync() -> TestResult {
    let (fake, rt) = fake(1, Completion::Eager);
    fake.register_kernel("boom", |_| Err("out of bounds".into()));
    let m = Module::from_cuda_source(&rt, D0, "k", "extern \"C\" __global__ void boom() {}")?;
    let s = rt.new_stream(D0, 0)?;
    s.launch(&m.function("boom")?, &LaunchConfig::for_elements(1, 1), &[])?;
    assert_eq!(
        s.synchronize(),
        Err(StreamError::Driver(DriverError::LAUNCH_FAILED))
    );
    Ok(())
}

#[test]
fn kernels_must_be_registered_and_defined() -> TestResult {
    let (_, rt) = fake(1, Completion::Eager);
    let m = Module::from_cuda_source(
        &rt,
        D0,
        "k",
        "extern \"C\" __global__ void unknown_kernel() {}",
    )?;
    let missing = m.function("unknown_kernel").err();
    assert_eq!(
        missing,
        Some(StreamError::KernelNotRegistered {
            name: "unknown_kernel".into()
        })
    );
    let text = missing.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        text.contains("`unknown_kernel`") && text.contains("register_fake_kernel"),
        "the error names the kernel and the way to register it: {text}"
    );
    assert_eq!(
        m.function("tiny").err(),
        Some(StreamError::Driver(DriverError::NOT_FOUND)),
        "not in this module"
    );
    Ok(())
}

/// No driver is data: the CUDA backend on a machine without libcuda (CI) reports no
/// devices and typed errors. On a machine with a GPU it reports the GPU.
#[test]
fn no_driver_is_data_not_a_panic() -> TestResult {
    let cuda = Arc::new(CudaDriver::new());
    let rt = Runtime::new(cuda.clone());
    match cuda.unavailable_reason() {
        Some(reason) => {
            assert_eq!(cuda.device_count(), Err(reason));
            assert!(!rt.is_available() && rt.device_count() == 0);
            assert_eq!(
                rt.check_device(D0),
                Err(StreamError::NotAvailable { reason })
            );
            assert!(cuda.malloc(D0, 1).is_err() && cuda.host_alloc(1).is_err());
            assert!(DeviceBuffer::<f32>::uninit(&rt, D0, 1).is_err());
            println!("no CUDA here: {reason}");
        }
        None => assert!(rt.is_available() && cuda.device_count()? > 0),
    }
    Ok(())
}

#[test]
fn a_hook_runs_once_at_the_start_of_the_next_call_of_its_kind() -> TestResult {
    let fake = FakeDriver::default();
    let seen = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (me, counter) = (std::thread::current().id(), seen.clone());
    fake.before_next(Call::Malloc, move || {
        assert_eq!(std::thread::current().id(), me, "on the calling thread");
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    let dev = DeviceIndex(0);
    let stream = fake.stream_create(dev, StreamFlags::default())?;
    fake.stream_destroy(stream)?;
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "not on other calls"
    );
    let p = fake.malloc(dev, 4096)?;
    let q = fake.malloc(dev, 4096)?;
    assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 1, "once");
    fake.free(dev, p)?;
    fake.free(dev, q)?;
    Ok(())
}

/// A buffer whose byte count does not fit 64 bits is a typed error before any allocator is
/// asked (it panicked in debug builds and wrapped to a tiny allocation in release ones).
#[test]
fn a_buffer_length_whose_bytes_overflow_is_refused() -> TestResult {
    let (fake, rt) = fake(1, Completion::Eager);
    let len = usize::MAX / 4 + 2;
    let device = DeviceBuffer::<f32>::uninit(&rt, D0, len).err();
    assert!(
        matches!(&device, Some(StreamError::Memory { .. })),
        "{device:?}"
    );
    let text = device.map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("larger than memory"), "{text}");
    let pinned = ferrocuda_stream::PinnedBuffer::<f32>::uninit(&rt, len).err();
    assert!(
        matches!(pinned, Some(StreamError::Memory { .. })),
        "{pinned:?}"
    );
    assert_eq!(fake.calls(Call::Malloc) + fake.calls(Call::HostAlloc), 0);
    Ok(())
}
