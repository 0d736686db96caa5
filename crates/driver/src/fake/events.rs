//! Events on the fake device: made, recorded in stream order (or as capture nodes), queried,
//! waited for and timed, with the capture rules on each.
use super::work::Work;
use super::{Call, FakeDriver, FakeEvent, Recorded};
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, EventFlags, EventHandle, StreamHandle};
use std::time::Instant;

pub(super) fn event_create(
    driver: &FakeDriver,
    dev: DeviceIndex,
    flags: EventFlags,
) -> Result<EventHandle, DriverError> {
    let mut st = driver.enter(Call::EventCreate)?;
    st.check_device(dev)?;
    if flags.interprocess && flags.timing {
        return Err(DriverError::INVALID_VALUE);
    }
    let raw = st.id();
    st.events.insert(
        raw,
        FakeEvent {
            device: dev,
            flags,
            recorded: Recorded::Nowhere,
            generation: 0,
        },
    );
    Ok(EventHandle { device: dev, raw })
}

pub(super) fn event_destroy(driver: &FakeDriver, event: EventHandle) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::EventDestroy)?;
    st.event(event)?;
    st.events.remove(&event.raw);
    Ok(())
}

pub(super) fn event_record(
    driver: &FakeDriver,
    event: EventHandle,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::EventRecord)?;
    let key = st.stream_key(stream)?;
    if st.event(event)?.device != stream.device {
        return Err(DriverError::INVALID_HANDLE);
    }
    let link = st.streams.get(&key).and_then(|s| s.capture.clone());
    if let Some(link) = link {
        if st.captures.get(&link.id).is_some_and(|c| c.invalidated) {
            return Err(DriverError::STREAM_CAPTURE_INVALIDATED);
        }
        if let Some(ev) = st.events.get_mut(&event.raw) {
            ev.recorded = Recorded::Captured {
                capture: link.id,
                deps: link.deps,
            };
        }
        return Ok(());
    }
    let generation = st.events.get(&event.raw).map_or(0, |e| e.generation + 1);
    let seq = st.streams.get(&key).map_or(0, |s| s.enqueued + 1);
    if let Some(ev) = st.events.get_mut(&event.raw) {
        ev.generation = generation;
        ev.recorded = Recorded::Stream {
            stream: key,
            seq,
            generation,
            at: None,
        };
    }
    // Implicit legacy-stream waits may come first; the record is the last item.
    st.enqueue(
        key,
        Work::Record {
            event: event.raw,
            generation,
        },
    )?;
    let seq = st.streams.get(&key).map_or(seq, |s| s.enqueued);
    if let Some(FakeEvent {
        recorded: Recorded::Stream { seq: s, .. },
        ..
    }) = st.events.get_mut(&event.raw)
    {
        *s = seq;
    }
    Ok(())
}

pub(super) fn event_query(driver: &FakeDriver, event: EventHandle) -> Result<bool, DriverError> {
    let mut st = driver.enter(Call::EventQuery)?;
    st.refuse_captured_event(event, DriverError::CAPTURED_EVENT)?;
    st.check_unsafe_call()?;
    let ev = st.event(event)?;
    Ok(st.event_done(ev))
}

pub(super) fn event_synchronize(
    driver: &FakeDriver,
    event: EventHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::EventSynchronize)?;
    st.refuse_captured_event(event, DriverError::INVALID_VALUE)?;
    st.check_unsafe_call()?;
    if let Recorded::Stream { stream, seq, .. } = st.event(event)?.recorded {
        st.run(stream, Some(seq), usize::MAX, true);
        if let Some(e) = st.sticky.get(event.device.as_usize()).copied().flatten() {
            return Err(e);
        }
    }
    Ok(())
}

pub(super) fn event_elapsed_ms(
    driver: &FakeDriver,
    start: EventHandle,
    end: EventHandle,
) -> Result<f32, DriverError> {
    let st = driver.enter(Call::EventElapsed)?;
    let stamp = |e: EventHandle| -> Result<Instant, DriverError> {
        let ev = st.event(e)?;
        if !ev.flags.timing {
            return Err(DriverError::INVALID_HANDLE);
        }
        match ev.recorded {
            Recorded::Stream { at: Some(t), .. } => Ok(t),
            Recorded::Stream { at: None, .. } => Err(DriverError::NOT_READY),
            _ => Err(DriverError::INVALID_HANDLE),
        }
    };
    let (a, b) = (stamp(start)?, stamp(end)?);
    let ms = if b >= a {
        (b - a).as_secs_f64() * 1e3
    } else {
        -((a - b).as_secs_f64() * 1e3)
    };
    Ok(ms as f32)
}
