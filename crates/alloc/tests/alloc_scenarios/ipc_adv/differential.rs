use super::*;

/// One allocation of the program: its pointers in both runs, its sends not yet given back,
/// whether the producer freed it, whether it was ever shared.
struct Live {
    x: DevicePtr,
    y: DevicePtr,
    tag: u8,
    open: usize,
    freed: bool,
    shared: bool,
    /// When it entered the limbo (collections free in that order, as PyTorch's limbo).
    limbo_seq: u64,
    /// Used on the side stream (`record_stream`).
    uses: bool,
}

/// A random program run on `shared` (with shares, consumers, and the allocator's own
/// collections) and on `reference` (no shares): the reference frees a shared block exactly
/// when the shared run's collection frees it, seen as the limbo shrinking, which may happen
/// only at a free of a shared block, an allocation, or `ipc_collect`, and then must free
/// every given-back block.
fn implicit_differential(conf: &str, seed: u64, fraction: bool) -> (u32, u32) {
    let fake = Arc::new(FakeDriver::default());
    let twin = Arc::new(FakeDriver::default());
    let shared = allocator(&fake, conf);
    let consumer = allocator(&fake, conf);
    let reference = allocator(&twin, conf);
    if fraction {
        shared.set_memory_fraction(0.003).unwrap();
        reference.set_memory_fraction(0.003).unwrap();
    }
    let s_side = fake.stream_create(D0, Default::default()).unwrap();
    let t_side = twin.stream_create(D0, Default::default()).unwrap();
    let mut rng = Rng(seed);
    let mut blocks: BTreeMap<u64, Live> = BTreeMap::new(); // by id
    let mut next_id = 0u64;
    // (block id, message, received block if opened)
    let mut sends: Vec<(u64, SharedMessage, Option<ferrocuda_alloc::ReceivedBlock>)> = Vec::new();
    let (mut implicit, mut ooms) = (0, 0);
    for step in 0..500 {
        let mut limbo_before = limbo(&shared);
        let mut eligible: Vec<(u64, u64)> = blocks
            .iter()
            .filter(|(_, b)| b.freed && b.open == 0)
            .map(|(&id, b)| (b.limbo_seq, id))
            .collect();
        eligible.sort_unstable();
        let eligible: Vec<u64> = eligible.into_iter().map(|(_, id)| id).collect();
        let op = rng.below(20);
        // What the op did about the limbo: None = must not collect; Some(extra) = may collect,
        // `extra` blocks entering the limbo.
        let mut may_collect: Option<u64> = None;
        let mut pending_twin_free: Option<DevicePtr> = None;
        let mut remove_after: Option<u64> = None;
        match op {
            0..=5 => {
                let bytes = [512, 4000, MIB + 7, 3 * MIB, 7 * MIB, 25 * MIB][rng.below(6) as usize];
                let side = rng.below(4) == 0;
                let (ss, ts) = if side { (s_side, t_side) } else { (S, S) };
                let mut eligible = eligible;
                if eligible.iter().any(|id| blocks[id].uses) {
                    // A block with other streams' uses, freed by the collection inside an
                    // allocation, waits for its events past that allocation's
                    // `process_events` (as in PyTorch): a twin that frees it before the
                    // allocation cannot follow, so collect explicitly first.
                    assert!(shared.ipc_collect());
                    collect_then(
                        &shared,
                        &reference,
                        &mut blocks,
                        limbo_before,
                        &eligible,
                        0,
                        step,
                        &mut implicit,
                    );
                    implicit -= 1;
                    limbo_before = limbo(&shared);
                    eligible.clear();
                }
                let x = shared.allocate(bytes, ss);
                // The twin frees what the shared run collected, then allocates.
                collect_then(
                    &shared,
                    &reference,
                    &mut blocks,
                    limbo_before,
                    &eligible,
                    0,
                    step,
                    &mut implicit,
                );
                let y = reference.allocate(bytes, ts);
                match (x, y) {
                    (Ok(x), Ok(y)) => {
                        assert_eq!(
                            place(&shared, x.ptr),
                            place(&reference, y.ptr),
                            "step {step} seed {seed} {conf}"
                        );
                        let tag = (step % 250) as u8 + 1;
                        fill(&fake, x.ptr, bytes.min(4096), tag, ss);
                        blocks.insert(
                            next_id,
                            Live {
                                x: x.ptr,
                                y: y.ptr,
                                tag,
                                open: 0,
                                freed: false,
                                shared: false,
                                limbo_seq: 0,
                                uses: false,
                            },
                        );
                        next_id += 1;
                    }
                    (Err(a), Err(b)) => {
                        assert!(
                            matches!(a, AllocError::OutOfMemory(_))
                                && matches!(b, AllocError::OutOfMemory(_)),
                            "step {step}: {a:?} vs {b:?}"
                        );
                        ooms += 1;
                    }
                    (a, b) => panic!("step {step} seed {seed} {conf}: {a:?} vs {b:?}"),
                }
                check_step(&shared, &reference, &blocks, &sends, step, seed, conf);
                continue;
            }
            6..=9 => {
                let live: Vec<u64> = blocks
                    .iter()
                    .filter(|(_, b)| !b.freed)
                    .map(|(&id, _)| id)
                    .collect();
                if live.is_empty() {
                    continue;
                }
                let id = live[rng.below(live.len() as u64) as usize];
                let b = blocks.get_mut(&id).unwrap();
                shared.free(b.x).unwrap();
                if b.shared {
                    b.freed = true;
                    b.limbo_seq = step as u64;
                    if b.open == 0 {
                        pending_twin_free = Some(b.y);
                        may_collect = Some(0);
                        remove_after = Some(id);
                    } else {
                        may_collect = Some(1);
                    }
                } else {
                    let y = b.y;
                    blocks.remove(&id);
                    reference.free(y).unwrap();
                }
            }
            10..=12 => {
                let live: Vec<u64> = blocks
                    .iter()
                    .filter(|(_, b)| !b.freed)
                    .map(|(&id, _)| id)
                    .collect();
                if live.is_empty() {
                    continue;
                }
                let id = live[rng.below(live.len() as u64) as usize];
                let b = blocks.get_mut(&id).unwrap();
                let n = 1 + rng.below(3);
                for _ in 0..n {
                    let m = shared.share(b.x, 1, S).unwrap();
                    let r = (rng.below(4) != 0).then(|| consumer.open_shared(&m, S).unwrap());
                    sends.push((id, m, r));
                    b.open += 1;
                }
                b.shared = true;
            }
            13..=15 => {
                if sends.is_empty() {
                    continue;
                }
                let k = rng.below(sends.len() as u64) as usize;
                let (id, m, r) = sends.swap_remove(k);
                if blocks[&id].freed && blocks[&id].open == 1 && !eligible.is_empty() {
                    // Keep one given-back block at a time: the order in which one
                    // collection frees several is PyTorch's limbo order, checked apart.
                    assert!(shared.ipc_collect());
                    collect_then(
                        &shared,
                        &reference,
                        &mut blocks,
                        limbo_before,
                        &eligible,
                        0,
                        step,
                        &mut implicit,
                    );
                    implicit -= 1;
                    limbo_before = limbo(&shared);
                }
                let b = &blocks[&id];
                match r {
                    Some(r) => {
                        assert_eq!(
                            read(&fake, r.ptr(), 1, S),
                            vec![b.tag],
                            "step {step}: a held block was overwritten"
                        );
                        if rng.below(2) == 0 {
                            r.close().unwrap();
                        } else {
                            drop(r);
                        }
                    }
                    None => {
                        if rng.below(2) == 0 {
                            consumer.open_shared(&m, S).unwrap().close().unwrap();
                        } else {
                            set_counter(&m, 0); // another process gave it back
                        }
                    }
                }
                blocks.get_mut(&id).unwrap().open -= 1;
            }
            16 => {
                shared.empty_cache();
                reference.empty_cache();
            }
            17 => {
                let live: Vec<u64> = blocks
                    .iter()
                    .filter(|(_, b)| !b.freed)
                    .map(|(&id, _)| id)
                    .collect();
                if let Some(&id) = live.get(rng.below(live.len().max(1) as u64) as usize) {
                    let b = blocks.get_mut(&id).unwrap();
                    b.uses = true;
                    shared.record_stream(b.x, s_side).unwrap();
                    reference.record_stream(b.y, t_side).unwrap();
                }
            }
            _ => {
                let freed = shared.ipc_collect();
                assert_eq!(freed, !eligible.is_empty(), "step {step}: ipc_collect");
                may_collect = Some(0);
            }
        }
        match may_collect {
            None => assert_eq!(
                limbo(&shared),
                limbo_before,
                "step {step}: op {op} collected"
            ),
            Some(extra) => collect_then(
                &shared,
                &reference,
                &mut blocks,
                limbo_before,
                &eligible,
                extra,
                step,
                &mut implicit,
            ),
        }
        // PyTorch's `CudaIPCSentDataDelete`: the limbo is collected, then the block freed.
        if let Some(y) = pending_twin_free {
            reference.free(y).unwrap();
        }
        if let Some(id) = remove_after {
            blocks.remove(&id);
        }
        check_step(&shared, &reference, &blocks, &sends, step, seed, conf);
    }
    // Everything given back and freed: equal to a run that never shared. The limbo's
    // blocks one at a time, in the order they entered it.
    let mut in_limbo: Vec<(bool, u64, u64)> = blocks
        .iter()
        .filter(|(_, b)| b.freed)
        .map(|(&id, b)| (b.open > 0, b.limbo_seq, id))
        .collect();
    in_limbo.sort_unstable(); // the one already given back (at most one) first
    for (_, _, id) in in_limbo {
        let mine: Vec<usize> = (0..sends.len()).filter(|&k| sends[k].0 == id).collect();
        for k in mine.into_iter().rev() {
            let (_, m, r) = sends.swap_remove(k);
            match r {
                Some(r) => r.close().unwrap(),
                None => set_counter(&m, 0),
            }
        }
        assert!(shared.ipc_collect(), "end {seed} {conf}");
        reference.free(blocks[&id].y).unwrap();
    }
    for (_, m, r) in sends.drain(..) {
        match r {
            Some(r) => r.close().unwrap(),
            None => set_counter(&m, 0),
        }
    }
    assert!(!shared.ipc_collect());
    assert_eq!(
        shared.stats().to_map(),
        reference.stats().to_map(),
        "end {seed} {conf}"
    );
    for b in blocks.values().filter(|b| !b.freed) {
        shared.free(b.x).unwrap();
        reference.free(b.y).unwrap();
    }
    assert_eq!(
        shared.stats().to_map(),
        reference.stats().to_map(),
        "end {seed} {conf}"
    );
    shared.empty_cache();
    reference.empty_cache();
    assert_eq!(
        shared.stats().to_map(),
        reference.stats().to_map(),
        "end {seed} {conf}"
    );
    assert_eq!(layout(&shared), layout(&reference));
    let stats = shared.ipc_stats();
    assert_eq!(
        (
            stats.shared_blocks,
            stats.shared_bytes,
            stats.limbo_blocks,
            stats.limbo_bytes,
            stats.open_sends
        ),
        (0, 0, 0, 0, 0)
    );
    let stats = consumer.ipc_stats();
    assert_eq!((stats.opened_handles, stats.opened_bytes), (0, 0));
    shared.check_invariants().unwrap();
    reference.check_invariants().unwrap();
    (implicit, ooms)
}

/// After an op of the shared run that may collect: either the limbo grew by `extra` only
/// (no collection) or every eligible block was freed; the reference frees them too.
#[allow(clippy::too_many_arguments)]
fn collect_then(
    shared: &CachingAllocator,
    reference: &CachingAllocator,
    blocks: &mut BTreeMap<u64, Live>,
    before: u64,
    eligible: &[u64],
    extra: u64,
    step: usize,
    implicit: &mut u32,
) {
    let after = limbo(shared);
    if after == before + extra {
        return;
    }
    assert_eq!(
        after,
        before + extra - eligible.len() as u64,
        "step {step}: a collection frees every given-back block"
    );
    for id in eligible {
        let b = blocks.remove(id).unwrap();
        reference.free(b.y).unwrap();
    }
    *implicit += 1;
}

fn check_step(
    shared: &CachingAllocator,
    reference: &CachingAllocator,
    blocks: &BTreeMap<u64, Live>,
    sends: &[(u64, SharedMessage, Option<ferrocuda_alloc::ReceivedBlock>)],
    step: usize,
    seed: u64,
    conf: &str,
) {
    let (a, b) = (shared.stats().to_map(), reference.stats().to_map());
    assert_eq!(a, b, "step {step} seed {seed} {conf}");
    assert_eq!(
        layout(shared),
        layout(reference),
        "step {step} seed {seed} {conf}"
    );
    let stats = shared.ipc_stats();
    let in_limbo = blocks.values().filter(|b| b.freed).count();
    let shared_blocks = blocks.values().filter(|b| b.shared).count();
    assert_eq!(stats.limbo_blocks as usize, in_limbo, "step {step}");
    assert_eq!(stats.shared_blocks as usize, shared_blocks, "step {step}");
    assert_eq!(stats.open_sends as usize, sends.len(), "step {step}");
}

#[test]
fn shares_with_the_allocators_own_collections_change_nothing_else() {
    let confs = [
        "",
        "expandable_segments:True",
        "max_split_size_mb:20",
        "roundup_power2_divisions:4",
        "garbage_collection_threshold:0.5",
    ];
    for (i, conf) in confs.iter().enumerate() {
        let (mut implicit, mut ooms) = (0, 0);
        for seed in 1..=8u64 {
            let fraction = conf.starts_with("garbage") || seed % 2 == 0;
            let (c, o) = implicit_differential(conf, seed * 104_729 + i as u64, fraction);
            implicit += c;
            ooms += o;
        }
        assert!(
            implicit >= 5,
            "{conf}: the program exercises collections ({implicit})"
        );
        assert!(ooms > 0, "{conf}: the programs reach the memory fraction");
    }
}
