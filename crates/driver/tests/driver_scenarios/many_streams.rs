//! The fake device's walks over a device's streams (draining it at a `free` or a device
//! synchronize, `advance_all`, the legacy stream's implicit waits) visit only the streams
//! with work queued, or capturing: their cost follows the work pending, not the number of
//! streams the device has ever had ([`FakeDriver::stream_visits`] counts the visits, so a
//! walk over every stream shows up as a count, not as a time). And what they do is what a
//! walk over every stream did.
use ferrocuda_driver::{Driver, DriverError, FakeDriver, fake::Completion};
use ferrocuda_types::{CaptureMode, DeviceIndex, MemsetValue, StreamFlags, StreamHandle};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);
const LEGACY: StreamHandle = StreamHandle::legacy(D0);

fn manual(devices: usize) -> FakeDriver {
    FakeDriver::builder()
        .devices(devices)
        .completion(Completion::Manual)
        .build()
}

fn streams(
    fake: &FakeDriver,
    dev: DeviceIndex,
    n: usize,
    non_blocking: bool,
) -> Result<Vec<StreamHandle>, DriverError> {
    let flags = StreamFlags {
        non_blocking,
        priority: 0,
    };
    (0..n).map(|_| fake.stream_create(dev, flags)).collect()
}

fn byte_at(fake: &FakeDriver, ptr: ferrocuda_types::DevicePtr) -> Result<u8, DriverError> {
    let mut out = [0u8; 1];
    fake.memcpy_dtoh(&mut out, ptr, LEGACY)?;
    Ok(out[0])
}

#[test]
fn a_drain_visits_only_the_streams_with_work_queued() -> TestResult {
    let fake = manual(2);
    let idle = streams(&fake, D0, 1000, true)?;
    let other = streams(&fake, D1, 1, true)?;
    let (ptr, spare) = (fake.malloc(D0, 4096)?, fake.malloc(D0, 4096)?);
    let ptr1 = fake.malloc(D1, 4096)?;
    fake.memset_async(ptr, MemsetValue::U8(1), 4096, idle[10])?;
    fake.memset_async(ptr, MemsetValue::U8(2), 4096, idle[500])?;
    fake.memset_async(ptr, MemsetValue::U8(3), 4096, idle[500])?;
    fake.memset_async(ptr1, MemsetValue::U8(4), 4096, other[0])?;

    let before = fake.stream_visits();
    fake.free(D0, spare)?; // cuMemFree waits for the device's work
    assert_eq!(
        fake.stream_visits() - before,
        2,
        "the two busy streams of device 0"
    );
    assert_eq!(fake.pending(idle[10])?, 0);
    assert_eq!(fake.pending(idle[500])?, 0);
    assert_eq!(fake.pending(other[0])?, 1, "device 1 is not drained");
    assert_eq!(byte_at(&fake, ptr)?, 3, "stream 500's work ran, in order");

    // Nothing queued any more: neither a free nor a synchronize visits a stream, however
    // many there are.
    let _more = streams(&fake, D0, 1000, true)?;
    let before = fake.stream_visits();
    let again = fake.malloc(D0, 4096)?;
    fake.free(D0, again)?;
    fake.device_synchronize(D0)?;
    assert_eq!(fake.stream_visits(), before);

    fake.device_synchronize(D1)?;
    assert_eq!(fake.pending(other[0])?, 0);
    Ok(())
}

#[test]
fn the_legacy_stream_waits_for_the_busy_blocking_streams_only() -> TestResult {
    let fake = manual(1);
    let _idle = streams(&fake, D0, 500, false)?;
    let blocking = streams(&fake, D0, 2, false)?;
    let non_blocking = streams(&fake, D0, 1, true)?;
    let ptr = fake.malloc(D0, 64)?;
    let elsewhere = fake.malloc(D0, 64)?;
    fake.memset_async(ptr, MemsetValue::U8(1), 64, blocking[0])?;
    fake.memset_async(elsewhere, MemsetValue::U8(9), 64, non_blocking[0])?;

    let before = fake.stream_visits();
    fake.memset_async(ptr, MemsetValue::U8(2), 64, LEGACY)?;
    assert!(
        fake.stream_visits() - before <= 2,
        "the legacy stream looked at the busy streams only"
    );
    assert_eq!(
        fake.pending(LEGACY)?,
        2,
        "a wait for the blocking stream, then the memset"
    );
    assert_eq!(
        fake.advance(LEGACY, None)?,
        0,
        "blocked on the blocking stream"
    );
    assert_eq!(fake.advance(blocking[0], None)?, 1);
    assert_eq!(fake.advance(LEGACY, None)?, 2);

    // A blocking stream waits for the legacy stream's work; a non-blocking one does not.
    fake.memset_async(ptr, MemsetValue::U8(3), 64, LEGACY)?;
    fake.memset_async(ptr, MemsetValue::U8(4), 64, blocking[1])?;
    assert_eq!(
        fake.pending(LEGACY)?,
        1,
        "nothing busy to wait for but itself"
    );
    assert_eq!(
        fake.pending(blocking[1])?,
        2,
        "a wait for the legacy stream, the memset"
    );
    assert_eq!(fake.pending(non_blocking[0])?, 1);
    let before = fake.stream_visits();
    assert_eq!(fake.advance_all(), 4);
    assert!(
        fake.stream_visits() - before <= 3 * 2,
        "three busy streams, two passes"
    );
    assert_eq!(
        byte_at(&fake, ptr)?,
        4,
        "the blocking stream ran after the legacy one"
    );
    assert_eq!(byte_at(&fake, elsewhere)?, 9);
    Ok(())
}

#[test]
fn advance_all_completes_cross_stream_waits_among_many_idle_streams() -> TestResult {
    let fake = manual(1);
    let all = streams(&fake, D0, 2000, true)?;
    let (first, last) = (all[1999], all[3]);
    let ptr = fake.malloc(D0, 64)?;
    let event = fake.event_create(D0, ferrocuda_types::EventFlags::default())?;
    fake.memset_async(ptr, MemsetValue::U8(5), 64, first)?;
    fake.event_record(event, first)?;
    fake.stream_wait_event(last, event)?;
    fake.memset_async(ptr, MemsetValue::U8(6), 64, last)?;
    assert!(!fake.event_query(event)?);

    let before = fake.stream_visits();
    // `last` sorts before `first`: its wait holds it in the first pass, not in the second.
    assert_eq!(fake.advance_all(), 4);
    assert!(
        fake.stream_visits() - before <= 2 * 3,
        "two busy streams, three passes"
    );
    assert!(fake.event_query(event)?);
    assert_eq!(byte_at(&fake, ptr)?, 6);
    Ok(())
}

#[test]
fn legacy_work_breaks_a_blocking_streams_capture_only_while_it_captures() -> TestResult {
    let fake = FakeDriver::default();
    let _idle = streams(&fake, D0, 500, false)?;
    let blocking = streams(&fake, D0, 1, false)?[0];
    let non_blocking = streams(&fake, D0, 1, true)?[0];
    let ptr = fake.malloc(D0, 64)?;

    fake.stream_begin_capture(non_blocking, CaptureMode::Global)?;
    fake.memset_async(ptr, MemsetValue::U8(1), 64, LEGACY)?;
    fake.stream_end_capture(non_blocking)?;

    fake.stream_begin_capture(blocking, CaptureMode::Global)?;
    assert_eq!(
        fake.memset_async(ptr, MemsetValue::U8(1), 64, LEGACY),
        Err(DriverError::STREAM_CAPTURE_IMPLICIT)
    );
    assert_eq!(
        fake.stream_end_capture(blocking).map(|_| ()),
        Err(DriverError::STREAM_CAPTURE_INVALIDATED)
    );
    fake.memset_async(ptr, MemsetValue::U8(2), 64, LEGACY)?;

    // A capturing stream destroyed is no longer one the legacy stream can break (relaxed:
    // its capture, never ended, refuses no later call).
    let doomed = streams(&fake, D0, 1, false)?[0];
    fake.stream_begin_capture(doomed, CaptureMode::Relaxed)?;
    fake.stream_destroy(doomed)?;
    fake.memset_async(ptr, MemsetValue::U8(3), 64, LEGACY)?;
    assert_eq!(byte_at(&fake, ptr)?, 3);
    Ok(())
}

/// As an H200 answers (`docs/measurements/h200_2026-12-01g/legacy_probe.py`, every capture
/// mode): while a blocking stream captures, a query or a synchronization of the legacy
/// stream is refused with 906 and invalidates the capture, and asking the legacy stream's
/// capture status answers 906 and invalidates nothing. A non-blocking stream's capture
/// leaves the legacy stream usable.
#[test]
fn the_legacy_stream_and_the_device_beside_a_capture() -> TestResult {
    type Call = fn(&FakeDriver) -> Result<(), DriverError>;
    let fake = FakeDriver::default();
    let blocking = streams(&fake, D0, 1, false)?[0];
    let non_blocking = streams(&fake, D0, 1, true)?[0];
    let calls: [(&str, Call, DriverError, bool); 3] = [
        (
            "query the legacy stream",
            |d| d.stream_query(LEGACY).map(|_| ()),
            DriverError::STREAM_CAPTURE_IMPLICIT,
            true,
        ),
        (
            "synchronize the legacy stream",
            |d| d.stream_synchronize(LEGACY),
            DriverError::STREAM_CAPTURE_IMPLICIT,
            true,
        ),
        (
            "ask the legacy stream's capture status",
            |d| d.stream_capture_status(LEGACY).map(|_| ()),
            DriverError::STREAM_CAPTURE_IMPLICIT,
            false,
        ),
    ];
    for mode in [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ] {
        for (what, call, code, invalidates) in calls {
            fake.stream_begin_capture(blocking, mode)?;
            assert_eq!(call(&fake), Err(code), "{mode:?}: {what}");
            let ended = fake.stream_end_capture(blocking);
            assert_eq!(
                ended.as_ref().err(),
                invalidates.then_some(&DriverError::STREAM_CAPTURE_INVALIDATED),
                "{mode:?}: {what}"
            );
            if let Ok(graph) = ended {
                fake.graph_destroy(graph)?;
            }
        }
    }
    fake.stream_begin_capture(non_blocking, CaptureMode::Relaxed)?;
    assert_eq!(fake.stream_query(LEGACY), Ok(true));
    fake.stream_synchronize(LEGACY)?;
    fake.graph_destroy(fake.stream_end_capture(non_blocking)?)?;
    Ok(())
}
