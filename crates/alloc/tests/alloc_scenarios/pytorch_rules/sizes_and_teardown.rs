use super::*;

// ---- 9. Sizes never overflow ---------------------------------------------------------------

/// Allocations that must each succeed or fail with an out-of-memory error; afterwards no
/// two of the live ones overlap and the books hold. `Err` describes what went wrong.
fn size_workload(a: &CachingAllocator) -> Result<(), String> {
    let sizes = [
        512,
        MIB + 1,
        5 * MIB,
        12 * MIB,
        30 * MIB,
        100 * MIB,
        3 * GIB,
    ];
    let mut live: Vec<Allocation> = Vec::new();
    for n in sizes {
        match a.allocate(n, LEGACY) {
            Ok(x) => live.push(x),
            Err(AllocError::OutOfMemory(_)) => {}
            Err(e) => return Err(format!("allocate({n}): {e}")),
        }
    }
    for (i, x) in live.iter().enumerate() {
        for y in &live[i + 1..] {
            let overlap =
                x.ptr.0 < y.ptr.0.wrapping_add(y.size) && y.ptr.0 < x.ptr.0.wrapping_add(x.size);
            if overlap || x.ptr.0.checked_add(x.size).is_none() {
                return Err(format!("live blocks overlap: {x:?} and {y:?}"));
            }
        }
    }
    a.check_invariants()?;
    for x in &live {
        a.free(x.ptr).map_err(|e| format!("free {}: {e}", x.ptr))?;
    }
    a.check_invariants()
}

/// Runs `f`, turning a panic into an `Err`.
/// Pinned requests from small to absurd: each succeeds, runs out of memory, or (past 2^63
/// bytes) is refused, and what succeeded can be freed and given back.
fn host_size_workload(a: &HostAllocator) -> Result<(), String> {
    let mut live = Vec::new();
    for n in [512, MIB + 1, 64 * MIB, 1 << 62, (1 << 63) + 1, u64::MAX] {
        match a.allocate(n, LEGACY) {
            Ok(r) if r.bytes >= n => live.push(r.addr()),
            Ok(r) => return Err(format!("allocate({n}) gave {} bytes", r.bytes)),
            Err(AllocError::Driver(e)) if e == DriverError::OUT_OF_MEMORY => {}
            Err(AllocError::HostRequestTooLarge(_)) if n > 1 << 63 => {}
            Err(e) => return Err(format!("allocate({n}): {e}")),
        }
    }
    for addr in live {
        a.free(addr).map_err(|e| e.to_string())?;
    }
    a.empty_cache().map_err(|e| e.to_string())?;
    a.check_invariants()
}

fn no_panic(what: &str, f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| format!("{what}: {e}")),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("{what}: panicked: {msg}"))
        }
    }
}

/// Every size key is range-checked: a value whose byte count does not fit (or is absurd)
/// is refused at parse time — or, for the keys the device allocator uses, the allocator
/// still works (no panic, typed errors, no overlapping blocks); for the pinned keys, the
/// host allocator likewise (no panic, and a failure is a typed error). The audit's case:
/// `large_segment_size_mb:17592186044416` (2^44 MiB = 2^64 bytes).
#[test]
fn d9_huge_size_keys_are_refused_or_harmless() {
    let values = [
        "17592186044416",       // 2^44 MiB = 2^64 bytes
        "18446744073709551615", // u64::MAX MiB
        "17592186044415",       // the largest that fits in bytes
        "9007199254740992",     // 2^53 MiB
    ];
    let device_keys = [
        "large_segment_size_mb",
        "max_split_size_mb",
        "max_non_split_rounding_mb",
    ];
    let pinned_keys = [
        "pinned_max_round_threshold_mb",
        "pinned_max_cached_size_mb",
        "pinned_reserve_segment_size_mb",
    ];
    let mut failures = Vec::new();
    for value in values {
        for key in device_keys {
            for extra in ["", ",expandable_segments:True"] {
                let config = format!("{key}:{value}{extra}");
                let Ok(parsed) = AllocatorConfig::parse(&config) else {
                    continue;
                };
                let r = no_panic(&config, || {
                    let fake = Arc::new(FakeDriver::builder().capacity(80 * GIB).build());
                    let a = CachingAllocator::new(fake, D0, parsed, Caching::On)
                        .map_err(|e| e.to_string())?;
                    size_workload(&a)
                });
                failures.extend(r.err());
            }
        }
        for key in pinned_keys {
            let config = format!("{key}:{value}");
            let Ok(parsed) = AllocatorConfig::parse(&config) else {
                continue;
            };
            let r = no_panic(&config, || {
                let fake = Arc::new(FakeDriver::builder().build());
                host_size_workload(&HostAllocator::new(fake, parsed.pinned))
            });
            failures.extend(r.err());
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// PyTorch (spec §3 step 1): a request of 1 EB or more fails at once with an out-of-memory
/// error; smaller huge requests go through the allocator and fail with one too. Sizes near
/// `u64::MAX` must never overflow (this runs in debug, where overflow panics), whatever
/// the configuration.
#[test]
fn d9_sizes_near_u64_max_fail_with_a_typed_error() {
    let configs = [
        "",
        "expandable_segments:True",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[>:16]",
        "max_split_size_mb:20",
        "max_split_size_mb:20,expandable_segments:True",
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
        "cross_stream_reuse:True",
        "expandable_segments:True,expandable_segments_reclaim:True",
    ];
    let sizes = [
        u64::MAX,
        u64::MAX - 1,
        u64::MAX - 511,
        1 << 63,
        (1 << 60) + 1,
        1 << 60,
        (1 << 60) - 1,
        (1 << 60) - 512,
        (1 << 59) + 1,
        80 * GIB + 1,
    ];
    let mut failures = Vec::new();
    for config in configs {
        let r = no_panic(config, || {
            let (_, a) = setup(80 * GIB, config);
            let keep = a.allocate(4096, LEGACY).map_err(|e| e.to_string())?;
            for n in sizes {
                match a.allocate(n, LEGACY) {
                    Err(AllocError::OutOfMemory(_)) => {}
                    other => return Err(format!("allocate({n:#x}): {other:?}")),
                }
                a.check_invariants()?;
            }
            for p in [DevicePtr(u64::MAX), DevicePtr(u64::MAX - 4095)] {
                if !matches!(a.free(p), Err(AllocError::InvalidPointer(_))) {
                    return Err(format!("free({p}) was not an invalid pointer"));
                }
                if !matches!(
                    a.record_stream(p, StreamHandle::legacy(D0)),
                    Err(AllocError::InvalidPointer(_))
                ) {
                    return Err(format!("record_stream({p}) was not an invalid pointer"));
                }
            }
            a.free(keep.ptr).map_err(|e| e.to_string())?;
            a.check_invariants()
        });
        failures.extend(r.err());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- 10. Dropping the allocator gives everything back -----------------------------------

/// Allocates a mix on two streams (one block used on the other stream too), frees it all
/// and drops the allocator: every byte, physical handle and address reservation taken
/// from the driver must have been given back.
fn drop_gives_everything_back(config: &str) {
    let (fake, a) = setup(80 * GIB, config);
    let s2 = new_stream(&fake);
    let xs: Vec<Allocation> = [
        (512, LEGACY),
        (3 * MIB, LEGACY),
        (30 * MIB, LEGACY),
        (4096, s2),
        (25 * MIB, s2),
    ]
    .into_iter()
    .map(|(n, s)| a.allocate(n, s).unwrap_or_else(|e| panic!("{e}")))
    .collect();
    a.record_stream(xs[2].ptr, s2)
        .unwrap_or_else(|e| panic!("{e}"));
    for x in &xs {
        a.free(x.ptr).unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(device_used(&fake) > 0);
    drop(a);
    let counts = |c: Call| fake.calls(c);
    assert_eq!(
        (
            device_used(&fake),
            counts(Call::Malloc) - counts(Call::Free),
            counts(Call::VmCreate) - counts(Call::VmDestroy),
            counts(Call::VmReserve) - counts(Call::VmRelease),
        ),
        (0, 0, 0, 0),
        "{config:?}: (bytes used, segments, physical handles, address reservations) \
         still held after the allocator was dropped"
    );
}

/// Dropping a `CachingAllocator` frees its cached segments (PyTorch's allocator lives for
/// the process, but a Rust value that owns device memory must give it back on drop).
#[test]
fn d10_drop_frees_cached_segments() {
    drop_gives_everything_back("");
}

/// The same with expandable segments: mapped pages released, address ranges freed.
#[test]
fn d10_drop_frees_expandable_pages_and_address_space() {
    drop_gives_everything_back("expandable_segments:True");
}

/// The same with page reclaim: spare physical pages are released too.
#[test]
fn d10_drop_frees_reclaimed_spare_pages() {
    drop_gives_everything_back("expandable_segments:True,expandable_segments_reclaim:True");
}

/// A live allocation outlives the allocator (its memory is the user's); everything else
/// goes back: a live 512 B block keeps exactly its 2 MiB segment.
#[test]
fn d10_drop_keeps_only_segments_with_live_blocks() -> TestResult {
    let (fake, a) = setup(80 * GIB, "");
    let live = a.allocate(512, LEGACY)?;
    let x = a.allocate(30 * MIB, LEGACY)?;
    a.free(x.ptr)?;
    drop(a);
    assert_ne!(live.ptr, DevicePtr(0));
    assert_eq!(device_used(&fake), 2 * MIB);
    Ok(())
}
