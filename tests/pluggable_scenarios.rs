//! Scenarios for pluggable allocators ("in" direction, written by an independent audit),
//! judged by PyTorch's
//! `CUDAPluggableAllocator` / `change_current_allocator` / `MemPool(allocator=...)` rules.
//!
//! Scenarios that touch the process-wide allocator choice run in a fresh process each: the
//! test re-executes this binary with `--exact NAME` and `FERROCUDA_PLUGGABLE_SCENARIO=NAME` (fake
//! backend). The others use the library-level API in-process, serialised by the fixture's
//! `Probe`.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ferrocuda::alloc::{AllocError, Caching, CachingAllocator, PluggableAllocator, Route};
use ferrocuda::driver::{Hook, PluggableError, PluggableLibrary};
use ferrocuda::memory::{self, MemPool};
use ferrocuda::stream::{DeviceBuffer, MemoryResource};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, DevicePtr, PoolId, StreamHandle};
use ferrocuda_pluggable_fixture::{Event, HOOK_FUNCTIONS, Probe, path};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Command;
use std::sync::{Barrier, Mutex};

const DEV: DeviceIndex = DeviceIndex(0);
const CHILD: &str = "FERROCUDA_PLUGGABLE_SCENARIO";
const MIB: u64 = 1 << 20;

// ---- helpers -------------------------------------------------------------------------------

/// Runs `body` in a fresh process of this test binary (fake backend, default allocator
/// configuration); in that process, runs it.
fn fresh(name: &str, body: impl FnOnce()) {
    match std::env::var(CHILD) {
        Ok(n) if n == name => return body(),
        Ok(_) => return,
        Err(_) => {}
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .env("FERROCUDA_BACKEND", "fake")
        .env_remove("FERROCUDA_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("FERROCUDA_NO_CUDA_MEMORY_CACHING")
        .env_remove("PYTORCH_NO_CUDA_MEMORY_CACHING")
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && so.contains("1 passed"),
        "scenario {name} failed in its own process ({}):\n--- stdout\n{so}\n--- stderr\n{se}",
        out.status
    );
}

/// Collects failed checks so that one scenario reports all of them.
#[derive(Default)]
struct Checks(Vec<String>);

impl Checks {
    fn check(&mut self, ok: bool, what: impl Into<String>) {
        if !ok {
            self.0.push(what.into());
        }
    }
    fn done(self) {
        assert!(
            self.0.is_empty(),
            "{} check(s) failed:\n  - {}",
            self.0.len(),
            self.0.join("\n  - ")
        );
    }
}

fn host_lib() -> PluggableLibrary {
    PluggableLibrary::load(path(), "fixture_host_alloc", "fixture_host_free").unwrap()
}

fn with_hooks(mut lib: PluggableLibrary, hooks: &[Hook]) -> PluggableLibrary {
    for (h, name) in Hook::ALL.iter().zip(HOOK_FUNCTIONS) {
        if hooks.contains(h) {
            lib = lib.with_hook(*h, name).unwrap();
        }
    }
    lib
}

#[derive(Copy, Clone, Debug, PartialEq)]
struct A {
    size: u64,
    device: i32,
    stream: u64,
    ptr: u64,
}
#[derive(Copy, Clone, Debug, PartialEq)]
struct F {
    ptr: u64,
    size: u64,
    device: i32,
    stream: u64,
}

fn allocs(ev: &[Event]) -> Vec<A> {
    ev.iter()
        .filter_map(|e| match *e {
            Event::Alloc {
                size,
                device,
                stream,
                ptr,
            } => Some(A {
                size,
                device,
                stream,
                ptr,
            }),
            _ => None,
        })
        .collect()
}

fn frees(ev: &[Event]) -> Vec<F> {
    ev.iter()
        .filter_map(|e| match *e {
            Event::Free {
                ptr,
                size,
                device,
                stream,
            } => Some(F {
                ptr,
                size,
                device,
                stream,
            }),
            _ => None,
        })
        .collect()
}

/// Replays the log: every alloc of a fresh address, every free of a live one with the
/// alloc's size, device and stream. Returns the problems.
fn replay(ev: &[Event]) -> Vec<String> {
    let mut live: BTreeMap<u64, (u64, i32, u64)> = BTreeMap::new();
    let mut bad = Vec::new();
    for e in ev {
        match *e {
            Event::Alloc {
                size,
                device,
                stream,
                ptr,
            } if ptr != 0 && live.insert(ptr, (size, device, stream)).is_some() => {
                bad.push(format!("address {ptr:#x} handed out while live"));
            }
            Event::Free {
                ptr,
                size,
                device,
                stream,
            } => match live.remove(&ptr) {
                None => bad.push(format!("free of {ptr:#x}, not live in the library")),
                Some(m) if m != (size, device, stream) => bad.push(format!(
                    "free of {ptr:#x} with {:?}, allocated with {m:?}",
                    (size, device, stream)
                )),
                Some(_) => {}
            },
            _ => {}
        }
    }
    bad
}

fn legacy() -> StreamHandle {
    StreamHandle::legacy(DEV)
}

// ---- library level -------------------------------------------------------------------------

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

// ---- the global allocator, a fresh process each --------------------------------------------

/// Once initialised (`init()`, a native allocation), the caching allocator can't be swapped.
#[test]
fn swap_refused_after_init() {
    fresh("swap_refused_after_init", || {
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
    fresh("swap_refused_after_statistic", || {
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
    fresh("swap_then_buffers_reach_library", || {
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
    fresh("hooks_and_unsupported_under_pluggable", || {
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
    });
}

/// Raw allocations under a pluggable allocator (`caching_allocator_alloc/delete`): the init
/// hook on a first raw allocation, double free, foreign pointer, zero and absurd sizes,
/// wrong device; buffers of an absurd length or a missing device.
#[test]
fn raw_alloc_rules_under_pluggable() {
    fresh("raw_alloc_rules_under_pluggable", || {
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

/// `MemPool(allocator)` + `use_mem_pool`: segments from the library, routed allocations only,
/// exact statistics, segments back through `free` when the pool goes.
#[test]
fn mempool_segments_come_from_library() {
    fresh("mempool_segments_come_from_library", || {
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
    fresh("mempool_in_use_not_released", || {
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
    fresh("mempool_null_segment_is_oom_with_exact_stats", || {
        let probe = Probe::open().unwrap();
        let mut c = Checks::default();
        let rt = ferrocuda::runtime();
        ferrocuda::init().unwrap(); // statistics are empty before CUDA is initialised
        let s0 = memory::memory_stats(DEV).unwrap();
        let null =
            PluggableAllocator::load(path(), "fixture_null_alloc", "fixture_host_free").unwrap();
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
    });
}

/// Several threads routing to one library-fed pool at once: bookkeeping and statistics stay
/// exact, and everything goes back when the pool goes.
#[test]
fn mempool_concurrent_threads() {
    fresh("mempool_concurrent_threads", || {
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
    fresh("fraction_first_runs_init_hook", || {
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
