//! Copies to pageable memory staged by threads (`DeviceBuffer::to_host`), where only the fake
//! device can show it: which driver calls a read makes, that its slots are the uploads'
//! slots, that it waits for its own stream and no other, and that a failure or a capture
//! ends it as the driver's copy ends. (Bytes and waits on both backends: the conformance
//! suite's `pageable_reads_staged_by_threads`.)
use super::support::*;

/// How many calls of each kind in `calls` `f` made on `fake`, and what `f` returned.
fn counted<T>(
    fake: &FakeDriver,
    calls: &[Call],
    f: impl FnOnce() -> Result<T, StreamError>,
) -> Result<(Vec<u64>, T), StreamError> {
    let before: Vec<u64> = calls.iter().map(|&c| fake.calls(c)).collect();
    let out = f()?;
    let made = calls.iter().zip(before).map(|(&c, b)| fake.calls(c) - b);
    Ok((made.collect(), out))
}

/// A buffer of `bytes` holding `pattern(bytes, seed)`, uploaded by the driver.
fn holding(
    rt: &Arc<Runtime>,
    bytes: usize,
    seed: usize,
) -> Result<(Vec<u8>, DeviceBuffer<u8>), Err> {
    let values = pattern(bytes, seed);
    let threads = rt.pageable_copy_threads();
    StagedCopies::install(rt, 0);
    let buf = DeviceBuffer::from_slice(rt, D0, &values)?;
    StagedCopies::install(rt, threads);
    Ok((values, buf))
}

#[test]
fn a_staged_read_moves_each_chunk_through_a_slot_and_small_ones_go_to_the_driver() -> R {
    let fake = fake_n(Completion::Eager, 1);
    let rt = runtime(&fake, 2);
    let kinds = [
        Call::MemcpyDtoH,
        Call::MemcpyDtoHPinned,
        Call::HostRead,
        Call::HostAlloc,
    ];
    let (small, buf) = holding(&rt, STAGED_MIN - 1, 1)?;
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(made, [1, 0, 0, 0], "below the staged minimum: the driver");
    assert!(back == small);

    let (big, buf) = holding(&rt, 5 * CHUNK + 3, 2)?;
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(made, [0, 6, 6, 6], "six chunks, a slot each (2 × {DEPTH})");
    assert!(back == big);
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(made, [0, 6, 6, 0], "the next read reuses the slots");
    assert!(back == big);
    let upload = pattern(big.len(), 3);
    let (made, ()) = counted(&fake, &[Call::HostAlloc], || buf.copy_from_host(&upload))?;
    assert_eq!(made, [0], "an upload uses the reads' slots");
    assert!(buf.to_host()? == upload);

    StagedCopies::install(&rt, 0);
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(made, [1, 0, 0, 0], "0 threads: the driver");
    assert!(back == upload);
    Ok(())
}

/// Work pending on two streams (manual completion): a read on one returns what that
/// stream's last kernel wrote, and the other stream's work is still pending after it.
#[test]
fn a_staged_read_waits_for_its_stream_and_no_other() -> R {
    timed("read-waits", 60, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 3);
        let m = add_one_and_fill(&rt, &fake)?;
        let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
        let n = (3 * DEPTH * CHUNK + 40) / 4;
        let (a, b) = (
            DeviceBuffer::<f32>::uninit(&rt, D0, n)?,
            DeviceBuffer::<f32>::uninit(&rt, D0, n)?,
        );
        rt.default_stream(D0)?.synchronize()?;
        launch_fill(&s1, &m, &a, 1.0)?;
        launch_fill(&s2, &m, &b, 2.0)?;
        launch_add_one(&s2, &m, &b)?;
        let pending = fake.pending(s1.handle())?;
        let back = {
            let _g = rt.stream_guard(&s2)?;
            b.to_host()?
        };
        assert!(
            back.iter().all(|&v| v == 3.0),
            "the read came after s2's kernels"
        );
        assert_eq!(
            fake.pending(s1.handle())?,
            pending,
            "s1's work still pending"
        );
        let _g = rt.stream_guard(&s1)?;
        assert!(a.to_host()?.iter().all(|&v| v == 1.0));
        Ok(())
    })
}

#[test]
fn from_a_capturing_stream_a_staged_read_fails_as_the_drivers_does() -> R {
    for mode in [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ] {
        let mut outcomes = Vec::new();
        for threads in [0, 2] {
            let fake = fake_n(Completion::Eager, 1);
            let rt = runtime(&fake, threads);
            let (_, buf) = holding(&rt, 4 * CHUNK, 4)?;
            let s = rt.new_stream(D0, 0)?;
            let _g = rt.stream_guard(&s)?;
            fake.stream_begin_capture(s.handle(), mode)?;
            let read = buf.to_host().map(drop);
            let ended = fake.stream_end_capture(s.handle()).map(|g| {
                let _ = fake.graph_destroy(g);
            });
            assert_eq!(fake.calls(Call::HostAlloc), 0, "no slot made");
            outcomes.push((read, ended));
        }
        assert!(outcomes[0].0.is_err(), "{mode:?}: {outcomes:?}");
        assert_eq!(outcomes[0], outcomes[1], "{mode:?}: driver vs staged");
    }
    Ok(())
}

#[test]
fn a_failed_transfer_ends_the_read_with_the_drivers_error_and_leaks_nothing() -> R {
    let fake = fake_n(Completion::Eager, 1);
    let rt = runtime(&fake, 2);
    let (values, buf) = holding(&rt, 6 * CHUNK, 5)?;
    for call in [Call::MemcpyDtoHPinned, Call::EventRecord, Call::HostRead] {
        fake.fail_nth(call, 3, DriverError::INVALID_VALUE);
        assert_eq!(
            buf.to_host(),
            Err(StreamError::Driver(DriverError::INVALID_VALUE)),
            "{call:?}"
        );
        assert!(buf.to_host()? == values, "the read after a failed {call:?}");
    }
    drop(buf);
    drop(rt);
    assert_eq!(fake.calls(Call::HostFree), fake.calls(Call::HostAlloc));
    assert_eq!(
        fake.calls(Call::EventDestroy),
        fake.calls(Call::EventCreate)
    );
    Ok(())
}

#[test]
fn copy_to_host_checks_its_length_first_and_overwrites_every_byte() -> R {
    for threads in [0, 2] {
        let fake = fake_n(Completion::Eager, 1);
        let rt = runtime(&fake, threads);
        let (values, buf) = holding(&rt, 3 * CHUNK + 5, 6)?;
        let kinds = [
            Call::MemcpyDtoH,
            Call::MemcpyDtoHPinned,
            Call::StreamSynchronize,
        ];
        let mut short = vec![0u8; values.len() - 1];
        let before: Vec<u64> = kinds.iter().map(|&c| fake.calls(c)).collect();
        assert_eq!(
            buf.copy_to_host(&mut short),
            Err(StreamError::LengthMismatch {
                expected: values.len(),
                found: values.len() - 1
            })
        );
        let after: Vec<u64> = kinds.iter().map(|&c| fake.calls(c)).collect();
        assert_eq!(before, after, "{threads} threads: no driver call");
        let mut out: Vec<u8> = values.iter().map(|v| !v).collect();
        buf.copy_to_host(&mut out)?;
        assert_eq!(first_diff(&out, &values), None, "{threads} threads");
    }
    Ok(())
}
