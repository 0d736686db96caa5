//! Streams on the fake device: made with their flags and priority, destroyed, queried,
//! synchronized and made to wait for events.
use super::work::Work;
use super::{Call, CaptureLink, FakeDriver, FakeStream, Recorded};
use crate::DriverError;
use ferrocuda_types::{DeviceIndex, EventHandle, StreamFlags, StreamHandle};

pub(super) fn stream_create(
    driver: &FakeDriver,
    dev: DeviceIndex,
    flags: StreamFlags,
) -> Result<StreamHandle, DriverError> {
    let mut st = driver.enter(Call::StreamCreate)?;
    st.check_device(dev)?;
    let raw = st.id();
    let flags = StreamFlags {
        priority: flags.priority.clamp(-5, 0),
        ..flags
    };
    st.streams.insert((dev.0, raw), FakeStream::new(dev, flags));
    Ok(StreamHandle { device: dev, raw })
}

pub(super) fn stream_destroy(driver: &FakeDriver, stream: StreamHandle) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::StreamDestroy)?;
    let key = st.stream_key(stream)?;
    // The legacy stream is the device's, an adopted one its maker's.
    if key.1 == 0 || st.foreign.contains_key(&key) {
        return Err(DriverError::INVALID_HANDLE);
    }
    // Work already enqueued still runs (it completes now; nothing can observe it later).
    st.run(key, None, usize::MAX, true);
    st.streams.remove(&key);
    st.busy.forget(key);
    Ok(())
}

pub(super) fn stream_query(driver: &FakeDriver, stream: StreamHandle) -> Result<bool, DriverError> {
    let mut st = driver.enter(Call::StreamQuery)?;
    let key = st.stream_key(stream)?;
    if stream.is_legacy() {
        st.refuse_legacy_beside_blocking_captures(stream.device)?;
    }
    st.refuse_if_capturing(key)?;
    st.check_unsafe_call()?;
    if let Some(e) = st.sticky.get(stream.device.as_usize()).copied().flatten() {
        return Err(e);
    }
    Ok(st.streams.get(&key).is_some_and(|s| s.queue.is_empty()))
}

pub(super) fn stream_synchronize(
    driver: &FakeDriver,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::StreamSynchronize)?;
    let key = st.stream_key(stream)?;
    if stream.is_legacy() {
        st.refuse_legacy_beside_blocking_captures(stream.device)?;
    }
    st.refuse_if_capturing(key)?;
    st.check_unsafe_call()?;
    st.drain(key)
}

pub(super) fn stream_wait_event(
    driver: &FakeDriver,
    stream: StreamHandle,
    event: EventHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::StreamWaitEvent)?;
    let key = st.stream_key(stream)?;
    let wait = match &st.event(event)?.recorded {
        Recorded::Nowhere => return Ok(()),
        Recorded::Stream {
            stream: other, seq, ..
        } => Work::Wait {
            stream: *other,
            seq: *seq,
        },
        Recorded::Captured { capture, deps } => {
            let (capture, deps) = (*capture, deps.clone());
            let s = st
                .streams
                .get_mut(&key)
                .ok_or(DriverError::INVALID_HANDLE)?;
            match s.capture.as_mut() {
                Some(link) if link.id == capture => {
                    for d in deps {
                        if !link.deps.contains(&d) {
                            link.deps.push(d);
                        }
                    }
                }
                Some(_) => return Err(DriverError::STREAM_CAPTURE_MERGE),
                None => {
                    // The stream joins the capture: a fork.
                    s.capture = Some(CaptureLink { id: capture, deps });
                    st.busy.set_capturing(key, true);
                    if let Some(c) = st.captures.get_mut(&capture) {
                        c.members.push(key);
                    }
                }
            }
            return Ok(());
        }
    };
    if st.streams.get(&key).is_some_and(|s| s.capture.is_some()) {
        // An event from outside the capture: already ordered before the capture.
        return Ok(());
    }
    st.enqueue(key, wait)
}
