//! The same program with and without the key: pointers and statistics at every step.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use super::*;

// ---- the same program with and without the key -------------------------------------------

/// One allocator of a lockstep pair.
struct Side {
    fake: Arc<FakeDriver>,
    a: CachingAllocator,
    streams: Vec<StreamHandle>,
}

fn side(capacity: u64, config: &str, fraction: f64, completion: Completion, history: bool) -> Side {
    let (fake, a) = setup(capacity, config, completion);
    if fraction < 1.0 {
        a.set_memory_fraction(fraction).unwrap();
    }
    if history {
        a.record_memory_history(
            HistoryOptions::parse(Some("all"), Some("alloc"), 100_000).unwrap(),
        );
    }
    let streams = vec![
        LEGACY,
        new_stream(&fake).unwrap(),
        new_stream(&fake).unwrap(),
    ];
    Side { fake, a, streams }
}

/// Runs a random program on both sides, comparing every result and the statistics after
/// every step; at every out-of-memory error checks the keyed side's figures against its
/// snapshot (taken on both sides, so their histories stay alike). Returns the errors seen.
fn lockstep(seed: u64, config: &str, fraction: f64, completion: Completion, steps: usize) -> usize {
    let path = temp_path(&format!("lockstep-{seed}-{}", config.len()));
    let keyed_config = if config.is_empty() {
        format!("oom_forensics:{path}")
    } else {
        format!("{config},oom_forensics:{path}")
    };
    let capacity = 256 * MIB;
    let plain = side(capacity, config, fraction, completion, seed % 2 == 1);
    let keyed = side(capacity, &keyed_config, fraction, completion, seed % 2 == 1);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut live: Vec<(DevicePtr, usize)> = Vec::new();
    let mut ooms = 0;
    for step in 0..steps {
        let what = rng.below(100);
        let ctx = format!("seed {seed} config {config:?} step {step}");
        if what < 55 || live.is_empty() {
            let bytes = match rng.below(10) {
                0..=3 => 1 + rng.below(MIB),
                4..=6 => MIB + rng.below(9 * MIB),
                7 | 8 => 10 * MIB + rng.below(50 * MIB),
                _ => 60 * MIB + rng.below(120 * MIB),
            };
            let si = rng.below(3) as usize;
            let p = plain.a.allocate(bytes, plain.streams[si]);
            let k = keyed.a.allocate(bytes, keyed.streams[si]);
            match (p, k) {
                (Ok(p), Ok(k)) => {
                    assert_eq!((p.ptr, p.size), (k.ptr, k.size), "{ctx}");
                    live.push((p.ptr, si));
                }
                (Err(AllocError::OutOfMemory(p)), Err(AllocError::OutOfMemory(k))) => {
                    ooms += 1;
                    assert!(p.forensics.is_none(), "{ctx}");
                    assert!(k.forensics.is_some(), "{ctx}: forensics with the key");
                    assert_eq!(plain_part(&k), *p, "{ctx}: PyTorch's figures");
                    if k.rejected_by_fraction {
                        // (`a_rejection_by_the_fraction_prints_the_forensics`)
                        assert!(k.to_string().starts_with(&p.to_string()), "{ctx}");
                    } else {
                        assert_message_is_pytorchs_then_forensics(&k);
                    }
                    let stream = keyed.streams[si];
                    let segments = check_against_snapshot(&keyed.a, &k);
                    let _ = plain.a.snapshot();
                    let x = k.forensics.as_deref().unwrap();
                    let expandable = segments.iter().any(|s| s.is_expandable);
                    // Blocks waiting for events: `pending_frees_*`.
                    let pending = segments
                        .iter()
                        .flat_map(|s| &s.blocks)
                        .any(|b| b.state == "active_pending_free");
                    if !expandable && !pending {
                        let want = expected_after_release(
                            &k,
                            x.releasable,
                            kept_largest(&segments, stream),
                        );
                        assert_eq!(x.largest_after_release, want, "{ctx}");
                    }
                    assert_eq!(x.snapshot, Ok(path.clone()), "{ctx}");
                    if rng.below(2) == 0 {
                        if !pending {
                            check_releasable_by_empty_cache(&keyed.a, &k);
                        } else {
                            keyed.a.empty_cache();
                        }
                        plain.a.empty_cache();
                    }
                }
                (p, k) => panic!("{ctx}: {p:?} vs {k:?}"),
            }
        } else if what < 90 {
            let i = rng.below(live.len() as u64) as usize;
            let (ptr, si) = live.swap_remove(i);
            if completion == Completion::Manual && rng.below(3) == 0 {
                // Another stream still uses it: freed behind an event.
                let other = (si + 1) % 3;
                for s in [&plain, &keyed] {
                    s.fake
                        .memset_async(ptr, MemsetValue::U8(1), 16, s.streams[other])
                        .unwrap();
                    s.a.record_stream(ptr, s.streams[other]).unwrap();
                }
            }
            plain.a.free(ptr).unwrap();
            keyed.a.free(ptr).unwrap();
        } else if what < 95 {
            if completion == Completion::Manual {
                plain.fake.advance_all();
                keyed.fake.advance_all();
            }
        } else {
            plain.a.empty_cache();
            keyed.a.empty_cache();
        }
        assert_eq!(plain.a.stats(), keyed.a.stats(), "{ctx}: statistics");
        if completion == Completion::Manual {
            for (p, k) in plain.streams.iter().zip(&keyed.streams) {
                assert_eq!(
                    plain.fake.pending(*p).unwrap(),
                    keyed.fake.pending(*k).unwrap(),
                    "{ctx}: the device's queues"
                );
            }
        }
    }
    assert_eq!(
        plain.fake.calls(Call::Malloc),
        keyed.fake.calls(Call::Malloc)
    );
    assert_eq!(plain.fake.calls(Call::Free), keyed.fake.calls(Call::Free));
    keyed.a.check_invariants().unwrap();
    ooms
}

/// Random programs on three streams, with and without the key: the same pointers,
/// statistics and PyTorch figures at every step, errors included.
#[test]
fn the_same_program_with_and_without_the_key() {
    let mut ooms = 0;
    for seed in 1..=6 {
        ooms += lockstep(seed, "", 1.0, Completion::Eager, 250);
    }
    assert!(ooms > 20, "the programs run out of memory often: {ooms}");
}

/// As above under PyTorch's other keys and ferrocuda's, some with a memory fraction.
#[test]
fn the_same_program_under_other_keys() {
    for (config, fraction) in [
        ("max_split_size_mb:20,garbage_collection_threshold:0.7", 0.8),
        ("throw_on_cudamalloc_oom:True", 0.7),
        ("cross_stream_reuse:True,oom_search_after_sync:True", 1.0),
        ("oom_release_partial:True,roundup_power2_divisions:4", 1.0),
    ] {
        let mut ooms = 0;
        for seed in 11..=13 {
            ooms += lockstep(seed, config, fraction, Completion::Eager, 200);
        }
        assert!(ooms > 5, "{config}: {ooms}");
    }
}

/// As above with expandable segments (PyTorch's and the recommended set).
#[test]
fn the_same_program_with_expandable_segments() {
    for config in ["expandable_segments:True", "ferrocuda_recommended:True"] {
        let mut ooms = 0;
        for seed in 21..=23 {
            ooms += lockstep(seed, config, 1.0, Completion::Eager, 200);
        }
        assert!(ooms > 5, "{config}: {ooms}");
    }
}

/// As above with a device that lags: blocks freed behind `record_stream` wait for events.
#[test]
fn the_same_program_with_a_lagging_device() {
    for (config, fraction) in [
        ("", 1.0),
        ("throw_on_cudamalloc_oom:True", 0.6),
        ("ferrocuda_recommended:True", 1.0),
    ] {
        for seed in 31..=33 {
            lockstep(seed, config, fraction, Completion::Manual, 200);
        }
    }
}
