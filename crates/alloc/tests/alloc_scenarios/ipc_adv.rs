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
use crate::ipc::{layout, place};
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

/// Handles: what a message names, for ordinary and expandable blocks, and opens that fail.
mod handles;

/// The consumer's stream and events, memory pressure with blocks held, caching off,
/// threads.
mod streams_and_pressure;

/// A differential test with the collections left to the allocator, over five
/// configurations.
mod differential;
