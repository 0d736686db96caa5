use super::*;

// ---- 6. Garbage-collection arithmetic ---------------------------------------------------

/// PyTorch (`garbage_collect_cached_blocks`): the age threshold is a double,
/// `total_age / count`; blocks with age >= threshold are freed, and a round that reaches
/// the target ends the loop. Ages: `pool.get_free_blocks_call_count - gc_count_base`, the
/// count bumped once per `get_free_block` on that pool, the base set by
/// `insert_into_blocks`.
///
/// 1 GiB device, fraction 0.5 (allowed 512 MiB), threshold 0.5 (GC above 256 MiB). Large
/// pool clock c: C 12 on s2 (c=1), A 80 (c=2), B 80 (c=3), D 100 on s2 (c=4; GC sees
/// 172 <= 256; reserved 272), free A (base 4), free C (base 4), 12 on s2 (c=5, a hit: C
/// again), free B (base 5), T 50 on s2 (c=6, miss): GC sees 272 > 256, target 16; ages
/// A 2, B 1, average 1.5 → only A is freed (80 >= 16, done). An integer average (1) would
/// free B too.
#[test]
fn d6_gc_average_age_is_a_double() -> TestResult {
    let (fake, a) = setup(
        GIB,
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
    );
    let s2 = new_stream(&fake);
    let c = a.allocate(12 * MIB, s2)?;
    let blk_a = a.allocate(80 * MIB, LEGACY)?;
    let blk_b = a.allocate(80 * MIB, LEGACY)?;
    let d = a.allocate(100 * MIB, s2)?;
    a.free(blk_a.ptr)?;
    a.free(c.ptr)?;
    let c2 = a.allocate(12 * MIB, s2)?;
    assert_eq!(c2.ptr, c.ptr, "a hit in the cache");
    a.free(blk_b.ptr)?;
    let t = a.allocate(50 * MIB, s2)?;
    assert!(segment_blocks(&a, blk_a.ptr).is_empty(), "A (age 2) freed");
    assert_eq!(
        segment_blocks(&a, blk_b.ptr).len(),
        1,
        "B (age 1 < 1.5) must stay cached"
    );
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "segment.all.current",
                "reserved_bytes.all.current"
            ]
        ),
        want(&[
            ("num_device_free", 1),
            ("segment.all.current", 4),
            ("reserved_bytes.all.current", (242 * MIB) as i64),
        ])
    );
    for p in [c2.ptr, d.ptr, t.ptr] {
        a.free(p)?;
    }
    a.check_invariants()?;
    Ok(())
}

/// PyTorch: each pool has its own clock (`get_free_blocks_call_count`); small-pool
/// searches do not age large-pool blocks.
///
/// Same device and settings as above. Live 512 B first (small segment, reserved 2). Large
/// clock c: A 100 (c=1), B 100 (c=2), D 100 on s2 (c=3; 202 <= 256), free A (base 3),
/// three 512 B requests (small-pool hits: no large tick, no GC), free B (base 3), T 50 on
/// s2 (c=4): 302 > 256, target 46; ages A 1, B 1, average 1 → both freed.
#[test]
fn d6_gc_ages_are_counted_per_pool() -> TestResult {
    let (fake, a) = setup(
        GIB,
        "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
    );
    let s2 = new_stream(&fake);
    let mut small = vec![a.allocate(512, LEGACY)?];
    let blk_a = a.allocate(100 * MIB, LEGACY)?;
    let blk_b = a.allocate(100 * MIB, LEGACY)?;
    let d = a.allocate(100 * MIB, s2)?;
    a.free(blk_a.ptr)?;
    for _ in 0..3 {
        small.push(a.allocate(512, LEGACY)?);
    }
    a.free(blk_b.ptr)?;
    let t = a.allocate(50 * MIB, s2)?;
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "segment.all.current",
                "reserved_bytes.all.current"
            ]
        ),
        want(&[
            ("num_device_free", 2),
            ("segment.all.current", 3),
            ("reserved_bytes.all.current", (152 * MIB) as i64),
        ])
    );
    for p in small.iter().map(|x| x.ptr).chain([d.ptr, t.ptr]) {
        a.free(p)?;
    }
    a.check_invariants()?;
    Ok(())
}

/// PyTorch: the clock only runs while a fraction is set and the threshold is > 0, so
/// searches made before the fraction was set age nothing.
///
/// 1 GiB device, threshold 0.5, no fraction yet. A 100, B 100, free A (base 0), two 20 MiB
/// requests on s2 (no tick, no GC: no fraction). Fraction 0.5 (GC above 256 MiB). Free B
/// (base 0). D 100 on s2 (c=1; 240 <= 256), T 50 on s2 (c=2): 340 > 256, target 84; ages
/// A 2, B 2 → both freed: reserved 140 + 50.
#[test]
fn d6_gc_clock_runs_only_with_a_fraction() -> TestResult {
    let (fake, a) = setup(GIB, "garbage_collection_threshold:0.5");
    let s2 = new_stream(&fake);
    let blk_a = a.allocate(100 * MIB, LEGACY)?;
    let blk_b = a.allocate(100 * MIB, LEGACY)?;
    a.free(blk_a.ptr)?;
    let e1 = a.allocate(20 * MIB, s2)?;
    let e2 = a.allocate(20 * MIB, s2)?;
    a.set_memory_fraction(0.5)?;
    a.free(blk_b.ptr)?;
    let d = a.allocate(100 * MIB, s2)?;
    let t = a.allocate(50 * MIB, s2)?;
    assert_eq!(
        stats(
            &a,
            &[
                "num_device_free",
                "segment.all.current",
                "reserved_bytes.all.current"
            ]
        ),
        want(&[
            ("num_device_free", 2),
            ("segment.all.current", 4),
            ("reserved_bytes.all.current", (190 * MIB) as i64),
        ])
    );
    for p in [e1.ptr, e2.ptr, d.ptr, t.ptr] {
        a.free(p)?;
    }
    a.check_invariants()?;
    Ok(())
}
