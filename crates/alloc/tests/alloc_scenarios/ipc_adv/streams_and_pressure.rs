use super::*;

#[test]
fn a_close_makes_the_consumers_queued_writes_visible_to_the_producer() {
    for by_drop in [false, true] {
        for conf in ["", "expandable_segments:True"] {
            let fake = fake_with(80 << 30, Completion::Manual);
            let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
            let s1 = fake.stream_create(D0, Default::default()).unwrap();
            let s2 = fake.stream_create(D0, Default::default()).unwrap();
            let x = producer.allocate(MIB, s1).unwrap();
            fill(&fake, x.ptr, MIB, 1, s1);
            let m = producer.share(x.ptr, MIB, s1).unwrap();
            let r = consumer.open_shared(&m, s2).unwrap();
            fill(&fake, r.ptr(), MIB, 2, s2);
            assert!(fake.pending(s2).unwrap() > 0, "queued");
            if by_drop {
                drop(r);
            } else {
                r.close().unwrap();
            }
            assert_eq!(
                fake.pending(s2).unwrap(),
                0,
                "{conf}: the close synchronizes"
            );
            assert_eq!(counter(&m), 0);
            // The producer reads on its own stream, which never waited for s2.
            assert_eq!(read(&fake, x.ptr, MIB, s1), vec![2; MIB as usize], "{conf}");
            producer.free(x.ptr).unwrap();
            let y = producer.allocate(MIB, s1).unwrap();
            assert_eq!(y.ptr, x.ptr);
        }
    }
}

#[test]
fn after_a_thousand_outstanding_events_a_send_synchronizes() {
    let fake = fake_with(80 << 30, Completion::Manual);
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let max = ferrocuda_alloc::ipc::MAXIMUM_EVENTS_TO_USE;
    assert_eq!(max, 1000);
    let s1 = fake.stream_create(D0, Default::default()).unwrap();
    let s2 = fake.stream_create(D0, Default::default()).unwrap();
    let x = producer.allocate(MIB, s1).unwrap();
    let mut msgs = Vec::new();
    for i in 0..max {
        fill(&fake, x.ptr, 16, (i % 200) as u8, s1);
        let m = producer.share(x.ptr, MIB, s1).unwrap();
        assert!(m.event_sync_required, "send {i}");
        msgs.push(m);
    }
    assert!(
        fake.pending(s1).unwrap() > 0,
        "sends with events do not synchronize"
    );
    fill(&fake, x.ptr, 16, 0xab, s1);
    let late = producer.share(x.ptr, MIB, s1).unwrap();
    assert!(!late.event_sync_required);
    assert_eq!(late.event_handle.len(), 64);
    assert_eq!(
        fake.pending(s1).unwrap(),
        0,
        "the send synchronized its stream"
    );
    let r = consumer.open_shared(&late, s2).unwrap();
    assert_eq!(read(&fake, r.ptr(), 16, s2), vec![0xab; 16]);
    r.close().unwrap();
    // Every earlier message opens (its event waited on) and closes.
    for m in &msgs {
        consumer.open_shared(m, s2).unwrap().close().unwrap();
    }
    assert_eq!(producer.ipc_stats().open_sends, 0);
    producer.free(x.ptr).unwrap();
    assert_eq!(allocated(&producer), 0);
    // All sends are gone with their block: events are used again.
    let y = producer.allocate(MIB, s1).unwrap();
    let m = producer.share(y.ptr, MIB, s1).unwrap();
    assert!(
        m.event_sync_required,
        "events given back with the block's sends"
    );
    consumer.open_shared(&m, s2).unwrap().close().unwrap();
    producer.free(y.ptr).unwrap();
}

#[test]
fn ten_thousand_and_one_sends_take_a_second_counter_file() {
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let x = producer.allocate(MIB, S).unwrap();
    let y = producer.allocate(MIB, S).unwrap();
    let mut msgs = Vec::with_capacity(10_001);
    for _ in 0..10_000 {
        msgs.push(producer.share(x.ptr, 1, S).unwrap());
    }
    let first = msgs[0].ref_counter_handle.clone();
    assert!(msgs.iter().all(|m| m.ref_counter_handle == first));
    let offsets: Vec<u64> = msgs.iter().map(|m| m.ref_counter_offset).collect();
    assert!(offsets.iter().all(|&o| o < 10_000));
    let mut sorted = offsets.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 10_000, "a fresh counter per send");
    let last = producer.share(y.ptr, 1, S).unwrap();
    assert_ne!(last.ref_counter_handle, first, "a new file");
    assert_eq!(last.ref_counter_offset, 0);
    assert!(shm_exists(&first) && shm_exists(&last.ref_counter_handle));
    assert_eq!(
        std::fs::metadata(shm_path(&first)).unwrap().len(),
        64 + 8 * 10_000
    );
    assert_eq!(producer.ipc_stats().open_sends, 10_001);
    // One of the old file's sends is held; the rest are given back.
    let held = consumer.open_shared(&msgs[4321], S).unwrap();
    for (i, m) in msgs.iter().enumerate() {
        if i != 4321 {
            consumer.open_shared(m, S).unwrap().close().unwrap();
        }
    }
    producer.free(x.ptr).unwrap();
    assert_eq!(limbo(&producer), 1);
    assert!(shm_exists(&first), "a counter of it is still held");
    held.close().unwrap();
    assert!(producer.ipc_collect());
    assert!(
        !shm_exists(&first),
        "the used-up file is let go with its last block"
    );
    assert!(
        shm_exists(&last.ref_counter_handle),
        "the current file still counts"
    );
    assert_eq!(counter(&last), 1);
    consumer.open_shared(&last, S).unwrap().close().unwrap();
    producer.free(y.ptr).unwrap();
    producer.ipc_collect();
    assert_eq!(allocated(&producer), 0);
    assert_eq!(producer.ipc_stats().open_sends, 0);
}

// ---- memory pressure, caching off -------------------------------------------------------

#[test]
fn a_held_block_is_never_reused_under_memory_pressure() {
    for conf in ["", "expandable_segments:True"] {
        let fake = fake_with(64 * MIB, Completion::Eager);
        let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
        let a = producer.allocate(30 * MIB, S).unwrap();
        fill(&fake, a.ptr, 30 * MIB, 0x5a, S);
        let m = producer.share(a.ptr, 30 * MIB, S).unwrap();
        let r = consumer.open_shared(&m, S).unwrap();
        producer.free(a.ptr).unwrap();
        let b = producer.allocate(30 * MIB, S).unwrap();
        assert!(b.ptr.0 >= a.ptr.0 + 30 * MIB || b.ptr.0 + 30 * MIB <= a.ptr.0);
        fill(&fake, b.ptr, 30 * MIB, 0x01, S);
        let c = producer.allocate(30 * MIB, S);
        assert!(
            is_oom(&c),
            "{conf}: the held block is not freed nor reused: {c:?}"
        );
        producer.empty_cache();
        assert_eq!(
            read(&fake, r.ptr(), 30 * MIB, S),
            vec![0x5a; 30 * MIB as usize],
            "{conf}"
        );
        assert_eq!(limbo(&producer), 1);
        r.close().unwrap();
        // Only the collection makes room: no explicit ipc_collect.
        let c = producer.allocate(30 * MIB, S).unwrap();
        assert_eq!(c.ptr, a.ptr, "{conf}: the given-back block");
        assert_eq!(limbo(&producer), 0);
        producer.free(c.ptr).unwrap();
        if !conf.is_empty() {
            // (Expandable pages are fragmented by `b`: 32 MiB does not fit 64 in PyTorch either.)
            continue;
        }
        // A bigger request: the collected segment is released to make room.
        let m = producer.share(b.ptr, MIB, S).unwrap();
        consumer.open_shared(&m, S).unwrap().close().unwrap();
        let d = producer.allocate(30 * MIB, S).unwrap();
        let m = producer.share(d.ptr, MIB, S).unwrap();
        let r = consumer.open_shared(&m, S).unwrap();
        producer.free(d.ptr).unwrap();
        r.close().unwrap();
        let e = producer.allocate(32 * MIB, S);
        assert!(e.is_ok(), "{conf}: {e:?}");
        assert_eq!(limbo(&producer), 0);
        producer.check_invariants().unwrap();
    }
}

#[test]
fn without_caching_a_held_block_keeps_its_driver_memory() {
    let fake = fake_with(64 * MIB, Completion::Eager);
    let driver: Arc<dyn Driver> = fake.clone();
    let producer =
        CachingAllocator::new(driver, D0, AllocatorConfig::default(), Caching::Off).unwrap();
    let consumer = allocator(&fake, "");
    let a = producer.allocate(40 * MIB, S).unwrap();
    fill(&fake, a.ptr, 40 * MIB, 0x3c, S);
    let m = producer.share(a.ptr, 40 * MIB, S).unwrap();
    let r = consumer.open_shared(&m, S).unwrap();
    let frees = fake.calls(Call::Free);
    producer.free(a.ptr).unwrap();
    producer.empty_cache();
    assert_eq!(fake.calls(Call::Free), frees, "not given to the driver");
    assert_eq!(limbo(&producer), 1);
    assert!(is_oom(&producer.allocate(40 * MIB, S)));
    assert_eq!(
        read(&fake, r.ptr(), 40 * MIB, S),
        vec![0x3c; 40 * MIB as usize]
    );
    r.close().unwrap();
    // The free of another shared block collects it.
    let b = producer.allocate(MIB, S).unwrap();
    let mb = producer.share(b.ptr, MIB, S).unwrap();
    consumer.open_shared(&mb, S).unwrap().close().unwrap();
    producer.free(b.ptr).unwrap();
    assert_eq!(fake.calls(Call::Free), frees + 2);
    assert_eq!(limbo(&producer), 0);
    assert_eq!(producer.ipc_stats().shared_blocks, 0);
    assert!(producer.allocate(40 * MIB, S).is_ok());
}

// ---- threads ----------------------------------------------------------------------------

#[test]
fn threads_sharing_and_freeing_never_see_a_held_block_reused() {
    for conf in ["", "expandable_segments:True"] {
        let fake = Arc::new(FakeDriver::default());
        let producer = Arc::new(allocator(&fake, conf));
        let consumer = Arc::new(allocator(&fake, conf));
        let handles: Vec<_> = (0..4u64)
            .map(|t| {
                let (fake, producer, consumer) = (fake.clone(), producer.clone(), consumer.clone());
                std::thread::spawn(move || {
                    let mut rng = Rng(t * 7 + 3);
                    let mut held = Vec::new();
                    for i in 0..300u64 {
                        let bytes = [512, 4096, 3 * MIB / 2][rng.below(3) as usize];
                        let x = producer.allocate(bytes, S).unwrap();
                        let tag = ((t * 61 + i) % 251) as u8 + 1;
                        fill(&fake, x.ptr, bytes.min(4096), tag, S);
                        match rng.below(4) {
                            0 => producer.free(x.ptr).unwrap(),
                            1 => {
                                let m = producer.share(x.ptr, bytes, S).unwrap();
                                consumer.open_shared(&m, S).unwrap().close().unwrap();
                                producer.free(x.ptr).unwrap();
                            }
                            _ => {
                                let m = producer.share(x.ptr, bytes, S).unwrap();
                                let r = consumer.open_shared(&m, S).unwrap();
                                producer.free(x.ptr).unwrap();
                                held.push((r, tag, bytes.min(4096)));
                            }
                        }
                        if held.len() > 6 || (rng.below(3) == 0 && !held.is_empty()) {
                            let k = rng.below(held.len() as u64) as usize;
                            let (r, tag, n) = held.swap_remove(k);
                            assert_eq!(read(&fake, r.ptr(), n, S), vec![tag; n as usize]);
                            r.close().unwrap();
                        }
                    }
                    for (r, tag, n) in held {
                        assert_eq!(read(&fake, r.ptr(), n, S), vec![tag; n as usize]);
                        r.close().unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        producer.ipc_collect();
        assert_eq!(allocated(&producer), 0, "{conf}");
        let stats = producer.ipc_stats();
        assert_eq!(
            (stats.shared_blocks, stats.limbo_blocks, stats.open_sends),
            (0, 0, 0)
        );
        assert_eq!(consumer.ipc_stats().opened_handles, 0);
        producer.check_invariants().unwrap();
        consumer.check_invariants().unwrap();
    }
}
