//! Bytes, stream order, and slots lent to another stream's upload.
use super::*;

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
