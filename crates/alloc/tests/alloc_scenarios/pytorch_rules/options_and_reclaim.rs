use super::*;

// ---- 7. Options must do what they say, or be refused ------------------------------------

/// Whether `e` says clearly that `key` is not supported yet.
fn says_unsupported(e: &str, key: &str) -> bool {
    let lower = e.to_lowercase();
    e.contains(key)
        && ["not supported", "unsupported", "not implemented", "not yet"]
            .iter()
            .any(|w| lower.contains(w))
}

/// Builds an allocator with `config`: `Ok(None)` when parsing or construction refuses it
/// saying it is not supported (acceptable), `Ok(Some(..))` when it is accepted.
fn accepted(
    capacity: u64,
    config: &str,
    key: &str,
) -> Result<Option<(Arc<FakeDriver>, CachingAllocator)>, String> {
    match try_setup(capacity, config, Completion::Eager) {
        Ok(pair) => Ok(Some(pair)),
        Err(e) if says_unsupported(&e.to_string(), key) => Ok(None),
        Err(e) => Err(format!(
            "{config:?} refused without saying it is unsupported: {e}"
        )),
    }
}

/// PyTorch 2.15 (spec §3.1): with `throw_on_cudamalloc_oom:True` and a fraction, a segment
/// request over the fraction is rejected at once — no release, no retry, no sync — with
/// "Allocation was preemptively rejected" and `num_oom_rejections` +1. Either that, or the
/// option is refused as not supported yet.
///
/// 1 GiB device, fraction 0.25 (256 MiB). Cached 200 MiB on s2; 100 MiB on the legacy
/// stream: 200 + 100 > 256 → rejected (without the option PyTorch would free the cached
/// segment and succeed).
#[test]
fn d7_throw_on_cudamalloc_oom_rejects_up_front_or_is_refused() -> TestResult {
    let key = "throw_on_cudamalloc_oom";
    let Some((fake, a)) = accepted(
        GIB,
        "throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.25",
        key,
    )?
    else {
        return Ok(());
    };
    let s2 = new_stream(&fake);
    let c = a.allocate(200 * MIB, s2)?;
    a.free(c.ptr)?;
    let r = a.allocate(100 * MIB, LEGACY);
    let msg = r.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        is_oom(&r) && msg.contains("preemptively rejected"),
        "accepted but without effect: {r:?}"
    );
    assert_eq!(
        stats(
            &a,
            &[
                "num_oom_rejections",
                "num_alloc_retries",
                "num_sync_all_streams",
                "num_device_free"
            ]
        ),
        want(&[
            ("num_oom_rejections", 1),
            ("num_alloc_retries", 0),
            ("num_sync_all_streams", 0),
            ("num_device_free", 0),
        ])
    );
    Ok(())
}

/// Options with no observable effect in ferrocuda yet (no stream reserve classes, no
/// in-capture record_stream reuse; the `pinned_*` keys have theirs, tested in `host.rs`, and
/// `backend:cudaMallocAsync` selects its allocator, tested in `async_backend.rs`):
/// accepting them silently would make a user believe they work. Each must be refused by
/// `AllocatorConfig::parse`/`CachingAllocator::new` — and by `update_config` at run time —
/// with an error that says it is not supported.
#[test]
fn d7_options_without_effect_are_refused() {
    let cases = [
        ("graph_capture_record_stream_reuse", "True"),
        ("expandable_segments_reserve_by_class", "[inference:0.5]"),
    ];
    let mut silent = Vec::new();
    for (key, value) in cases {
        let config = format!("{key}:{value}");
        match accepted(GIB, &config, key) {
            Ok(None) => {}
            Ok(Some(_)) => silent.push(format!("{config}: accepted by CachingAllocator::new")),
            Err(e) => silent.push(e),
        }
        let (_, a) = setup(GIB, "");
        match a.update_config(&config) {
            Err(e) if says_unsupported(&e.to_string(), key) => {}
            Err(e) => silent.push(format!("{config}: update_config error is unclear: {e}")),
            Ok(()) => silent.push(format!("{config}: accepted by update_config")),
        }
    }
    assert!(
        silent.is_empty(),
        "options accepted with no effect:\n{}",
        silent.join("\n")
    );
}

/// `release_lock_on_cudamalloc:True` (spec §3.1): the device lock is released around
/// cudaMalloc. Either that is observable — another thread takes the allocator's lock
/// (reads the statistics) while this one is inside the driver's malloc — or the option is
/// refused.
#[test]
fn d7_release_lock_on_cudamalloc_releases_the_lock_or_is_refused() -> TestResult {
    let key = "release_lock_on_cudamalloc";
    let Some((fake, a)) = accepted(GIB, "release_lock_on_cudamalloc:True", key)? else {
        return Ok(());
    };
    let a = Arc::new(a);
    let (tx, rx) = std::sync::mpsc::channel();
    let other = a.clone();
    fake.before_next(Call::Malloc, move || {
        // Inside the driver's malloc: another thread must get the lock.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = other.stats();
            done_tx.send(()).ok();
        });
        let got = done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .is_ok();
        tx.send(got).ok();
    });
    let x = a.allocate(30 * MIB, LEGACY)?;
    assert_eq!(
        rx.recv().ok(),
        Some(true),
        "the lock was held across cudaMalloc"
    );
    a.free(x.ptr)?;
    Ok(())
}

/// `expandable_segments_reserve:0.5` (spec §4.8): each expandable segment reserves half the
/// device's memory of address space (instead of 9/8). Either that, or refused.
#[test]
fn d7_expandable_segments_reserve_sets_the_reservation_or_is_refused() -> TestResult {
    let key = "expandable_segments_reserve";
    let Some((_, a)) = accepted(
        80 * GIB,
        "expandable_segments:True,expandable_segments_reserve:0.5",
        key,
    )?
    else {
        return Ok(());
    };
    let x = a.allocate(512, LEGACY)?;
    let seg = a
        .blocks()
        .into_iter()
        .find(|b| b.ptr == x.ptr)
        .map(|b| b.segment);
    let reserved: u64 = seg.map_or(0, |s| segment_blocks(&a, s).iter().map(|b| b.size).sum());
    assert_eq!(reserved, 40 * GIB, "address space reserved for the segment");
    a.free(x.ptr)?;
    Ok(())
}

// ---- 8. Expandable page reclaim keeps exact books ---------------------------------------

/// After an out-of-memory error with `expandable_segments_reclaim`, the books still hold:
/// `check_invariants` passes, reserved bytes equal the mapped bytes of `blocks()` and of the
/// snapshot and the device's used bytes; and as PyTorch's OOM path releases every fully
/// free page (`release_cached_blocks`), only the page holding the live 2 MiB block stays.
///
/// 80 GiB device. 40 MiB (pages 0–1 of 20 MiB), 2 MiB (page 2), free the 40 MiB, then
/// 81 GiB → OOM; pages 0–1 are unmapped on the way: 20 MiB reserved.
#[test]
fn d8_reclaim_books_hold_after_an_out_of_memory_error() -> TestResult {
    let (fake, a) = setup(
        80 * GIB,
        "expandable_segments:True,expandable_segments_reclaim:True",
    );
    let x = a.allocate(40 * MIB, LEGACY)?;
    let y = a.allocate(2 * MIB, LEGACY)?;
    a.free(x.ptr)?;
    let r = a.allocate(81 * GIB, LEGACY);
    assert!(is_oom(&r), "{r:?}");
    a.check_invariants()?;
    let reserved = stat(&a, "reserved_bytes.all.current") as u64;
    let mapped: u64 = a.blocks().iter().filter(|b| b.mapped).map(|b| b.size).sum();
    let (segments, _) = a.snapshot();
    let in_snapshot: u64 = segments.iter().map(|s| s.total_size).sum();
    assert_eq!(
        (reserved, reserved, reserved),
        (mapped, in_snapshot, device_used(&fake)),
        "reserved vs (mapped blocks, snapshot, device used)"
    );
    assert_eq!(reserved, 20 * MIB, "only the live block's page stays");
    a.free(y.ptr)?;
    a.check_invariants()?;
    Ok(())
}

/// Many streams, each with its own expandable segment (and its own address reservation):
/// every request must succeed or fail with a plain out-of-memory error, never a driver
/// error such as `CUDA_ERROR_INVALID_HANDLE`. The audit used 45 000 streams; the default
/// here is 45 000 too (set `FERROCUDA_AUDIT_STREAMS` to change it).
#[test]
fn d8_many_streams_with_expandable_segments_never_hit_a_driver_error() -> TestResult {
    let streams: usize = std::env::var("FERROCUDA_AUDIT_STREAMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(45_000);
    let (fake, a) = setup(
        80 * GIB,
        "expandable_segments:True,expandable_segments_reclaim:True",
    );
    let (mut ok, mut ooms) = (0usize, 0usize);
    for i in 0..streams {
        let s = new_stream(&fake);
        match a.allocate(512, s) {
            Ok(x) => {
                ok += 1;
                a.free(x.ptr)?;
            }
            Err(AllocError::OutOfMemory(_)) => ooms += 1,
            Err(e) => panic!("stream {i} (after {ok} successes, {ooms} OOMs): {e}"),
        }
    }
    eprintln!("{streams} streams: {ok} allocations, {ooms} out-of-memory errors");
    a.check_invariants()?;
    Ok(())
}
