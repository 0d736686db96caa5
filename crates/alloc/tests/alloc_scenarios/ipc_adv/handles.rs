use super::*;

#[test]
fn ordinary_handles_name_the_segment_base_and_offsets_the_block() {
    let fake = Arc::new(FakeDriver::default());
    let producer = allocator(&fake, "");
    let blocks: Vec<_> = (0..4)
        .map(|_| producer.allocate(3000, S).unwrap())
        .collect();
    let base = producer
        .snapshot()
        .0
        .iter()
        .map(|s| s.address)
        .min()
        .unwrap();
    let segment_handle = fake.ipc_mem_handle(D0, DevicePtr(base)).unwrap();
    for b in &blocks {
        let h = producer.share_ipc_handle(b.ptr).unwrap();
        assert_eq!(h.handle.len(), 66);
        assert_eq!(&h.handle[..2], &[2, b'c']);
        assert_eq!(&h.handle[2..], &segment_handle.0[..]);
        assert_eq!(h.offset, b.ptr.0 - base);
        let m = producer.share(b.ptr, 3000, S).unwrap();
        assert_eq!((m.handle.clone(), m.offset_bytes), (h.handle, h.offset));
        assert_eq!((m.device, m.size_bytes), (0, 3000));
        assert_eq!(m.event_handle.len(), 64);
    }
}

#[test]
fn split_blocks_of_one_segment_share_one_mapping_in_any_close_order() {
    for conf in ["", "expandable_segments:True"] {
        for seed in 1..=5u64 {
            let fake = Arc::new(FakeDriver::default());
            let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
            let blocks: Vec<_> = (0..5)
                .map(|_| producer.allocate(4096, S).unwrap())
                .collect();
            for (i, b) in blocks.iter().enumerate() {
                fill(&fake, b.ptr, 4096, i as u8 + 1, S);
            }
            let msgs: Vec<_> = blocks
                .iter()
                .map(|b| producer.share(b.ptr, 4096, S).unwrap())
                .collect();
            let opens_before = fake.calls(Call::IpcOpenMem) + fake.calls(Call::VmImport);
            let mut received: Vec<_> = msgs
                .iter()
                .map(|m| Some(consumer.open_shared(m, S).unwrap()))
                .collect();
            assert_eq!(
                fake.calls(Call::IpcOpenMem) + fake.calls(Call::VmImport) - opens_before,
                1,
                "{conf}: one mapping"
            );
            let r0 = received[0].as_ref().unwrap().ptr().0;
            for (i, r) in received.iter().enumerate() {
                let r = r.as_ref().unwrap();
                assert_eq!(r.ptr().0 - r0, blocks[i].ptr.0 - blocks[0].ptr.0);
                assert_eq!(read(&fake, r.ptr(), 4096, S), vec![i as u8 + 1; 4096]);
            }
            // Free some in the producer, close in a random order.
            let mut rng = Rng(seed * 31 + 7);
            for b in blocks.iter().filter(|_| rng.below(2) == 0) {
                producer.free(b.ptr).unwrap();
            }
            let mut order: Vec<usize> = (0..5).collect();
            for i in (1..5).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            for (k, &j) in order.iter().enumerate() {
                // The remaining ones still read their own bytes.
                for (i, r) in received.iter().enumerate() {
                    if let Some(r) = r {
                        assert_eq!(read(&fake, r.ptr(), 4096, S), vec![i as u8 + 1; 4096]);
                    }
                }
                let r = received[j].take().unwrap();
                if k % 2 == 0 {
                    r.close().unwrap();
                } else {
                    drop(r);
                }
                let want = u64::from(k < 4);
                assert_eq!(consumer.ipc_stats().opened_handles, want, "{conf}");
            }
            assert_eq!(
                fake.calls(Call::IpcOpenMem) + fake.calls(Call::VmImport) - opens_before,
                1
            );
            assert_eq!(consumer.ipc_stats().opened_bytes, 0);
            producer.ipc_collect();
            for b in &blocks {
                let _ = producer.free(b.ptr);
            }
            assert_eq!(allocated(&producer), 0, "{conf} {seed}");
            assert_eq!(producer.ipc_stats().shared_blocks, 0);
            // A new open after all closed maps again.
            let y = producer.allocate(4096, S).unwrap();
            let m = producer.share(y.ptr, 4096, S).unwrap();
            let r = consumer.open_shared(&m, S).unwrap();
            assert_eq!(consumer.ipc_stats().opened_handles, 1);
            r.close().unwrap();
            producer.free(y.ptr).unwrap();
            producer.check_invariants().unwrap();
            consumer.check_invariants().unwrap();
        }
    }
}

#[test]
fn expandable_handles_name_the_pages_under_the_block() {
    let fake = Arc::new(FakeDriver::default());
    let conf = "expandable_segments:True";
    let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
    // Large-pool blocks in one expandable segment of 20 MiB pages: [0,15) [15,25) [25,40).
    let a = producer.allocate(15 * MIB, S).unwrap();
    let b = producer.allocate(10 * MIB, S).unwrap();
    let c = producer.allocate(15 * MIB, S).unwrap();
    assert_eq!(b.ptr.0, a.ptr.0 + 15 * MIB);
    assert_eq!(c.ptr.0, b.ptr.0 + 10 * MIB);
    let header = |h: &[u8]| {
        let pid = i32::from_ne_bytes(h[2..6].try_into().unwrap());
        let zero = &h[6..10];
        let page = u64::from_ne_bytes(h[10..18].try_into().unwrap());
        let count = u64::from_ne_bytes(h[18..26].try_into().unwrap());
        let fds: Vec<i32> = h[26..]
            .chunks(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(zero, &[0, 0, 0, 0]);
        assert_eq!(pid as u32, std::process::id());
        (page, count, fds)
    };
    let (ha, hb, hc) = (
        producer.share_ipc_handle(a.ptr).unwrap(),
        producer.share_ipc_handle(b.ptr).unwrap(),
        producer.share_ipc_handle(c.ptr).unwrap(),
    );
    let (pa, na, fa) = header(&ha.handle);
    let (pb, nb, fb) = header(&hb.handle);
    let (pc, nc, fc) = header(&hc.handle);
    assert_eq!((pa, pb, pc), (20 * MIB, 20 * MIB, 20 * MIB));
    assert_eq!((na, nb, nc), (1, 2, 1));
    assert_eq!((fa.len(), fb.len(), fc.len()), (1, 2, 1));
    assert_eq!(
        (fb[0], fb[1]),
        (fa[0], fc[0]),
        "the same pages, the same descriptors"
    );
    assert_ne!(fa[0], fc[0]);
    assert_eq!((ha.offset, hb.offset, hc.offset), (0, 15 * MIB, 5 * MIB));
    // Data through the consumer's three mappings (distinct handle bytes).
    for (x, v) in [(&a, 1u8), (&b, 2), (&c, 3)] {
        fill(&fake, x.ptr, x.size, v, S);
    }
    let msgs: Vec<_> = [&a, &b, &c]
        .iter()
        .map(|x| producer.share(x.ptr, x.size, S).unwrap())
        .collect();
    let rs: Vec<_> = msgs
        .iter()
        .map(|m| consumer.open_shared(m, S).unwrap())
        .collect();
    for (r, (x, v)) in rs.iter().zip([(&a, 1u8), (&b, 2), (&c, 3)]) {
        assert_eq!(r.size(), x.size);
        assert_eq!(read(&fake, r.ptr(), x.size, S), vec![v; x.size as usize]);
    }
    let stats = consumer.ipc_stats();
    assert_eq!(stats.opened_handles, 3);
    assert_eq!(stats.opened_bytes, (1 + 2 + 1) * 20 * MIB);
    // The consumer writes through b's mapping across the page boundary.
    fill(&fake, rs[1].ptr(), 10 * MIB, 9, S);
    assert_eq!(read(&fake, b.ptr, 10 * MIB, S), vec![9; 10 * MIB as usize]);
    assert_eq!(read(&fake, a.ptr, 15 * MIB, S), vec![1; 15 * MIB as usize]);
    drop(rs);
    assert_eq!(consumer.ipc_stats().opened_bytes, 0);
    // A block ending exactly on a page boundary names one page.
    let fresh = Arc::new(FakeDriver::default());
    let p = allocator(&fresh, conf);
    let whole = p.allocate(20 * MIB, S).unwrap();
    let (_, n, fds) = header(&p.share_ipc_handle(whole.ptr).unwrap().handle);
    assert_eq!((n, fds.len()), (1, 1));
}

#[test]
fn two_producers_in_one_process_never_share_a_counter() {
    let fake = Arc::new(FakeDriver::builder().devices(2).build());
    let other = Arc::new(FakeDriver::default());
    let d1 = DeviceIndex(1);
    let s1 = StreamHandle::legacy(d1);
    let driver: Arc<dyn Driver> = fake.clone();
    let p0 = allocator(&fake, "");
    let p1 =
        CachingAllocator::new(driver.clone(), d1, AllocatorConfig::default(), Caching::On).unwrap();
    let p2 = allocator(&other, "");
    let c1 = CachingAllocator::new(driver, d1, AllocatorConfig::default(), Caching::On).unwrap();
    let x0 = p0.allocate(MIB, S).unwrap();
    let x1 = p1.allocate(MIB, s1).unwrap();
    let x2 = p2.allocate(MIB, S).unwrap();
    let mut sent = Vec::new();
    for _ in 0..3 {
        sent.push(p0.share(x0.ptr, MIB, S).unwrap());
        sent.push(p1.share(x1.ptr, MIB, s1).unwrap());
        sent.push(p2.share(x2.ptr, MIB, S).unwrap());
    }
    let mut seen = std::collections::HashSet::new();
    for m in &sent {
        assert!(
            m.ref_counter_handle
                .starts_with(&format!("/torch_{}_", std::process::id()))
        );
        assert!(shm_exists(&m.ref_counter_handle));
        assert!(seen.insert((m.ref_counter_handle.clone(), m.ref_counter_offset)));
        assert_eq!(counter(m), 1);
    }
    assert!(sent.iter().filter(|m| m.device == 1).count() == 3);
    // Device 1's message opened on device 1, data intact; on device 0 it is refused.
    fill(&fake, x1.ptr, MIB, 0x77, s1);
    let r = c1.open_shared(&sent[1], s1).unwrap();
    assert_eq!(read(&fake, r.ptr(), MIB, s1), vec![0x77; MIB as usize]);
    let c0 = allocator(&fake, "");
    assert!(matches!(
        c0.open_shared(&sent[1], S),
        Err(AllocError::Ipc(IpcError::WrongDevice {
            message: 1,
            allocator: 0
        }))
    ));
    r.close().unwrap();
    assert_eq!(counter(&sent[1]), 0);
    for (i, m) in sent.iter().enumerate() {
        if i != 1 {
            assert_eq!(counter(m), 1, "another producer's counter untouched");
        }
    }
}

#[test]
fn a_message_survives_serde_and_opens() {
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let x = producer.allocate(MIB, S).unwrap();
    fill(&fake, x.ptr, MIB, 0x42, S);
    let m = producer.share(x.ptr, MIB, S).unwrap();
    let json = serde_json::to_string(&m).unwrap();
    let back: SharedMessage = serde_json::from_str(&json).unwrap();
    assert_eq!(back.handle, m.handle);
    assert_eq!(back.ref_counter_handle, m.ref_counter_handle);
    let r = consumer.open_shared(&back, S).unwrap();
    assert_eq!(read(&fake, r.ptr(), MIB, S), vec![0x42; MIB as usize]);
    r.close().unwrap();
    assert_eq!(counter(&m), 0);
}

#[test]
fn a_failed_open_leaves_nothing_open_and_no_counter_changed() {
    for conf in ["", "expandable_segments:True"] {
        let fake = Arc::new(FakeDriver::default());
        let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
        let x = producer.allocate(MIB, S).unwrap();
        let good = producer.share(x.ptr, MIB, S).unwrap();
        assert!(good.event_sync_required);
        let mut garbage_event = good.clone();
        garbage_event.event_handle = vec![0xee; 64];
        let r = consumer.open_shared(&garbage_event, S);
        assert!(r.is_err(), "{conf}: an event handle that names no event");
        drop(r);
        let mut truncated = good.clone();
        truncated.handle.pop();
        assert!(matches!(
            consumer.open_shared(&truncated, S).map(drop),
            Err(AllocError::Ipc(IpcError::BadHandle(_)))
        ));
        assert_eq!(
            consumer.ipc_stats().opened_handles,
            0,
            "{conf}: no leaked mapping"
        );
        assert_eq!(
            fake.calls(Call::IpcOpenMem),
            fake.calls(Call::IpcCloseMem),
            "{conf}"
        );
        assert_eq!(
            counter(&good),
            1,
            "{conf}: a failed open gives nothing back"
        );
        // A message without an event (as when events ran out) ignores the event bytes.
        let mut no_event = good.clone();
        no_event.event_sync_required = false;
        no_event.event_handle = vec![0; 64];
        let r = consumer.open_shared(&no_event, S).unwrap();
        r.close().unwrap();
        let r = consumer.open_shared(&good, S).unwrap();
        r.close().unwrap();
        assert_eq!(counter(&good), -1);
        producer.free(x.ptr).unwrap();
        assert_eq!(allocated(&producer), 0);
    }
}

#[test]
fn a_consumer_closing_after_its_producer_is_gone_lets_its_mapping_go() {
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let x = producer.allocate(MIB, S).unwrap();
    let m = producer.share(x.ptr, MIB, S).unwrap();
    let r = consumer.open_shared(&m, S).unwrap();
    producer.free(x.ptr).unwrap();
    drop(producer);
    let _ = r.close(); // best effort, as PyTorch's deleter
    assert_eq!(consumer.ipc_stats().opened_handles, 0);
    assert_eq!(fake.calls(Call::IpcOpenMem), fake.calls(Call::IpcCloseMem));
}
