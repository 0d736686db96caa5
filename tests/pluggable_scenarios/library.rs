use super::*;

/// Missing file, missing alloc/free/hook symbol, a non-library file, odd names: typed errors
/// naming what is missing, never a panic.
#[test]
fn load_errors_are_typed_and_named() {
    let _probe = Probe::open().unwrap();
    let mut c = Checks::default();
    match PluggableLibrary::load("/nonexistent/libnope.so", "a", "f") {
        Err(PluggableError::Load(m)) => c.check(
            m.contains("/nonexistent/libnope.so")
                && m.contains("cannot open shared object file: No such file or directory"),
            format!("missing file message: {m:?}"),
        ),
        other => c.check(false, format!("missing file gave {other:?}")),
    }
    match PluggableLibrary::load(path(), "nope_alloc", "fixture_host_free") {
        Err(PluggableError::MissingFunction { name, message }) => c.check(
            name == "nope_alloc" && message.contains("undefined symbol: nope_alloc"),
            format!("missing alloc: {name:?} {message:?}"),
        ),
        other => c.check(false, format!("missing alloc gave {other:?}")),
    }
    match PluggableLibrary::load(path(), "fixture_host_alloc", "nope_free") {
        Err(PluggableError::MissingFunction { name, message }) => c.check(
            name == "nope_free" && message.contains("undefined symbol: nope_free"),
            format!("missing free: {name:?} {message:?}"),
        ),
        other => c.check(false, format!("missing free gave {other:?}")),
    }
    match host_lib().with_hook(Hook::Reset, "nope_reset") {
        Err(PluggableError::MissingFunction { name, .. }) => {
            c.check(name == "nope_reset", format!("missing hook name {name:?}"))
        }
        other => c.check(false, format!("missing hook gave {other:?}")),
    }
    match PluggableAllocator::load(path(), "nope_alloc", "fixture_host_free") {
        Err(e @ AllocError::Pluggable(_)) => c.check(
            e.to_string().contains("undefined symbol: nope_alloc"),
            format!("AllocError text {e}"),
        ),
        other => c.check(false, format!("PluggableAllocator::load gave {other:?}")),
    }
    let not_a_lib = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let r = catch_unwind(AssertUnwindSafe(|| {
        PluggableLibrary::load(not_a_lib, "fixture_host_alloc", "fixture_host_free").map(drop)
    }));
    c.check(
        matches!(r, Ok(Err(PluggableError::Load(_)))),
        format!("non-library file gave {r:?}"),
    );
    for odd in ["", "fixture_host\0alloc"] {
        let r = catch_unwind(AssertUnwindSafe(|| {
            PluggableLibrary::load(path(), odd, "fixture_host_free").map(drop)
        }));
        c.check(
            matches!(r, Ok(Err(PluggableError::MissingFunction { .. }))),
            format!("alloc name {odd:?} gave {r:?}"),
        );
    }
    // Optional hooks absent: fine.
    let lib = host_lib();
    c.check(
        Hook::ALL.iter().all(|h| !lib.has_hook(*h)),
        "fresh library reports a hook",
    );
    c.done();
}

/// `raw_delete` rules, null allocations, zero bytes, base allocation, absent hooks.
#[test]
fn library_level_free_rules() {
    let probe = Probe::open().unwrap();
    let mut c = Checks::default();
    let base_live = probe.live();

    // A null from alloc: typed out-of-memory, nothing recorded; freeing 0: not allocated here.
    let null = PluggableAllocator::load(path(), "fixture_null_alloc", "fixture_host_free").unwrap();
    let r = MemoryResource::allocate(&*null, DEV, 100, legacy());
    c.check(
        r.as_ref()
            .is_err_and(|e| e.to_string().contains("100 bytes")),
        format!("null alloc gave {r:?}"),
    );
    c.check(null.live() == 0, "null allocation recorded");
    probe.clear();
    let r = null.raw_delete(DevicePtr(0));
    c.check(
        matches!(r, Err(AllocError::NotAllocatedHere(DevicePtr(0)))),
        format!("free of 0 gave {r:?}"),
    );
    c.check(
        frees(&probe.events()).is_empty(),
        "free of 0 reached the library",
    );

    // alloc/free arguments, double free, a pointer of another allocator instance.
    let a = PluggableAllocator::new(with_hooks(host_lib(), &[Hook::BaseAlloc]));
    let b = PluggableAllocator::new(host_lib());
    c.check(
        a.initialized() && a.name() == "pluggable",
        "new allocator not initialised",
    );
    probe.clear();
    let s7 = StreamHandle {
        device: DEV,
        raw: 7,
    };
    let p = a.malloc(1000, DEV, s7);
    c.check(p.0 != 0, "host alloc returned null");
    c.check(
        allocs(&probe.events())
            == vec![A {
                size: 1000,
                device: 0,
                stream: 7,
                ptr: p.0,
            }],
        format!("alloc call: {:?}", probe.events()),
    );
    let based = a.base_allocation(DevicePtr(p.0 + 100), 1);
    c.check(
        based == (p, 1000),
        format!("base_allocation with hook: {based:?}"),
    );
    let unbased = b.base_allocation(DevicePtr(p.0 + 100), 1);
    c.check(
        unbased == (DevicePtr(p.0 + 100), 1),
        format!("base_allocation without hook: {unbased:?}"),
    );
    probe.clear();
    let r = b.raw_delete(p);
    c.check(
        matches!(r, Err(AllocError::NotAllocatedHere(_))),
        format!("free through another allocator gave {r:?}"),
    );
    c.check(
        frees(&probe.events()).is_empty(),
        "foreign free reached the library",
    );
    let r = a.raw_delete(p);
    c.check(r.is_ok(), format!("free gave {r:?}"));
    let r2 = a.raw_delete(p);
    c.check(
        r2.as_ref()
            .is_err_and(|e| e.to_string() == "Trying to free a pointer not allocated here"),
        format!("double free gave {r2:?}"),
    );
    c.check(
        frees(&probe.events())
            == vec![F {
                ptr: p.0,
                size: 1000,
                device: 0,
                stream: 7,
            }],
        format!("free calls: {:?}", frees(&probe.events())),
    );

    // Zero bytes (PyTorch hands 0 to the library).
    let z = a.malloc(0, DEV, legacy());
    if z.0 != 0 {
        c.check(
            a.raw_delete(z).is_ok(),
            "free of a zero-byte allocation failed",
        );
    }
    // Hooks absent: no calls, no panic.
    probe.clear();
    b.empty_cache();
    b.set_memory_fraction(0.5, DEV);
    b.record_stream(DevicePtr(1), s7);
    b.begin_allocate_to_pool(DEV, PoolId(0, 9));
    b.end_allocate_to_pool(DEV, PoolId(0, 9));
    b.release_pool(DEV, PoolId(0, 9));
    c.check(
        probe.events().is_empty(),
        format!("absent hooks called: {:?}", probe.events()),
    );
    c.check(
        a.live() == 0 && b.live() == 0,
        "allocator still records allocations",
    );
    c.check(probe.live() == base_live, "library still holds allocations");
    c.done();
}

/// Concurrent alloc/free (frees from other threads than the allocating one) and racing
/// double frees keep the library's bookkeeping consistent.
#[test]
fn threads_keep_library_bookkeeping() {
    let probe = Probe::open().unwrap();
    let base_live = probe.live();
    let a = PluggableAllocator::new(host_lib());
    let shared: Mutex<Vec<DevicePtr>> = Mutex::new(Vec::new());
    let double_ok = Mutex::new(0usize);
    let rounds = 150;
    let barrier = Barrier::new(4);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (a, shared, barrier) = (&a, &shared, &barrier);
            s.spawn(move || {
                let stream = StreamHandle {
                    device: DEV,
                    raw: t + 1,
                };
                for i in 0..400u64 {
                    let p = a.malloc(1 + (t * 997 + i * 31) % 8192, DEV, stream);
                    assert_ne!(p.0, 0);
                    shared.lock().unwrap().push(p);
                    if i % 2 == 1 {
                        // Free someone's allocation (maybe another thread's).
                        let q = shared.lock().unwrap().pop();
                        if let Some(q) = q {
                            a.raw_delete(q).unwrap();
                        }
                    }
                }
                barrier.wait();
                loop {
                    let q = shared.lock().unwrap().pop();
                    match q {
                        Some(q) => a.raw_delete(q).unwrap(),
                        None => break,
                    }
                }
            });
        }
    });
    // Racing double frees: exactly one wins.
    let race = Barrier::new(2);
    for _ in 0..rounds {
        let p = a.malloc(256, DEV, legacy());
        std::thread::scope(|s| {
            for _ in 0..2 {
                let (a, race, double_ok) = (&a, &race, &double_ok);
                s.spawn(move || {
                    race.wait();
                    if a.raw_delete(p).is_ok() {
                        *double_ok.lock().unwrap() += 1;
                    }
                });
            }
        });
    }
    let ev = probe.events();
    let mut c = Checks::default();
    let wins = *double_ok.lock().unwrap();
    c.check(
        wins == rounds,
        format!("racing double frees: {wins} successes for {rounds} rounds"),
    );
    c.check(
        a.live() == 0,
        format!("allocator still records {}", a.live()),
    );
    c.check(
        probe.live() == base_live,
        format!("library live {} vs {base_live}", probe.live()),
    );
    c.check(
        allocs(&ev).len() == frees(&ev).len(),
        format!("{} allocs vs {} frees", allocs(&ev).len(), frees(&ev).len()),
    );
    let bad = replay(&ev);
    c.check(
        bad.is_empty(),
        format!("log replay: {:?}", &bad[..bad.len().min(5)]),
    );
    c.done();
}

/// A caching allocator's private pool fed by the library: segments from `alloc`, back
/// through `free` on `emptyCache(pool)` and when the caching allocator goes; exact stats.
#[test]
fn caching_allocator_pool_segment_source() {
    let probe = Probe::open().unwrap();
    let base_live = probe.live();
    let mut c = Checks::default();
    let h = ferrocuda_testkit::fake_harness();
    let ca = CachingAllocator::new(
        h.rt.driver().clone(),
        DEV,
        AllocatorConfig::default(),
        Caching::On,
    )
    .unwrap();
    let a = PluggableAllocator::new(host_lib());
    let pool = PoolId::handle();
    ca.create_pool_with_allocator(pool, a.clone()).unwrap();
    let again = ca.create_pool_with_allocator(pool, a.clone());
    c.check(
        matches!(again, Err(AllocError::Pool(_))),
        format!("second create gave {again:?}"),
    );
    probe.clear();
    ca.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
        .unwrap();
    let x = ca.allocate(MIB, legacy()).unwrap();
    let y = ca.allocate(3 * MIB, legacy()).unwrap();
    ca.end_allocate_to_pool(pool).unwrap();
    // `use_mem_pool`'s finally: the routing's user goes (begin added one).
    ca.release_pool(pool).unwrap();
    c.check(
        ca.pool_use_count(pool) == Some(1),
        format!("use count {:?}", ca.pool_use_count(pool)),
    );
    let z = ca.allocate(MIB, legacy()).unwrap();
    let al = allocs(&probe.events());
    let sizes: Vec<u64> = al.iter().map(|a| a.size).collect();
    c.check(
        sizes == vec![2 * MIB, 20 * MIB],
        format!("segment sizes from library {sizes:?}"),
    );
    c.check(
        al.iter().all(|a| a.device == 0 && a.stream == 0),
        format!("segment alloc args {al:?}"),
    );
    let st = ca.stats();
    c.check(
        st.reserved_bytes.all.current == (24 * MIB) as i64
            && st.allocated_bytes.all.current == (5 * MIB) as i64
            && st.segment.all.current == 3
            && st.num_device_alloc == 3,
        format!(
            "stats: reserved {} allocated {} segments {} device allocs {}",
            st.reserved_bytes.all.current,
            st.allocated_bytes.all.current,
            st.segment.all.current,
            st.num_device_alloc
        ),
    );
    for p in [x.ptr, y.ptr, z.ptr] {
        ca.free(p).unwrap();
    }
    c.check(
        frees(&probe.events()).is_empty(),
        "freeing blocks freed segments",
    );
    ca.release_pool(pool).unwrap();
    ca.empty_cache_pool(pool);
    let fr = frees(&probe.events());
    let mut fsizes: Vec<u64> = fr.iter().map(|f| f.size).collect();
    fsizes.sort();
    c.check(
        fsizes == vec![2 * MIB, 20 * MIB],
        format!("segments freed {fr:?}"),
    );
    let st = ca.stats();
    c.check(
        st.reserved_bytes.all.current == (2 * MIB) as i64
            && st.segment.all.current == 1
            && st.num_device_free == 2
            && st.allocated_bytes.all.current == 0,
        format!(
            "stats after pool release: reserved {} segments {} device frees {}",
            st.reserved_bytes.all.current, st.segment.all.current, st.num_device_free
        ),
    );
    // The allocator goes: the segments of a still-held pool go back through `free`.
    let pool2 = PoolId::handle();
    ca.create_pool_with_allocator(pool2, a.clone()).unwrap();
    ca.begin_allocate_to_pool(pool2, Route::Thread(std::thread::current().id()))
        .unwrap();
    let w = ca.allocate(4096, legacy()).unwrap();
    ca.end_allocate_to_pool(pool2).unwrap();
    ca.release_pool(pool2).unwrap();
    ca.free(w.ptr).unwrap();
    probe.clear();
    drop(ca);
    let fr = frees(&probe.events());
    c.check(
        fr.len() == 1 && fr[0].size == 2 * MIB,
        format!("dropping the caching allocator freed {fr:?}"),
    );
    c.check(
        a.live() == 0,
        format!("pluggable allocator still records {}", a.live()),
    );
    c.check(probe.live() == base_live, "library still holds segments");
    c.done();
}
