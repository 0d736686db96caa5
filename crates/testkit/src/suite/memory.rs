//! Memory: device buffers and their copies, kernels over them, use after destroy, out of memory, pinned host copies, virtual memory.
use super::*;

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

/// Copies from pageable memory staged by threads (`pageable_copy_threads`): every size
/// (below the staged minimum, at it, ragged tails, more chunks than slots, so that slots are
/// reused within a copy) lands byte for byte, in stream order (after a kernel enqueued before
/// it, before one enqueued after it), with 1 to 3 threads and with the driver's copy (0).
pub fn pageable_copies_staged_by_threads(h: &Harness) -> TestResult {
    use ferrocuda_stream::{CHUNK, DEPTH, STAGED_MIN};
    let rt = &h.rt;
    let s = rt.new_stream(DEV, 0)?;
    let _current = rt.stream_guard(&s)?;
    let add_one = module(h)?.function("add_one_f32")?;
    for threads in [0, 1, 2, 3] {
        crate::StagedCopies::install(rt, threads);
        assert_eq!(rt.pageable_copy_threads(), threads);
        let many = (threads.max(1) * DEPTH + 3) * CHUNK + 124;
        for (k, bytes) in [STAGED_MIN - 4, STAGED_MIN, 3 * CHUNK + 124, many]
            .into_iter()
            .enumerate()
        {
            step!("{threads} threads, {bytes} bytes");
            let n = bytes / 4;
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 7 + k + threads) % 1009) as f32)
                .collect();
            let buf = DeviceBuffer::<f32>::filled(rt, DEV, n, -1.0)?;
            // The stream is busy when the copy comes, and a kernel follows it.
            launch_spin(h, &s, 20)?;
            buf.copy_from_host(&values)?;
            s.launch(
                &add_one,
                &elementwise(n),
                &[buf.arg(), KernelArg::value(&(n as u32))],
            )?;
            // Read back by the driver's own copy: this checks the upload alone.
            let mut raw = vec![0u8; 4 * n];
            rt.driver().memcpy_dtoh(&mut raw, buf.ptr(), s.handle())?;
            let back = raw
                .chunks_exact(4)
                .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
            let wrong = back.zip(&values).position(|(b, v)| b != v + 1.0);
            assert_eq!(wrong, None, "{threads} threads, {bytes} bytes");
        }
    }
    crate::StagedCopies::install(rt, 0);
    Ok(())
}

/// A staged copy (2 threads, more chunks than slots) to a stream that is not capturing, while
/// a capture is underway on another stream, begun by this thread in each mode, or by another
/// thread in the global mode: the copy lands and the capture ends with its graph (the staged
/// copy's own calls run in the relaxed capture mode; the driver's copy breaks no capture
/// either).
pub fn staged_copies_leave_a_capture_elsewhere_intact(h: &Harness) -> TestResult {
    use ferrocuda_stream::{CHUNK, DEPTH};
    let (rt, d) = (&h.rt, h.rt.driver());
    let (capturing, copying) = (rt.new_stream(DEV, 0)?, rt.new_stream(DEV, 0)?);
    let bytes = 3 * DEPTH * CHUNK + 1;
    let buf = DeviceBuffer::<u8>::uninit(rt, DEV, bytes)?;
    let scratch = DeviceBuffer::<u8>::uninit(rt, DEV, 4096)?;
    rt.synchronize(DEV)?;
    crate::StagedCopies::install(rt, 2);
    let modes = [
        (CaptureMode::Global, false),
        (CaptureMode::ThreadLocal, false),
        (CaptureMode::Relaxed, false),
        (CaptureMode::Global, true),
    ];
    for (k, (mode, other_thread)) in modes.into_iter().enumerate() {
        step!("a capture in {mode:?} mode, copying from another thread: {other_thread}");
        let values: Vec<u8> = (0..bytes).map(|i| ((i * 11 + k) % 253) as u8).collect();
        let copy = || -> Result<(), StreamError> {
            let _g = rt.stream_guard(&copying)?;
            buf.copy_from_host(&values)
        };
        d.stream_begin_capture(capturing.handle(), mode)?;
        d.memset_async(scratch.ptr(), MemsetValue::U8(3), 4096, capturing.handle())?;
        let copied = if other_thread {
            std::thread::scope(|sc| sc.spawn(copy).join().expect("copying thread"))
        } else {
            copy()
        };
        let graph = d.stream_end_capture(capturing.handle());
        if let Ok(g) = graph {
            d.graph_destroy(g)?;
        }
        copied?;
        assert!(graph.is_ok(), "the capture ended with {graph:?}");
        copying.synchronize()?;
        assert!(buf.to_host()? == values, "the staged copy's bytes");
    }
    crate::StagedCopies::install(rt, 0);
    Ok(())
}

/// Copies to pageable memory staged by threads (`pageable_copy_threads`; `to_host` into a new
/// `Vec`, `copy_to_host` into one that holds other values): every
/// size (below the read's staged minimum, at it, ragged tails, more chunks than slots, so that slots
/// are reused within a copy) comes back byte for byte, after the work enqueued before it (a
/// slow kernel, then one that writes the values read), with 1 to 3 threads and with the
/// driver's copy (0).
pub fn pageable_reads_staged_by_threads(h: &Harness) -> TestResult {
    use ferrocuda_stream::{CHUNK, DEPTH, STAGED_READ_MIN};
    let rt = &h.rt;
    let s = rt.new_stream(DEV, 0)?;
    let _current = rt.stream_guard(&s)?;
    let add_one = module(h)?.function("add_one_f32")?;
    for threads in [0, 1, 2, 3] {
        let many = (threads.max(1) * DEPTH + 3) * CHUNK + 124;
        for (k, bytes) in [STAGED_READ_MIN - 4, STAGED_READ_MIN, 9 * CHUNK + 124, many]
            .into_iter()
            .enumerate()
        {
            step!("{threads} threads, {bytes} bytes");
            let n = bytes / 4;
            let values: Vec<f32> = (0..n)
                .map(|i| ((i * 5 + k + threads) % 1013) as f32)
                .collect();
            crate::StagedCopies::install(rt, 0);
            let buf = DeviceBuffer::from_slice(rt, DEV, &values)?;
            crate::StagedCopies::install(rt, threads);
            // The stream is busy, and the values read are written by its last kernel.
            launch_spin(h, &s, 20)?;
            s.launch(
                &add_one,
                &elementwise(n),
                &[buf.arg(), KernelArg::value(&(n as u32))],
            )?;
            let back = buf.to_host()?;
            let wrong = back.iter().zip(&values).position(|(b, v)| *b != v + 1.0);
            assert_eq!(wrong, None, "{threads} threads, {bytes} bytes");
            // Into memory that holds other values: every element overwritten.
            let mut again = vec![-7.0f32; n];
            buf.copy_to_host(&mut again)?;
            assert!(
                again == back,
                "{threads} threads, {bytes} bytes, into a used buffer"
            );
        }
    }
    crate::StagedCopies::install(rt, 0);
    Ok(())
}

/// A copy to pageable memory (`to_host`, more chunks than slots) from a stream that is not
/// capturing, while a capture is underway on another stream (begun by this thread in each
/// mode, or by another thread in the global mode; or on the legacy stream while a blocking
/// stream captures in the relaxed mode): staged by 2 threads, it ends as the
/// driver's copy does (served or refused with the same error, the capture ended or broken
/// alike), and when served its bytes are the buffer's.
pub fn staged_reads_meet_a_capture_elsewhere_as_the_drivers_do(h: &Harness) -> TestResult {
    use ferrocuda_stream::{CHUNK, DEPTH};
    let (rt, d) = (&h.rt, h.rt.driver());
    let (capturing, copying) = (rt.new_stream(DEV, 0)?, rt.new_stream(DEV, 0)?);
    let bytes = 3 * DEPTH * CHUNK + 1;
    let values: Vec<u8> = (0..bytes).map(|i| (i * 13 % 251) as u8).collect();
    let buf = DeviceBuffer::from_slice(rt, DEV, &values)?;
    let scratch = DeviceBuffer::<u8>::uninit(rt, DEV, 4096)?;
    rt.synchronize(DEV)?;
    let modes = [
        (CaptureMode::Global, false),
        (CaptureMode::ThreadLocal, false),
        (CaptureMode::Relaxed, false),
        (CaptureMode::Global, true),
    ];
    // And a read on the legacy stream while a blocking stream captures (relaxed): CUDA
    // refuses legacy-stream work then (an implicit wait on the capturing stream).
    let blocking = d.stream_create(DEV, StreamFlags::default())?;
    let legacy = rt.default_stream(DEV)?;
    let cases = modes
        .into_iter()
        .map(|(mode, other)| (mode, other, capturing.handle(), &copying))
        .chain([(CaptureMode::Relaxed, false, blocking, &legacy)]);
    for (mode, other_thread, capturing, copying) in cases {
        let mut outcomes = Vec::new();
        for threads in [0, 2] {
            step!(
                "a capture in {mode:?} mode, reading from another thread: {other_thread}, {threads} threads"
            );
            crate::StagedCopies::install(rt, threads);
            let read = || -> Result<Vec<u8>, StreamError> {
                let _g = rt.stream_guard(copying)?;
                buf.to_host()
            };
            d.stream_begin_capture(capturing, mode)?;
            d.memset_async(scratch.ptr(), MemsetValue::U8(3), 4096, capturing)?;
            let back = if other_thread {
                std::thread::scope(|sc| sc.spawn(read).join().expect("reading thread"))
            } else {
                read()
            };
            let graph = d.stream_end_capture(capturing);
            if let Ok(g) = graph {
                d.graph_destroy(g)?;
            }
            rt.synchronize(DEV)?;
            if let Ok(back) = &back {
                assert!(*back == values, "{threads} threads: the bytes read");
            }
            outcomes.push((back.map(drop), graph.map(drop)));
        }
        assert_eq!(
            outcomes[0], outcomes[1],
            "{mode:?}, other thread {other_thread}: driver vs staged"
        );
    }
    d.stream_destroy(blocking)?;
    crate::StagedCopies::install(rt, 0);
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
