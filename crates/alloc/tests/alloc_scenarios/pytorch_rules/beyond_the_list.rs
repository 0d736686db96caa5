use super::*;

// ---- Beyond the audit list -----------------------------------------------------------------

/// PyTorch: the 1 EB guard is a `TORCH_CHECK_WITH(OutOfMemoryError, …)` in
/// `NativeCachingAllocator::malloc`/`allocate`, before the device allocator: it raises but
/// counts nothing (`num_ooms` stays 0) and calls no OOM observer.
#[test]
fn extra_one_exabyte_guard_counts_no_oom() -> TestResult {
    let (_, a) = setup(GIB, "");
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = seen.clone();
    a.add_oom_observer(Arc::new(move |_| {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }));
    let r = a.allocate(1 << 60, LEGACY);
    assert_eq!(
        r.err().map(|e| e.to_string()).as_deref(),
        Some("CUDA out of memory. Tried to allocate more than 1EB memory.")
    );
    assert_eq!(
        (
            stat(&a, "num_ooms"),
            seen.load(std::sync::atomic::Ordering::Relaxed)
        ),
        (0, 0),
        "(num_ooms, observer calls)"
    );
    Ok(())
}

/// Oracle class A: `free_block` applies the net change of `inactive_split` once (its merges
/// subtract, a result still split adds, then one `increase` or `decrease`), so a free that
/// merges one split neighbour and stays split moves no block count at all.
#[test]
fn oracle_a_free_block_applies_the_net_inactive_split_change() -> TestResult {
    let (_, a) = setup(GIB, "");
    let k = 512 * 1024;
    // One 2 MiB small segment: a | b | c | free tail. The first split counts 1.
    let x = a.allocate(k, LEGACY)?;
    let y = a.allocate(k, LEGACY)?;
    let _z = a.allocate(k, LEGACY)?;
    // Freeing x: no merge, still split: +1 (increase).
    a.free(x.ptr)?;
    // Freeing y: merges x (-1, -512 KiB), still split (+1, +1 MiB): net 0 blocks, +512 KiB.
    a.free(y.ptr)?;
    for (key, value) in [
        ("inactive_split.all.current", 2),
        ("inactive_split.all.allocated", 2),
        ("inactive_split.all.freed", 0),
        ("inactive_split_bytes.all.current", (k + 2 * k) as i64),
        // 1.5 MiB (first split) + 512 KiB (x) + 512 KiB (y's net)
        ("inactive_split_bytes.all.allocated", (3 * k + k + k) as i64),
        // the tail shrank twice by 512 KiB
        ("inactive_split_bytes.all.freed", (2 * k) as i64),
    ] {
        assert_eq!(stat(&a, key), value, "{key}");
    }
    Ok(())
}

/// Oracle class B: PyTorch's `map_block` merges the range it mapped with both free
/// neighbours, so a free block right after a hole that gets mapped joins the new block.
/// Segment (20 MiB pages): [free a][unmapped][free c][d]; a 30 MiB request takes a, maps
/// the hole and merges c: one 60 MiB block, 30 MiB handed out, 30 MiB left free in one
/// piece, which a second 30 MiB request takes without mapping anything.
#[test]
fn oracle_b_a_mapped_hole_merges_the_free_block_after_it() -> TestResult {
    let (_, al) = setup(GIB, "expandable_segments:True");
    let page = 20 * MIB;
    let a = al.allocate(page, LEGACY)?;
    let b = al.allocate(page, LEGACY)?;
    let c = al.allocate(page, LEGACY)?;
    let _d = al.allocate(page, LEGACY)?;
    assert_eq!(c.ptr.0, a.ptr.0 + 2 * page);
    al.free(b.ptr)?;
    al.empty_cache(); // b's page is unmapped: a hole
    al.free(a.ptr)?;
    al.free(c.ptr)?;
    let maps = stat(&al, "num_device_alloc");
    let x = al.allocate(30 * MIB, LEGACY)?;
    assert_eq!(x.ptr, a.ptr);
    assert_eq!(stat(&al, "num_device_alloc"), maps + 1);
    let y = al.allocate(30 * MIB, LEGACY)?;
    assert_eq!(
        y.ptr.0,
        a.ptr.0 + 30 * MIB,
        "the rest of a, the hole and c is one block"
    );
    assert_eq!(
        stat(&al, "num_device_alloc"),
        maps + 1,
        "nothing more mapped"
    );
    al.check_invariants()?;
    Ok(())
}

/// Oracle class C: `alloc_block` checks the memory fraction against the allocation size
/// (`get_allocation_size`) before trying expandable segments, not against the pages the
/// request would map. With 100 MiB allowed, 80 MiB mapped and a 10 MiB free tail, a 25 MiB
/// request (26 MiB allocation size: 106 MiB > 100) runs out of memory in PyTorch although
/// one more 20 MiB page would fit.
#[test]
fn oracle_c_expandable_growth_is_checked_against_the_allocation_size() -> TestResult {
    let (_, al) = setup(GIB, "expandable_segments:True");
    al.set_memory_fraction(100.0 / 1024.0)?;
    let _x = al.allocate(70 * MIB, LEGACY)?;
    assert_eq!(stat(&al, "reserved_bytes.all.current"), 80 * MIB as i64);
    let r = al.allocate(25 * MIB, LEGACY);
    assert!(is_oom(&r), "{r:?}");
    assert_eq!(stat(&al, "reserved_bytes.all.current"), 80 * MIB as i64);
    // 11 MiB (12 MiB allocation size: 92 MiB) passes the check and maps a whole page.
    let _y = al.allocate(11 * MIB, LEGACY)?;
    assert_eq!(stat(&al, "reserved_bytes.all.current"), 100 * MIB as i64);
    al.check_invariants()?;
    Ok(())
}
