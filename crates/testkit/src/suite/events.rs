//! Events: query and synchronize, timing, and the errors of misuse.
use super::*;

pub fn event_query_and_synchronize(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let ev = rt.new_event(EventFlags::default())?;
    assert!(
        ev.query()? && ev.device().is_none(),
        "an unrecorded event is complete"
    );
    ev.synchronize()?;
    let s = rt.new_stream(DEV, 0)?;
    launch_spin(h, &s, 100)?;
    ev.record(&s)?;
    assert_eq!(ev.device(), Some(DEV));
    assert!(!ev.query()?, "recorded after a 100 ms kernel");
    assert!(!s.query()?);
    ev.synchronize()?;
    assert!(ev.query()? && s.query()?);
    Ok(())
}

/// The torch.cuda docs' event-timing example.
pub fn event_timing(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let timing = EventFlags {
        timing: true,
        ..EventFlags::default()
    };
    let (start, end) = (rt.new_event(timing)?, rt.new_event(timing)?);
    let s = rt.current_stream(DEV)?;
    start.record(&s)?;
    launch_spin(h, &s, 2)?;
    end.record(&s)?;
    rt.synchronize(DEV)?;
    let ms = start.elapsed_time(&end)?;
    assert!(ms > 0.2 && ms < 10_000.0, "elapsed {ms} ms");
    Ok(())
}

pub fn event_errors(h: &Harness) -> TestResult {
    let rt = &h.rt;
    let timing = EventFlags {
        timing: true,
        ..EventFlags::default()
    };
    let (a, b) = (rt.new_event(timing)?, rt.new_event(timing)?);
    assert_eq!(a.elapsed_time(&b), Err(StreamError::EventNotRecorded));
    let plain = rt.new_event(EventFlags::default())?;
    let s = rt.current_stream(DEV)?;
    plain.record(&s)?;
    a.record(&s)?;
    assert_eq!(a.elapsed_time(&plain), Err(StreamError::TimingDisabled));
    let ipc = EventFlags {
        timing: true,
        interprocess: true,
        ..EventFlags::default()
    };
    assert_eq!(
        rt.new_event(ipc).err(),
        Some(StreamError::InterprocessTiming)
    );
    let ipc_ok = rt.new_event(EventFlags {
        interprocess: true,
        ..EventFlags::default()
    })?;
    ipc_ok.record(&s)?;
    ipc_ok.synchronize()?;
    Ok(())
}
