//! Adversarial scenarios of CUDA IPC (`share`, `open_shared`, the limbo), written from the
//! contract: when a collection may run and when it may not, several sends of one block,
//! counters read and written in the shared-memory file as another process would, counter
//! files rolling over, events running out, what the consumer's stream sees and what its
//! close makes visible, memory pressure with blocks held, caching off, two producers in one
//! process, failed opens, threads, and a differential test with the collections left to
//! the allocator (no explicit `ipc_collect`) over five configurations.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
use crate::Rng;
use ferrocuda_alloc::{AllocError, Caching, CachingAllocator, IpcError, SharedMessage};
use ferrocuda_driver::fake::{Call, Completion};
use ferrocuda_driver::{Driver, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::collections::BTreeMap;
use std::sync::Arc;

const D0: DeviceIndex = DeviceIndex(0);
const S: StreamHandle = StreamHandle::legacy(D0);
const MIB: u64 = 1 << 20;

fn allocator(fake: &Arc<FakeDriver>, conf: &str) -> CachingAllocator {
    let driver: Arc<dyn Driver> = fake.clone();
    CachingAllocator::new(
        driver,
        D0,
        AllocatorConfig::parse(conf).unwrap(),
        Caching::On,
    )
    .unwrap()
}

fn fake_with(capacity: u64, completion: Completion) -> Arc<FakeDriver> {
    Arc::new(
        FakeDriver::builder()
            .capacity(capacity)
            .completion(completion)
            .build(),
    )
}

fn fill(fake: &FakeDriver, ptr: DevicePtr, bytes: u64, value: u8, s: StreamHandle) {
    fake.memcpy_htod_async(ptr, &vec![value; bytes as usize], s)
        .unwrap();
}

fn read(fake: &FakeDriver, ptr: DevicePtr, bytes: u64, s: StreamHandle) -> Vec<u8> {
    let mut out = vec![0; bytes as usize];
    fake.memcpy_dtoh(&mut out, ptr, s).unwrap();
    out
}

fn shm_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new("/dev/shm").join(name.trim_start_matches('/'))
}

fn shm_exists(name: &str) -> bool {
    shm_path(name).exists()
}

/// The send's counter as another process reads it: the `i64` after the 64-byte header.
fn counter(m: &SharedMessage) -> i64 {
    let bytes = std::fs::read(shm_path(&m.ref_counter_handle)).unwrap();
    let at = 64 + 8 * m.ref_counter_offset as usize;
    i64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// Writes the send's counter as a PyTorch consumer in another process would.
fn set_counter(m: &SharedMessage, value: i64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(shm_path(&m.ref_counter_handle))
        .unwrap();
    f.write_all_at(&value.to_ne_bytes(), 64 + 8 * m.ref_counter_offset)
        .unwrap();
}

fn allocated(a: &CachingAllocator) -> u64 {
    a.stats().allocated_bytes.all.current as u64
}

fn reserved(a: &CachingAllocator) -> u64 {
    a.stats().reserved_bytes.all.current as u64
}

fn limbo(a: &CachingAllocator) -> u64 {
    a.ipc_stats().limbo_blocks
}

fn is_oom<T>(r: &Result<T, AllocError>) -> bool {
    matches!(r, Err(AllocError::OutOfMemory(_)))
}

// ---- when collections run ------------------------------------------------------------

#[test]
fn an_allocation_that_finds_a_cached_block_does_not_collect() {
    // PyTorch's free-memory callbacks run only when the search fails: a given-back block in
    // the limbo is not preferred over a cached block by best fit.
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let p = producer.allocate(4 * MIB, S).unwrap();
    let q = producer.allocate(8 * MIB, S).unwrap();
    assert_eq!(q.ptr.0, p.ptr.0 + 4 * MIB, "one 20 MiB segment");
    let m = producer.share(p.ptr, 4 * MIB, S).unwrap();
    let r = consumer.open_shared(&m, S).unwrap();
    producer.free(p.ptr).unwrap();
    r.close().unwrap();
    assert_eq!(counter(&m), 0);
    producer.free(q.ptr).unwrap(); // [4, 20) MiB cached
    assert_eq!(limbo(&producer), 1, "a plain free does not collect");
    let again = producer.allocate(4 * MIB, S).unwrap();
    assert_eq!(again.ptr, q.ptr, "the cached block is found first");
    assert_eq!(
        limbo(&producer),
        1,
        "no collection when a cached block fits"
    );
    assert_eq!(allocated(&producer), 8 * MIB);
    producer.check_invariants().unwrap();
}

#[test]
fn empty_cache_and_plain_frees_neither_collect_nor_free_the_limbo() {
    for conf in ["", "expandable_segments:True"] {
        let fake = Arc::new(FakeDriver::default());
        let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
        let a = producer.allocate(3 * MIB, S).unwrap();
        let b = producer.allocate(5 * MIB, S).unwrap();
        let c = producer.allocate(1000, S).unwrap();
        fill(&fake, a.ptr, 3 * MIB, 0xa5, S);
        let m = producer.share(a.ptr, 3 * MIB, S).unwrap();
        let r = consumer.open_shared(&m, S).unwrap();
        producer.free(a.ptr).unwrap();
        let (alloc_before, reserved_before) = (allocated(&producer), reserved(&producer));
        producer.free(b.ptr).unwrap();
        producer.free(c.ptr).unwrap();
        producer.empty_cache();
        assert_eq!(limbo(&producer), 1, "{conf}");
        assert_eq!(
            allocated(&producer),
            alloc_before - 5 * MIB - 1024,
            "{conf}"
        );
        assert!(reserved(&producer) >= 3 * MIB, "{conf}");
        assert!(reserved(&producer) <= reserved_before, "{conf}");
        // The consumer still reads the data: nothing under it was unmapped or reused.
        let big = producer.allocate(3 * MIB, S).unwrap();
        fill(&fake, big.ptr, 3 * MIB, 0x11, S);
        assert_eq!(
            read(&fake, r.ptr(), 3 * MIB, S),
            vec![0xa5; 3 * MIB as usize],
            "{conf}"
        );
        r.close().unwrap();
        // Given back but not collected: empty_cache still does not free it.
        producer.empty_cache();
        assert_eq!(
            limbo(&producer),
            1,
            "{conf}: empty_cache is not a collection"
        );
        assert!(producer.ipc_collect());
        producer.free(big.ptr).unwrap();
        producer.empty_cache();
        assert_eq!(reserved(&producer), 0, "{conf}");
        assert_eq!(allocated(&producer), 0, "{conf}");
        producer.check_invariants().unwrap();
    }
}

#[test]
fn a_free_of_another_shared_block_collects_the_limbo() {
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let a = producer.allocate(MIB * 2, S).unwrap();
    let b = producer.allocate(MIB * 2, S).unwrap();
    let (ma, mb) = (
        producer.share(a.ptr, 1, S).unwrap(),
        producer.share(b.ptr, 1, S).unwrap(),
    );
    let (ra, rb) = (
        consumer.open_shared(&ma, S).unwrap(),
        consumer.open_shared(&mb, S).unwrap(),
    );
    producer.free(a.ptr).unwrap();
    ra.close().unwrap();
    assert_eq!(limbo(&producer), 1, "a close does not collect");
    // `b` is shared and still held: its free puts it in the limbo and collects `a`.
    producer.free(b.ptr).unwrap();
    let stats = producer.ipc_stats();
    assert_eq!((stats.limbo_blocks, stats.shared_blocks), (1, 1));
    assert_eq!(stats.limbo_bytes, 2 * MIB);
    assert_eq!(allocated(&producer), 2 * MIB);
    rb.close().unwrap();
    assert!(producer.ipc_collect());
    assert!(!producer.ipc_collect(), "nothing left to free");
    assert_eq!(allocated(&producer), 0);
}

// ---- several sends, counters ------------------------------------------------------------

#[test]
fn every_send_of_a_block_must_be_returned_in_any_order() {
    let orders = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for (i, order) in orders.iter().enumerate() {
        for free_first in [true, false] {
            let fake = Arc::new(FakeDriver::default());
            let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
            let x = producer.allocate(6000, S).unwrap();
            let msgs: Vec<SharedMessage> = (0..3)
                .map(|_| producer.share(x.ptr, 6000, S).unwrap())
                .collect();
            assert!(msgs.windows(2).all(|w| w[0].handle == w[1].handle));
            let offsets: Vec<u64> = msgs.iter().map(|m| m.ref_counter_offset).collect();
            assert!(
                offsets[0] != offsets[1] && offsets[1] != offsets[2] && offsets[0] != offsets[2]
            );
            assert!(msgs.iter().all(|m| counter(m) == 1));
            let stats = producer.ipc_stats();
            assert_eq!((stats.shared_blocks, stats.open_sends), (1, 3), "{i}");
            assert_eq!(stats.shared_bytes, x.size);
            let mut opened: Vec<Option<_>> = msgs
                .iter()
                .map(|m| Some(consumer.open_shared(m, S).unwrap()))
                .collect();
            assert!(msgs.iter().all(|m| counter(m) == 1), "open does not count");
            assert_eq!(consumer.ipc_stats().opened_handles, 1);
            if free_first {
                producer.free(x.ptr).unwrap();
            }
            for (k, &j) in order.iter().enumerate() {
                opened[j].take().unwrap().close().unwrap();
                assert_eq!(counter(&msgs[j]), 0);
                assert_eq!(producer.ipc_stats().open_sends as usize, 2 - k);
                if k < 2 {
                    assert!(!producer.ipc_collect(), "{order:?}: sends still open");
                    assert_eq!(allocated(&producer), x.size, "{order:?}");
                }
            }
            if free_first {
                assert!(producer.ipc_collect(), "{order:?}");
            } else {
                assert_eq!(producer.ipc_stats().shared_blocks, 1, "live, shared");
                producer.free(x.ptr).unwrap();
            }
            assert_eq!(allocated(&producer), 0, "{order:?} {free_first}");
            let stats = producer.ipc_stats();
            assert_eq!(
                (stats.shared_blocks, stats.limbo_blocks, stats.open_sends),
                (0, 0, 0)
            );
            assert_eq!(consumer.ipc_stats().opened_handles, 0);
            // The same address again, never shared: freed at once.
            let y = producer.allocate(6000, S).unwrap();
            assert_eq!(y.ptr, x.ptr);
            producer.free(y.ptr).unwrap();
            assert_eq!(allocated(&producer), 0);
            assert_eq!(limbo(&producer), 0);
        }
    }
}

#[test]
fn a_message_opened_twice_counts_down_twice_and_below_zero_is_given_back() {
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let x = producer.allocate(MIB * 3, S).unwrap();
    let m = producer.share(x.ptr, MIB * 3, S).unwrap();
    let r1 = consumer.open_shared(&m, S).unwrap();
    let r2 = consumer.open_shared(&m, S).unwrap();
    assert_eq!(r1.ptr(), r2.ptr());
    assert_eq!(r1.size(), MIB * 3);
    r1.close().unwrap();
    r2.close().unwrap();
    assert_eq!(counter(&m), -1, "each received block decrements (PyTorch)");
    assert_eq!(producer.ipc_stats().open_sends, 0);
    producer.free(x.ptr).unwrap();
    assert_eq!(allocated(&producer), 0, "a counter <= 0 frees at once");
    assert_eq!(limbo(&producer), 0);
}

#[test]
fn a_send_returned_by_another_process_writing_the_file_is_collected() {
    // A PyTorch consumer decrements the counter in the file; a message never opened keeps
    // the block until then.
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let x = producer.allocate(MIB * 2, S).unwrap();
    let opened = producer.share(x.ptr, 1, S).unwrap();
    let never = producer.share(x.ptr, 1, S).unwrap();
    consumer.open_shared(&opened, S).unwrap().close().unwrap();
    producer.free(x.ptr).unwrap();
    assert_eq!(limbo(&producer), 1);
    assert!(!producer.ipc_collect());
    assert_eq!(producer.ipc_stats().open_sends, 1);
    set_counter(&never, 0);
    assert_eq!(producer.ipc_stats().open_sends, 0);
    assert!(producer.ipc_collect());
    assert_eq!(allocated(&producer), 0);
}

#[test]
fn dropping_or_closing_a_received_block_counts_down_once() {
    for conf in ["", "expandable_segments:True"] {
        let fake = Arc::new(FakeDriver::default());
        let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
        let x = producer.allocate(5000, S).unwrap();
        let (m1, m2) = (
            producer.share(x.ptr, 5000, S).unwrap(),
            producer.share(x.ptr, 5000, S).unwrap(),
        );
        let r1 = consumer.open_shared(&m1, S).unwrap();
        let r2 = consumer.open_shared(&m2, S).unwrap();
        drop(r1);
        assert_eq!((counter(&m1), counter(&m2)), (0, 1), "{conf}");
        r2.close().unwrap();
        assert_eq!((counter(&m1), counter(&m2)), (0, 0), "{conf}");
        assert_eq!(consumer.ipc_stats().opened_handles, 0);
        assert_eq!(consumer.ipc_stats().opened_bytes, 0);
        assert!(
            fake.calls(Call::IpcOpenMem) + fake.calls(Call::VmImport) > 0,
            "{conf}"
        );
        producer.free(x.ptr).unwrap();
        assert_eq!(allocated(&producer), 0, "{conf}");
    }
}

#[test]
fn a_block_given_back_before_its_free_is_freed_at_once_and_reused() {
    for conf in ["", "expandable_segments:True", "max_split_size_mb:20"] {
        // Sizes whose segment (or expandable pages) leaves no cached block that fits.
        for bytes in [20 * MIB, 30 * MIB] {
            let fake = Arc::new(FakeDriver::default());
            let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
            let x = producer.allocate(bytes, S).unwrap();
            let m = producer.share(x.ptr, bytes, S).unwrap();
            consumer.open_shared(&m, S).unwrap().close().unwrap();
            producer.free(x.ptr).unwrap();
            assert_eq!(allocated(&producer), 0, "{conf} {bytes}");
            assert_eq!(producer.ipc_stats().shared_blocks, 0, "{conf} {bytes}");
            let segments = producer.stats().segment.all.current;
            let again = producer.allocate(bytes, S).unwrap();
            assert_eq!(again.ptr, x.ptr, "{conf} {bytes}");
            assert_eq!(producer.stats().segment.all.current, segments);
            producer.free(again.ptr).unwrap();
            assert_eq!(allocated(&producer), 0);
            // Shared, freed, given back: the next allocation reuses it (no collect).
            let m = producer.share(again.ptr, bytes, S);
            assert!(matches!(m, Err(AllocError::InvalidPointer(_))), "freed");
            let y = producer.allocate(bytes, S).unwrap();
            let m = producer.share(y.ptr, bytes, S).unwrap();
            let r = consumer.open_shared(&m, S).unwrap();
            producer.free(y.ptr).unwrap();
            assert_eq!(allocated(&producer), y.size);
            r.close().unwrap();
            let z = producer.allocate(bytes, S).unwrap();
            assert_eq!(z.ptr, y.ptr, "{conf} {bytes}: reused without ipc_collect");
            assert_eq!(producer.stats().segment.all.current, segments);
            assert_eq!(limbo(&producer), 0);
            producer.free(z.ptr).unwrap();
            producer.check_invariants().unwrap();
        }
    }
}

#[test]
fn freed_or_parked_blocks_cannot_be_shared() {
    let fake = Arc::new(FakeDriver::default());
    let producer = allocator(&fake, "");
    // A block freed (perhaps parked in this thread's cache): not a live allocation.
    for _ in 0..3 {
        let x = producer.allocate(1000, S).unwrap();
        producer.free(x.ptr).unwrap();
        assert!(
            matches!(
                producer.share(x.ptr, 1000, S),
                Err(AllocError::InvalidPointer(_))
            ),
            "share of a freed block"
        );
        assert!(matches!(
            producer.share_ipc_handle(x.ptr),
            Err(AllocError::InvalidPointer(_))
        ));
    }
    assert_eq!(producer.ipc_stats().open_sends, 0);
    // share_ipc_handle alone is no send: the free is immediate.
    let y = producer.allocate(1000, S).unwrap();
    let h = producer.share_ipc_handle(y.ptr).unwrap();
    assert_eq!(&h.handle[..2], &[2, b'c']);
    assert_eq!(producer.ipc_stats().open_sends, 0);
    producer.free(y.ptr).unwrap();
    assert_eq!(allocated(&producer), 0);
    assert_eq!(limbo(&producer), 0);
}

#[test]
fn a_block_in_the_limbo_cannot_be_shared_or_freed_again() {
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
    let x = producer.allocate(1000, S).unwrap();
    let m = producer.share(x.ptr, 1000, S).unwrap();
    let r = consumer.open_shared(&m, S).unwrap();
    producer.free(x.ptr).unwrap();
    assert!(
        matches!(
            producer.share(x.ptr, 1000, S),
            Err(AllocError::InvalidPointer(_))
        ),
        "a send of a freed block"
    );
    assert!(matches!(
        producer.share_ipc_handle(x.ptr),
        Err(AllocError::InvalidPointer(_))
    ));
    assert!(
        matches!(producer.free(x.ptr), Err(AllocError::InvalidPointer(_))),
        "a double free of a block in the limbo"
    );
    assert_eq!(limbo(&producer), 1);
    assert_eq!(producer.ipc_stats().open_sends, 1);
    r.close().unwrap();
    assert!(producer.ipc_collect());
    assert!(matches!(
        producer.free(x.ptr),
        Err(AllocError::InvalidPointer(_))
    ));
    producer.check_invariants().unwrap();
}

#[test]
fn one_collection_frees_the_limbo_in_the_order_it_was_filled() {
    // PyTorch's limbo is a vector: one collection frees its blocks in the order they were
    // freed by the producer, and the statistics of adjacent frees (inactive splits)
    // depend on that order.
    let orders: Vec<Vec<usize>> = (0..24)
        .map(|mut n| {
            let mut rest = vec![0, 1, 2, 3];
            let mut out = Vec::new();
            for k in (1..=4).rev() {
                out.push(rest.remove(n % k));
                n /= k;
            }
            out
        })
        .collect();
    let mut differing = Vec::new();
    for order in &orders {
        let fake = Arc::new(FakeDriver::default());
        let twin = Arc::new(FakeDriver::default());
        let (producer, consumer) = (allocator(&fake, ""), allocator(&fake, ""));
        let reference = allocator(&twin, "");
        let xs: Vec<_> = (0..4)
            .map(|_| producer.allocate(4 * MIB, S).unwrap())
            .collect();
        let ys: Vec<_> = (0..4)
            .map(|_| reference.allocate(4 * MIB, S).unwrap())
            .collect();
        let received: Vec<_> = xs
            .iter()
            .map(|x| {
                consumer
                    .open_shared(&producer.share(x.ptr, 1, S).unwrap(), S)
                    .unwrap()
            })
            .collect();
        for &i in order {
            producer.free(xs[i].ptr).unwrap();
        }
        drop(received);
        assert!(producer.ipc_collect());
        for &i in order {
            reference.free(ys[i].ptr).unwrap();
        }
        assert_eq!(layout(&producer), layout(&reference));
        let (a, b) = (producer.stats().to_map(), reference.stats().to_map());
        if a != b {
            let keys: Vec<_> = a
                .iter()
                .filter(|(k, v)| b.get(*k) != Some(*v))
                .map(|(k, v)| format!("{k}: {v} (PyTorch's order: {:?})", b.get(k)))
                .collect();
            differing.push((order.clone(), keys));
        }
    }
    assert!(
        differing.is_empty(),
        "free orders whose statistics differ: {differing:#?}"
    );
}

#[test]
fn a_second_free_of_a_held_block_does_not_free_it() {
    for conf in ["", "expandable_segments:True"] {
        let fake = Arc::new(FakeDriver::default());
        let (producer, consumer) = (allocator(&fake, conf), allocator(&fake, conf));
        let x = producer.allocate(30 * MIB, S).unwrap();
        fill(&fake, x.ptr, 4096, 0x5a, S);
        let m = producer.share(x.ptr, 30 * MIB, S).unwrap();
        let r = consumer.open_shared(&m, S).unwrap();
        producer.free(x.ptr).unwrap();
        let again = producer.free(x.ptr);
        let y = producer.allocate(30 * MIB, S).unwrap();
        fill(&fake, y.ptr, 4096, 0x01, S);
        let held_bytes_kept = read(&fake, r.ptr(), 4096, S) == vec![0x5a; 4096];
        r.close().unwrap();
        producer.ipc_collect();
        let y_live = allocated(&producer) == y.size;
        assert!(
            held_bytes_kept && y_live && matches!(again, Err(AllocError::InvalidPointer(_))),
            "{conf}: second free {again:?}; y == x: {}; the consumer's bytes kept: \
             {held_bytes_kept}; y still allocated after the collection: {y_live}",
            y.ptr == x.ptr
        );
    }
}

// ---- handles ----------------------------------------------------------------------------

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

// ---- streams and events -----------------------------------------------------------------

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

// ---- differential with the allocator's own collections -----------------------------------

use super::ipc::{layout, place};

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
