//! The pinned host allocator against a small model of PyTorch's `CachingHostAllocatorImpl`
//! (written from aten/src/ATen/core/CachingHostAllocator.h, as plainly as possible: vectors
//! and linear scans), on random programs of allocate / free / record_event / stream
//! completion / empty_cache / private-pool routing, under the rounding and caching
//! thresholds. After every step the allocator hands out exactly the block the model names
//! (or a new one where the model makes one), and every statistic equals the model's.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use ferrocuda_alloc::{HostAllocator, Route};
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, PoolId, Stat, StreamFlags, StreamHandle};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;
/// Streams: the legacy one and two non-blocking ones; the last is routed to a private pool
/// while routing is on.
const STREAMS: usize = 3;
const ROUTED: usize = 2;

/// Free-list buckets (`MAX_SIZE_INDEX`).
const BUCKETS: usize = 64;

/// `Log2_64_Ceil`.
fn size_index(size: u64) -> usize {
    (0..64)
        .find(|&i| 1u128 << i >= u128::from(size))
        .unwrap_or(64)
}

/// `PowerOf2Ceil` below both thresholds, else the exact size.
fn round_size(size: u64, c: &AllocatorConfig) -> u64 {
    let below = |limit: Option<u64>| limit.is_none_or(|l| size <= l);
    if below(c.pinned.max_round_threshold) && below(c.pinned.max_cached_size) {
        1 << size_index(size)
    } else {
        size
    }
}

const CONFIGS: [&str; 4] = [
    "",
    "pinned_max_round_threshold_mb:1",
    "pinned_max_cached_size_mb:2",
    "pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:2",
];

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: usize },
    Free { pick: usize },
    Record { pick: usize, stream: usize },
    Advance { stream: usize },
    EmptyCache,
    ToggleRoute,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![1u64..=5000, (MIB / 2)..=(3 * MIB)];
    prop_oneof![
        6 => (size, 0..STREAMS).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        4 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        3 => (any::<usize>(), 0..STREAMS).prop_map(|(pick, stream)| Op::Record { pick, stream }),
        2 => (0..STREAMS).prop_map(|stream| Op::Advance { stream }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::ToggleRoute),
    ]
}

#[derive(Debug)]
struct MBlock {
    addr: u64,
    size: u64,
    pool: usize,
    allocated: bool,
    event_count: usize,
    streams: Vec<usize>,
    gone: bool,
}

/// PyTorch's host allocator, plainly: pool 0 is the default, pool 1 the private one.
#[derive(Default)]
struct Model {
    config: AllocatorConfig,
    blocks: Vec<MBlock>,
    /// Free blocks per (pool, bucket), newest last.
    free: HashMap<(usize, usize), Vec<usize>>,
    /// Per pool: (block, stream, epoch of the stream when recorded), newest first.
    events: HashMap<usize, VecDeque<(usize, usize, u64)>>,
    epoch: [u64; STREAMS],
    routing: bool,
    private_users: u32,
    private_exists: bool,
    allocations: Stat,
    allocated_bytes: Stat,
    active: Vec<Stat>,
    active_bytes: Vec<Stat>,
    driver_allocs: i64,
    driver_frees: i64,
}

impl Model {
    fn max_cached(&self) -> u64 {
        self.config.pinned.max_cached_size.unwrap_or(u64::MAX)
    }

    fn process(&mut self, pool: usize) {
        while let Some((b, s, at)) = self.events.entry(pool).or_default().pop_back() {
            if self.epoch[s] <= at {
                self.events.entry(pool).or_default().push_back((b, s, at));
                return;
            }
            self.blocks[b].event_count -= 1;
            if self.blocks[b].event_count == 0 {
                self.available(b);
            }
        }
    }

    fn available(&mut self, b: usize) {
        let (size, pool) = (self.blocks[b].size, self.blocks[b].pool);
        let i = size_index(size);
        self.active[i].decrease(1);
        self.active_bytes[i].decrease(size as i64);
        if size > self.max_cached() {
            self.remove(b);
        } else {
            self.free.entry((pool, i)).or_default().push(b);
        }
    }

    fn remove(&mut self, b: usize) {
        self.blocks[b].gone = true;
        self.allocations.decrease(1);
        self.allocated_bytes.decrease(self.blocks[b].size as i64);
        self.driver_frees += 1;
    }

    /// The block it hands out: `Ok(index)` of a cached one, `Err(size)` for a new one.
    fn allocate(&mut self, size: u64, stream: usize) -> Result<usize, u64> {
        let pool = usize::from(self.routing && stream == ROUTED);
        self.process(pool);
        let size = round_size(size, &self.config);
        let i = size_index(size);
        let list = self.free.entry((pool, i)).or_default();
        let blocks = &self.blocks;
        if let Some(at) = list.iter().rposition(|&b| blocks[b].size >= size) {
            let b = list.remove(at);
            self.blocks[b].allocated = true;
            self.active[i].increase(1);
            self.active_bytes[i].increase(self.blocks[b].size as i64);
            return Ok(b);
        }
        Err(size)
    }

    fn add(&mut self, addr: u64, size: u64, stream: usize) -> usize {
        let pool = usize::from(self.routing && stream == ROUTED);
        self.blocks.push(MBlock {
            addr,
            size,
            pool,
            allocated: true,
            event_count: 0,
            streams: Vec::new(),
            gone: false,
        });
        self.allocations.increase(1);
        self.allocated_bytes.increase(size as i64);
        self.active[size_index(size)].increase(1);
        self.active_bytes[size_index(size)].increase(size as i64);
        self.driver_allocs += 1;
        self.blocks.len() - 1
    }

    fn free(&mut self, b: usize) {
        self.blocks[b].allocated = false;
        let streams = std::mem::take(&mut self.blocks[b].streams);
        if streams.is_empty() {
            self.available(b);
            return;
        }
        self.blocks[b].event_count += streams.len();
        let pool = self.blocks[b].pool;
        for s in streams {
            let at = self.epoch[s];
            self.events.entry(pool).or_default().push_front((b, s, at));
        }
    }

    fn empty_cache(&mut self) {
        let freeable = self.private_exists && self.private_users == 0;
        for pool in std::iter::once(0).chain(freeable.then_some(1)) {
            self.process(pool);
            for i in 0..BUCKETS {
                for b in self.free.remove(&(pool, i)).unwrap_or_default() {
                    self.remove(b);
                }
            }
            if pool == 1 && self.blocks.iter().all(|b| b.pool == 0 || b.gone) {
                self.private_exists = false;
            }
        }
    }

    fn stats(&self) -> BTreeMap<String, i64> {
        let sum = |v: &[Stat]| {
            v.iter().fold(Stat::default(), |a, s| Stat {
                current: a.current + s.current,
                peak: a.peak + s.peak,
                allocated: a.allocated + s.allocated,
                freed: a.freed + s.freed,
            })
        };
        let mut m = BTreeMap::new();
        for (name, s) in [
            ("allocations", self.allocations),
            ("allocated_bytes", self.allocated_bytes),
            ("active_requests", sum(&self.active)),
            ("active_bytes", sum(&self.active_bytes)),
        ] {
            m.insert(format!("{name}.current"), s.current);
            m.insert(format!("{name}.peak"), s.peak);
            m.insert(format!("{name}.allocated"), s.allocated);
            m.insert(format!("{name}.freed"), s.freed);
        }
        m.insert("num_host_alloc".into(), self.allocations.allocated);
        m.insert("num_host_free".into(), self.allocations.freed);
        m.insert("host_alloc_time.count".into(), self.driver_allocs);
        m.insert("host_free_time.count".into(), self.driver_frees);
        m
    }
}

fn run(config: &str, ops: &[Op]) -> Result<(), TestCaseError> {
    let fake = Arc::new(FakeDriver::builder().completion(Completion::Manual).build());
    let config = AllocatorConfig::parse(config).unwrap();
    let a = HostAllocator::new(fake.clone(), config.pinned.clone());
    let mut streams = vec![StreamHandle::legacy(D0)];
    for _ in 1..STREAMS {
        let flags = StreamFlags {
            non_blocking: true,
            priority: 0,
        };
        streams.push(fake.stream_create(D0, flags).unwrap());
    }
    let pool = PoolId::handle();
    let mut m = Model {
        config,
        active: vec![Stat::default(); BUCKETS],
        active_bytes: vec![Stat::default(); BUCKETS],
        ..Model::default()
    };
    let mut live: Vec<usize> = Vec::new();
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Alloc { size, stream } => {
                let got = a.allocate(size, streams[stream]).unwrap();
                let b = match m.allocate(size, stream) {
                    Ok(b) => {
                        prop_assert_eq!(got.addr(), m.blocks[b].addr, "step {}: reuse", step);
                        b
                    }
                    Err(rounded) => {
                        let known = m.blocks.iter().any(|b| !b.gone && b.addr == got.addr());
                        prop_assert!(!known, "step {}: {:?} reused a block", step, op);
                        prop_assert_eq!(got.bytes, rounded);
                        m.add(got.addr(), rounded, stream)
                    }
                };
                live.push(b);
            }
            Op::Free { pick } if !live.is_empty() => {
                let b = live.swap_remove(pick % live.len());
                a.free(m.blocks[b].addr).unwrap();
                m.free(b);
            }
            Op::Record { pick, stream } if !live.is_empty() => {
                let b = live[pick % live.len()];
                prop_assert!(a.record_event(m.blocks[b].addr, streams[stream]).unwrap());
                if !m.blocks[b].streams.contains(&stream) {
                    m.blocks[b].streams.push(stream);
                }
            }
            Op::Advance { stream } => {
                fake.advance(streams[stream], None).unwrap();
                m.epoch[stream] += 1;
            }
            Op::EmptyCache => {
                a.empty_cache().unwrap();
                m.empty_cache();
            }
            Op::ToggleRoute => {
                if m.routing {
                    a.end_allocate_to_pool(pool).unwrap();
                    a.release_pool(pool).unwrap();
                    m.private_users -= 1;
                } else {
                    a.begin_allocate_to_pool(pool, Route::Stream(streams[ROUTED]))
                        .unwrap();
                    m.private_users += 1;
                    m.private_exists = true;
                }
                m.routing = !m.routing;
            }
            _ => {}
        }
        let got = a.stats().to_map();
        for (k, v) in m.stats() {
            prop_assert_eq!(got[&k], v, "step {}: {} after {:?}", step, k, op);
        }
        prop_assert_eq!(a.private_pool_count(), usize::from(m.private_exists));
        a.check_invariants().map_err(TestCaseError::fail)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_host_allocator_matches_the_model(
        config in 0..CONFIGS.len(),
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        run(CONFIGS[config], &ops)?;
    }
}
