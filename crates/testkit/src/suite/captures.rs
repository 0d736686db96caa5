//! Captures: recording and replaying, the capture rules (legacy stream, nesting, synchronize, captured event query), capture modes across threads, fork and join.
use super::*;

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
    // A non-blocking stream's capture leaves the legacy stream alone.
    assert_eq!(d.stream_capture_status(legacy)?, CaptureStatus::None);
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
    // Asked of the legacy stream while a blocking stream captures, even in global mode, the
    // driver answers 906 and the capture stays valid (cuStreamGetCaptureInfo's
    // documentation); once it ends the legacy stream answers again.
    let blocking = d.stream_create(
        DEV,
        StreamFlags {
            non_blocking: false,
            priority: 0,
        },
    )?;
    d.stream_begin_capture(blocking, CaptureMode::Global)?;
    assert_eq!(
        driver_err(d.stream_capture_status(legacy)),
        Some(DriverError::STREAM_CAPTURE_IMPLICIT)
    );
    assert!(matches!(
        d.stream_capture_status(blocking)?,
        CaptureStatus::Active { .. }
    ));
    d.graph_destroy(d.stream_end_capture(blocking)?)?;
    assert_eq!(d.stream_capture_status(legacy)?, CaptureStatus::None);
    d.stream_destroy(blocking)?;
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

/// Synchronizing the device while any stream of it captures, from the capturing thread or
/// another, in any capture mode and with the caller switched to relaxed mode or not: the
/// driver refuses (900) and invalidates the capture, of a blocking or a non-blocking stream.
/// (PyTorch's `torch.cuda.graph` synchronizes before it captures, so a second capture begun
/// that way breaks the first.)
pub fn device_synchronize_breaks_every_capture(h: &Harness) -> TestResult {
    let d = h.rt.driver();
    let sync_from = |other_thread: bool, relaxed: bool| {
        let call = || {
            let previous = relaxed
                .then(|| d.exchange_capture_mode(CaptureMode::Relaxed))
                .transpose()?;
            let r = d.device_synchronize(DEV);
            if let Some(previous) = previous {
                d.exchange_capture_mode(previous)?;
            }
            r
        };
        if other_thread {
            std::thread::scope(|sc| sc.spawn(call).join().expect("thread"))
        } else {
            call()
        }
    };
    for non_blocking in [false, true] {
        let s = d.stream_create(
            DEV,
            StreamFlags {
                non_blocking,
                priority: 0,
            },
        )?;
        for mode in [
            CaptureMode::Global,
            CaptureMode::ThreadLocal,
            CaptureMode::Relaxed,
        ] {
            for (other_thread, relaxed) in [(false, false), (true, false), (true, true)] {
                step!(
                    "{mode:?} capture, non-blocking {non_blocking}, other thread {other_thread}, caller relaxed {relaxed}"
                );
                d.stream_begin_capture(s, mode)?;
                assert_eq!(
                    sync_from(other_thread, relaxed),
                    Err(DriverError::STREAM_CAPTURE_UNSUPPORTED)
                );
                assert_eq!(d.stream_capture_status(s)?, CaptureStatus::Invalidated);
                assert_eq!(
                    driver_err(d.stream_end_capture(s)),
                    Some(DriverError::STREAM_CAPTURE_INVALIDATED)
                );
            }
        }
        d.stream_destroy(s)?;
    }
    d.device_synchronize(DEV)?;
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
