//! The bytes, the stream order and the source: what a staged copy leaves must be what the
//! driver's copy leaves, for every size and thread count.
use super::support::*;

// ---- rule 1: bytes -------------------------------------------------------------------------

/// Every size near the edges, for 1, 2, 3, 5 and 7 threads: the bytes land exactly, one
/// transfer per chunk (none below the staged minimum). Manual completion, so a slot reused
/// too early would show.
#[test]
fn bytes_land_exactly_for_every_size_and_thread_count() -> R {
    timed("bytes", 240, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 0);
        let s = rt.new_stream(D0, 0)?;
        for threads in [1usize, 2, 3, 5, 7] {
            StagedCopies::install(&rt, threads);
            let reuse = (threads * DEPTH + 3) * CHUNK + 5;
            for (k, bytes) in [
                STAGED_MIN - 1,
                STAGED_MIN,
                STAGED_MIN + 1,
                2 * CHUNK + CHUNK - 1,
                5 * CHUNK + 1,
                reuse,
            ]
            .into_iter()
            .enumerate()
            {
                let values = pattern(bytes, 100 * threads + k);
                let buf = DeviceBuffer::<u8>::filled(&rt, D0, bytes, 0xA5)?;
                rt.default_stream(D0)?.synchronize()?; // the fill ran (it is on another stream)
                let _g = rt.stream_guard(&s)?;
                let pinned_before = fake.calls(Call::MemcpyHtoDPinned);
                buf.copy_from_host(&values)?;
                let staged = fake.calls(Call::MemcpyHtoDPinned) - pinned_before;
                let want = if bytes >= STAGED_MIN {
                    bytes.div_ceil(CHUNK)
                } else {
                    0
                };
                assert_eq!(
                    staged as usize, want,
                    "{threads} threads, {bytes} bytes: transfers"
                );
                assert_eq!(
                    first_diff(&buf.to_host()?, &values),
                    None,
                    "{threads} threads, {bytes} bytes: first wrong byte"
                );
            }
        }
        Ok(())
    })
}

/// Typed buffers (i16 with an odd element count, f64) through `copy_from_host`: the cut into
/// chunks is by bytes, so a chunk boundary can split an element.
#[test]
fn typed_buffers_whose_elements_straddle_chunk_boundaries() -> R {
    timed("typed", 120, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 3);
        let n16 = (7 * CHUNK + 3) / 2; // an odd number of i16, 7 chunks and a bit
        let v16: Vec<i16> = (0..n16).map(|i| (i as i16).wrapping_mul(30503)).collect();
        let b16 = DeviceBuffer::<i16>::uninit(&rt, D0, n16)?;
        b16.copy_from_host(&v16)?;
        assert_eq!(b16.to_host()?, v16);
        let n64 = (9 * CHUNK) / 8 + 1;
        let v64: Vec<f64> = (0..n64).map(|i| i as f64 * 1.5 - 3.0).collect();
        let b64 = DeviceBuffer::<f64>::uninit(&rt, D0, n64)?;
        b64.copy_from_host(&v64)?;
        assert_eq!(b64.to_host()?, v64);
        assert!(fake.calls(Call::MemcpyHtoDPinned) >= 7 + 10);
        Ok(())
    })
}

// ---- rule 2: stream order ------------------------------------------------------------------

/// Ordered across three streams by the user: a fill on s1, s2 waits for s1, the (staged,
/// slot-reusing) copy on s2, an event after it, s3 waits for it and adds one. The result is
/// the copied values + 1, for 0 and for 1, 2 threads; the fill never lands after the copy.
#[test]
fn order_kept_across_streams_through_wait_stream_and_events() -> R {
    timed("order-cross", 120, || {
        for threads in [0usize, 1, 2] {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let m = add_one_and_fill(&rt, &fake)?;
            let (s1, s2, s3) = (
                rt.new_stream(D0, 0)?,
                rt.new_stream(D0, 0)?,
                rt.new_stream(D0, 0)?,
            );
            let n = (3 * DEPTH * CHUNK + 4 * 1000) / 4;
            let values: Vec<f32> = (0..n).map(|i| (i % 977) as f32).collect();
            let buf = DeviceBuffer::<f32>::uninit(&rt, D0, n)?;
            // Make sure the allocation is settled before s1 touches it.
            rt.default_stream(D0)?.synchronize()?;
            launch_fill(&s1, &m, &buf, -7.0)?;
            s2.wait_stream(&s1)?;
            {
                let _g = rt.stream_guard(&s2)?;
                buf.copy_from_host(&values)?;
            }
            let ev = s2.record_event(None)?;
            s3.wait_event(&ev)?;
            launch_add_one(&s3, &m, &buf)?;
            let back = {
                let _g = rt.stream_guard(&s3)?;
                buf.to_host()?
            };
            let wrong = back.iter().zip(&values).position(|(b, v)| *b != v + 1.0);
            assert_eq!(
                wrong.map(|i| (i, back[i], values[i] + 1.0)),
                None,
                "{threads} threads"
            );
        }
        Ok(())
    })
}

/// A kernel enqueued on the stream after the copy returns, with the stream already holding a
/// fill before the copy, and the copy going through the legacy default stream (no guard): the
/// kernel sees the copied bytes, the fill does not overwrite them.
#[test]
fn order_kept_on_the_legacy_default_stream() -> R {
    timed("order-legacy", 120, || {
        for threads in [0usize, 2] {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let m = add_one_and_fill(&rt, &fake)?;
            let s = rt.current_stream(D0)?;
            assert!(s.is_default());
            let n = (2 * DEPTH * CHUNK * 2 + 12) / 4;
            let values: Vec<f32> = (0..n).map(|i| (i % 1013) as f32 * 0.5).collect();
            let buf = DeviceBuffer::<f32>::uninit(&rt, D0, n)?;
            launch_fill(&s, &m, &buf, 3.0)?;
            buf.copy_from_host(&values)?;
            launch_add_one(&s, &m, &buf)?;
            let back = buf.to_host()?;
            let wrong = back.iter().zip(&values).position(|(b, v)| *b != v + 1.0);
            assert_eq!(wrong, None, "{threads} threads");
        }
        Ok(())
    })
}

// ---- rule 3: the source ---------------------------------------------------------------------

/// The source overwritten and then dropped right after the copy returns, with every transfer
/// still pending (manual completion): what lands is what the source held during the call.
/// With and without slot reuse within the copy, and with a second copy from the same
/// (overwritten) vector into another buffer before either stream runs.
#[test]
fn source_overwritten_and_dropped_after_return_does_not_change_the_copy() -> R {
    timed("source", 120, || {
        for (threads, chunks) in [(2usize, 3usize), (1, 3 * DEPTH + 1), (3, 2), (4, 40)] {
            let fake = fake_n(Completion::Manual, 1);
            let rt = runtime(&fake, threads);
            let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
            let bytes = chunks * CHUNK + 17;
            let mut src = pattern(bytes, chunks);
            let first = src.clone();
            let (a, b) = (
                DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?,
                DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?,
            );
            rt.default_stream(D0)?.synchronize()?;
            {
                let _g = rt.stream_guard(&s1)?;
                a.copy_from_host(&src)?;
            }
            src.iter_mut().for_each(|x| *x = !*x);
            let second = src.clone();
            {
                let _g = rt.stream_guard(&s2)?;
                b.copy_from_host(&src)?;
            }
            src.iter_mut().for_each(|x| *x = 0);
            drop(src);
            let got_a = {
                let _g = rt.stream_guard(&s1)?;
                a.to_host()?
            };
            let got_b = {
                let _g = rt.stream_guard(&s2)?;
                b.to_host()?
            };
            assert_eq!(
                first_diff(&got_a, &first),
                None,
                "{threads} threads, {chunks} chunks: first copy"
            );
            assert_eq!(
                first_diff(&got_b, &second),
                None,
                "{threads} threads, {chunks} chunks: second copy"
            );
        }
        Ok(())
    })
}

// ---- rule 4: errors -----------------------------------------------------------------------

/// A wrong length is `LengthMismatch` with staging on, for one too few and one too many, and
/// touches the driver not at all (no slot made, nothing enqueued).
#[test]
fn length_mismatch_with_staging_on_makes_no_driver_call() -> R {
    timed("length", 60, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 4);
        let n = 3 * CHUNK;
        let buf = DeviceBuffer::<u8>::uninit(&rt, D0, n)?;
        let before = [
            Call::HostAlloc,
            Call::MemcpyHtoD,
            Call::MemcpyHtoDPinned,
            Call::EventCreate,
        ]
        .map(|c| fake.calls(c));
        for len in [n - 1, n + 1, 0, 2 * n] {
            let v = vec![1u8; len];
            assert_eq!(
                buf.copy_from_host(&v),
                Err(StreamError::LengthMismatch {
                    expected: n,
                    found: len
                })
            );
        }
        let after = [
            Call::HostAlloc,
            Call::MemcpyHtoD,
            Call::MemcpyHtoDPinned,
            Call::EventCreate,
        ]
        .map(|c| fake.calls(c));
        assert_eq!(before, after);
        Ok(())
    })
}
