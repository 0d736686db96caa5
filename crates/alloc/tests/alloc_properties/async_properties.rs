//! Random programs of alloc / use on a stream (with `record_stream`) / free / stream
//! progress / `empty_cache` through the `backend:cudaMallocAsync` allocator on the fake
//! device. After every step: no two live allocations overlap, the pool's used memory equals
//! a recount of the live blocks (each at least its request in 2 MiB blocks), and no memory is handed out again while work of an earlier
//! owner on another stream is still pending (checked through an event recorded after each
//! use).
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use ferrocuda_alloc::AsyncAllocator;
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{
    DeviceIndex, DevicePtr, EventFlags, EventHandle, MemsetValue, StreamFlags, StreamHandle,
};
use proptest::prelude::*;
use std::sync::Arc;

const D0: DeviceIndex = DeviceIndex(0);
const BLOCK: u64 = 2 << 20;

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: usize },
    Free { pick: usize },
    Use { pick: usize, stream: usize },
    Advance { stream: usize },
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        3 => prop::sample::select(vec![512u64, 1 << 20, 3 << 20, 12 << 20]),
        1 => 1u64..=(24 << 20),
    ];
    prop_oneof![
        6 => (size, 0..3usize).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        4 => (any::<usize>(), 0..3usize).prop_map(|(pick, stream)| Op::Use { pick, stream }),
        2 => (0..3usize).prop_map(|stream| Op::Advance { stream }),
        1 => Just(Op::EmptyCache),
    ]
}

/// A use of memory: work on `stream`, done when `event` is.
#[derive(Clone, Copy, Debug)]
struct Use {
    stream: usize,
    event: EventHandle,
}

struct Live {
    ptr: u64,
    size: u64,
    stream: usize,
    uses: Vec<Use>,
}

/// Memory given back, with the uses that must be over before another stream gets it.
struct Freed {
    ptr: u64,
    size: u64,
    uses: Vec<Use>,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_programs_keep_stream_order_and_the_books(ops in proptest::collection::vec(op(), 1..160)) {
        let fake = Arc::new(FakeDriver::builder().completion(Completion::Manual).capacity(4 << 30).backing(false).build());
        let a = AsyncAllocator::new(fake.clone());
        let streams: Vec<StreamHandle> = (0..3)
            .map(|_| fake.stream_create(D0, StreamFlags { non_blocking: true, priority: 0 }).unwrap())
            .collect();
        let mut live: Vec<Live> = Vec::new();
        let mut freed: Vec<Freed> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc { size, stream } => {
                    let before = a.stats(D0).unwrap().allocated_bytes.all.current as u64;
                    let p = a.allocate(D0, size, streams[stream]).unwrap().0;
                    // The fake's pool hands out whole blocks: the one taken is what the pool's
                    // used memory grew by, at least the request in 2 MiB blocks.
                    let block = a.stats(D0).unwrap().allocated_bytes.all.current as u64 - before;
                    prop_assert!(block >= size.div_ceil(BLOCK) * BLOCK, "block {block} for {size}");
                    let range = (p, block);
                    for l in &live {
                        prop_assert!(!overlaps(range, (l.ptr, l.size)), "{p:#x} overlaps a live block");
                    }
                    for f in freed.iter().filter(|f| overlaps(range, (f.ptr, f.size))) {
                        for u in f.uses.iter().filter(|u| u.stream != stream) {
                            prop_assert!(fake.event_query(u.event).unwrap(),
                                "{p:#x} handed to stream {stream} while stream {} still uses it", u.stream);
                        }
                    }
                    freed.retain(|f| !overlaps(range, (f.ptr, f.size)));
                    live.push(Live { ptr: p, size: range.1, stream, uses: Vec::new() });
                }
                Op::Free { pick } if !live.is_empty() => {
                    let l = live.swap_remove(pick % live.len());
                    a.free(DevicePtr(l.ptr)).unwrap();
                    freed.push(Freed { ptr: l.ptr, size: l.size, uses: l.uses });
                }
                Op::Use { pick, stream } if !live.is_empty() => {
                    let i = pick % live.len();
                    let l = &mut live[i];
                    let s = streams[stream];
                    fake.memset_async(DevicePtr(l.ptr), MemsetValue::U8(7), 1, s).unwrap();
                    let event = fake.event_create(D0, EventFlags::default()).unwrap();
                    fake.event_record(event, s).unwrap();
                    if stream != l.stream {
                        a.record_stream(DevicePtr(l.ptr), s).unwrap();
                    }
                    l.uses.push(Use { stream, event });
                }
                Op::Advance { stream } => {
                    fake.advance(streams[stream], None).unwrap();
                }
                Op::EmptyCache => a.empty_cache().unwrap(),
                _ => {}
            }
            let stats = a.stats(D0).unwrap();
            let used: u64 = live.iter().map(|l| l.size).sum();
            prop_assert_eq!(stats.allocated_bytes.all.current as u64, used);
            prop_assert!(stats.reserved_bytes.all.current as u64 >= used);
            prop_assert_eq!(stats.allocation.all.current, 0);
        }
        for l in live.drain(..) {
            a.free(DevicePtr(l.ptr)).unwrap();
        }
        a.empty_cache().unwrap();
        prop_assert_eq!(a.stats(D0).unwrap().reserved_bytes.all.current, 0);
    }
}
