//! Driver failures, slot creation, devices, many threads, and lowering the thread count.
use super::*;

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
