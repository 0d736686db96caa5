//! Helpers shared by the audit test files (written against the public API alone)
//! (`alloc_scenarios/pytorch_rules.rs`, `alloc_diff.rs`): an allocator on a fresh fake
//! device, streams, statistics by key, a seeded RNG.

use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{AllocatorConfig, StreamFlags, StreamHandle};
use std::sync::Arc;

#[allow(unused_imports)] // each test file uses a different subset
pub(crate) use super::{D0, GIB, LEGACY, MIB, TestResult};

/// A fake device of `capacity` bytes (eager completion) and a caching allocator on it with
/// `config` (PyTorch's grammar). Panics if either cannot be made.
pub(crate) fn setup(capacity: u64, config: &str) -> (Arc<FakeDriver>, CachingAllocator) {
    match try_setup(capacity, config, Completion::Eager) {
        Ok(pair) => pair,
        Err(e) => panic!("setup({capacity}, {config:?}): {e}"),
    }
}

/// [`setup`] that reports a config or construction error instead of panicking.
pub(crate) fn try_setup(
    capacity: u64,
    config: &str,
    completion: Completion,
) -> Result<(Arc<FakeDriver>, CachingAllocator), Box<dyn std::error::Error>> {
    let fake = Arc::new(
        FakeDriver::builder()
            .capacity(capacity)
            .completion(completion)
            .backing(false)
            .build(),
    );
    let config = AllocatorConfig::parse(config)?;
    let alloc = CachingAllocator::new(fake.clone(), D0, config, Caching::On)?;
    Ok((fake, alloc))
}

/// A new non-blocking stream on the fake device.
pub(crate) fn new_stream(fake: &FakeDriver) -> StreamHandle {
    fake.stream_create(
        D0,
        StreamFlags {
            non_blocking: true,
            priority: 0,
        },
    )
    .unwrap_or_else(|e| panic!("stream_create: {e}"))
}

/// One `memory_stats()` entry by its PyTorch key.
pub(crate) fn stat(a: &CachingAllocator, key: &str) -> i64 {
    match a.stats().to_map().get(key) {
        Some(v) => *v,
        None => panic!("no statistic {key}"),
    }
}

/// Several `memory_stats()` entries, in the order asked, for one `assert_eq!`.
pub(crate) fn stats(a: &CachingAllocator, keys: &[&str]) -> Vec<(String, i64)> {
    let map = a.stats().to_map();
    keys.iter()
        .map(|k| (k.to_string(), map.get(*k).copied().unwrap_or(i64::MIN)))
        .collect()
}

/// The same keys paired with expected values, for comparison with [`stats`].
pub(crate) fn want(pairs: &[(&str, i64)]) -> Vec<(String, i64)> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

/// Bytes the fake device has handed out (`total - free` of `cudaMemGetInfo`).
pub(crate) fn device_used(fake: &FakeDriver) -> u64 {
    let (free, total) = fake
        .mem_get_info(D0)
        .unwrap_or_else(|e| panic!("mem_get_info: {e}"));
    total - free
}

/// SplitMix64: a small seeded generator, so scripts replay from their seed alone.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `percent`/100.
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }
}
