//! Several errors, the key at run time, paths, 1 EB, caching off, threads.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use super::*;

// ---- several errors, the key at run time, paths --------------------------------------------

/// Several errors in a row: each has its figures and the file is overwritten with the
/// latest state each time.
#[test]
fn several_errors_in_a_row_overwrite_the_snapshot() {
    let path = temp_path("several");
    let (fake, a) = setup(
        128 * MIB,
        &format!("oom_forensics:{path}"),
        Completion::Eager,
    );
    a.record_memory_history(HistoryOptions::parse(Some("all"), Some("all"), 1000).unwrap());
    let side = new_stream(&fake).unwrap();
    let mut live = Vec::new();
    for round in 0..4u64 {
        live.push(a.allocate((20 + 5 * round) * MIB, LEGACY).unwrap());
        live.push(a.allocate(300_000, side).unwrap());
        let r = oom(a.allocate(120 * MIB, if round % 2 == 0 { LEGACY } else { side }));
        let x = r.forensics.clone().unwrap();
        assert_eq!(x.snapshot, Ok(path.clone()));
        let segments = check_against_snapshot(&a, &r);
        let written = Snapshot::from_pickle(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            written.segments, segments,
            "round {round}: the latest state"
        );
        let ooms = written.device_traces[0]
            .iter()
            .filter(|e| e.action == "oom")
            .count();
        assert_eq!(ooms as u64, round + 1, "round {round}");
        assert_eq!(stat(&a, "num_ooms"), round as i64 + 1);
    }
}

/// The key set at run time, kept by a re-parse that does not name it, refused as `True`
/// (nothing changing), moved to another path, and turned off.
#[test]
fn the_key_at_run_time() {
    let (_, a) = setup(64 * MIB, "", Completion::Eager);
    let live = a.allocate(50 * MIB, LEGACY).unwrap();
    assert!(oom(a.allocate(30 * MIB, LEGACY)).forensics.is_none());
    let first = temp_path("runtime-1");
    a.update_config(&format!("oom_forensics:{first}")).unwrap();
    let r = oom(a.allocate(30 * MIB, LEGACY));
    assert_eq!(r.forensics.unwrap().snapshot, Ok(first.clone()));
    a.update_config("max_split_size_mb:40").unwrap();
    let r = oom(a.allocate(30 * MIB, LEGACY));
    assert_eq!(r.forensics.unwrap().snapshot, Ok(first.clone()), "kept");
    for bad in [
        "oom_forensics:True",
        "oom_forensics:",
        "max_split_size_mb:40,oom_forensics:True",
    ] {
        assert!(a.update_config(bad).is_err(), "{bad}");
    }
    assert_eq!(
        a.config().release.oom_forensics.as_deref(),
        Some(first.as_str())
    );
    let r = oom(a.allocate(30 * MIB, LEGACY));
    assert_eq!(r.forensics.unwrap().snapshot, Ok(first.clone()));
    let second = temp_path("runtime-2");
    a.update_config(&format!("oom_forensics:{second}")).unwrap();
    let r = oom(a.allocate(30 * MIB, LEGACY));
    assert_eq!(r.forensics.unwrap().snapshot, Ok(second.clone()));
    a.update_config("oom_forensics:False").unwrap();
    let r = oom(a.allocate(30 * MIB, LEGACY));
    assert!(r.forensics.is_none());
    let (_, plain) = setup(64 * MIB, "max_split_size_mb:40", Completion::Eager);
    let _p = plain.allocate(50 * MIB, LEGACY).unwrap();
    let pr = oom(plain.allocate(30 * MIB, LEGACY));
    assert_eq!(r.to_string(), pr.to_string(), "PyTorch's message alone");
    std::fs::remove_file(&second).unwrap();
    let _ = oom(a.allocate(30 * MIB, LEGACY));
    assert!(
        !std::path::Path::new(&second).exists(),
        "off: nothing written"
    );
    let _ = live;
}

/// `oom_forensics:False` given with other keys after the key was on, in one string.
#[test]
fn false_beside_other_keys_turns_it_off() {
    let path = temp_path("false-beside");
    let c = AllocatorConfig::parse(&format!("oom_forensics:{path},oom_forensics:False"));
    // Either a duplicate-key error or the last one wins; never on.
    if let Ok(c) = c {
        assert_eq!(c.release.oom_forensics, None);
    }
    let mut c = AllocatorConfig::parse(&format!("oom_forensics:{path}")).unwrap();
    c.update("expandable_segments:True,oom_forensics:False")
        .unwrap();
    assert_eq!(c.release.oom_forensics, None);
}

/// Paths with dots, `..`, a relative-looking tail: written exactly where named.
#[test]
fn paths_with_dots_are_written_where_named() {
    let dir = temp_dir("dots");
    std::fs::create_dir_all(dir.join("sub.d")).unwrap();
    let path = format!("{}/sub.d/../.oom.v1.2.pickle", dir.display());
    let (_, a) = setup(
        64 * MIB,
        &format!("oom_forensics:{path}"),
        Completion::Eager,
    );
    let _x = a.allocate(40 * MIB, LEGACY).unwrap();
    let r = oom(a.allocate(40 * MIB, LEGACY));
    assert_eq!(r.forensics.unwrap().snapshot, Ok(path.clone()));
    let bytes = std::fs::read(dir.join(".oom.v1.2.pickle")).unwrap();
    Snapshot::from_pickle(&bytes).unwrap();
}

/// A path with a space is the path named (or refused when parsed): never silently another
/// path.
#[test]
fn a_path_with_a_space_is_not_changed() {
    let dir = temp_dir("space");
    std::fs::create_dir_all(dir.join("my dir")).unwrap();
    let path = format!("{}/my dir/oom file.pickle", dir.display());
    match AllocatorConfig::parse(&format!("oom_forensics:{path}")) {
        Err(_) => {}
        Ok(c) => {
            assert_eq!(
                c.release.oom_forensics.as_deref(),
                Some(path.as_str()),
                "the path as named"
            );
        }
    }
}

/// Other characters the configuration string treats specially (`[`, `]`) and a `False` in
/// another case: refused, or the path as named.
#[test]
fn brackets_and_lowercase_false_are_refused_or_kept() {
    for path in [
        "/tmp/ferrocuda-oom[1].pickle",
        "/tmp/a]b.pickle",
        "false",
        "FALSE",
    ] {
        match AllocatorConfig::parse(&format!("oom_forensics:{path}")) {
            Err(_) => {}
            Ok(c) => assert_eq!(
                c.release.oom_forensics.as_deref(),
                Some(path),
                "{path}: the path as named"
            ),
        }
    }
}

/// A path that names a folder, and a folder that does not exist: said in the forensics, the
/// error still PyTorch's out of memory with the figures.
#[test]
fn unwritable_paths_are_said() {
    let dir = temp_dir("unwritable");
    for path in [
        dir.to_string_lossy().into_owned(),
        format!("{}/missing/oom.pickle", dir.display()),
        "/proc/ferrocuda-oom.pickle".to_string(),
    ] {
        let (_, a) = setup(
            64 * MIB,
            &format!("oom_forensics:{path}"),
            Completion::Eager,
        );
        let _x = a.allocate(40 * MIB, LEGACY).unwrap();
        let r = oom(a.allocate(40 * MIB, LEGACY));
        let x = r.forensics.as_deref().expect("forensics");
        assert!(
            matches!(&x.snapshot, Err(why) if why.contains(&path)),
            "{x:?}"
        );
        assert_message_is_pytorchs_then_forensics(&r);
        assert!(r.to_string().contains("no snapshot: "));
        check_against_snapshot(&a, &r);
    }
}

// ---- 1 EB, caching off, threads ------------------------------------------------------------

/// A request of 1 EB or more: no forensics, PyTorch's message alone, nothing written; just
/// below, the forensics come.
#[test]
fn one_exabyte_gets_no_forensics() {
    let path = temp_path("exabyte");
    let (_, a) = setup(
        64 * MIB,
        &format!("oom_forensics:{path}"),
        Completion::Eager,
    );
    let (_, plain) = setup(64 * MIB, "", Completion::Eager);
    for n in [1u64 << 60, (1 << 60) + 1, u64::MAX] {
        let r = oom(a.allocate(n, LEGACY));
        assert!(r.beyond_one_exabyte);
        assert!(r.forensics.is_none(), "{n}");
        assert_eq!(r.to_string(), oom(plain.allocate(n, LEGACY)).to_string());
    }
    assert!(!std::path::Path::new(&path).exists(), "nothing written");
    for n in [(1u64 << 60) - 1, (1 << 60) - (1 << 21), 40 * MIB * 1000] {
        let r = oom(a.allocate(n, LEGACY));
        assert!(!r.beyond_one_exabyte);
        assert!(r.forensics.is_some(), "{n}");
        assert_message_is_pytorchs_then_forensics(&r);
        assert_eq!(*oom(plain.allocate(n, LEGACY)), plain_part(&r));
    }
    assert_eq!(a.stats(), plain.stats());
}

/// Caching off (`*_NO_CUDA_MEMORY_CACHING=1`): an out-of-memory error still has the
/// forensics after PyTorch's unchanged message; no cached memory, nothing releasable, the
/// live allocations listed; the same pointers and statistics as without the key.
#[test]
fn caching_off() {
    let path = temp_path("nocache");
    let build = |config: &str| {
        let fake = Arc::new(FakeDriver::builder().capacity(64 * MIB).build());
        let config = AllocatorConfig::parse(config).unwrap();
        let a = CachingAllocator::new(fake.clone(), D0, config, Caching::Off).unwrap();
        (fake, a)
    };
    let (_, a) = build(&format!("oom_forensics:{path}"));
    let (_, plain) = build("");
    let mut live = Vec::new();
    for n in [10 * MIB, 3 * MIB, 20 * MIB, 1000, 5 * MIB, 7 * MIB, 7 * MIB] {
        let x = a.allocate(n, LEGACY).unwrap();
        assert_eq!(x.ptr, plain.allocate(n, LEGACY).unwrap().ptr);
        live.push(x);
    }
    let r = oom(a.allocate(30 * MIB, LEGACY));
    let p = oom(plain.allocate(30 * MIB, LEGACY));
    assert_eq!(plain_part(&r), *p);
    assert_eq!(a.stats(), plain.stats());
    let x = r.forensics.as_deref().expect("forensics with caching off");
    assert_message_is_pytorchs_then_forensics(&r);
    assert!(x.free.is_empty(), "{x:?}");
    assert_eq!(x.releasable, 0);
    assert_eq!(x.largest_after_release, r.device_free);
    let mut want: Vec<(u64, u64)> = live.iter().map(|l| (l.size, l.ptr.0)).collect();
    want.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    want.truncate(5);
    let got: Vec<(u64, u64)> = x.largest_live.iter().map(|b| (b.size, b.ptr)).collect();
    assert_eq!(got, want);
}

/// Errors on several threads at once: none deadlocks, each carries the forensics and a
/// written snapshot, and the file left is a whole snapshot.
#[test]
fn concurrent_errors_on_several_threads() {
    let path = temp_path("threads");
    let (fake, a) = setup(GIB, &format!("oom_forensics:{path}"), Completion::Eager);
    a.record_memory_history(HistoryOptions::parse(Some("all"), Some("alloc"), 10_000).unwrap());
    let a = Arc::new(a);
    let streams: Vec<_> = (0..6).map(|_| new_stream(&fake).unwrap()).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = streams
        .into_iter()
        .enumerate()
        .map(|(t, stream)| {
            let a = a.clone();
            let tx = tx.clone();
            let path = path.clone();
            std::thread::spawn(move || {
                let mut errors = 0;
                for round in 0..15 {
                    let mut mine = Vec::new();
                    loop {
                        match a.allocate((24 + t as u64 + round) * MIB, stream) {
                            Ok(x) => mine.push(x.ptr),
                            Err(AllocError::OutOfMemory(r)) => {
                                let x = r.forensics.as_deref().expect("forensics");
                                assert_eq!(x.snapshot, Ok(path.clone()));
                                assert_message_is_pytorchs_then_forensics(&r);
                                errors += 1;
                                break;
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                    for p in mine {
                        a.free(p).unwrap();
                    }
                }
                tx.send(errors).unwrap();
            })
        })
        .collect();
    drop(tx);
    let mut total = 0;
    for _ in 0..handles.len() {
        total += rx
            .recv_timeout(std::time::Duration::from_secs(300))
            .expect("no deadlock: every thread finishes");
    }
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(total, 6 * 15);
    let written = Snapshot::from_pickle(&std::fs::read(&path).unwrap());
    assert!(written.is_ok(), "a whole snapshot: {written:?}");
    a.check_invariants().unwrap();
}

/// The key changes no driver call before an error: the same mallocs, frees, event queries
/// and synchronizations, and a rejection leaves blocks waiting for events as they were.
#[test]
fn no_extra_synchronization_at_a_rejection() {
    let run = |config: &str| {
        let (fake, a) = setup(128 * MIB, config, Completion::Manual);
        let s0 = new_stream(&fake).unwrap();
        let s1 = new_stream(&fake).unwrap();
        a.set_memory_fraction(0.5).unwrap();
        let x = a.allocate(40 * MIB, s0).unwrap();
        fake.memset_async(x.ptr, MemsetValue::U8(1), 16, s1)
            .unwrap();
        a.record_stream(x.ptr, s1).unwrap();
        a.free(x.ptr).unwrap();
        let r = oom(a.allocate(40 * MIB, s0));
        let calls: Vec<u64> = [
            Call::EventSynchronize,
            Call::StreamSynchronize,
            Call::DeviceSynchronize,
            Call::Malloc,
            Call::Free,
        ]
        .into_iter()
        .map(|c| fake.calls(c))
        .collect();
        let pending = fake.pending(s1).unwrap();
        let stats = a.stats();
        let next = a.allocate(4 * MIB, s0).unwrap().ptr;
        (r, calls, pending, stats, next, a)
    };
    let path = temp_path("sync");
    let (plain, pc, pp, ps, pn, _) = run("throw_on_cudamalloc_oom:True");
    let (keyed, kc, kp, ks, kn, a) = run(&format!(
        "throw_on_cudamalloc_oom:True,oom_forensics:{path}"
    ));
    assert!(keyed.rejected_by_fraction);
    assert_eq!(plain_part(&keyed), *plain);
    assert_eq!(
        (pp, &ps, pn),
        (kp, &ks, kn),
        "device queue, statistics, next pointer"
    );
    assert_eq!(pc, kc, "driver calls");
    let _ = a;
}

/// A block freed behind `record_stream` whose event has not completed: `empty_cache` waits
/// for it and gives its whole segment back, so it is releasable.
#[test]
fn pending_frees_are_releasable() {
    let path = temp_path("pending");
    let (fake, a) = setup(
        128 * MIB,
        &format!("throw_on_cudamalloc_oom:True,oom_forensics:{path}"),
        Completion::Manual,
    );
    let s0 = new_stream(&fake).unwrap();
    let s1 = new_stream(&fake).unwrap();
    a.set_memory_fraction(0.5).unwrap(); // 64 MiB
    let x = a.allocate(40 * MIB, s0).unwrap();
    fake.memset_async(x.ptr, MemsetValue::U8(1), 16, s1)
        .unwrap();
    a.record_stream(x.ptr, s1).unwrap();
    a.free(x.ptr).unwrap();
    let r = oom(a.allocate(40 * MIB, s0));
    assert!(r.rejected_by_fraction);
    let f = r.forensics.clone().unwrap();
    // `empty_cache` waits for the event, then gives the 40 MiB segment back; a 64 MiB
    // request then fits the fraction.
    assert_eq!(f.releasable, 40 * MIB, "{f:?}");
    assert_eq!(f.largest_after_release, 64 * MIB, "{f:?}");
    check_releasable_by_empty_cache(&a, &r);
}

/// A block waiting for an event between a live block and a free one: after `empty_cache`
/// (which waits for events) they form one free block, which it keeps.
#[test]
fn pending_frees_merge_into_the_kept_block() {
    let path = temp_path("pending-merge");
    let (fake, a) = setup(
        80 * MIB,
        &format!("throw_on_cudamalloc_oom:True,oom_forensics:{path}"),
        Completion::Manual,
    );
    let s0 = new_stream(&fake).unwrap();
    let s1 = new_stream(&fake).unwrap();
    a.set_memory_fraction(0.5).unwrap(); // 40 MiB
    let _live = a.allocate(8 * MIB, s0).unwrap();
    let b = a.allocate(7 * MIB, s0).unwrap(); // 5 MiB free at the segment's end
    fake.memset_async(b.ptr, MemsetValue::U8(1), 16, s1)
        .unwrap();
    a.record_stream(b.ptr, s1).unwrap();
    a.free(b.ptr).unwrap();
    let _fill = a.allocate(20 * MIB, s0).unwrap(); // 40 MiB reserved: the fraction's limit
    let r = oom(a.allocate(12 * MIB, s0));
    assert!(r.rejected_by_fraction);
    let x = r.forensics.clone().unwrap();
    assert_eq!(x.releasable, 0);
    assert_eq!(x.largest_after_release, 12 * MIB, "{}", brief(&x));
    a.empty_cache();
    let again = a.allocate(12 * MIB, s0).unwrap();
    assert_eq!(again.ptr, b.ptr, "the merged block, kept by empty_cache");
}

/// `largest_after_release` looks at the failed request's stream and the default pool only:
/// a larger kept block on another stream or in a private pool does not count.
#[test]
fn largest_after_release_is_the_failed_streams() {
    let path = temp_path("kept");
    let (fake, a) = setup(
        100 * MIB,
        &format!("oom_forensics:{path}"),
        Completion::Eager,
    );
    let side = new_stream(&fake).unwrap();
    // LEGACY: a 20 MiB segment with 6 MiB free at its end; `side`: 14 MiB free at the end.
    let l: Vec<_> = (0..2)
        .map(|_| a.allocate(7 * MIB, LEGACY).unwrap())
        .collect();
    let s = a.allocate(6 * MIB, side).unwrap();
    // A retained pool with a live block and 16 MiB free on LEGACY.
    let pool = PoolId::handle();
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
        .unwrap();
    let p = a.allocate(4 * MIB, LEGACY).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    let fill = a.allocate(40 * MIB, LEGACY).unwrap(); // 100 MiB reserved: the device is full
    let r = oom(a.allocate(12 * MIB, LEGACY));
    let x = r.forensics.clone().unwrap();
    let segments = check_against_snapshot(&a, &r);
    assert_eq!((r.device_free, x.releasable), (0, 0));
    assert_eq!(kept_largest(&segments, LEGACY), 6 * MIB);
    assert_eq!(x.largest_after_release, 6 * MIB, "{x:?}");
    let r = oom(a.allocate(16 * MIB, side));
    let x = r.forensics.clone().unwrap();
    assert_eq!(x.largest_after_release, 14 * MIB, "{x:?}");
    let _ = (l, s, p, fill);
}

/// The out-of-memory observers see PyTorch's figures, as without the key
/// (docs/serving_memory.md).
#[test]
fn observers_see_pytorchs_figures() {
    let path = temp_path("observer");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (_, a) = setup(
        64 * MIB,
        &format!("oom_forensics:{path}"),
        Completion::Eager,
    );
    let sink = seen.clone();
    a.add_oom_observer(Arc::new(move |r: &OutOfMemory| {
        sink.lock().unwrap().push(r.clone());
    }));
    let _x = a.allocate(40 * MIB, LEGACY).unwrap();
    let r = oom(a.allocate(40 * MIB, LEGACY));
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0], plain_part(&r));
}

/// The allocator of a second device: the snapshot written holds that device's segments and
/// its history (with its `oom` entry) under that device's index, as PyTorch's
/// `_dump_snapshot` lays them out.
#[test]
fn a_second_devices_snapshot() {
    let path = temp_path("device1");
    let fake = Arc::new(FakeDriver::builder().devices(2).capacity(64 * MIB).build());
    let d1 = ferrocuda_types::DeviceIndex(1);
    let config = AllocatorConfig::parse(&format!("oom_forensics:{path}")).unwrap();
    let a = CachingAllocator::new(fake.clone(), d1, config, Caching::On).unwrap();
    a.record_memory_history(HistoryOptions::parse(Some("all"), Some("all"), 1000).unwrap());
    let legacy1 = StreamHandle::legacy(d1);
    let _x = a.allocate(40 * MIB, legacy1).unwrap();
    let r = oom(a.allocate(40 * MIB, legacy1));
    assert_eq!(r.device, 1);
    let segments = check_against_snapshot(&a, &r);
    let written = Snapshot::from_pickle(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(written.segments, segments);
    assert!(written.segments.iter().all(|s| s.device == 1));
    assert!(
        written
            .device_traces
            .get(1)
            .is_some_and(|t| t.iter().any(|e| e.action == "oom")),
        "device 1's history at index 1: {} lists",
        written.device_traces.len()
    );
}

/// The history after an error: the key adds exactly one `snapshot` entry (the snapshot it
/// writes) right after each `oom` entry, and nothing else. (Ambiguity reported: the rules
/// promise identical pointers and statistics, not an identical trace.)
#[test]
fn the_history_differs_only_by_the_written_snapshot() {
    let path = temp_path("history");
    let run = |config: &str| {
        let (_, a) = setup(64 * MIB, config, Completion::Eager);
        a.record_memory_history(HistoryOptions::parse(Some("all"), None, 1000).unwrap());
        let x = a.allocate(40 * MIB, LEGACY).unwrap();
        let _ = oom(a.allocate(40 * MIB, LEGACY));
        let _ = oom(a.allocate(30 * MIB, LEGACY));
        a.free(x.ptr).unwrap();
        let (_, trace) = a.snapshot();
        // (A `snapshot` entry's size is the active bytes.)
        trace
            .iter()
            .map(|e| (e.action.clone(), e.addr, e.size))
            .collect::<Vec<_>>()
    };
    let plain = run("");
    let keyed = run(&format!("oom_forensics:{path}"));
    let mut expected = Vec::new();
    for e in &plain {
        expected.push(e.clone());
        if e.0 == "oom" {
            expected.push(("snapshot".to_string(), 0, 40 * MIB));
        }
    }
    assert_eq!(keyed, expected);
}

/// Errors on several threads while another turns the key on and off: no deadlock, and each
/// error is either PyTorch's message alone (no forensics) or followed by the forensics.
#[test]
fn errors_while_the_key_is_toggled() {
    let path = temp_path("toggle");
    let (fake, a) = setup(256 * MIB, "", Completion::Eager);
    let a = Arc::new(a);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let toggler = {
        let (a, stop, path) = (a.clone(), stop.clone(), path.clone());
        std::thread::spawn(move || {
            let mut on = false;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                on = !on;
                let c = if on {
                    format!("oom_forensics:{path}")
                } else {
                    "oom_forensics:False".to_string()
                };
                a.update_config(&c).unwrap();
                std::thread::yield_now();
            }
        })
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let workers: Vec<_> = (0..3)
        .map(|t| {
            let (a, tx) = (a.clone(), tx.clone());
            let stream = new_stream(&fake).unwrap();
            std::thread::spawn(move || {
                let (mut with, mut without) = (0, 0);
                for round in 0..30u64 {
                    let mut mine = Vec::new();
                    loop {
                        match a.allocate((30 + t + round % 7) * MIB, stream) {
                            Ok(x) => mine.push(x.ptr),
                            Err(AllocError::OutOfMemory(r)) => {
                                if r.forensics.is_some() {
                                    assert_message_is_pytorchs_then_forensics(&r);
                                    with += 1;
                                } else {
                                    assert!(!r.to_string().contains(HEADER));
                                    without += 1;
                                }
                                break;
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                    for p in mine {
                        a.free(p).unwrap();
                    }
                }
                tx.send((with, without)).unwrap();
            })
        })
        .collect();
    drop(tx);
    let mut total = 0;
    for _ in 0..workers.len() {
        let (w, wo) = rx
            .recv_timeout(std::time::Duration::from_secs(300))
            .expect("no deadlock");
        total += w + wo;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    toggler.join().unwrap();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(total, 90);
    a.check_invariants().unwrap();
}
