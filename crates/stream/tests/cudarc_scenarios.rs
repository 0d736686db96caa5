//! ferrocuda beside cudarc: another library's streams adopted (never destroyed by us), and
//! buffers lent to another stream without a copy, the order between the streams kept both
//! ways. The fake device checks the bookkeeping and the ordering in CI (its stand-in for a
//! cudarc stream is `FakeDriver::foreign_stream`); the `gpu_` tests use cudarc itself on the
//! real driver: its copies and memset on a ferrocuda buffer, and its stream made current for
//! ferrocuda's work (its launch builder, whose launch is `unsafe`, is tested in
//! crates/driver/tests/cudarc_gpu.rs). They are ignored (skipped, with the reason) without a
//! GPU; the GPU bundle runs them with `--include-ignored`, where a missing GPU fails them.
#![forbid(unsafe_code)]
use ferrocuda_driver::interop::CudarcSlice;
use ferrocuda_driver::interop::cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg,
};
use ferrocuda_driver::{
    Call, CudaDriver, Driver, DriverError, FakeDriver, ForeignStream, fake::Completion,
};
use ferrocuda_stream::{DeviceBuffer, KernelCache, Lent, Runtime, StreamError};
use ferrocuda_types::{DeviceIndex, MemsetValue};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

fn fake(devices: usize) -> (Arc<FakeDriver>, Arc<Runtime>) {
    let fake = Arc::new(
        FakeDriver::builder()
            .devices(devices)
            .completion(Completion::Manual)
            .build(),
    );
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    (fake, rt)
}

#[test]
fn an_adopted_stream_carries_ferrocudas_work_and_is_never_destroyed() -> TestResult {
    let (fake, rt) = fake(1);
    let foreign = fake.foreign_stream(D0)?;
    let s = rt.adopt_stream(foreign.clone())?;
    let twice = rt.adopt_stream(foreign.clone())?;
    assert_eq!(s, twice, "one stream, adopted twice");
    assert_eq!(
        s.adopted_from().map(ForeignStream::raw),
        Some(foreign.raw())
    );
    assert_eq!(fake.adoptions(&foreign), Some(2));
    {
        let _current = rt.stream_guard(&s)?;
        let x = DeviceBuffer::<i32>::filled(&rt, D0, 8, 7)?;
        assert_eq!(
            fake.pending(s.handle())?,
            1,
            "the fill went on the adopted stream"
        );
        assert_eq!(x.to_host()?, [7; 8]);
    }
    drop((s, twice));
    assert_eq!(fake.adoptions(&foreign), Some(0), "forgotten, still alive");
    assert_eq!(fake.calls(Call::StreamDestroy), 0);
    let raw = ferrocuda_types::StreamHandle {
        device: D0,
        raw: foreign.raw(),
    };
    assert_eq!(
        fake.stream_query(raw),
        Err(DriverError::INVALID_HANDLE),
        "unknown to the driver once forgotten"
    );
    Ok(())
}

#[test]
fn a_foreign_stream_of_another_driver_or_a_missing_device_is_refused() -> TestResult {
    let (_, rt) = fake(1);
    let (other, _) = fake(2);
    let on_d1 = other.foreign_stream(DeviceIndex(1))?;
    assert!(matches!(
        rt.adopt_stream(on_d1),
        Err(StreamError::InvalidDevice { index: 1, count: 1 })
    ));
    let theirs = other.foreign_stream(D0)?;
    assert_eq!(
        rt.adopt_stream(theirs).err(),
        Some(StreamError::Driver(DriverError::INVALID_HANDLE))
    );
    Ok(())
}

/// Lent, the borrowing stream waits for the buffer's pending work; given back, ferrocuda's
/// current stream waits for the borrower's.
#[test]
fn lending_orders_the_borrowing_stream_both_ways() -> TestResult {
    let (fake, rt) = fake(1);
    let home = rt.current_stream(D0)?;
    let x = DeviceBuffer::<u8>::filled(&rt, D0, 64, 1)?; // pending on `home`
    let theirs = rt.adopt_stream(fake.foreign_stream(D0)?)?;
    let lent = x.lend(&theirs)?;
    assert_eq!(lent.stream(), Some(&theirs));
    assert_eq!(lent.buffer().ptr(), x.ptr(), "no copy");
    // The other library writes the buffer on its stream.
    fake.memset_async(x.ptr(), MemsetValue::U8(2), 64, theirs.handle())?;
    assert_eq!(
        fake.advance(theirs.handle(), None)?,
        0,
        "it waits for the fill"
    );
    fake.advance(home.handle(), None)?;
    assert!(fake.advance(theirs.handle(), None)? > 0);
    fake.memset_async(x.ptr(), MemsetValue::U8(3), 64, theirs.handle())?;
    lent.give_back()?;
    x.fill(4)?;
    assert_eq!(
        fake.advance(home.handle(), None)?,
        0,
        "ferrocuda's next write waits for the borrower"
    );
    assert_eq!(x.to_host()?, [4; 64], "in order: 1, 2, 3, then 4");
    Ok(())
}

#[test]
fn lending_to_the_current_stream_orders_nothing() -> TestResult {
    let (fake, rt) = fake(2);
    let x = DeviceBuffer::<u8>::filled(&rt, D0, 64, 1)?;
    let waits = fake.calls(Call::StreamWaitEvent);
    drop(x.lend(&rt.current_stream(D0)?)?);
    assert_eq!(fake.calls(Call::StreamWaitEvent), waits);
    let elsewhere = rt.new_stream(DeviceIndex(1), 0)?;
    assert!(matches!(
        x.lend(&elsewhere),
        Err(StreamError::DeviceMismatch {
            what: "the borrowing stream",
            ..
        })
    ));
    Ok(())
}

/// The slice implements what cudarc's APIs ask of device memory (its cuBLAS wrappers take
/// `DevicePtr`/`DevicePtrMut`, its launch builder `PushKernelArg`), whatever it keeps.
#[test]
fn a_cudarc_slice_is_what_cudarcs_apis_take() {
    fn device_memory<S: DevicePtr<f32> + DevicePtrMut<f32> + DeviceSlice<f32>>() {}
    fn kernel_argument<'a, 'b: 'a, S: 'b>()
    where
        LaunchArgs<'a>: PushKernelArg<&'b S> + PushKernelArg<&'b mut S>,
    {
    }
    device_memory::<CudarcSlice<'static, f32, Lent<'static, f32>>>();
    kernel_argument::<CudarcSlice<'static, f32, ()>>();
}

// ---- the real driver ------------------------------------------------------------------

/// A runtime over the real driver and a cudarc context on device 0; fails without a GPU.
fn gpu() -> Result<(Arc<Runtime>, Arc<CudaContext>), Box<dyn std::error::Error>> {
    let driver = Arc::new(CudaDriver::new());
    if let Some(reason) = driver.unavailable_reason() {
        return Err(format!("no usable CUDA device ({reason}): this test needs a GPU").into());
    }
    Ok((Runtime::new(driver), CudaContext::new(0)?))
}

#[test]
#[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_cudarc_copies_into_and_out_of_a_ferrocuda_buffer() -> TestResult {
    let (rt, ctx) = gpu()?;
    // A stream of cudarc's own, not ferrocuda's current one: the order is kept by events.
    let stream: Arc<CudaStream> = ctx.new_stream()?;
    let n = 1 << 20;
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let x = DeviceBuffer::from_slice(&rt, D0, &values)?;
    {
        let mut view = x.cudarc(&stream)?;
        assert_eq!((view.ptr(), view.len()), (x.ptr(), n), "no copy");
        assert_eq!(
            stream.clone_dtoh(&view)?,
            values,
            "cudarc reads ferrocuda's write"
        );
        stream.memcpy_htod(&vec![3.0f32; n], &mut view)?;
    }
    // No synchronisation: ferrocuda's current stream waited for cudarc's on give-back.
    assert_eq!(x.to_host()?, vec![3.0f32; n]);
    {
        let other = ctx.new_stream()?;
        let mut view = x.cudarc(&stream)?;
        other.memset_zeros(&mut view)?; // another stream: it joins, then the host waits
    }
    assert_eq!(x.to_host()?, vec![0.0f32; n]);
    ctx.check_err()?;
    Ok(())
}

#[test]
#[ignore = "needs a GPU: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_an_adopted_cudarc_stream_carries_ferrocudas_work() -> TestResult {
    let (rt, ctx) = gpu()?;
    let stream = ctx.new_stream()?;
    let adopted = rt.adopt_stream(ForeignStream::cudarc(&stream)?)?;
    assert_eq!(adopted.handle().raw, stream.cu_stream() as u64);
    let x = {
        let _current = rt.stream_guard(&adopted)?;
        let x = DeviceBuffer::<i32>::filled(&rt, D0, 4096, 9)?;
        // On the same stream: no ordering needed, cudarc reads what ferrocuda wrote.
        assert_eq!(stream.clone_dtoh(&x.cudarc(&stream)?)?, vec![9i32; 4096]);
        x
    };
    drop(adopted);
    // Still cudarc's stream, alive and working.
    let y = stream.clone_htod(&[5u32; 16])?;
    assert_eq!(stream.clone_dtoh(&y)?, vec![5u32; 16]);
    assert_eq!(x.to_host()?, vec![9i32; 4096]);
    // The legacy stream of cudarc is the device's own.
    let legacy = rt.adopt_stream(ForeignStream::cudarc(&ctx.default_stream())?)?;
    assert!(legacy.is_default());
    // A stream of a context that is not the primary one is refused.
    let other = CudaContext::new_non_primary(0, 0)?;
    let theirs = ForeignStream::cudarc(&other.new_stream()?)?;
    assert_eq!(
        rt.adopt_stream(theirs).err(),
        Some(StreamError::Driver(DriverError::INVALID_CONTEXT))
    );
    ctx.check_err()?;
    Ok(())
}
