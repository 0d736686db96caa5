//! What the allocator's test binaries share: an allocator on a fake device, a statistic by
//! PyTorch's key, a stream; and [`audit`], the audit tests' own helpers. Each binary uses a
//! different subset.
#![allow(dead_code, clippy::panic)]
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, StreamFlags, StreamHandle};
use std::sync::Arc;

pub(crate) mod audit;

pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const GIB: u64 = 1 << 30;
pub(crate) const D0: DeviceIndex = DeviceIndex(0);
pub(crate) const LEGACY: StreamHandle = StreamHandle::legacy(D0);

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;

/// An allocator with `config` on a fake device of `capacity` bytes.
pub(crate) fn setup(
    capacity: u64,
    config: &str,
    completion: Completion,
) -> (Arc<FakeDriver>, CachingAllocator) {
    let fake = Arc::new(
        FakeDriver::builder()
            .capacity(capacity)
            .completion(completion)
            .build(),
    );
    let config = AllocatorConfig::parse(config).unwrap_or_else(|e| panic!("{e}"));
    let alloc = CachingAllocator::new(fake.clone(), D0, config, Caching::On)
        .unwrap_or_else(|e| panic!("{e}"));
    (fake, alloc)
}

/// A non-blocking stream on the fake device.
pub(crate) fn new_stream(fake: &FakeDriver) -> Result<StreamHandle, ferrocuda_driver::DriverError> {
    stream_on(fake, D0, true)
}

/// A stream on device `dev` of the fake device: non-blocking, or blocking (as
/// `cudaStreamCreate` makes it: it waits for the legacy stream, and the legacy stream for it).
pub(crate) fn stream_on(
    fake: &FakeDriver,
    dev: DeviceIndex,
    non_blocking: bool,
) -> Result<StreamHandle, ferrocuda_driver::DriverError> {
    fake.stream_create(
        dev,
        StreamFlags {
            non_blocking,
            priority: 0,
        },
    )
}

/// A `memory_stats` value by its PyTorch key.
pub(crate) fn stat(a: &CachingAllocator, key: &str) -> i64 {
    a.stats().to_map()[key]
}

/// A tiny deterministic generator (xorshift64).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// A generator whose state is `seed` spread over the word (never zero).
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Below `n` (0 for `n` of 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// True `p` times in a hundred.
    pub(crate) fn pct(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
    pub(crate) fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// The statistics in which `a` (with the thread cache) and `b` (through the lock) differ.
pub(crate) fn stats_diff(a: &CachingAllocator, b: &CachingAllocator) -> Option<String> {
    let (x, y) = (a.stats().to_map(), b.stats().to_map());
    let d: Vec<_> = x
        .iter()
        .filter(|(k, v)| y.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: tc {v} vs lock {:?}", y.get(k)))
        .collect();
    (!d.is_empty()).then(|| d.join("; "))
}
