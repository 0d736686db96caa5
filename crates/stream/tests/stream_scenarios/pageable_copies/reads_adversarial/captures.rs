//! Captures: of the read's own stream, of another stream in each mode, the caller's own mode, the legacy stream beside a blocking one.
use super::*;

/// What a read returned (bytes right, or the error) and how the capture ended.
#[derive(Debug, PartialEq)]
struct CaptureOutcome {
    read: Result<bool, StreamError>,
    capture_ended: Result<(), DriverError>,
}

/// Where the capture is, relative to the read.
#[derive(Copy, Clone, Debug, PartialEq)]
enum Capturing {
    /// The read's own stream, begun by this thread.
    ReadStream,
    /// Another stream, begun by this thread.
    Other,
    /// Another stream, begun (and ended) by another thread.
    OtherByAnotherThread,
    /// The read's own stream, begun (and ended) by another thread.
    ReadStreamByAnotherThread,
    /// Another stream, begun by this thread; the read's stream joined it through an event.
    JoinedThroughAnEvent,
}

/// A capture (in `mode`) on the stream `at` says, with a memset in it, while this thread
/// reads `STAGED_READ_MIN + 3` bytes (9 chunks) on its own stream; `warm`: a
/// read before left slots in the pool (none with fewer than `READ_MIN_THREADS` threads: that
/// read, and every read then, is the driver's). Manual completion; the buffer's bytes are
/// seeded on the read's stream and complete.
fn read_during_capture(
    threads: usize,
    mode: CaptureMode,
    at: Capturing,
    warm: bool,
) -> Result<CaptureOutcome, Err> {
    let fake = fake_n(Completion::Manual, 1);
    let rt = runtime(&fake, threads);
    let (s_cap, s_read) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
    let s_read = match at {
        Capturing::ReadStream | Capturing::ReadStreamByAnotherThread => s_cap.clone(),
        _ => s_read,
    };
    let want = values(STAGED_READ_MIN + 3, 8);
    let buf = DeviceBuffer::<u8>::uninit(&rt, D0, want.len())?;
    let scratch = DeviceBuffer::<u8>::uninit(&rt, D0, 4096)?;
    rt.default_stream(D0)?.synchronize()?;
    seed(&fake, buf.ptr(), &want, &s_read)?;
    s_read.synchronize()?;
    if warm {
        assert_eq!(diff(&read_on(&rt, &buf, &s_read)?, &want), None, "warm-up");
        if threads >= READ_MIN_THREADS {
            assert!(fake.calls(Call::HostAlloc) > 0, "warm-up: slots made");
        }
    }
    let by_other = matches!(
        at,
        Capturing::OtherByAnotherThread | Capturing::ReadStreamByAnotherThread
    );
    let (started_tx, started_rx) = mpsc::channel::<Result<(), DriverError>>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let capturer = if by_other {
        let (fake2, h, p) = (fake.clone(), s_cap.handle(), scratch.ptr());
        Some(std::thread::spawn(move || -> Result<(), DriverError> {
            let begun = fake2
                .stream_begin_capture(h, mode)
                .and_then(|()| fake2.memset_async(p, MemsetValue::U8(3), 4096, h));
            let ok = begun.is_ok();
            let _ = started_tx.send(begun);
            if !ok {
                return Err(DriverError::ILLEGAL_STATE);
            }
            let _ = go_rx.recv();
            fake2.stream_end_capture(h).map(|g| {
                let _ = fake2.graph_destroy(g);
            })
        }))
    } else {
        fake.stream_begin_capture(s_cap.handle(), mode)?;
        fake.memset_async(scratch.ptr(), MemsetValue::U8(3), 4096, s_cap.handle())?;
        if at == Capturing::JoinedThroughAnEvent {
            let ev = fake.event_create(D0, EventFlags::default())?;
            fake.event_record(ev, s_cap.handle())?;
            fake.stream_wait_event(s_read.handle(), ev)?;
            fake.event_destroy(ev)?;
        }
        None
    };
    if by_other {
        started_rx.recv()??;
    }
    let read = read_on(&rt, &buf, &s_read).map(|got| got == want);
    if threads < READ_MIN_THREADS {
        assert_eq!(
            (
                fake.calls(Call::MemcpyDtoHPinned),
                fake.calls(Call::HostAlloc)
            ),
            (0, 0),
            "{threads} threads, {mode:?} {at:?}: no read staged, no slot made"
        );
    }
    let capture_ended = match capturer {
        Some(t) => {
            go_tx.send(())?;
            t.join().map_err(|_| "capturing thread panicked")?
        }
        None => {
            if at == Capturing::JoinedThroughAnEvent {
                // Join the forked stream back so that only the read can break the capture.
                let ev = fake.event_create(D0, EventFlags::default())?;
                let joined = fake
                    .event_record(ev, s_read.handle())
                    .and_then(|()| fake.stream_wait_event(s_cap.handle(), ev));
                fake.event_destroy(ev)?;
                joined.and_then(|()| {
                    fake.stream_end_capture(s_cap.handle()).map(|g| {
                        let _ = fake.graph_destroy(g);
                    })
                })
            } else {
                fake.stream_end_capture(s_cap.handle()).map(|g| {
                    let _ = fake.graph_destroy(g);
                })
            }
        }
    };
    Ok(CaptureOutcome {
        read,
        capture_ended,
    })
}

const MODES: [CaptureMode; 3] = [
    CaptureMode::Global,
    CaptureMode::ThreadLocal,
    CaptureMode::Relaxed,
];

/// Compares `threads` against the driver for every mode and warmth at `at`.
fn capture_report(at: Capturing, staged: &[usize], report: &mut Vec<String>) -> R {
    for mode in MODES {
        for warm in [false, true] {
            let driver = read_during_capture(0, mode, at, warm)?;
            for &threads in staged {
                let got = read_during_capture(threads, mode, at, warm)?;
                if got != driver {
                    report.push(format!(
                        "{at:?} {mode:?} warm={warm}:\n    driver (0 threads): {driver:?}\n    \
                         staged ({threads} threads): {got:?}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// From the capturing stream itself (begun by this thread or by another one), and from a
/// stream that joined the capture through an event: in every mode, warm or cold, the staged
/// read fails as the driver's does and leaves the capture as the driver's leaves it.
#[test]
fn from_a_captured_stream_every_way_a_read_fails_as_the_drivers_does() -> R {
    timed("read-capture-same", 40, || {
        let mut report = Vec::new();
        for at in [
            Capturing::ReadStream,
            Capturing::ReadStreamByAnotherThread,
            Capturing::JoinedThroughAnEvent,
        ] {
            capture_report(at, &[2], &mut report)?;
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

/// A capture on another stream, begun by this thread or by another one, in every mode, warm
/// or cold: the read is served or refused as the driver's is, and the capture ends (or is
/// broken) as with the driver's copy.
#[test]
fn with_another_stream_capturing_a_read_is_served_or_refused_as_the_drivers_is() -> R {
    timed("read-capture-other", 40, || {
        let mut report = Vec::new();
        for at in [Capturing::Other, Capturing::OtherByAnotherThread] {
            capture_report(at, &[1, 3], &mut report)?;
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

/// The reading thread set its own capture mode (`cuThreadExchangeStreamCaptureMode`, as
/// PyTorch does around calls that may be unsafe) and a Global capture runs on another
/// stream, begun by this thread or by another one. With the caller Relaxed (or ThreadLocal
/// while another thread captures) the driver's copy is allowed and the capture survives; the
/// staging threads must not break it either. Compared for 1 (a read by the driver), 2 and 3
/// threads (staged reads).
#[test]
fn a_callers_own_capture_mode_decides_for_the_staged_read_too() -> R {
    timed("read-capture-caller-mode", 40, || {
        let run = |threads: usize, caller: CaptureMode, other_thread: bool| -> Result<_, Err> {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let (s_cap, s_read) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
            let want = values((2 * DEPTH + 1) * CHUNK + 1, 9);
            let buf = DeviceBuffer::<u8>::uninit(&rt, D0, want.len())?;
            let scratch = DeviceBuffer::<u8>::uninit(&rt, D0, 4096)?;
            rt.default_stream(D0)?.synchronize()?;
            seed(&fake, buf.ptr(), &want, &s_read)?;
            let (go_tx, go_rx) = mpsc::channel::<()>();
            let (started_tx, started_rx) = mpsc::channel::<()>();
            let begin = {
                let (fake, h, p) = (fake.clone(), s_cap.handle(), scratch.ptr());
                move || -> Result<(), DriverError> {
                    fake.stream_begin_capture(h, CaptureMode::Global)?;
                    fake.memset_async(p, MemsetValue::U8(3), 4096, h)
                }
            };
            let old = fake.exchange_capture_mode(caller)?;
            let capturer = if other_thread {
                let (fake2, h) = (fake.clone(), s_cap.handle());
                Some(std::thread::spawn(move || -> Result<(), DriverError> {
                    begin()?;
                    let _ = started_tx.send(());
                    let _ = go_rx.recv();
                    end_capture(&fake2, h)
                }))
            } else {
                begin()?;
                None
            };
            if other_thread {
                started_rx.recv()?;
            }
            let read = read_on(&rt, &buf, &s_read).map(|got| got == want);
            let ended = match capturer {
                Some(t) => {
                    go_tx.send(())?;
                    t.join().map_err(|_| "capturing thread panicked")?
                }
                None => end_capture(&fake, s_cap.handle()),
            };
            fake.exchange_capture_mode(old)?;
            let outcome = CaptureOutcome {
                read,
                capture_ended: ended,
            };
            Ok((outcome, dtoh_calls(&fake)))
        };
        let mut report = Vec::new();
        for (caller, other_thread) in [
            (CaptureMode::Relaxed, false),
            (CaptureMode::Relaxed, true),
            (CaptureMode::ThreadLocal, true),
        ] {
            let (driver, _) = run(0, caller, other_thread)?;
            assert_eq!(
                driver,
                CaptureOutcome {
                    read: Ok(true),
                    capture_ended: Ok(())
                },
                "caller {caller:?}, capture by another thread: {other_thread}"
            );
            for threads in 1..=3 {
                let (got, [by_driver, staged]) = run(threads, caller, other_thread)?;
                if got != driver {
                    report.push(format!(
                        "caller {caller:?}, Global capture by another thread: {other_thread}: \
                         {threads} threads: {got:?}"
                    ));
                }
                let expected = threads >= READ_MIN_THREADS;
                if (staged > 0, by_driver > 0) != (expected, !expected) {
                    report.push(format!(
                        "caller {caller:?}, Global capture by another thread: {other_thread}: \
                         {threads} threads: {by_driver} copies by the driver, {staged} into \
                         slots (staged expected: {expected})"
                    ));
                }
            }
        }
        assert!(
            report.is_empty(),
            "driver: read Ok(true), capture ends Ok; staged:\n{}",
            report.join("\n")
        );
        Ok(())
    })
}

/// A read on the legacy default stream while a BLOCKING stream of the device captures
/// (Relaxed, so the driver's copy itself is allowed), cold and with slots in the pool: the
/// staged read is served or refused as the driver's, and the capture ends as it does.
#[test]
fn a_read_on_the_legacy_stream_while_a_blocking_stream_captures() -> R {
    timed("read-capture-legacy", 30, || {
        let mut report = Vec::new();
        for warm in [false, true] {
            let mut outcomes = Vec::new();
            for threads in [0usize, 2] {
                let fake = fake_n(Completion::Manual, 1);
                let rt = runtime(&fake, threads);
                let want = values(STAGED_READ_MIN + CHUNK + 5, 10);
                let buf = DeviceBuffer::<u8>::uninit(&rt, D0, want.len())?;
                let scratch = DeviceBuffer::<u8>::uninit(&rt, D0, 64)?;
                let legacy = rt.default_stream(D0)?;
                seed(&fake, buf.ptr(), &want, &legacy)?;
                legacy.synchronize()?;
                if warm {
                    assert_eq!(diff(&buf.to_host()?, &want), None, "warm-up");
                    assert_eq!(
                        fake.calls(Call::HostAlloc) > 0,
                        threads > 0,
                        "{threads} threads: the warm-up read staged"
                    );
                }
                let blocking = fake.stream_create(
                    D0,
                    StreamFlags {
                        non_blocking: false,
                        priority: 0,
                    },
                )?;
                fake.stream_begin_capture(blocking, CaptureMode::Relaxed)?;
                fake.memset_async(scratch.ptr(), MemsetValue::U8(1), 64, blocking)?;
                let read = buf.to_host().map(|got| got == want);
                let capture_ended = fake.stream_end_capture(blocking).map(|g| {
                    let _ = fake.graph_destroy(g);
                });
                fake.stream_destroy(blocking)?;
                outcomes.push(CaptureOutcome {
                    read,
                    capture_ended,
                });
            }
            if outcomes[0] != outcomes[1] {
                report.push(format!(
                    "warm={warm}:\n    driver (0 threads): {:?}\n    staged (2 threads): {:?}",
                    outcomes[0], outcomes[1]
                ));
            }
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

/// A read on the legacy default stream while a BLOCKING stream has an upload pending (manual
/// completion): compare the bytes returned and what is left pending on the blocking stream
/// with the driver's copy.
#[test]
fn a_read_on_the_legacy_stream_while_a_blocking_stream_has_work_pending() -> R {
    timed("read-legacy-pending", 20, || {
        let mut outcomes = Vec::new();
        for threads in [0usize, 2] {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let bytes = STAGED_READ_MIN + CHUNK + 5;
            let (old, new) = (values(bytes, 19), values(bytes, 20));
            let buf = DeviceBuffer::<u8>::uninit(&rt, D0, old.len())?;
            let legacy = rt.default_stream(D0)?;
            seed(&fake, buf.ptr(), &old, &legacy)?;
            legacy.synchronize()?;
            let blocking = fake.stream_create(
                D0,
                StreamFlags {
                    non_blocking: false,
                    priority: 0,
                },
            )?;
            fake.memcpy_htod_async(buf.ptr(), &new, blocking)?;
            let staged_before = fake.calls(Call::MemcpyDtoHPinned);
            let got = buf.to_host()?;
            assert_eq!(
                fake.calls(Call::MemcpyDtoHPinned) > staged_before,
                threads > 0,
                "{threads} threads: the read staged"
            );
            let seen = if got == old {
                "old bytes"
            } else if got == new {
                "the blocking stream's bytes"
            } else {
                "other bytes"
            };
            outcomes.push((seen, fake.pending(blocking)?));
            fake.stream_destroy(blocking)?;
        }
        assert_eq!(
            outcomes[1], outcomes[0],
            "(bytes returned, items left pending on the blocking stream): staged (2 threads) \
             vs driver (0 threads)"
        );
        Ok(())
    })
}

// ---- driver failures -----------------------------------------------------------------------
