//! Other streams' work, slots in flight, two devices, many threads at once and the slot bound.
use super::support::*;

/// Work pending on s1 (a kernel, a driver copy, a staged copy); then a copy on s2 with many
/// more chunks than slots (so it reuses its own slots, waiting on its own events), and a copy
/// on the legacy default stream (s1 is non-blocking): s1's pending work stays pending.
#[test]
fn a_slot_reusing_copy_never_completes_another_streams_work() -> R {
    timed("no-wait", 120, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 1);
        let m = add_one_and_fill(&rt, &fake)?;
        let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
        let f = DeviceBuffer::<f32>::uninit(&rt, D0, 1024)?;
        let small = DeviceBuffer::<u8>::uninit(&rt, D0, 1000)?;
        let first = pattern(2 * CHUNK + 1, 1);
        let x = DeviceBuffer::<u8>::uninit(&rt, D0, first.len())?;
        let big = pattern((3 * DEPTH + 2) * CHUNK + 9, 2);
        let (y, z) = (
            DeviceBuffer::<u8>::uninit(&rt, D0, big.len())?,
            DeviceBuffer::<u8>::uninit(&rt, D0, big.len())?,
        );
        rt.default_stream(D0)?.synchronize()?;
        {
            let _g = rt.stream_guard(&s1)?;
            launch_fill(&s1, &m, &f, 1.0)?;
            small.copy_from_host(&[5u8; 1000])?;
            x.copy_from_host(&first)?;
        }
        let pending = fake.pending(s1.handle())?;
        assert!(pending >= 4, "{pending}");
        {
            let _g = rt.stream_guard(&s2)?;
            y.copy_from_host(&big)?;
        }
        assert_eq!(
            fake.pending(s1.handle())?,
            pending,
            "a copy on s2 reusing its own slots completed work of s1"
        );
        z.copy_from_host(&big)?; // legacy default stream
        assert_eq!(
            fake.pending(s1.handle())?,
            pending,
            "a copy on the legacy stream completed work of (non-blocking) s1"
        );
        let _g = rt.stream_guard(&s2)?;
        assert_eq!(first_diff(&y.to_host()?, &big), None);
        drop(_g);
        assert_eq!(first_diff(&z.to_host()?, &big), None);
        let _g = rt.stream_guard(&s1)?;
        assert_eq!(first_diff(&x.to_host()?, &first), None);
        Ok(())
    })
}

/// Slots in flight on s1 (never completed) and the thread count changed at run time (4, then
/// 1): later copies on s2 never wait for s1, and land exactly.
#[test]
fn lowering_the_thread_count_with_slots_in_flight_never_waits() -> R {
    timed("lower-threads", 120, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 4);
        let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
        let big = pattern(4 * DEPTH * CHUNK, 5);
        let a = DeviceBuffer::<u8>::uninit(&rt, D0, big.len())?;
        let b = DeviceBuffer::<u8>::uninit(&rt, D0, big.len())?;
        rt.default_stream(D0)?.synchronize()?;
        {
            let _g = rt.stream_guard(&s1)?;
            a.copy_from_host(&big)?;
        }
        let pending = fake.pending(s1.handle())?;
        let made = fake.calls(Call::HostAlloc);
        StagedCopies::install(&rt, 1);
        for k in 0..3 {
            let v = pattern(big.len(), 50 + k);
            let _g = rt.stream_guard(&s2)?;
            b.copy_from_host(&v)?;
            assert_eq!(
                fake.pending(s1.handle())?,
                pending,
                "copy {k} waited for s1"
            );
            assert_eq!(first_diff(&b.to_host()?, &v), None, "copy {k}");
        }
        eprintln!(
            "observation: slots made with 4 threads: {made}; total after lowering to 1 thread \
             (bound 2×1×DEPTH = {}): {} made, {} freed",
            2 * DEPTH,
            fake.calls(Call::HostAlloc),
            fake.calls(Call::HostFree)
        );
        StagedCopies::install(&rt, 4);
        let _g = rt.stream_guard(&s1)?;
        assert_eq!(first_diff(&a.to_host()?, &big), None);
        Ok(())
    })
}

// ---- rule 6: leaks ---------------------------------------------------------------------------

/// Two devices, slots in flight on both when the runtime goes (manual completion), streams and
/// buffers dropped first: every host_alloc freed, every event destroyed, and the pending bytes
/// landed before that (checked through reads before the drop on other buffers).
#[test]
fn two_devices_with_slots_in_flight_free_everything_with_the_runtime() -> R {
    timed("leak-2dev", 120, || {
        let fake = fake_n(Completion::Manual, 2);
        let rt = runtime(&fake, 2);
        let mut keep = Vec::new();
        for (dev, chunks) in [(D0, 9usize), (D1, 5), (D1, 11), (D0, 3)] {
            let s = rt.new_stream(dev, 0)?;
            let v = pattern(chunks * CHUNK + 1, chunks);
            let b = DeviceBuffer::<u8>::uninit(&rt, dev, v.len())?;
            let _g = rt.stream_guard(&s)?;
            b.copy_from_host(&v)?;
            drop(_g);
            keep.push((s, b, v));
        }
        let made = fake.calls(Call::HostAlloc);
        assert!(
            made as usize <= 2 * 2 * 2 * DEPTH,
            "at most 2×threads×DEPTH per device: {made}"
        );
        drop(keep);
        drop(rt);
        assert_eq!(fake.calls(Call::HostFree), made, "slots freed");
        assert_eq!(
            fake.calls(Call::EventDestroy),
            fake.calls(Call::EventCreate),
            "events destroyed"
        );
        Ok(())
    })
}

// ---- rule 7 and the bound: concurrency -------------------------------------------------------

/// Many threads at once over two devices, some sharing a stream, some with their own, manual
/// completion (slots stay in flight until someone waits), 3 staging threads: every copy lands
/// exactly, no deadlock, and the slot bound per device is kept.
#[test]
fn many_threads_two_devices_shared_and_own_streams() -> R {
    timed("concurrency", 300, || {
        let fake = fake_n(Completion::Manual, 2);
        let threads = 3;
        let rt = runtime(&fake, threads);
        let shared = [rt.new_stream(D0, 0)?, rt.new_stream(D1, 0)?];
        let workers = 8;
        let barrier = Arc::new(Barrier::new(workers));
        let handles: Vec<_> = (0..workers)
            .map(|k| {
                let (rt, barrier) = (rt.clone(), barrier.clone());
                let shared = shared.clone();
                std::thread::spawn(move || -> R {
                    let dev = if k % 2 == 0 { D0 } else { D1 };
                    let stream = if k < 4 {
                        shared[k % 2].clone()
                    } else {
                        rt.new_stream(dev, 0)?
                    };
                    barrier.wait();
                    for round in 0..4 {
                        let bytes = (2 + (k + round) % 7) * CHUNK + 31 * k + round;
                        let v = pattern(bytes, 10 * k + round);
                        let b = DeviceBuffer::<u8>::uninit(&rt, dev, bytes)?;
                        let _g = rt.stream_guard(&stream)?;
                        b.copy_from_host(&v)?;
                        if round % 2 == 1 {
                            let got = b.to_host()?;
                            assert_eq!(first_diff(&got, &v), None, "thread {k} round {round}");
                        } else {
                            // Leave it in flight a while; check with the next round.
                            let w = pattern(bytes, 999 + k);
                            b.copy_from_host(&w)?;
                            assert_eq!(
                                first_diff(&b.to_host()?, &w),
                                None,
                                "thread {k} round {round} (second copy)"
                            );
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| "worker panicked")??;
        }
        let made = fake.calls(Call::HostAlloc) as usize;
        eprintln!(
            "slots made over two devices: {made} (bound {} per device)",
            2 * threads * DEPTH
        );
        assert!(
            made <= 2 * 2 * threads * DEPTH,
            "more slots than 2 devices × 2×threads×DEPTH: {made}"
        );
        Ok(())
    })
}

/// The per-device bound (2 × threads × DEPTH slots kept) while copies overlap: during copy A
/// (on s1, its slots out of the pool), copies B (s2) and C (s3) start. With one thread the
/// runtime may keep at most 8 slots, so at most 8 `host_alloc` calls may ever be made, and a
/// copy that finds none goes to the driver.
#[test]
fn overlapping_copies_keep_the_per_device_slot_bound() -> R {
    timed("bound-overlap", 60, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 1);
        let streams = [
            rt.new_stream(D0, 0)?,
            rt.new_stream(D0, 0)?,
            rt.new_stream(D0, 0)?,
        ];
        let bytes = DEPTH * CHUNK;
        let bufs = [
            Arc::new(DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?),
            Arc::new(DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?),
            Arc::new(DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?),
        ];
        let values: Vec<Vec<u8>> = (0..3).map(|k| pattern(bytes, 70 + k)).collect();
        rt.default_stream(D0)?.synchronize()?;
        let results = Arc::new(Mutex::new(Vec::new()));
        {
            // Runs on copy A's thread at its first transfer, while A holds its slots: B and C,
            // as two other threads could.
            let (rt2, results2) = (rt.clone(), results.clone());
            let (s2, s3) = (streams[1].clone(), streams[2].clone());
            let (b2, b3) = (bufs[1].clone(), bufs[2].clone());
            let (v2, v3) = (values[1].clone(), values[2].clone());
            fake.before_next(Call::MemcpyHtoDPinned, move || {
                let copy = |s: &Stream, buf: &DeviceBuffer<u8>, v: &[u8]| {
                    let _g = rt2.stream_guard(s)?;
                    buf.copy_from_host(v)
                };
                let b = copy(&s2, &b2, &v2);
                let c = copy(&s3, &b3, &v3);
                results2.lock().unwrap().push((b, c));
            });
        }
        {
            let _g = rt.stream_guard(&streams[0])?;
            bufs[0].copy_from_host(&values[0])?;
        }
        let (b, c) = results.lock().unwrap().pop().ok_or("hook did not run")?;
        b?;
        c?;
        for (k, s) in streams.iter().enumerate() {
            let _g = rt.stream_guard(s)?;
            assert_eq!(
                first_diff(&bufs[k].to_host()?, &values[k]),
                None,
                "copy {k}"
            );
        }
        let made = fake.calls(Call::HostAlloc) as usize;
        assert!(
            made <= 2 * DEPTH,
            "{made} slots made for device 0 with 1 thread; the runtime may keep at most \
             2 × 1 × DEPTH = {} (driver copies: {})",
            2 * DEPTH,
            fake.calls(Call::MemcpyHtoD)
        );
        drop(bufs);
        drop(streams);
        drop(rt);
        assert_eq!(fake.calls(Call::HostFree) as usize, made);
        Ok(())
    })
}

/// The same bound with real threads: 6 threads, each on a stream of its own, copying at once
/// (manual completion, so no slot comes back idle): slots made stay within 2 × threads × DEPTH.
#[test]
fn simultaneous_copies_from_real_threads_keep_the_bound() -> R {
    timed("bound-threads", 120, || {
        let fake = fake_n(Completion::Manual, 1);
        let rt = runtime(&fake, 1);
        let n = 6;
        let barrier = Arc::new(Barrier::new(n));
        let hs: Vec<_> = (0..n)
            .map(|k| {
                let (rt, barrier) = (rt.clone(), barrier.clone());
                std::thread::spawn(move || -> R {
                    let s = rt.new_stream(D0, 0)?;
                    let v = pattern(DEPTH * CHUNK, k);
                    let b = DeviceBuffer::<u8>::uninit(&rt, D0, v.len())?;
                    rt.default_stream(D0)?.synchronize()?;
                    barrier.wait();
                    let _g = rt.stream_guard(&s)?;
                    b.copy_from_host(&v)?;
                    assert_eq!(first_diff(&b.to_host()?, &v), None, "thread {k}");
                    Ok(())
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| "worker panicked")??;
        }
        let made = fake.calls(Call::HostAlloc) as usize;
        eprintln!("real threads: {made} slots made (bound {})", 2 * DEPTH);
        assert!(made <= 2 * DEPTH, "{made} slots made, bound {}", 2 * DEPTH);
        Ok(())
    })
}
