//! Copies to pageable memory staged by threads (`DeviceBuffer::to_host`), where only the fake
//! device can show it: which driver calls a read makes, that its slots are the uploads'
//! slots, that it waits for its own stream and no other, and that a failure or a capture
//! ends it as the driver's copy ends. A read is staged only from `STAGED_READ_MIN` bytes
//! with `READ_MIN_THREADS` threads or more; below either, the driver copies. (Bytes and
//! waits on both backends: the conformance suite's `pageable_reads_staged_by_threads`.)
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

/// A buffer of `bytes` holding `values(bytes, seed)`, uploaded by the driver.
fn holding(
    rt: &Arc<Runtime>,
    bytes: usize,
    seed: usize,
) -> Result<(Vec<u8>, DeviceBuffer<u8>), Err> {
    let want = values(bytes, seed);
    let threads = rt.pageable_copy_threads();
    StagedCopies::install(rt, 0);
    let buf = DeviceBuffer::from_slice(rt, D0, &want)?;
    StagedCopies::install(rt, threads);
    Ok((want, buf))
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
    let (small, buf) = holding(&rt, STAGED_READ_MIN - 1, 1)?;
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(
        made,
        [1, 0, 0, 0],
        "below the staged read minimum: the driver"
    );
    assert!(back == small);

    // 8 whole chunks and 3 bytes: 9 chunks through the 2 × DEPTH slots of a read by 2
    // threads, one of them used twice.
    let (big, buf) = holding(&rt, STAGED_READ_MIN + 3, 2)?;
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(
        made,
        [0, 9, 9, 2 * DEPTH as u64],
        "nine chunks, each through a slot (2 × {DEPTH} made)"
    );
    assert!(back == big);
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(made, [0, 9, 9, 0], "the next read reuses the slots");
    assert!(back == big);
    let upload = values(big.len(), 3);
    let (made, ()) = counted(&fake, &[Call::HostAlloc], || buf.copy_from_host(&upload))?;
    assert_eq!(made, [0], "an upload uses the reads' slots");
    assert!(buf.to_host()? == upload);

    StagedCopies::install(&rt, 0);
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(made, [1, 0, 0, 0], "0 threads: the driver");
    assert!(back == upload);
    Ok(())
}

/// The rule itself: a read is staged only from `STAGED_READ_MIN` bytes with
/// `READ_MIN_THREADS` threads or more (below either, the driver copies), while an upload is
/// staged from `STAGED_MIN` bytes with one thread.
#[test]
fn a_read_is_staged_only_from_its_own_minimum_with_two_threads_and_an_upload_as_before() -> R {
    assert_eq!(
        (READ_MIN_THREADS, STAGED_READ_MIN, STAGED_MIN),
        (2, 8 * CHUNK, 2 * CHUNK)
    );
    let kinds = [
        Call::MemcpyDtoH,
        Call::MemcpyDtoHPinned,
        Call::MemcpyHtoD,
        Call::MemcpyHtoDPinned,
    ];
    let fake = fake_n(Completion::Eager, 1);
    let rt = runtime(&fake, READ_MIN_THREADS);
    let (below, buf) = holding(&rt, STAGED_READ_MIN - 1, 1)?;
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(
        made,
        [1, 0, 0, 0],
        "2 threads, STAGED_READ_MIN - 1 bytes: the driver"
    );
    assert!(back == below);
    let (at, buf) = holding(&rt, STAGED_READ_MIN, 2)?;
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(
        made,
        [0, 8, 0, 0],
        "2 threads, STAGED_READ_MIN bytes: staged, 8 chunks"
    );
    assert!(back == at);

    let fake = fake_n(Completion::Eager, 1);
    let rt = runtime(&fake, READ_MIN_THREADS - 1);
    let (many, buf) = holding(&rt, 3 * STAGED_READ_MIN, 3)?;
    let (made, back) = counted(&fake, &kinds, || buf.to_host())?;
    assert_eq!(
        made,
        [1, 0, 0, 0],
        "1 thread, 3 × STAGED_READ_MIN bytes: the driver"
    );
    assert!(back == many);
    assert_eq!(
        fake.calls(Call::HostAlloc),
        0,
        "1 thread: no slot made by a read"
    );
    let up = values(STAGED_MIN, 4);
    let buf = DeviceBuffer::<u8>::uninit(&rt, D0, up.len())?;
    let (made, ()) = counted(&fake, &kinds, || buf.copy_from_host(&up))?;
    assert_eq!(
        made,
        [0, 0, 0, 2],
        "1 thread, an upload of STAGED_MIN bytes: staged"
    );
    assert!(buf.to_host()? == up);
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
        let before = dtoh_calls(&fake);
        let back = {
            let _g = rt.stream_guard(&s2)?;
            b.to_host()?
        };
        let after = dtoh_calls(&fake);
        assert_eq!(after[0], before[0], "staged: no copy by the driver");
        assert!(after[1] > before[1], "staged: transfers into slots");
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
            let (_, buf) = holding(&rt, STAGED_READ_MIN, 4)?;
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
    let (values, buf) = holding(&rt, STAGED_READ_MIN + 2 * CHUNK, 5)?;
    for call in [Call::MemcpyDtoHPinned, Call::EventRecord, Call::HostRead] {
        fake.fail_nth(call, 3, DriverError::INVALID_VALUE);
        assert_eq!(
            buf.to_host().map(|got| got.len()),
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
        let (values, buf) = holding(&rt, STAGED_READ_MIN + CHUNK + 5, 6)?;
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
        let before = dtoh_calls(&fake);
        buf.copy_to_host(&mut out)?;
        let after = dtoh_calls(&fake);
        assert!(
            out == values,
            "{threads} threads: first wrong byte {:?}",
            first_diff(&out, &values)
        );
        let (driver, staged) = (after[0] - before[0], after[1] - before[1]);
        if threads == 0 {
            assert_eq!((driver, staged), (1, 0), "0 threads: the driver");
        } else {
            assert_eq!(
                (driver, staged),
                (0, 10),
                "{threads} threads: 10 chunks staged"
            );
        }
    }
    Ok(())
}

/// A read the driver does because the count is now below the reads' minimum still gives the
/// idle slots beyond the count's bound back (the count lowered from 3 to 1: 2 × 1 × DEPTH
/// kept), as a staged copy with fewer threads would.
#[test]
fn a_read_below_the_thread_minimum_gives_the_slots_beyond_its_bound_back() -> R {
    let fake = fake_n(Completion::Eager, 1);
    let rt = runtime(&fake, 3);
    let (values, buf) = holding(&rt, 6 * DEPTH * CHUNK, 7)?;
    buf.copy_from_host(&values)?;
    buf.copy_from_host(&values)?;
    let made = fake.calls(Call::HostAlloc) as usize;
    assert_eq!(made, 3 * DEPTH, "one upload's worth, kept");
    StagedCopies::install(&rt, 1);
    assert_eq!(READ_MIN_THREADS, 2);
    let before = dtoh_calls(&fake);
    assert!(buf.to_host()? == values);
    assert_eq!(
        dtoh_calls(&fake)[0] - before[0],
        1,
        "1 thread: the driver reads"
    );
    assert_eq!(
        made - fake.calls(Call::HostFree) as usize,
        2 * DEPTH,
        "the bound of 1 thread kept, the rest given back"
    );
    Ok(())
}
