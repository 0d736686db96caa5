use super::*;

/// Once initialised (`init()`, a native allocation), the caching allocator can't be swapped.
#[test]
fn swap_refused_after_init() {
    fresh("global_choice::swap_refused_after_init", || {
        let probe = Probe::open().unwrap();
        let mut c = Checks::default();
        ferrocuda::init().unwrap();
        let a = PluggableAllocator::new(with_hooks(host_lib(), &[Hook::Init]));
        let r = memory::change_current_allocator(&a);
        c.check(
            matches!(r, Err(AllocError::AlreadyInitialized))
                && r.as_ref().unwrap_err().to_string()
                    == "Can't swap an already initialized allocator",
            format!("swap after init gave {r:?}"),
        );
        c.check(
            memory::get_allocator_backend() == "native",
            "backend changed",
        );
        let buf = DeviceBuffer::<f32>::uninit(ferrocuda::runtime(), DEV, 256);
        c.check(
            buf.is_ok(),
            format!("native allocation after refusal: {buf:?}"),
        );
        c.check(
            probe.events().is_empty(),
            format!("library called: {:?}", probe.events()),
        );
        c.check(
            memory::memory_allocated(DEV).unwrap() == 1024,
            "native stats wrong",
        );
        c.done();
    });
}

/// A statistic read before CUDA is initialised initialises nothing (PyTorch): the swap is refused only after `init`.
#[test]
fn swap_refused_after_statistic() {
    fresh("global_choice::swap_refused_after_statistic", || {
        let _probe = Probe::open().unwrap();
        // A statistic read before CUDA is initialised initialises nothing (PyTorch's
        // `memory_stats_as_nested_dict` returns {}), so the swap is still allowed; after
        // `init` it is refused.
        assert_eq!(memory::memory_allocated(DEV).unwrap(), 0);
        assert!(memory::memory_stats(DEV).unwrap().is_empty());
        ferrocuda::init().unwrap();
        let a = PluggableAllocator::new(host_lib());
        let r = memory::change_current_allocator(&a);
        assert!(
            matches!(r, Err(AllocError::AlreadyInitialized)),
            "swap after init: {r:?}"
        );
    });
}

/// The swap: once only; buffers' alloc/free reach the library with (size, device, stream)
/// and the allocation's (ptr, size, device, stream); `init` hook once; record_stream hook.
#[test]
fn swap_then_buffers_reach_library() {
    fresh("global_choice::swap_then_buffers_reach_library", || {
        let probe = Probe::open().unwrap();
        let rt = ferrocuda::runtime();
        let mut c = Checks::default();
        c.check(
            memory::get_allocator_backend() == "native",
            "backend before swap",
        );
        let a = PluggableAllocator::new(with_hooks(
            host_lib(),
            &[Hook::Init, Hook::RecordStream, Hook::Reset],
        ));
        memory::change_current_allocator(&a).unwrap();
        c.check(
            memory::get_allocator_backend() == "pluggable",
            "backend after swap",
        );
        let again = memory::change_current_allocator(&a);
        c.check(
            matches!(again, Err(AllocError::AlreadyInitialized)),
            format!("second swap {again:?}"),
        );
        let other = PluggableAllocator::new(host_lib());
        let r = memory::change_current_allocator(&other);
        c.check(
            matches!(r, Err(AllocError::AlreadyInitialized)),
            format!("swap out {r:?}"),
        );
        c.check(
            !probe.events().iter().any(|e| matches!(e, Event::Init(_))),
            format!("init hook ran at the swap: {:?}", probe.events()),
        );
        let cur = rt.current_stream(DEV).unwrap().handle().raw;
        let b = DeviceBuffer::<f32>::uninit(rt, DEV, 1000).unwrap();
        let n = rt.device_count() as i32;
        c.check(
            probe.events()
                == vec![
                    Event::Init(n),
                    Event::Alloc {
                        size: 4000,
                        device: 0,
                        stream: cur,
                        ptr: b.ptr().0,
                    },
                ],
            format!("first allocation's calls: {:?}", probe.events()),
        );
        ferrocuda::init().unwrap();
        let s = rt.new_stream(DEV, 0).unwrap();
        let sraw = s.handle().raw;
        let cbuf = {
            let _g = rt.stream_guard(&s).unwrap();
            DeviceBuffer::<u8>::uninit(rt, DEV, 100).unwrap()
        };
        b.record_stream(&s).unwrap();
        probe.clear();
        let (bp, cp) = (b.ptr().0, cbuf.ptr().0);
        drop(cbuf);
        drop(b);
        let ev_all = probe.events();
        c.check(
            frees(&ev_all)
                == vec![
                    F {
                        ptr: cp,
                        size: 100,
                        device: 0,
                        stream: sraw,
                    },
                    F {
                        ptr: bp,
                        size: 4000,
                        device: 0,
                        stream: cur,
                    },
                ],
            format!("frees {:?}", frees(&ev_all)),
        );
        c.check(a.live() == 0, format!("allocator records {}", a.live()));
        memory::empty_cache().unwrap();
        c.check(
            probe.events().contains(&Event::Reset),
            "empty_cache did not reset",
        );
        c.done();
    });
}

/// Hooks for empty_cache / memory fraction; PyTorch's "does not yet support" errors.
#[test]
fn hooks_and_unsupported_under_pluggable() {
    fresh(
        "global_choice::hooks_and_unsupported_under_pluggable",
        || {
            let probe = Probe::open().unwrap();
            let mut c = Checks::default();
            let a = PluggableAllocator::new(with_hooks(
                host_lib(),
                &[
                    Hook::Reset,
                    Hook::MemoryFraction,
                    Hook::Init,
                    Hook::RecordStream,
                ],
            ));
            memory::change_current_allocator(&a).unwrap();
            let rt = ferrocuda::runtime();
            let s = rt.new_stream(DEV, 0).unwrap();
            let b = DeviceBuffer::<u8>::uninit(rt, DEV, 64).unwrap();
            probe.clear();
            b.record_stream(&s).unwrap();
            c.check(
                probe.events()
                    == vec![Event::RecordStream {
                        ptr: b.ptr().0,
                        stream: s.handle().raw,
                    }],
                format!("record_stream calls {:?}", probe.events()),
            );
            probe.clear();
            memory::empty_cache().unwrap();
            memory::set_per_process_memory_fraction(0.25, DEV).unwrap();
            for bad in [1.5, -0.1] {
                let r = memory::set_per_process_memory_fraction(bad, DEV);
                c.check(r.is_err(), format!("fraction {bad} accepted"));
            }
            let r = memory::set_per_process_memory_fraction(0.5, DeviceIndex(3));
            c.check(r.is_err(), "fraction on a missing device accepted");
            c.check(
                probe.events()
                    == vec![
                        Event::Reset,
                        Event::MemoryFraction {
                            fraction: 0.25,
                            device: 0,
                        },
                    ],
                format!("hook calls {:?}", probe.events()),
            );
            // NaN passes torch/cuda/memory.py's range check (`fraction < 0 or fraction > 1`)
            // and the pluggable allocator checks nothing: the hook gets it, as in PyTorch.
            let r = memory::set_per_process_memory_fraction(f64::NAN, DEV);
            let nan_reached = matches!(
                probe.events().last(),
                Some(Event::MemoryFraction { fraction, device: 0 }) if fraction.is_nan()
            );
            c.check(
                r.is_ok() && nan_reached,
                format!("NaN fraction: {r:?}, hook calls {:?}", probe.events()),
            );
            probe.clear();
            let text = |f: &str| {
                format!(
                    "CUDAPluggableAllocator does not yet support {f}. If you need it, please file an issue describing your use case."
                )
            };
            let results: Vec<(&str, Result<(), AllocError>)> = vec![
                ("getDeviceStats", memory::memory_stats(DEV).map(drop)),
                ("getDeviceStats", memory::memory_allocated(DEV).map(drop)),
                (
                    "getDeviceStats",
                    memory::max_memory_allocated(DEV).map(drop),
                ),
                ("getDeviceStats", memory::memory_reserved(DEV).map(drop)),
                ("getDeviceStats", memory::max_memory_reserved(DEV).map(drop)),
                (
                    "getDeviceStats",
                    memory::memory_summary(DEV, false).map(drop),
                ),
                ("resetPeakStats", memory::reset_peak_memory_stats(DEV)),
                (
                    "resetAccumulatedStats",
                    memory::reset_accumulated_memory_stats(DEV),
                ),
                (
                    "getMemoryFraction",
                    memory::get_per_process_memory_fraction(DEV).map(drop),
                ),
                (
                    "recordHistory",
                    memory::record_memory_history(Some("all"), None, "all", 100),
                ),
                ("snapshot", memory::memory_snapshot().map(drop)),
                ("createOrIncrefPool", MemPool::new(None).map(drop)),
                (
                    "createOrIncrefPool",
                    MemPool::new(Some(a.clone())).map(drop),
                ),
            ];
            for (f, r) in results {
                c.check(
                    matches!(&r, Err(e) if e.to_string() == text(f)),
                    format!("{f}: {r:?}"),
                );
            }
            let info = memory::mem_get_info(DEV);
            c.check(info.is_ok(), format!("mem_get_info {info:?}"));
            c.check(
                probe.events().is_empty(),
                format!(
                    "unsupported calls reached the library: {:?}",
                    probe.events()
                ),
            );
            c.done();
        },
    );
}

/// Raw allocations under a pluggable allocator (`caching_allocator_alloc/delete`): the init
/// hook on a first raw allocation, double free, foreign pointer, zero and absurd sizes,
/// wrong device; buffers of an absurd length or a missing device.
#[test]
fn raw_alloc_rules_under_pluggable() {
    fresh("global_choice::raw_alloc_rules_under_pluggable", || {
        let probe = Probe::open().unwrap();
        let base_live = probe.live();
        let mut c = Checks::default();
        let rt = ferrocuda::runtime();
        let a = PluggableAllocator::new(with_hooks(host_lib(), &[Hook::Init]));
        memory::change_current_allocator(&a).unwrap();
        let p = memory::caching_allocator_alloc(256, DEV, None).unwrap();
        let ev = probe.events();
        c.check(
            matches!(ev.first(), Some(Event::Init(_))),
            format!("first allocation (raw) did not run the init hook first: {ev:?}"),
        );
        c.check(
            allocs(&ev)
                == vec![A {
                    size: 256,
                    device: 0,
                    stream: 0,
                    ptr: p.0,
                }],
            format!("raw alloc calls {ev:?}"),
        );
        probe.clear();
        memory::caching_allocator_delete(p).unwrap();
        let again = memory::caching_allocator_delete(p);
        c.check(
            matches!(&again, Err(e @ AllocError::NotAllocatedHere(_)) if e.to_string() == "Trying to free a pointer not allocated here"),
            format!("double raw free gave {again:?}"),
        );
        let foreign = memory::caching_allocator_delete(DevicePtr(0xdead_0000));
        c.check(
            matches!(foreign, Err(AllocError::NotAllocatedHere(_))),
            format!("foreign free gave {foreign:?}"),
        );
        c.check(
            frees(&probe.events()).len() == 1,
            format!("library frees {:?}", frees(&probe.events())),
        );
        // Zero bytes: no panic; what is handed out can be freed.
        let z = catch_unwind(AssertUnwindSafe(|| {
            memory::caching_allocator_alloc(0, DEV, None)
        }));
        match z {
            Ok(Ok(z)) if z.0 != 0 => c.check(
                memory::caching_allocator_delete(z).is_ok(),
                "zero-byte raw allocation not freeable",
            ),
            Ok(_) => {}
            Err(_) => c.check(false, "zero-byte raw allocation panicked"),
        }
        // Absurd sizes: typed out-of-memory.
        for bytes in [u64::MAX, 1 << 62] {
            let r = catch_unwind(AssertUnwindSafe(|| {
                memory::caching_allocator_alloc(bytes, DEV, None)
            }));
            c.check(
                matches!(r, Ok(Err(AllocError::PluggableOutOfMemory { .. }))),
                format!("raw alloc of {bytes} gave {r:?}"),
            );
        }
        let big = catch_unwind(AssertUnwindSafe(|| {
            DeviceBuffer::<u8>::uninit(rt, DEV, 1 << 60).map(drop)
        }));
        c.check(
            matches!(big, Ok(Err(_))),
            format!("buffer of 2^60 bytes gave {big:?}"),
        );
        // A length whose byte count overflows: typed error, no panic (and never a wrapped,
        // too small allocation).
        probe.clear();
        let over = catch_unwind(AssertUnwindSafe(|| {
            DeviceBuffer::<f32>::uninit(rt, DEV, (usize::MAX / 4) + 2).map(|b| b.bytes())
        }));
        c.check(
            matches!(over, Ok(Err(_))),
            format!(
                "buffer of usize::MAX/4+2 f32 (byte count overflows) gave {}; library saw {:?}",
                match &over {
                    Ok(r) => format!("{r:?}"),
                    Err(p) => format!(
                        "a panic: {:?}",
                        p.downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    ),
                },
                allocs(&probe.events())
            ),
        );
        // Wrong device: typed error, the library is not asked.
        probe.clear();
        let s0 = rt.current_stream(DEV).unwrap();
        let r1 = memory::caching_allocator_alloc(1024, DeviceIndex(5), None);
        c.check(
            r1.is_err(),
            format!("raw alloc on device 5 (no stream) gave {r1:?}"),
        );
        let r2 = memory::caching_allocator_alloc(1024, DeviceIndex(5), Some(&s0));
        c.check(
            r2.is_err(),
            format!("raw alloc on device 5 (stream of device 0) gave {r2:?}"),
        );
        let r3 = DeviceBuffer::<u8>::uninit(rt, DeviceIndex(5), 16);
        c.check(r3.is_err(), format!("buffer on device 5 gave {r3:?}"));
        let bad_dev: Vec<A> = allocs(&probe.events())
            .into_iter()
            .filter(|a| a.device != 0)
            .collect();
        c.check(
            bad_dev.is_empty(),
            format!("library asked for a missing device: {bad_dev:?}"),
        );
        if let Ok(p) = r2 {
            let _ = memory::caching_allocator_delete(p);
        }
        // Hooks absent (no Reset, no MemoryFraction): fine.
        c.check(memory::empty_cache().is_ok(), "empty_cache without hook");
        c.check(
            memory::set_per_process_memory_fraction(0.5, DEV).is_ok(),
            "fraction without hook",
        );
        c.check(a.live() == 0, format!("allocator records {}", a.live()));
        c.check(probe.live() == base_live, "library still holds memory");
        c.done();
    });
}
