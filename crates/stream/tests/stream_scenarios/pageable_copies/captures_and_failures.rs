//! Captures underway (on the copy's stream, on another stream of the same or another thread,
//! in every mode) and driver calls that fail: the staged copy ends as the driver's copy does,
//! breaks no capture, hangs on nothing and leaks nothing.
use super::support::*;

/// What a copy into stream `copy_on` returns and whether the capture begun (by this thread, in
/// `mode`) on stream `capture_on` still ends with a graph afterwards.
#[derive(Debug, PartialEq)]
struct CaptureOutcome {
    copy: Result<(), StreamError>,
    capture_ended: Result<(), DriverError>,
    bytes_ok: Option<bool>,
}

fn copy_during_capture(
    threads: usize,
    mode: CaptureMode,
    same_stream: bool,
    warm: bool,
    from_other_thread: bool,
) -> Result<CaptureOutcome, Err> {
    let fake = fake_n(Completion::Manual, 1);
    let rt = runtime(&fake, threads);
    let (s_cap, s_copy) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
    let s_copy = if same_stream { s_cap.clone() } else { s_copy };
    let bytes = 3 * DEPTH * CHUNK + 1;
    let values = pattern(bytes, 7);
    let buf = Arc::new(DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?);
    let scratch = DeviceBuffer::<u8>::uninit(&rt, D0, 4096)?;
    rt.default_stream(D0)?.synchronize()?;
    if warm {
        // Earlier copies leave slots in the pool (their transfers completed).
        let _g = rt.stream_guard(&s_copy)?;
        buf.copy_from_host(&pattern(bytes, 1))?;
        s_copy.synchronize()?;
    }
    fake.stream_begin_capture(s_cap.handle(), mode)?;
    fake.memset_async(scratch.ptr(), MemsetValue::U8(3), 4096, s_cap.handle())?;
    let copy = if from_other_thread {
        let (rt2, s2, buf2, v2) = (rt.clone(), s_copy.clone(), buf.clone(), values.clone());
        std::thread::spawn(move || -> Result<(), StreamError> {
            let _g = rt2.stream_guard(&s2)?;
            buf2.copy_from_host(&v2)
        })
        .join()
        .map_err(|_| "copying thread panicked")?
    } else {
        let _g = rt.stream_guard(&s_copy)?;
        buf.copy_from_host(&values)
    };
    let capture_ended = match fake.stream_end_capture(s_cap.handle()) {
        Ok(g) => {
            fake.graph_destroy(g)?;
            Ok(())
        }
        Err(e) => Err(e),
    };
    let bytes_ok = match (&copy, same_stream) {
        (Ok(()), false) => {
            let _g = rt.stream_guard(&s_copy)?;
            Some(buf.to_host()? == values)
        }
        _ => None,
    };
    Ok(CaptureOutcome {
        copy,
        capture_ended,
        bytes_ok,
    })
}

/// Into the capturing stream itself, in every capture mode, with and without slots already in
/// the pool: the staged copy's error and the capture's fate are the driver's (0 threads).
#[test]
fn into_the_capturing_stream_every_mode_fails_as_the_driver_does() -> R {
    timed("capture-same", 60, || {
        let mut report = Vec::new();
        for mode in [
            CaptureMode::Global,
            CaptureMode::ThreadLocal,
            CaptureMode::Relaxed,
        ] {
            for warm in [false, true] {
                let driver = copy_during_capture(0, mode, true, warm, false)?;
                let staged = copy_during_capture(2, mode, true, warm, false)?;
                assert!(driver.copy.is_err(), "{mode:?}: {driver:?}");
                if driver != staged {
                    report.push(format!(
                        "{mode:?} warm={warm}: driver {driver:?} vs staged {staged:?}"
                    ));
                }
            }
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

/// A capture on ANOTHER stream, begun by this thread in any mode, while this thread or
/// another copies to its own stream, with and without slots in the pool: with the driver the
/// copy succeeds and the capture survives; the staged copy must do the same.
#[test]
fn a_capture_on_another_stream_is_left_alone() -> R {
    timed("capture-other-stream", 120, || {
        let mut report = Vec::new();
        for from_other_thread in [false, true] {
            for mode in [
                CaptureMode::Global,
                CaptureMode::ThreadLocal,
                CaptureMode::Relaxed,
            ] {
                for warm in [false, true] {
                    let driver = copy_during_capture(0, mode, false, warm, from_other_thread)?;
                    let staged = copy_during_capture(2, mode, false, warm, from_other_thread)?;
                    if driver != staged {
                        report.push(format!(
                            "{mode:?} warm={warm} other thread={from_other_thread}:\n    \
                             driver (0 threads): {driver:?}\n    staged (2 threads): {staged:?}"
                        ));
                    }
                }
            }
        }
        assert!(
            report.is_empty(),
            "staged copy differs:\n{}",
            report.join("\n")
        );
        Ok(())
    })
}

/// The copying thread has set its capture mode to Relaxed
/// (`cuThreadExchangeStreamCaptureMode`, as PyTorch does around calls that may be unsafe),
/// and itself began a Global capture on another stream. Its own unsafe calls are then
/// allowed; the staged copy's helper threads must not break the capture either (compare with
/// 0 threads, and with 1 thread where no helper thread runs).
#[test]
fn a_relaxed_callers_capture_is_not_broken_by_the_staging_threads() -> R {
    timed("capture-relaxed-caller", 60, || {
        let mut outcomes = Vec::new();
        for threads in [0usize, 1, 2] {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let (s_cap, s_copy) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
            let bytes = 3 * DEPTH * CHUNK + 1; // more chunks than slots: slots reused
            let values = pattern(bytes, 8);
            let buf = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
            let scratch = DeviceBuffer::<u8>::uninit(&rt, D0, 4096)?;
            rt.default_stream(D0)?.synchronize()?;
            let old = fake.exchange_capture_mode(CaptureMode::Relaxed)?;
            fake.stream_begin_capture(s_cap.handle(), CaptureMode::Global)?;
            fake.memset_async(scratch.ptr(), MemsetValue::U8(3), 4096, s_cap.handle())?;
            let copy = {
                let _g = rt.stream_guard(&s_copy)?;
                buf.copy_from_host(&values)
            };
            let ended = fake.stream_end_capture(s_cap.handle()).map(|g| {
                let _ = fake.graph_destroy(g);
            });
            fake.exchange_capture_mode(old)?;
            let bytes_ok = {
                let _g = rt.stream_guard(&s_copy)?;
                copy.is_ok() && buf.to_host()? == values
            };
            outcomes.push((threads, copy, ended, bytes_ok));
        }
        let driver = (&outcomes[0].1, &outcomes[0].2, outcomes[0].3);
        let diffs: Vec<String> = outcomes[1..]
            .iter()
            .filter(|(_, c, e, b)| (c, e, *b) != driver)
            .map(|(t, c, e, b)| format!("{t} threads: copy {c:?}, capture end {e:?}, bytes ok {b}"))
            .collect();
        assert!(
            diffs.is_empty(),
            "driver (0 threads): copy {:?}, capture end {:?}, bytes ok {}\n{}",
            driver.0,
            driver.1,
            driver.2,
            diffs.join("\n")
        );
        Ok(())
    })
}

/// A copy to the legacy default stream while a BLOCKING stream of the device is capturing
/// (relaxed mode): compare with the driver's copy.
#[test]
fn a_copy_to_the_legacy_stream_while_a_blocking_stream_captures() -> R {
    timed("capture-legacy", 60, || {
        let mut outcomes = Vec::new();
        for threads in [0usize, 2] {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let bytes = 3 * CHUNK;
            let values = pattern(bytes, 3);
            let buf = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
            rt.default_stream(D0)?.synchronize()?;
            let blocking = fake.stream_create(
                D0,
                StreamFlags {
                    non_blocking: false,
                    priority: 0,
                },
            )?;
            let scratch = DeviceBuffer::<u8>::uninit(&rt, D0, 64)?;
            rt.default_stream(D0)?.synchronize()?;
            fake.stream_begin_capture(blocking, CaptureMode::Relaxed)?;
            fake.memset_async(scratch.ptr(), MemsetValue::U8(1), 64, blocking)?;
            let copy = buf.copy_from_host(&values);
            let ended = fake.stream_end_capture(blocking).map(|g| {
                let _ = fake.graph_destroy(g);
            });
            outcomes.push((copy, ended));
            fake.stream_destroy(blocking)?;
        }
        assert_eq!(outcomes[0], outcomes[1], "driver vs staged");
        Ok(())
    })
}

/// Driver failures at every step of a staged copy (the write into a slot, the wait for a
/// reused slot, a transfer out of a reused slot, the event record, the event query of a pooled
/// slot): each copy returns without panic or hang (an error where the copy could not be
/// done; success where only a pooled slot's query failed), and the next copy lands exactly.
/// At the end, with the runtime dropped, every slot freed and every event destroyed.
#[test]
fn every_injected_failure_returns_and_the_next_copy_works_and_nothing_leaks() -> R {
    timed("failures", 180, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 2);
        let s = rt.new_stream(D0, 0)?;
        let bytes = 4 * DEPTH * CHUNK + 333; // 17 chunks: 2 threads × 4 slots, reused
        let buf = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
        let cases: Vec<(Call, u64, bool)> = vec![
            // (call, nth, expect an error)
            (Call::HostWrite, 1, true),
            (Call::HostWrite, 12, true),
            (Call::EventSynchronize, 1, true),
            (Call::EventSynchronize, 5, true),
            (Call::MemcpyHtoDPinned, 1, true),
            (Call::MemcpyHtoDPinned, 10, true),
            (Call::EventRecord, 1, true),
            (Call::EventRecord, 9, true),
            (Call::EventQuery, 1, false),
            (Call::EventQuery, 3, false),
        ];
        let _g = rt.stream_guard(&s)?;
        buf.copy_from_host(&pattern(bytes, 1))?; // slots made
        for (round, (call, nth, expect_err)) in cases.into_iter().enumerate() {
            let values = pattern(bytes, 1000 + round);
            let before = fake.calls(call);
            fake.fail_nth(call, nth, DriverError::INVALID_VALUE);
            let r = buf.copy_from_host(&values);
            let made = fake.calls(call) - before;
            assert!(
                made >= nth,
                "round {round}: {call:?} #{nth} not reached ({made} calls)"
            );
            if expect_err {
                assert_eq!(
                    r,
                    Err(StreamError::Driver(DriverError::INVALID_VALUE)),
                    "round {round}: {call:?} #{nth}"
                );
            } else {
                r.map_err(|e| format!("round {round}: {call:?} #{nth}: {e:?}"))?;
                assert_eq!(
                    first_diff(&driver_read(&fake, &buf, &s)?, &values),
                    None,
                    "round {round}: {call:?} #{nth}: copy that survived the failure"
                );
            }
            // Whatever happened, the next copy works.
            let next = pattern(bytes, 2000 + round);
            buf.copy_from_host(&next)
                .map_err(|e| format!("round {round}: the copy after {call:?} #{nth}: {e:?}"))?;
            assert_eq!(
                first_diff(&driver_read(&fake, &buf, &s)?, &next),
                None,
                "round {round}: the copy after {call:?} #{nth}"
            );
        }
        drop(_g);
        drop(buf);
        drop(s);
        let allocs = fake.calls(Call::HostAlloc);
        assert!(
            allocs as usize <= 2 * 2 * DEPTH,
            "bound: {allocs} slots made"
        );
        drop(rt);
        assert_eq!(fake.calls(Call::HostFree), allocs, "every slot freed");
        assert_eq!(
            fake.calls(Call::EventDestroy),
            fake.calls(Call::EventCreate),
            "every event destroyed"
        );
        Ok(())
    })
}

/// Page-locked memory or an event refused while slots are being made (the first one, or one
/// after some were made): the copy still succeeds (by the driver, or staged over the slots it
/// got), the next copy works, and once the runtime goes every slot made is freed and every
/// event made destroyed (injected failures not counted as made).
#[test]
fn slot_creation_failures_fall_back_and_leak_nothing() -> R {
    timed("slot-failures", 120, || {
        for (call, nth) in [
            (Call::HostAlloc, 1u64),
            (Call::HostAlloc, 3),
            (Call::EventCreate, 1),
            (Call::EventCreate, 4),
        ] {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, 2);
            let s = rt.new_stream(D0, 0)?;
            let bytes = 11 * CHUNK + 5;
            let buf = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
            rt.default_stream(D0)?.synchronize()?;
            let _g = rt.stream_guard(&s)?;
            let (before_alloc, before_event) =
                (fake.calls(Call::HostAlloc), fake.calls(Call::EventCreate));
            fake.fail_nth(call, nth, DriverError::OUT_OF_MEMORY);
            let values = pattern(bytes, nth as usize);
            buf.copy_from_host(&values)
                .map_err(|e| format!("{call:?} #{nth}: {e:?}"))?;
            assert!(
                fake.calls(call)
                    - if call == Call::HostAlloc {
                        before_alloc
                    } else {
                        before_event
                    }
                    >= nth,
                "{call:?} #{nth} not reached"
            );
            assert_eq!(
                first_diff(&buf.to_host()?, &values),
                None,
                "{call:?} #{nth}"
            );
            let next = pattern(bytes, 77);
            buf.copy_from_host(&next)?;
            assert_eq!(
                first_diff(&buf.to_host()?, &next),
                None,
                "{call:?} #{nth}: next"
            );
            drop(_g);
            drop(buf);
            drop(s);
            let failed_alloc = u64::from(call == Call::HostAlloc);
            let failed_event = u64::from(call == Call::EventCreate);
            let allocs = fake.calls(Call::HostAlloc) - failed_alloc;
            drop(rt);
            assert_eq!(
                fake.calls(Call::HostFree),
                allocs,
                "{call:?} #{nth}: slots made vs freed"
            );
            assert_eq!(
                fake.calls(Call::EventDestroy),
                fake.calls(Call::EventCreate) - failed_event,
                "{call:?} #{nth}: events made vs destroyed"
            );
        }
        Ok(())
    })
}
