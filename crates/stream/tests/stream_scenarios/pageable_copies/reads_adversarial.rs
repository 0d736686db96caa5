//! Adversarial scenarios for copies to pageable memory staged by threads (`DeviceBuffer::to_host`), each against the driver's copy (0 threads) and under a time limit.
//! A read is staged only from `STAGED_READ_MIN` bytes with `READ_MIN_THREADS` threads or
//! more: 1 thread, where a scenario compares it, must do what the driver does.
use super::support::*;
use ferrocuda_types::{DevicePtr, Element, EventFlags};

/// `values` into device memory at `ptr` by the driver's own copy, enqueued on `s` (still
/// pending under manual completion): what a read after it on `s` must return.
fn seed(fake: &FakeDriver, ptr: DevicePtr, values: &[u8], s: &Stream) -> R {
    fake.memcpy_htod_async(ptr, values, s.handle())?;
    Ok(())
}

/// `buf` read with `to_host` on `s` (made current for the read), as bytes.
fn read_on<T: Element>(
    rt: &Arc<Runtime>,
    buf: &DeviceBuffer<T>,
    s: &Stream,
) -> Result<Vec<u8>, StreamError> {
    let _g = rt.stream_guard(s)?;
    buf.to_host()
        .map(|v| bytemuck::cast_slice::<T, u8>(&v).to_vec())
}

/// Where two byte strings first differ, for messages (`None`: equal). Compares with `==`
/// first, which is fast in a debug build.
fn diff(a: &[u8], b: &[u8]) -> Option<usize> {
    if a == b { None } else { first_diff(a, b) }
}

/// Ends the capture on `s` and destroys its graph.
fn end_capture(fake: &FakeDriver, s: ferrocuda_types::StreamHandle) -> Result<(), DriverError> {
    fake.stream_end_capture(s).map(|g| {
        let _ = fake.graph_destroy(g);
    })
}

/// Makes calls of kind `call` (on a spare stream and event) until `calls(call)` reaches
/// `until`: a failure injected for a call the scenario did not reach then hits nothing else.
fn spend(fake: &FakeDriver, call: Call, until: u64) -> R {
    if fake.calls(call) >= until {
        return Ok(());
    }
    let spare = fake.stream_create(D0, StreamFlags::default())?;
    let ev = fake.event_create(D0, EventFlags::default())?;
    while fake.calls(call) < until {
        let before = fake.calls(call);
        let _ = match call {
            Call::StreamSynchronize => fake.stream_synchronize(spare),
            Call::EventQuery => fake.event_query(ev).map(drop),
            Call::EventRecord => fake.event_record(ev, spare),
            Call::EventSynchronize => fake.event_synchronize(ev),
            Call::MemcpyDtoHPinned | Call::HostRead | Call::HostAlloc | Call::EventCreate => {
                return Err(format!("spend: {call:?} not supported").into());
            }
            _ => Ok(()),
        };
        if fake.calls(call) == before {
            return Err(format!("spend: {call:?} not counted").into());
        }
    }
    fake.event_destroy(ev)?;
    fake.stream_destroy(spare)?;
    Ok(())
}

/// Slots kept now: made minus freed.
fn kept(fake: &FakeDriver) -> u64 {
    fake.calls(Call::HostAlloc) - fake.calls(Call::HostFree)
}

// ---- bytes and order -----------------------------------------------------------------------

fn typed_reads<T: Element>(
    rt: &Arc<Runtime>,
    fake: &FakeDriver,
    s: &Stream,
    source: &[u8],
    sizes: &[usize],
    threads: usize,
) -> R {
    let width = size_of::<T>();
    for &bytes in sizes {
        let n = bytes.div_ceil(width);
        let want = &source[..n * width];
        let buf = DeviceBuffer::<T>::uninit(rt, D0, n)?;
        seed(fake, buf.ptr(), want, s)?;
        let got = read_on(rt, &buf, s)?;
        assert_eq!(
            diff(&got, want),
            None,
            "{threads} threads, {} × {n} ({} bytes): first wrong byte",
            std::any::type_name::<T>(),
            n * width
        );
    }
    Ok(())
}

/// Every size near the edges (below, at and just above the staged read minimum, a part
/// chunk at the end, more chunks than the device may keep slots), for u8, i16, f32 and f64,
/// with 0 to 3 threads (1: every read by the driver), under manual completion (the bytes are
/// seeded on the read's stream and still pending when the read starts): every read returns
/// exactly the seeded bytes.
#[test]
fn bytes_match_the_driver_for_every_size_element_type_and_thread_count() -> R {
    timed("read-bytes", 60, || {
        let biggest = (2 * 3 * DEPTH + 1) * CHUNK + 8;
        let source = values(biggest, 41);
        let edges = [
            STAGED_READ_MIN - 1,
            STAGED_READ_MIN,
            STAGED_READ_MIN + 1,
            STAGED_READ_MIN + CHUNK - 2,
        ];
        for threads in 0..=3usize {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let s = rt.new_stream(D0, 0)?;
            typed_reads::<u8>(&rt, &fake, &s, &source, &edges, threads)?;
            if threads == 0 {
                continue;
            }
            typed_reads::<i16>(&rt, &fake, &s, &source, &edges[1..], threads)?;
            typed_reads::<f32>(&rt, &fake, &s, &source, &edges[2..], threads)?;
            typed_reads::<f64>(&rt, &fake, &s, &source, &edges[2..], threads)?;
            // More chunks than 2 × threads × DEPTH: slots reused within one read.
            let reuse = [(2 * threads * DEPTH + 1) * CHUNK + 8];
            if threads == 1 {
                typed_reads::<f64>(&rt, &fake, &s, &source, &reuse, threads)?;
            } else {
                typed_reads::<u8>(&rt, &fake, &s, &source, &reuse, threads)?;
            }
            // 12 reads, the first below the minimum: with 1 thread all by the driver.
            let [driver, staged] = dtoh_calls(&fake);
            if threads < READ_MIN_THREADS {
                assert_eq!((driver, staged), (12, 0), "{threads} thread: the driver");
            } else {
                assert_eq!(
                    driver, 1,
                    "{threads} threads: only the read below the minimum"
                );
                assert!(staged > 0, "{threads} threads: staged");
            }
        }
        Ok(())
    })
}

/// What one run of the stream-order scenario saw.
#[derive(Debug, PartialEq)]
struct OrderOutcome {
    kernels_seen: bool,
    upload_seen: Option<usize>,
    own_upload_seen: Option<usize>,
    after_event_pending: usize,
}

/// Manual completion. s1: a fill kernel on `a`, a (staged) upload into `x`, an event, then a
/// fill on `c` after the event. s2: waits for the event, adds one to `a`, uploads into `y`
/// (its own slots busy). Reads of `a`, `x` and `y` on s2 (each at least the staged read
/// minimum: staged from 2 threads, by the driver with 1) must see all of it, and s1's work
/// after the event must still be pending, exactly as with the driver's copy.
#[test]
fn a_read_sees_kernels_uploads_and_event_waits_enqueued_before_it() -> R {
    timed("read-order", 30, || {
        let mut outcomes = Vec::new();
        for threads in 0..=3usize {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let m = add_one_and_fill(&rt, &fake)?;
            let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
            let n = (STAGED_READ_MIN + 40) / 4;
            let a = DeviceBuffer::<f32>::uninit(&rt, D0, n)?;
            let c = DeviceBuffer::<f32>::uninit(&rt, D0, 16)?;
            let up = values(STAGED_READ_MIN + 7, 3);
            let own = values(2 * DEPTH * CHUNK + 3, 4);
            let x = DeviceBuffer::<u8>::uninit(&rt, D0, up.len())?;
            let y = DeviceBuffer::<u8>::uninit(&rt, D0, own.len())?;
            rt.default_stream(D0)?.synchronize()?;
            let ev = {
                let _g = rt.stream_guard(&s1)?;
                launch_fill(&s1, &m, &a, 1.0)?;
                x.copy_from_host(&up)?;
                s1.record_event(None)?
            };
            launch_fill(&s1, &m, &c, 9.0)?;
            s2.wait_event(&ev)?;
            launch_add_one(&s2, &m, &a)?;
            {
                let _g = rt.stream_guard(&s2)?;
                y.copy_from_host(&own)?;
            }
            let before = dtoh_calls(&fake);
            let got_a = {
                let _g = rt.stream_guard(&s2)?;
                a.to_host()?
            };
            let got_x = read_on(&rt, &x, &s2)?;
            let got_y = read_on(&rt, &y, &s2)?;
            let after = dtoh_calls(&fake);
            let by_driver = after[0] - before[0];
            if (1..READ_MIN_THREADS).contains(&threads) {
                assert_eq!(
                    (by_driver, after[1] - before[1]),
                    (3, 0),
                    "{threads} thread: three reads by the driver"
                );
            } else if threads >= READ_MIN_THREADS {
                assert_eq!(by_driver, 0, "{threads} threads: three staged reads");
            }
            outcomes.push(OrderOutcome {
                kernels_seen: got_a.iter().all(|&v| v == 2.0),
                upload_seen: diff(&got_x, &up),
                own_upload_seen: diff(&got_y, &own),
                after_event_pending: fake.pending(s1.handle())?,
            });
        }
        let driver = &outcomes[0];
        assert_eq!(
            driver,
            &OrderOutcome {
                kernels_seen: true,
                upload_seen: None,
                own_upload_seen: None,
                after_event_pending: 1
            }
        );
        for (threads, o) in outcomes.iter().enumerate().skip(1) {
            assert_eq!(o, driver, "{threads} threads vs the driver's copy");
        }
        Ok(())
    })
}

/// Manual completion, one thread kept busy: s1 holds every slot the device may keep (a staged
/// upload of 2 × threads × DEPTH chunks, pending, after a kernel). Reads on s2 (of buffers
/// seeded on s2), of every size (below the staged read minimum, at it, more chunks than a
/// copy's slots), must not complete any of s1's work, must not make a slot beyond the bound,
/// and must return the bytes; then a read on s1 returns the upload. With 1 thread every read
/// is the driver's.
#[test]
fn with_every_slot_lent_to_another_streams_upload_a_read_completes_none_of_its_work() -> R {
    timed("read-no-wait", 30, || {
        for threads in 1..=3usize {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let m = add_one_and_fill(&rt, &fake)?;
            let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
            let f = DeviceBuffer::<f32>::uninit(&rt, D0, 1024)?;
            let bound = 2 * threads * DEPTH;
            let up = values(bound * CHUNK, 5);
            let x = DeviceBuffer::<u8>::uninit(&rt, D0, up.len())?;
            let below = values(STAGED_READ_MIN - 1, 8);
            let small = values(STAGED_READ_MIN + 1, 6);
            let big = values((threads.max(2) * DEPTH + 2) * CHUNK + 1, 7);
            let (o, p, q) = (
                DeviceBuffer::<u8>::uninit(&rt, D0, below.len())?,
                DeviceBuffer::<u8>::uninit(&rt, D0, small.len())?,
                DeviceBuffer::<u8>::uninit(&rt, D0, big.len())?,
            );
            rt.default_stream(D0)?.synchronize()?;
            seed(&fake, o.ptr(), &below, &s2)?;
            seed(&fake, p.ptr(), &small, &s2)?;
            seed(&fake, q.ptr(), &big, &s2)?;
            launch_fill(&s1, &m, &f, 1.0)?;
            {
                let _g = rt.stream_guard(&s1)?;
                x.copy_from_host(&up)?;
            }
            let pending = fake.pending(s1.handle())?;
            assert!(pending > 1, "{threads} threads: s1's work pending");
            for (buf, want) in [(&o, &below), (&p, &small), (&q, &big)] {
                let before = dtoh_calls(&fake);
                let got = read_on(&rt, buf, &s2)?;
                let after = dtoh_calls(&fake);
                assert_eq!(diff(&got, want), None, "{threads} threads: read on s2");
                let staged = threads >= READ_MIN_THREADS && want.len() >= STAGED_READ_MIN;
                assert_eq!(
                    (after[0] - before[0] == 0, after[1] - before[1] > 0),
                    (staged, staged),
                    "{threads} threads, {} bytes: staged expected: {staged}",
                    want.len()
                );
                assert_eq!(
                    fake.pending(s1.handle())?,
                    pending,
                    "{threads} threads: a read on s2 ({} bytes) completed work of s1",
                    want.len()
                );
            }
            assert!(
                fake.calls(Call::HostAlloc) as usize <= bound,
                "{threads} threads: {} slots made, bound {bound}",
                fake.calls(Call::HostAlloc)
            );
            assert_eq!(
                diff(&read_on(&rt, &x, &s1)?, &up),
                None,
                "{threads}: upload"
            );
        }
        Ok(())
    })
}

// ---- captures ------------------------------------------------------------------------------

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

/// Driver failures at every step of a staged read (the transfer into a slot, its event
/// record, the wait for it, the copy out of the slot, a pooled slot's query, a stream
/// synchronize), early and late in a read of 10 chunks with 2 threads (slots reused), under
/// manual completion: each read returns an error or the right bytes, never a panic or a
/// hang; the next read and the next upload work; the bound holds; and once the runtime goes
/// every slot is freed and every event destroyed.
#[test]
fn every_injected_read_failure_returns_and_the_next_copies_work_and_nothing_leaks() -> R {
    timed("read-failures", 60, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 2);
        let s = rt.new_stream(D0, 0)?;
        let bytes = (2 * DEPTH + 1) * CHUNK + 333;
        let buf = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
        let cases: Vec<(Call, u64)> = vec![
            (Call::MemcpyDtoHPinned, 1),
            (Call::MemcpyDtoHPinned, 9),
            (Call::EventRecord, 1),
            (Call::EventRecord, 8),
            (Call::EventSynchronize, 1),
            (Call::EventSynchronize, 7),
            (Call::HostRead, 1),
            (Call::HostRead, 10),
            (Call::EventQuery, 1),
            (Call::EventQuery, 3),
            (Call::StreamSynchronize, 1),
        ];
        let first = values(bytes, 1);
        seed(&fake, buf.ptr(), &first, &s)?;
        assert_eq!(diff(&read_on(&rt, &buf, &s)?, &first), None, "slots made");
        let mut report = Vec::new();
        for (round, (call, nth)) in cases.into_iter().enumerate() {
            let want = values(bytes, 100 + round);
            seed(&fake, buf.ptr(), &want, &s)?;
            let before = fake.calls(call);
            fake.fail_nth(call, nth, DriverError::INVALID_VALUE);
            let r = read_on(&rt, &buf, &s);
            let made = fake.calls(call) - before;
            match &r {
                Ok(got) if got != &want => report.push(format!(
                    "{call:?} #{nth}: success with wrong bytes (first at {:?})",
                    diff(got, &want)
                )),
                _ => {}
            }
            if made < nth {
                eprintln!("observation: a read made {made} {call:?} calls (< {nth})");
            }
            spend(&fake, call, before + nth)?;
            // Whatever happened, the next read and the next upload work.
            let next = values(bytes, 200 + round);
            seed(&fake, buf.ptr(), &next, &s)?;
            match read_on(&rt, &buf, &s) {
                Ok(got) if got == next => {}
                Ok(got) => report.push(format!(
                    "after {call:?} #{nth} ({r:?}): the next read: wrong bytes at {:?}",
                    diff(&got, &next)
                )),
                Err(e) => report.push(format!(
                    "after {call:?} #{nth}: the next read failed: {e:?}"
                )),
            }
            let up = values(bytes, 300 + round);
            let uploaded = {
                let _g = rt.stream_guard(&s)?;
                buf.copy_from_host(&up)
            };
            match uploaded {
                Ok(()) => {
                    if let Some(at) = diff(&driver_read(&fake, &buf, &s)?, &up) {
                        report.push(format!("after {call:?} #{nth}: the next upload: byte {at}"));
                    }
                }
                Err(e) => report.push(format!(
                    "after {call:?} #{nth}: the next upload failed: {e:?}"
                )),
            }
        }
        drop(buf);
        drop(s);
        let allocs = fake.calls(Call::HostAlloc);
        if allocs as usize > 2 * 2 * DEPTH {
            report.push(format!("bound: {allocs} slots made, at most {}", 4 * DEPTH));
        }
        drop(rt);
        if fake.calls(Call::HostFree) != allocs {
            report.push(format!(
                "{allocs} slots made, {} freed",
                fake.calls(Call::HostFree)
            ));
        }
        if fake.calls(Call::EventDestroy) != fake.calls(Call::EventCreate) {
            report.push(format!(
                "{} events made, {} destroyed",
                fake.calls(Call::EventCreate),
                fake.calls(Call::EventDestroy)
            ));
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

/// Manual completion, `threads` threads, slots made and idle. A read on s1 whose `nth`
/// event record fails (and, with `sync_fail = Some(k)`, whose `k`-th stream synchronize
/// fails too) leaves that chunk's transfer into its slot pending on s1, with no event after
/// it, unless the read waits for s1. Then an upload on s2 (which takes idle slots), then s1
/// completes, then s2: the uploaded bytes must be exact, the next read on s1 must work, and
/// every slot goes back with the runtime. What went wrong, if anything.
fn record_failure_then_upload(
    threads: usize,
    nth: u64,
    sync_fail: Option<u64>,
) -> Result<Vec<String>, Err> {
    let mut report = Vec::new();
    let case =
        format!("{threads} threads, event record #{nth} fails, stream sync {sync_fail:?} fails");
    let fake = fake_n(Completion::Manual, 1);
    let rt = runtime(&fake, threads);
    let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
    let bytes = 2 * threads * DEPTH * CHUNK;
    let (old, new) = (values(bytes, 11), values(bytes, 12));
    let r = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
    let u = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
    rt.default_stream(D0)?.synchronize()?;
    seed(&fake, r.ptr(), &old, &s1)?;
    assert_eq!(diff(&read_on(&rt, &r, &s1)?, &old), None, "warm-up");
    let (records, syncs) = (
        fake.calls(Call::EventRecord),
        fake.calls(Call::StreamSynchronize),
    );
    fake.fail_nth(Call::EventRecord, nth, DriverError::INVALID_VALUE);
    if let Some(k) = sync_fail {
        fake.fail_nth(Call::StreamSynchronize, k, DriverError::INVALID_VALUE);
    }
    let failed = read_on(&rt, &r, &s1);
    if fake.calls(Call::EventRecord) - records < nth
        || sync_fail.is_some_and(|k| fake.calls(Call::StreamSynchronize) - syncs < k)
    {
        report.push(format!("{case}: not reached"));
    }
    spend(&fake, Call::EventRecord, records + nth)?;
    if let Some(k) = sync_fail {
        spend(&fake, Call::StreamSynchronize, syncs + k)?;
    }
    let left_on_s1 = fake.pending(s1.handle())?;
    let uploaded = {
        let _g = rt.stream_guard(&s2)?;
        u.copy_from_host(&new)
    };
    fake.advance(s1.handle(), None)?;
    let case = format!(
        "{case} (read: {:?}; {left_on_s1} items left pending on s1)",
        failed.as_ref().map(drop)
    );
    match (&uploaded, driver_read(&fake, &u, &s2)) {
        (Ok(()), Ok(got)) => {
            if let Some(at) = diff(&got, &new) {
                let wrong = got
                    .chunks(CHUNK)
                    .zip(new.chunks(CHUNK))
                    .enumerate()
                    .filter(|(_, (g, w))| g != w)
                    .map(|(k, _)| k)
                    .collect::<Vec<_>>();
                report.push(format!(
                    "{case}: the upload on s2 returned Ok but landed wrong from byte {at} \
                     (chunks {wrong:?} wrong)"
                ));
            }
        }
        (up, landed) => report.push(format!(
            "{case}: upload {up:?}, landing {:?}",
            landed.map(drop)
        )),
    }
    match read_on(&rt, &r, &s1) {
        Ok(got) if got == old => {}
        other => report.push(format!(
            "{case}: the next read on s1: {:?}",
            other.map(|got| diff(&got, &old))
        )),
    }
    drop((r, u, s1, s2));
    let made = fake.calls(Call::HostAlloc);
    drop(rt);
    if fake.calls(Call::HostFree) != made {
        report.push(format!(
            "{case}: {made} slots made, {} freed",
            fake.calls(Call::HostFree)
        ));
    }
    Ok(report)
}

/// A read's event record fails, early or late (the read then waits for its stream): an
/// upload on another stream right after never writes through the slot before the stale
/// transfer has landed. (2 and 3 threads: with 1 the read is the driver's.)
#[test]
fn a_slot_whose_event_record_failed_is_not_reused_under_a_pending_transfer() -> R {
    timed("read-record-failure-reuse", 30, || {
        let mut report = Vec::new();
        for threads in [2usize, 3] {
            for nth in [1u64, 2, 4] {
                report.extend(record_failure_then_upload(threads, nth, None)?);
            }
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

/// As above, but the read's wait for its stream after the failed record (its second stream
/// synchronize) fails too: the read reports an error; the slot whose transfer is still
/// pending on s1 must not be lent to the upload on s2 (or not before that transfer lands).
/// (2 and 3 threads: with 1 the read is the driver's.)
#[test]
fn a_slot_whose_event_record_and_recovery_sync_failed_is_not_reused() -> R {
    timed("read-record-and-sync-failure-reuse", 30, || {
        let mut report = Vec::new();
        for threads in [2usize, 3] {
            for nth in [1u64, 2, 3] {
                report.extend(record_failure_then_upload(threads, nth, Some(2))?);
            }
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

/// Page-locked memory or an event refused while a read makes its slots (the first, or one
/// after some were made): the read still returns the right bytes (by the driver, or staged
/// over the slots it got), the next read and upload work, and once the runtime goes every
/// slot made is freed and every event made destroyed.
#[test]
fn slot_creation_failures_during_a_read_fall_back_and_leak_nothing() -> R {
    timed("read-slot-failures", 30, || {
        let mut report = Vec::new();
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
            let want = values(bytes, nth as usize);
            let buf = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
            rt.default_stream(D0)?.synchronize()?;
            seed(&fake, buf.ptr(), &want, &s)?;
            let before = fake.calls(call);
            fake.fail_nth(call, nth, DriverError::OUT_OF_MEMORY);
            match read_on(&rt, &buf, &s) {
                Ok(got) if got == want => {}
                other => report.push(format!(
                    "{call:?} #{nth}: the read: {:?}",
                    other.map(|g| diff(&g, &want))
                )),
            }
            if fake.calls(call) - before < nth {
                report.push(format!("{call:?} #{nth}: not reached"));
            }
            let next = values(bytes, 77);
            seed(&fake, buf.ptr(), &next, &s)?;
            match read_on(&rt, &buf, &s) {
                Ok(got) if got == next => {}
                other => report.push(format!(
                    "{call:?} #{nth}: the next read: {:?}",
                    other.map(|g| diff(&g, &next))
                )),
            }
            let up = values(bytes, 78);
            {
                let _g = rt.stream_guard(&s)?;
                buf.copy_from_host(&up)?;
            }
            if let Some(at) = diff(&driver_read(&fake, &buf, &s)?, &up) {
                report.push(format!("{call:?} #{nth}: the next upload: byte {at}"));
            }
            drop((buf, s));
            let allocs = fake.calls(Call::HostAlloc) - u64::from(call == Call::HostAlloc);
            let events = fake.calls(Call::EventCreate) - u64::from(call == Call::EventCreate);
            if allocs as usize > 2 * 2 * DEPTH {
                report.push(format!("{call:?} #{nth}: {allocs} slots made"));
            }
            drop(rt);
            if fake.calls(Call::HostFree) != allocs {
                report.push(format!(
                    "{call:?} #{nth}: {allocs} slots made, {} freed",
                    fake.calls(Call::HostFree)
                ));
            }
            if fake.calls(Call::EventDestroy) != events {
                report.push(format!(
                    "{call:?} #{nth}: {events} events made, {} destroyed",
                    fake.calls(Call::EventDestroy)
                ));
            }
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

// ---- devices, threads and the bound --------------------------------------------------------

/// A buffer on device 1 is read on device 1's current stream, whatever the current device
/// and device 0's current stream are: manual completion, its bytes seeded on D1's current
/// stream (pending), device 0's slots already made by an earlier read, device 0 current with
/// a stream of its own that has pending work. The read returns the seeded bytes and leaves
/// device 0's stream pending, as the driver's does (1 thread: every read the driver's).
#[test]
fn a_read_uses_its_buffers_devices_current_stream_and_that_devices_slots() -> R {
    timed("read-device", 30, || {
        for threads in [0usize, 1, 3] {
            let fake = fake_n(Completion::Manual, 2);
            let rt = runtime(&fake, threads);
            let m = add_one_and_fill(&rt, &fake)?;
            let (s0, s1) = (rt.new_stream(D0, 0)?, rt.new_stream(D1, 0)?);
            let want0 = values(STAGED_READ_MIN + CHUNK + 1, 13);
            let want1 = values((2 * threads.max(1) * DEPTH + 1) * CHUNK + 9, 14);
            let b0 = DeviceBuffer::<u8>::uninit(&rt, D0, want0.len())?;
            let b1 = DeviceBuffer::<u8>::uninit(&rt, D1, want1.len())?;
            let f = DeviceBuffer::<f32>::uninit(&rt, D0, 256)?;
            rt.synchronize(D0)?;
            rt.synchronize(D1)?;
            seed(&fake, b0.ptr(), &want0, &s0)?;
            assert_eq!(
                diff(&read_on(&rt, &b0, &s0)?, &want0),
                None,
                "{threads}: D0"
            );
            assert_eq!(
                fake.calls(Call::HostAlloc) > 0,
                threads >= READ_MIN_THREADS,
                "{threads} threads: device 0's slots made by the read"
            );
            let _g1 = rt.stream_guard(&s1)?;
            let _g0 = rt.stream_guard(&s0)?; // device 0 current again
            assert_eq!(rt.current_device(), D0);
            seed(&fake, b1.ptr(), &want1, &s1)?;
            launch_fill(&s0, &m, &f, 1.0)?;
            let pending0 = fake.pending(s0.handle())?;
            let got = b1.to_host()?;
            assert_eq!(diff(&got, &want1), None, "{threads} threads: D1's bytes");
            assert_eq!(
                fake.pending(s0.handle())?,
                pending0,
                "{threads} threads: device 0's stream completed"
            );
            // Again, now that device 1 has slots too, and device 0 once more.
            assert_eq!(diff(&b1.to_host()?, &want1), None, "{threads}: D1 again");
            assert_eq!(diff(&b0.to_host()?, &want0), None, "{threads}: D0 again");
            let [by_driver, staged] = dtoh_calls(&fake);
            if threads < READ_MIN_THREADS {
                assert_eq!(staged, 0, "{threads} threads: no read staged");
                assert_eq!(by_driver, 4, "{threads} threads: four reads by the driver");
            } else {
                assert_eq!(by_driver, 0, "{threads} threads: four staged reads");
            }
        }
        Ok(())
    })
}

/// Six threads at once over two devices, some sharing a stream, some with their own,
/// manual completion, 2 staging threads: each uploads, reads back (8 or 9 whole chunks and a
/// few bytes: above the staged read minimum), reads a buffer another copy of its own left in
/// flight, rounds over. Every read returns its bytes whole, no
/// deadlock, and at most 2 × threads × DEPTH slots per device.
#[test]
fn reads_and_uploads_from_several_threads_on_two_devices_each_land_whole() -> R {
    timed("read-concurrency", 40, || {
        let fake = fake_n(Completion::Manual, 2);
        let threads = 2;
        let rt = runtime(&fake, threads);
        let shared = [rt.new_stream(D0, 0)?, rt.new_stream(D1, 0)?];
        let workers = 6;
        let barrier = Arc::new(Barrier::new(workers));
        let handles: Vec<_> = (0..workers)
            .map(|k| {
                let (rt, barrier, shared) = (rt.clone(), barrier.clone(), shared.clone());
                std::thread::spawn(move || -> R {
                    let dev = if k % 2 == 0 { D0 } else { D1 };
                    let stream = if k < 2 {
                        shared[k % 2].clone()
                    } else {
                        rt.new_stream(dev, 0)?
                    };
                    barrier.wait();
                    for round in 0..3 {
                        let bytes = STAGED_READ_MIN + (k + round) % 2 * CHUNK + 7 * k + round;
                        let (v, w) = (values(bytes, 10 * k + round), values(bytes, 99 + k));
                        let a = DeviceBuffer::<u8>::uninit(&rt, dev, bytes)?;
                        let b = DeviceBuffer::<u8>::uninit(&rt, dev, bytes)?;
                        let _g = rt.stream_guard(&stream)?;
                        a.copy_from_host(&v)?;
                        b.copy_from_host(&w)?;
                        let got_a = a.to_host()?;
                        assert_eq!(diff(&got_a, &v), None, "thread {k} round {round}: a");
                        a.copy_from_host(&w)?;
                        assert_eq!(diff(&b.to_host()?, &w), None, "thread {k} round {round}: b");
                        assert_eq!(
                            diff(&a.to_host()?, &w),
                            None,
                            "thread {k} round {round}: a'"
                        );
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "worker panicked")??;
        }
        let made = fake.calls(Call::HostAlloc) as usize;
        assert!(
            fake.calls(Call::MemcpyDtoHPinned) > 0,
            "reads staged ({} by the driver)",
            fake.calls(Call::MemcpyDtoH)
        );
        assert!(
            made <= 2 * 2 * threads * DEPTH,
            "{made} slots made over two devices, bound {} each",
            2 * threads * DEPTH
        );
        Ok(())
    })
}

/// Manual completion, 4 threads (up to 32 slots): an upload on s1 leaves 8 slots in flight
/// (never completed), a read on s2 leaves more idle. Lowered to 2 threads (bound 16; the
/// fewest that stage a read): the next (staged) reads on s2 complete none of s1's work, make
/// no slot and return their bytes. Returns the slots (made by the upload on s1, made in all,
/// freed) after those reads.
fn lower_with_slots_in_flight() -> Result<(u64, u64, u64), Err> {
    const LOWERED: usize = READ_MIN_THREADS;
    let fake = fake_n(Completion::Manual, 1);
    let rt = runtime(&fake, 4);
    let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
    let up = values(2 * DEPTH * CHUNK, 15);
    let want = values(6 * DEPTH * CHUNK, 16);
    let x = DeviceBuffer::<u8>::uninit(&rt, D0, up.len())?;
    let y = DeviceBuffer::<u8>::uninit(&rt, D0, want.len())?;
    rt.default_stream(D0)?.synchronize()?;
    {
        let _g = rt.stream_guard(&s1)?;
        x.copy_from_host(&up)?;
    }
    let pending = fake.pending(s1.handle())?;
    let in_flight = fake.calls(Call::HostAlloc);
    seed(&fake, y.ptr(), &want, &s2)?;
    assert_eq!(diff(&read_on(&rt, &y, &s2)?, &want), None, "4 threads");
    let made = fake.calls(Call::HostAlloc);
    assert!(
        made as usize > 2 * LOWERED * DEPTH,
        "{made} slots made with 4 threads"
    );
    StagedCopies::install(&rt, LOWERED);
    for k in 0..2 {
        let staged = fake.calls(Call::MemcpyDtoHPinned);
        assert_eq!(diff(&read_on(&rt, &y, &s2)?, &want), None, "read {k}");
        assert!(
            fake.calls(Call::MemcpyDtoHPinned) > staged,
            "read {k} staged"
        );
        assert_eq!(
            fake.pending(s1.handle())?,
            pending,
            "read {k} waited for s1"
        );
    }
    assert_eq!(
        fake.calls(Call::HostAlloc),
        made,
        "no slot made after lowering"
    );
    let freed = fake.calls(Call::HostFree);
    let _g = rt.stream_guard(&s1)?;
    assert_eq!(diff(&x.to_host()?, &up), None, "the upload on s1");
    Ok((in_flight, made, freed))
}

/// Lowering the thread count with slots in flight on another stream: later reads never
/// wait for them, make no slot and land whole.
#[test]
fn lowering_the_thread_count_with_slots_in_flight_never_waits_for_them() -> R {
    timed("read-lower-threads", 20, || {
        lower_with_slots_in_flight().map(drop)
    })
}

/// The same, several times over: after the reads, the idle slots beyond the new bound are
/// given back, so at most 2 × 2 × DEPTH slots are kept (those in flight count).
#[test]
fn lowering_the_thread_count_with_slots_in_flight_keeps_the_new_bound() -> R {
    timed("read-lower-threads-bound", 40, || {
        let mut report = Vec::new();
        for round in 0..6 {
            let (in_flight, made, freed) = lower_with_slots_in_flight()?;
            let bound = 2 * READ_MIN_THREADS * DEPTH;
            if (made - freed) as usize > bound {
                report.push(format!(
                    "round {round}: {} slots kept after lowering to {READ_MIN_THREADS} threads \
                     (bound {bound}; {made} made, {freed} freed; {in_flight} made by the \
                     upload on s1, in flight)",
                    made - freed,
                ));
            }
        }
        assert!(report.is_empty(), "{}", report.join("\n"));
        Ok(())
    })
}

/// The thread count is lowered (from 5 to 2, from 3 to 1, from 2 to 0) by another thread
/// while a read of many chunks is underway (at its first copy out of a slot): the read
/// returns its bytes whole, nothing hangs, and the later read is staged with 2 threads and
/// the driver's with 1 or 0. After it the slots kept are within the new bound for 2 threads
/// (the fewest whose read is staged, so the only count whose read gives slots back: with 1,
/// slots beyond its bound stay until a staged upload; 0 threads:
/// `lowering_the_thread_count_to_zero_gives_the_idle_slots_back`).
#[test]
fn lowering_the_thread_count_during_a_read_neither_hangs_nor_tears_it() -> R {
    timed("read-lower-during", 30, || {
        for (from, to) in [(5usize, 2usize), (3, 1), (2, 0)] {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, from);
            let s = rt.new_stream(D0, 0)?;
            let want = values((2 * from * DEPTH + 3) * CHUNK + 1, 17);
            let buf = DeviceBuffer::<u8>::uninit(&rt, D0, want.len())?;
            rt.default_stream(D0)?.synchronize()?;
            seed(&fake, buf.ptr(), &want, &s)?;
            let lowered = Arc::new(Mutex::new(Vec::new()));
            {
                let (rt2, lowered2) = (rt.clone(), lowered.clone());
                fake.before_next(Call::HostRead, move || {
                    let h = std::thread::spawn(move || StagedCopies::install(&rt2, to));
                    lowered2.lock().unwrap().push(h);
                });
            }
            assert_eq!(diff(&read_on(&rt, &buf, &s)?, &want), None, "{from} → {to}");
            for h in lowered.lock().unwrap().drain(..) {
                h.join().map_err(|_| "installing thread panicked")?;
            }
            assert_eq!(rt.pageable_copy_threads(), to);
            seed(&fake, buf.ptr(), &want, &s)?;
            let before = dtoh_calls(&fake);
            assert_eq!(
                diff(&read_on(&rt, &buf, &s)?, &want),
                None,
                "{from} → {to}: next"
            );
            let after = dtoh_calls(&fake);
            let staged = to >= READ_MIN_THREADS;
            assert_eq!(
                (after[0] - before[0] == 0, after[1] - before[1] > 0),
                (staged, staged),
                "{from} → {to} threads: the next read staged: {staged}"
            );
            assert!(
                !staged || kept(&fake) as usize <= 2 * to * DEPTH,
                "{from} → {to} threads: {} slots kept",
                kept(&fake)
            );
        }
        Ok(())
    })
}

/// 3 threads, a read leaves its slots idle; the thread count is lowered to 0 (bound 0, every
/// copy by the driver from now on). Idle slots beyond the new bound go back: after the
/// install, a read and an upload, no slot may be kept (nothing is in flight).
#[test]
fn lowering_the_thread_count_to_zero_gives_the_idle_slots_back() -> R {
    timed("read-lower-to-zero", 20, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 3);
        let s = rt.new_stream(D0, 0)?;
        let want = values((2 * 3 * DEPTH + 3) * CHUNK + 1, 18);
        let buf = DeviceBuffer::<u8>::uninit(&rt, D0, want.len())?;
        rt.default_stream(D0)?.synchronize()?;
        seed(&fake, buf.ptr(), &want, &s)?;
        assert_eq!(diff(&read_on(&rt, &buf, &s)?, &want), None, "3 threads");
        let idle = kept(&fake);
        assert!(idle > 0, "slots made");
        StagedCopies::install(&rt, 0);
        assert_eq!(
            diff(&read_on(&rt, &buf, &s)?, &want),
            None,
            "0 threads: read"
        );
        {
            let _g = rt.stream_guard(&s)?;
            buf.copy_from_host(&want)?;
        }
        s.synchronize()?;
        assert_eq!(
            kept(&fake),
            0,
            "{idle} idle slots before lowering to 0 threads; {} made, {} freed",
            fake.calls(Call::HostAlloc),
            fake.calls(Call::HostFree)
        );
        Ok(())
    })
}
