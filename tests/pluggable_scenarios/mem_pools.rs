use super::*;

/// `MemPool(allocator)` + `use_mem_pool`: segments from the library, routed allocations only,
/// exact statistics, segments back through `free` when the pool goes.
#[test]
fn mempool_segments_come_from_library() {
    fresh("mem_pools::mempool_segments_come_from_library", || {
        let probe = Probe::open().unwrap();
        let base_live = probe.live();
        let mut c = Checks::default();
        let rt = ferrocuda::runtime();
        ferrocuda::init().unwrap(); // statistics are empty before CUDA is initialised
        let s0 = memory::memory_stats(DEV).unwrap();
        let a = PluggableAllocator::new(host_lib());
        let pool = MemPool::new(Some(a.clone())).unwrap();
        c.check(pool.use_count().unwrap() == 1, "use_count of a new pool");
        probe.clear();
        let (x, y) = {
            let _g = memory::use_mem_pool(&pool).unwrap();
            c.check(
                pool.use_count().unwrap() == 2,
                "use_count inside use_mem_pool",
            );
            let x = DeviceBuffer::<u8>::uninit(rt, DEV, MIB as usize).unwrap();
            let y = DeviceBuffer::<u8>::uninit(rt, DEV, 5 * MIB as usize).unwrap();
            // Another thread's allocation is not routed.
            let other = std::thread::scope(|s| {
                s.spawn(|| {
                    let t = DeviceBuffer::<u8>::uninit(rt, DEV, 4096).unwrap();
                    t.ptr()
                })
                .join()
                .unwrap()
            });
            let _ = other;
            (x, y)
        };
        c.check(
            pool.use_count().unwrap() == 1,
            "use_count after use_mem_pool",
        );
        let outside = DeviceBuffer::<u8>::uninit(rt, DEV, MIB as usize).unwrap();
        let al = allocs(&probe.events());
        let sizes: Vec<u64> = al.iter().map(|a| a.size).collect();
        c.check(
            sizes == vec![2 * MIB, 20 * MIB],
            format!("library segment requests {al:?}"),
        );
        let s1 = memory::memory_stats(DEV).unwrap();
        let d = |k: &str| s1[k] - s0[k];
        // Pool: 2 + 20 MiB; default pool: one 2 MiB small segment (the other thread's 4 KiB,
        // freed, then `outside`'s 1 MiB).
        c.check(
            d("reserved_bytes.all.current") == (24 * MIB) as i64
                && d("allocated_bytes.all.current") == (7 * MIB) as i64
                && d("segment.all.current") == 3
                && d("num_device_alloc") == 3,
            format!(
                "stats deltas: reserved {} allocated {} segments {} device allocs {}",
                d("reserved_bytes.all.current"),
                d("allocated_bytes.all.current"),
                d("segment.all.current"),
                d("num_device_alloc")
            ),
        );
        for (what, p) in [("x", x.ptr().0), ("y", y.ptr().0)] {
            c.check(
                al.iter().any(|a| a.ptr <= p && p < a.ptr + a.size),
                format!("pool buffer {what} not inside a library segment"),
            );
        }
        c.check(
            !al.iter()
                .any(|a| a.ptr <= outside.ptr().0 && outside.ptr().0 < a.ptr + a.size),
            "buffer made outside use_mem_pool lies in a pool segment",
        );
        drop(x);
        drop(y);
        drop(outside);
        c.check(
            frees(&probe.events()).is_empty(),
            "block frees freed segments",
        );
        drop(pool);
        let fr = frees(&probe.events());
        let mut fs: Vec<u64> = fr.iter().map(|f| f.size).collect();
        fs.sort();
        c.check(
            fs == vec![2 * MIB, 20 * MIB],
            format!("pool drop freed {fr:?}"),
        );
        c.check(
            replay(&probe.events()).is_empty(),
            format!("replay {:?}", replay(&probe.events())),
        );
        let s2 = memory::memory_stats(DEV).unwrap();
        let d2 = |k: &str| s2[k] - s0[k];
        c.check(
            d2("reserved_bytes.all.current") == (2 * MIB) as i64
                && d2("allocated_bytes.all.current") == 0
                && d2("segment.all.current") == 1
                && d2("num_device_free") == 2,
            format!(
                "stats after pool drop: reserved {} allocated {} segments {} device frees {}",
                d2("reserved_bytes.all.current"),
                d2("allocated_bytes.all.current"),
                d2("segment.all.current"),
                d2("num_device_free")
            ),
        );
        c.check(
            a.live() == 0 && probe.live() == base_live,
            "segments not all returned",
        );
        c.done();
    });
}

/// A pool still in use keeps its segments: not through global `empty_cache` while the pool
/// is held, not when the pool object goes while a block lives; back once both are done.
#[test]
fn mempool_in_use_not_released() {
    fresh("mem_pools::mempool_in_use_not_released", || {
        let probe = Probe::open().unwrap();
        let base_live = probe.live();
        let mut c = Checks::default();
        let rt = ferrocuda::runtime();
        let a = PluggableAllocator::new(host_lib());
        let pool = MemPool::new(Some(a.clone())).unwrap();
        probe.clear();
        {
            let _g = memory::use_mem_pool(&pool).unwrap();
            let x = DeviceBuffer::<u8>::uninit(rt, DEV, 4096).unwrap();
            drop(x);
        }
        memory::empty_cache().unwrap();
        c.check(
            frees(&probe.events()).is_empty(),
            format!(
                "global empty_cache freed a held pool's segment: {:?}",
                frees(&probe.events())
            ),
        );
        let reserved = memory::memory_reserved(DEV).unwrap();
        let y = {
            let _g = memory::use_mem_pool(&pool).unwrap();
            DeviceBuffer::<u8>::uninit(rt, DEV, 4096).unwrap()
        };
        drop(pool);
        c.check(
            frees(&probe.events()).is_empty(),
            format!(
                "pool drop freed a segment with a live block: {:?}",
                frees(&probe.events())
            ),
        );
        c.check(
            memory::memory_reserved(DEV).unwrap() == reserved,
            "reserved changed while the pool's block lives",
        );
        drop(y);
        memory::empty_cache().unwrap();
        let al = allocs(&probe.events());
        let fr = frees(&probe.events());
        c.check(
            al.len() == 1 && fr.len() == 1 && fr[0].ptr == al[0].ptr && fr[0].size == al[0].size,
            format!("after the last block and empty_cache: allocs {al:?} frees {fr:?}"),
        );
        c.check(
            memory::memory_reserved(DEV).unwrap() == reserved - (2 * MIB),
            format!(
                "reserved {} vs {}",
                memory::memory_reserved(DEV).unwrap(),
                reserved
            ),
        );
        c.check(
            a.live() == 0 && probe.live() == base_live,
            "segment not returned",
        );
        c.done();
    });
}

/// A null segment from the library is out of memory: typed error, exact statistics (no
/// segment counted, one OOM), and the library not asked to free anything.
#[test]
fn mempool_null_segment_is_oom_with_exact_stats() {
    fresh(
        "mem_pools::mempool_null_segment_is_oom_with_exact_stats",
        || {
            let probe = Probe::open().unwrap();
            let mut c = Checks::default();
            let rt = ferrocuda::runtime();
            ferrocuda::init().unwrap(); // statistics are empty before CUDA is initialised
            let s0 = memory::memory_stats(DEV).unwrap();
            let null = PluggableAllocator::load(path(), "fixture_null_alloc", "fixture_host_free")
                .unwrap();
            let pool = MemPool::new(Some(null.clone())).unwrap();
            probe.clear();
            let r = {
                let _g = memory::use_mem_pool(&pool).unwrap();
                catch_unwind(AssertUnwindSafe(|| {
                    DeviceBuffer::<u8>::uninit(rt, DEV, MIB as usize).map(drop)
                }))
            };
            c.check(
                matches!(r, Ok(Err(_))),
                format!("allocation from a null pool gave {r:?}"),
            );
            if let Ok(Err(e)) = &r {
                c.check(
                    e.to_string().contains("out of memory")
                        || e.to_string().contains("Tried to allocate"),
                    format!("OOM text: {e}"),
                );
            }
            let s1 = memory::memory_stats(DEV).unwrap();
            let d = |k: &str| s1[k] - s0[k];
            c.check(
                d("reserved_bytes.all.current") == 0
                    && d("allocated_bytes.all.current") == 0
                    && d("segment.all.current") == 0
                    && d("num_device_alloc") == 0
                    && d("num_ooms") == 1,
                format!(
                    "stats deltas: reserved {} allocated {} segments {} device allocs {} ooms {}",
                    d("reserved_bytes.all.current"),
                    d("allocated_bytes.all.current"),
                    d("segment.all.current"),
                    d("num_device_alloc"),
                    d("num_ooms")
                ),
            );
            let al = allocs(&probe.events());
            c.check(
                !al.is_empty() && al.iter().all(|a| a.ptr == 0),
                format!("library allocs {al:?}"),
            );
            let after = DeviceBuffer::<u8>::uninit(rt, DEV, MIB as usize);
            c.check(after.is_ok(), "default pool unusable after a pool OOM");
            drop(after);
            drop(pool);
            c.check(
                frees(&probe.events()).is_empty(),
                "library asked to free after a null segment",
            );
            c.done();
        },
    );
}

/// Several threads routing to one library-fed pool at once: bookkeeping and statistics stay
/// exact, and everything goes back when the pool goes.
#[test]
fn mempool_concurrent_threads() {
    fresh("mem_pools::mempool_concurrent_threads", || {
        let probe = Probe::open().unwrap();
        let base_live = probe.live();
        let mut c = Checks::default();
        let rt = ferrocuda::runtime();
        ferrocuda::init().unwrap(); // statistics are empty before CUDA is initialised
        let s0 = memory::memory_stats(DEV).unwrap();
        let a = PluggableAllocator::new(host_lib());
        // One pool per thread, all fed by the same library (PyTorch refuses two
        // `use_mem_pool` of one pool at once: "already recording to mempool_id").
        let pools: Vec<MemPool> = (0..4)
            .map(|_| MemPool::new(Some(a.clone())).unwrap())
            .collect();
        {
            let _g = memory::use_mem_pool(&pools[0]).unwrap();
            let r = std::thread::scope(|s| {
                s.spawn(|| {
                    memory::use_mem_pool(&pools[0])
                        .map(drop)
                        .map_err(|e| e.to_string())
                })
                .join()
                .unwrap()
            });
            c.check(
                r.as_ref().is_err_and(|e| {
                    e.contains("beginAllocateToPool: already recording to mempool_id")
                }),
                format!("second concurrent use_mem_pool of one pool gave {r:?}"),
            );
            c.check(
                pools[0].use_count().unwrap() == 2,
                format!(
                    "use_count after a refused use_mem_pool: {:?}",
                    pools[0].use_count()
                ),
            );
        }
        probe.clear();
        let barrier = Barrier::new(4);
        let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for (t, pool) in pools.iter().enumerate() {
                let barrier = &barrier;
                let errors = &errors;
                s.spawn(move || {
                    let g = memory::use_mem_pool(pool);
                    barrier.wait();
                    let _g = match g {
                        Ok(g) => g,
                        Err(e) => {
                            errors
                                .lock()
                                .unwrap()
                                .push(format!("thread {t}: use_mem_pool: {e:?}"));
                            return;
                        }
                    };
                    let mut keep = Vec::new();
                    for i in 0..200usize {
                        let len = 512 + (t * 7919 + i * 104_729) % (3 << 20);
                        match DeviceBuffer::<u8>::uninit(rt, DEV, len) {
                            Ok(b) => keep.push(b),
                            Err(e) => {
                                errors
                                    .lock()
                                    .unwrap()
                                    .push(format!("thread {t} alloc {i}: {e}"));
                                return;
                            }
                        }
                        if keep.is_empty() {
                            continue;
                        }
                        if i % 3 == 0 {
                            keep.swap_remove(i % keep.len());
                        }
                        if keep.len() > 8 {
                            keep.remove(0);
                        }
                    }
                });
            }
        });
        let errors = errors.into_inner().unwrap();
        c.check(errors.is_empty(), format!("worker errors: {errors:?}"));
        let s1 = memory::memory_stats(DEV).unwrap();
        c.check(
            s1["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"],
            "allocated bytes not back after the threads",
        );
        let ev = probe.events();
        let al = allocs(&ev);
        c.check(
            s1["num_device_alloc"] - s0["num_device_alloc"] == al.len() as i64,
            format!(
                "num_device_alloc delta {} vs {} library allocs",
                s1["num_device_alloc"] - s0["num_device_alloc"],
                al.len()
            ),
        );
        let lib_reserved: u64 =
            al.iter().map(|a| a.size).sum::<u64>() - frees(&ev).iter().map(|f| f.size).sum::<u64>();
        c.check(
            s1["reserved_bytes.all.current"] - s0["reserved_bytes.all.current"]
                == lib_reserved as i64,
            format!(
                "reserved delta {} vs library-held {}",
                s1["reserved_bytes.all.current"] - s0["reserved_bytes.all.current"],
                lib_reserved
            ),
        );
        drop(pools);
        let ev = probe.events();
        c.check(
            allocs(&ev).len() == frees(&ev).len(),
            format!(
                "{} segment allocs vs {} frees",
                allocs(&ev).len(),
                frees(&ev).len()
            ),
        );
        let bad = replay(&ev);
        c.check(bad.is_empty(), format!("replay: {bad:?}"));
        let s2 = memory::memory_stats(DEV).unwrap();
        c.check(
            s2["reserved_bytes.all.current"] == s0["reserved_bytes.all.current"]
                && s2["segment.all.current"] == s0["segment.all.current"],
            format!(
                "reserved {} vs {}, segments {} vs {}",
                s2["reserved_bytes.all.current"],
                s0["reserved_bytes.all.current"],
                s2["segment.all.current"],
                s0["segment.all.current"]
            ),
        );
        c.check(
            a.live() == 0 && probe.live() == base_live,
            "segments not all returned",
        );
        c.done();
    });
}

/// PyTorch's `set_per_process_memory_fraction` runs `_lazy_init()` first, which runs the
/// current pluggable allocator's `init` hook (CUDA's initialisation and the allocator's are
/// one event there): the fraction hook must not be the library's first call once CUDA is
/// initialised.
#[test]
fn fraction_first_runs_init_hook() {
    fresh("mem_pools::fraction_first_runs_init_hook", || {
        let probe = Probe::open().unwrap();
        let mut c = Checks::default();
        let a =
            PluggableAllocator::new(with_hooks(host_lib(), &[Hook::Init, Hook::MemoryFraction]));
        memory::change_current_allocator(&a).unwrap();
        memory::set_per_process_memory_fraction(0.5, DEV).unwrap();
        let n = ferrocuda::runtime().device_count() as i32;
        c.check(
            probe.events()
                == vec![
                    Event::Init(n),
                    Event::MemoryFraction {
                        fraction: 0.5,
                        device: 0,
                    },
                ],
            format!(
                "calls of a first set_per_process_memory_fraction: {:?} (CUDA initialised: {})",
                probe.events(),
                ferrocuda::is_initialized()
            ),
        );
        c.done();
    });
}
