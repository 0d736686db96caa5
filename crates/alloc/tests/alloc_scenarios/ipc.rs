//! Sharing blocks with another process (CUDA IPC) on the fake device, where the other
//! process is a second allocator on the same fake: handles in PyTorch's bytes, data seen
//! both ways, a freed block kept while a consumer holds it (the limbo) and freed by the
//! next collection, the handle opened once for the blocks of one segment, the counter file
//! in shared memory, bad messages, and a differential test: a random program with shares
//! against the same program without them, where each shared block's free is deferred to
//! the collection after its last consumer closed it, equal at every step.
use crate::Rng;
use ferrocuda_alloc::{
    AllocError, Allocation, Caching, CachingAllocator, IpcError, ReceivedBlock, SharedMessage,
};
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::collections::HashMap;
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
const S: StreamHandle = StreamHandle::legacy(D0);
const MIB: u64 = 1 << 20;

fn allocator(fake: &Arc<FakeDriver>, conf: &str) -> Result<CachingAllocator, AllocError> {
    let driver: Arc<dyn Driver> = fake.clone();
    CachingAllocator::new(driver, D0, AllocatorConfig::parse(conf)?, Caching::On)
}

fn fill(fake: &FakeDriver, ptr: DevicePtr, bytes: u64, value: u8) -> Result<(), DriverError> {
    fake.memcpy_htod_async(ptr, &vec![value; bytes as usize], S)
}

fn read(fake: &FakeDriver, ptr: DevicePtr, bytes: u64) -> Result<Vec<u8>, DriverError> {
    let mut out = vec![0; bytes as usize];
    fake.memcpy_dtoh(&mut out, ptr, S)?;
    Ok(out)
}

fn shm_exists(name: &str) -> bool {
    std::path::Path::new("/dev/shm")
        .join(name.trim_start_matches('/'))
        .exists()
}

fn share_both_ways(conf: &str, kind: u8) -> TestResult {
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, conf)?, allocator(&fake, conf)?);
    let a = producer.allocate(3 * MIB, S)?;
    let b = producer.allocate(MIB, S)?;
    fill(&fake, a.ptr, 3 * MIB, 0x11)?;
    fill(&fake, b.ptr, MIB, 0x22)?;
    let (ma, mb) = (
        producer.share(a.ptr, 3 * MIB, S)?,
        producer.share(b.ptr, MIB, S)?,
    );
    assert_eq!(&ma.handle[..2], &[2, kind]);
    assert!(ma.event_sync_required && ma.event_handle.len() == 64);
    assert_eq!(ma.ref_counter_handle, mb.ref_counter_handle);
    assert_eq!(mb.ref_counter_offset, ma.ref_counter_offset + 1);
    assert!(shm_exists(&ma.ref_counter_handle));
    let stats = producer.ipc_stats();
    assert_eq!((stats.shared_blocks, stats.open_sends), (2, 2));

    let ra = consumer.open_shared(&ma, S)?;
    let rb = consumer.open_shared(&mb, S)?;
    assert_eq!(
        read(&fake, ra.ptr(), 3 * MIB)?,
        vec![0x11; 3 * MIB as usize]
    );
    assert_eq!(read(&fake, rb.ptr(), MIB)?, vec![0x22; MIB as usize]);
    fill(&fake, rb.ptr(), MIB, 0x33)?; // the consumer writes; the producer sees it
    assert_eq!(read(&fake, b.ptr, MIB)?, vec![0x33; MIB as usize]);

    // The producer frees `a` while the consumer holds it: allocated still, not reused.
    let allocated = producer.stats().allocated_bytes.all.current;
    producer.free(a.ptr)?;
    assert_eq!(producer.stats().allocated_bytes.all.current, allocated);
    assert_eq!(producer.ipc_stats().limbo_blocks, 1);
    let again = producer.allocate(3 * MIB, S)?;
    assert_ne!(again.ptr, a.ptr);
    producer.free(again.ptr)?;
    assert!(!producer.ipc_collect(), "nothing is given back yet");

    ra.close()?;
    assert_eq!(producer.ipc_stats().open_sends, 1);
    assert!(producer.ipc_collect());
    assert_eq!(producer.ipc_stats().limbo_blocks, 0);
    // `b`: given back by its consumer first, then freed at once.
    rb.close()?;
    producer.free(b.ptr)?;
    let stats = producer.ipc_stats();
    assert_eq!((stats.shared_blocks, stats.open_sends), (0, 0));
    assert_eq!(producer.stats().allocated_bytes.all.current, 0);
    assert_eq!(consumer.ipc_stats().opened_handles, 0);
    assert!(
        !shm_exists(&ma.ref_counter_handle),
        "the counter file is let go"
    );
    producer.check_invariants()?;
    consumer.check_invariants()?;
    Ok(())
}

#[test]
fn a_block_of_an_ordinary_segment_is_shared_both_ways() -> TestResult {
    share_both_ways("", b'c')
}

#[test]
fn a_block_of_an_expandable_segment_is_shared_both_ways() -> TestResult {
    share_both_ways("expandable_segments:True", b'e')
}

#[test]
fn blocks_of_one_segment_open_one_handle() -> TestResult {
    for (conf, pages) in [("", 0), ("expandable_segments:True", 1)] {
        let fake = Arc::new(FakeDriver::default());
        let (producer, consumer) = (allocator(&fake, conf)?, allocator(&fake, conf)?);
        let x = producer.allocate(1000, S)?;
        let y = producer.allocate(1000, S)?;
        let (mx, my) = (
            producer.share(x.ptr, 1000, S)?,
            producer.share(y.ptr, 1000, S)?,
        );
        assert_eq!(mx.handle, my.handle, "{conf}");
        assert_eq!(my.offset_bytes - mx.offset_bytes, y.ptr.0 - x.ptr.0);
        let (rx, ry) = (consumer.open_shared(&mx, S)?, consumer.open_shared(&my, S)?);
        assert_eq!(ry.ptr().0 - rx.ptr().0, y.ptr.0 - x.ptr.0);
        let stats = consumer.ipc_stats();
        assert_eq!(stats.opened_handles, 1, "{conf}");
        assert_eq!(stats.opened_bytes, pages * 2 * MIB, "{conf}");
        // An expandable handle names the pages under the block: the header and one
        // descriptor per page.
        if pages > 0 {
            assert_eq!(mx.handle.len(), 2 + 24 + 4);
        } else {
            assert_eq!(mx.handle.len(), 2 + 64);
        }
        drop(rx);
        assert_eq!(consumer.ipc_stats().opened_handles, 1);
        drop(ry);
        assert_eq!(consumer.ipc_stats().opened_handles, 0);
        assert_eq!(producer.ipc_stats().open_sends, 0, "drop closes");
    }
    Ok(())
}

/// A producer's 30 MiB block shared with a consumer that holds it open, then freed by the
/// producer (it waits in the limbo).
struct SharedAndFreed {
    fake: Arc<FakeDriver>,
    producer: CachingAllocator,
    consumer: CachingAllocator,
    /// The producer's block.
    a: Allocation,
    /// The consumer's hold on it.
    r: ReceivedBlock,
}

fn shared_and_freed() -> Result<SharedAndFreed, Box<dyn std::error::Error>> {
    let fake = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, "")?, allocator(&fake, "")?);
    let a = producer.allocate(30 * MIB, S)?;
    let m = producer.share(a.ptr, 30 * MIB, S)?;
    let r = consumer.open_shared(&m, S)?;
    producer.free(a.ptr)?;
    Ok(SharedAndFreed {
        fake,
        producer,
        consumer,
        a,
        r,
    })
}

#[test]
fn an_allocation_that_finds_no_block_collects_the_limbo_first() -> TestResult {
    // PyTorch's free-memory callback: before a new segment, given-back blocks are freed
    // and the search runs again, so the freed block is reused without an explicit collect.
    // (Every part bound, so that the consumer lives until the end, as the fake does.)
    let SharedAndFreed {
        fake: _fake,
        producer,
        consumer: _consumer,
        a,
        r,
    } = shared_and_freed()?;
    r.close()?;
    let segments = producer.stats().segment.all.current;
    let again = producer.allocate(30 * MIB, S)?;
    assert_eq!(again.ptr, a.ptr);
    assert_eq!(producer.stats().segment.all.current, segments);
    assert_eq!(producer.ipc_stats().shared_blocks, 0);
    Ok(())
}

#[test]
fn a_close_whose_wait_fails_does_not_give_the_block_back() -> TestResult {
    // The consumer's work may still touch the block: the producer keeps it (in limbo once
    // freed) rather than reuse it under that work.
    let SharedAndFreed {
        fake,
        producer,
        consumer,
        a,
        r,
    } = shared_and_freed()?;
    fake.fail_nth(Call::StreamSynchronize, 1, DriverError::UNKNOWN);
    assert!(r.close().is_err(), "the failed wait is reported");
    assert_eq!(producer.ipc_stats().open_sends, 1);
    assert!(!producer.ipc_collect(), "the block is not given back");
    let again = producer.allocate(30 * MIB, S)?;
    assert_ne!(again.ptr, a.ptr, "nor reused");
    assert_eq!(
        consumer.ipc_stats().opened_handles,
        0,
        "the handle is closed"
    );
    producer.check_invariants()?;
    Ok(())
}

#[test]
fn the_data_sent_is_what_the_stream_had_written_at_the_send() -> TestResult {
    // The consumer's stream waits for the producer's event (manual completion: the copy
    // is still queued when the message leaves).
    let fake = Arc::new(
        FakeDriver::builder()
            .completion(ferrocuda_driver::Completion::Manual)
            .build(),
    );
    let (producer, consumer) = (allocator(&fake, "")?, allocator(&fake, "")?);
    let s1 = fake.stream_create(D0, Default::default())?;
    let a = producer.allocate(MIB, s1)?;
    fake.memcpy_htod_async(a.ptr, &vec![9u8; MIB as usize], s1)?;
    let m = producer.share(a.ptr, MIB, s1)?;
    let s2 = fake.stream_create(D0, Default::default())?;
    let r = consumer.open_shared(&m, s2)?;
    let mut out = vec![0u8; MIB as usize];
    fake.memcpy_dtoh(&mut out, r.ptr(), s2)?;
    assert_eq!(out, vec![9u8; MIB as usize]);
    r.close()?;
    producer.free(a.ptr)?;
    Ok(())
}

#[test]
fn bad_messages_are_typed_errors() -> TestResult {
    let fake = Arc::new(FakeDriver::default());
    let other = Arc::new(FakeDriver::default());
    let (producer, consumer) = (allocator(&fake, "")?, allocator(&fake, "")?);
    let stranger = allocator(&other, "")?;
    let a = producer.allocate(MIB, S)?;
    let good = producer.share(a.ptr, MIB, S)?;
    let bad = |f: &dyn Fn(&mut SharedMessage)| {
        let mut m = good.clone();
        f(&mut m);
        consumer.open_shared(&m, S).map(drop)
    };
    let malformed =
        |r: Result<(), AllocError>| matches!(r, Err(AllocError::Ipc(IpcError::BadHandle(_))));
    assert!(malformed(bad(&|m| m.handle = vec![3, b'c'])));
    assert!(malformed(bad(&|m| m.handle[1] = b'x')));
    assert!(malformed(bad(&|m| m.handle.truncate(10))));
    assert!(malformed(bad(&|m| m.event_handle.truncate(3))));
    assert!(matches!(
        bad(&|m| m.device = 1),
        Err(AllocError::Ipc(IpcError::WrongDevice {
            message: 1,
            allocator: 0
        }))
    ));
    // Another fake's handle is another machine's.
    let other_ptr = stranger.allocate(MIB, StreamHandle::legacy(D0))?;
    let foreign = stranger.share(other_ptr.ptr, MIB, StreamHandle::legacy(D0))?;
    let r = consumer.open_shared(&foreign, S);
    assert!(matches!(r, Err(AllocError::Driver(e)) if e == DriverError::INVALID_VALUE));
    // Sharing what is not a live allocation.
    assert!(matches!(
        producer.share(DevicePtr(a.ptr.0 + 512), 1, S),
        Err(AllocError::InvalidPointer(_))
    ));
    let mut expandable = allocator(&fake, "expandable_segments:True")?.share_ipc_handle(a.ptr);
    assert!(matches!(expandable, Err(AllocError::InvalidPointer(_))));
    // Descriptors of a process that is not this one (the fake has no other).
    let e = allocator(&fake, "expandable_segments:True")?;
    let x = e.allocate(MIB, S)?;
    let mut m = e.share(x.ptr, MIB, S)?;
    m.handle[2..6].copy_from_slice(&(std::process::id() + 1).to_ne_bytes());
    expandable = consumer.open_shared(&m, S).map(|_| unreachable!());
    assert!(matches!(expandable, Err(AllocError::Driver(e)) if e == DriverError::OPERATING_SYSTEM));
    Ok(())
}

#[test]
fn without_caching_each_allocation_is_its_own_handle() -> TestResult {
    let fake = Arc::new(FakeDriver::default());
    let driver: Arc<dyn Driver> = fake.clone();
    let producer = CachingAllocator::new(driver, D0, AllocatorConfig::default(), Caching::Off)?;
    let consumer = allocator(&fake, "")?;
    let a = producer.allocate(4096, S)?;
    fill(&fake, a.ptr, 4096, 5)?;
    let m = producer.share(a.ptr, 4096, S)?;
    assert_eq!(m.offset_bytes, 0);
    let r = consumer.open_shared(&m, S)?;
    assert_eq!(read(&fake, r.ptr(), 4096)?, vec![5; 4096]);
    producer.free(a.ptr)?;
    assert_eq!(producer.ipc_stats().limbo_blocks, 1);
    r.close()?;
    assert!(producer.ipc_collect());
    assert_eq!(producer.ipc_stats().shared_blocks, 0);
    Ok(())
}

/// One random program run twice: `shared` shares blocks and frees them whenever it likes;
/// `reference` never shares and frees a shared block only once its consumers closed it and
/// the collection after that ran. Pointers, statistics and snapshots are equal after
/// every step.
fn differential(conf: &str, seed: u64) -> Result<u32, Box<dyn std::error::Error>> {
    let fake = Arc::new(FakeDriver::default());
    let twin = Arc::new(FakeDriver::default());
    let shared = allocator(&fake, conf)?;
    let consumer = allocator(&fake, conf)?;
    let reference = allocator(&twin, conf)?;
    let mut rng = Rng(seed);
    // live: index -> (ptr in shared, ptr in reference); opens: per block, its open sends.
    let mut live: Vec<(DevicePtr, DevicePtr)> = Vec::new();
    let mut opens: HashMap<u64, Vec<ferrocuda_alloc::ReceivedBlock>> = HashMap::new();
    let mut freed_while_open: HashMap<u64, DevicePtr> = HashMap::new();
    let mut deferred = 0;
    for step in 0..400 {
        match rng.below(10) {
            0..=3 => {
                let bytes = [512, 4000, MIB + 7, 3 * MIB, 25 * MIB][rng.below(5) as usize];
                let (x, y) = (shared.allocate(bytes, S)?, reference.allocate(bytes, S)?);
                assert_eq!(
                    place(&shared, x.ptr),
                    place(&reference, y.ptr),
                    "step {step}"
                );
                live.push((x.ptr, y.ptr));
            }
            4..=5 if !live.is_empty() => {
                let (x, y) = live.swap_remove(rng.below(live.len() as u64) as usize);
                shared.free(x)?;
                if opens.get(&x.0).is_some_and(|o| !o.is_empty()) {
                    freed_while_open.insert(x.0, y);
                    deferred += 1;
                } else {
                    reference.free(y)?;
                }
            }
            6..=7 if !live.is_empty() => {
                let (x, _) = live[rng.below(live.len() as u64) as usize];
                let m = shared.share(x, 1, S)?;
                opens
                    .entry(x.0)
                    .or_default()
                    .push(consumer.open_shared(&m, S)?);
            }
            _ => {
                let blocks: Vec<u64> = opens
                    .iter()
                    .filter(|(_, o)| !o.is_empty())
                    .map(|(&p, _)| p)
                    .collect();
                if blocks.is_empty() {
                    continue;
                }
                let p = blocks[rng.below(blocks.len() as u64) as usize];
                let list = opens.get_mut(&p).ok_or("open")?;
                list.swap_remove(rng.below(list.len() as u64) as usize)
                    .close()?;
                shared.ipc_collect();
                if list.is_empty()
                    && let Some(y) = freed_while_open.remove(&p)
                {
                    reference.free(y)?;
                }
            }
        }
        let (a, b) = (shared.stats().to_map(), reference.stats().to_map());
        assert_eq!(a, b, "step {step} seed {seed} {conf}");
        assert_eq!(layout(&shared), layout(&reference), "step {step}");
    }
    shared.check_invariants()?;
    Ok(deferred)
}

/// Where `ptr` lies: its segment's rank by address and its offset there. (The consumer's
/// mappings take addresses of the shared fake too, so raw addresses differ between the
/// runs while their order does not.)
pub(super) fn place(a: &CachingAllocator, ptr: DevicePtr) -> (usize, u64) {
    let segments = a.snapshot().0;
    let mut bases: Vec<(u64, u64)> = segments.iter().map(|s| (s.address, s.total_size)).collect();
    bases.sort_unstable();
    let rank = bases.iter().position(|&(b, n)| (b..b + n).contains(&ptr.0));
    rank.map_or((usize::MAX, ptr.0), |r| (r, ptr.0 - bases[r].0))
}

/// The snapshot's segments and blocks with addresses as [`place`]s.
/// A segment's rank, size and blocks (offset, size, state).
pub(super) type SegmentLayout = (usize, u64, Vec<(u64, u64, String)>);

pub(super) fn layout(a: &CachingAllocator) -> Vec<SegmentLayout> {
    let mut segments = a.snapshot().0;
    segments.sort_by_key(|s| s.address);
    segments
        .iter()
        .enumerate()
        .map(|(rank, s)| {
            let blocks = s.blocks.iter();
            let blocks = blocks.map(|b| (b.address - s.address, b.size, b.state.clone()));
            (rank, s.total_size, blocks.collect())
        })
        .collect()
}

#[test]
fn shares_change_nothing_but_when_a_shared_block_is_freed() -> TestResult {
    for (i, conf) in ["", "expandable_segments:True", "max_split_size_mb:20"]
        .iter()
        .enumerate()
    {
        let mut deferred = 0;
        for seed in 1..=6 {
            deferred += differential(conf, seed * 7919 + i as u64)?;
        }
        // The programs do free blocks their consumers still hold.
        assert!(deferred >= 10, "{conf}: {deferred}");
    }
    Ok(())
}
