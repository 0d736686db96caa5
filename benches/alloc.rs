//! The caching allocator's hot path, measured like `shared/tools/torch_anchor.py` measures
//! PyTorch's (same sizes, same churn generator, same "wall time / (iterations × threads)"):
//! a cached alloc+free pair on 1 thread and on 8 threads, and a 1024-live mixed churn
//! carried from sample to sample as the anchor's single run is (`churn_refill_*` starts
//! every sample from an empty live set instead); and the 1 MiB pair with `thread_cache:False`
//! (every request through the allocator's lock); and the 1 MiB pair, 8 threads and churn again
//! with `expandable_segments:True` (`_expandable`: PyTorch's expandable rules alone) and with
//! `ferrocuda_recommended:True` (`_recommended`: ferrocuda's set, with page reclaim and
//! small blocks kept inside their pages), so the recommended set's cost splits into
//! PyTorch's rules and ferrocuda's own. Beside them, the floor any exact path pays: one
//! uncontended lock and unlock of a parking mutex and of the allocator's own spin lock, and
//! a lock-and-unlock pair (the two locked operations of an alloc+free pair) on 8 threads
//! contending for one mutex, as PyTorch's allocator's calls contend for its one mutex per
//! device.
//!
//! On the GPU bundle it runs over the real driver (required there); elsewhere over the fake
//! device, where the hot path is the same code (it makes no driver call once cached).
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

mod common;

use criterion::{Criterion, criterion_group};
use ferrocuda::alloc::{Caching, CachingAllocator};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, StreamHandle};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEV: DeviceIndex = DeviceIndex(0);
const STREAM: StreamHandle = StreamHandle::legacy(DEV);

fn pair(a: &CachingAllocator, size: u64) {
    let x = a.allocate(size, STREAM).expect("allocate");
    a.free(black_box(x.ptr)).expect("free");
}

fn hot_path(c: &mut Criterion) {
    let driver = common::driver("alloc");
    let a = Arc::new(
        CachingAllocator::new(driver.clone(), DEV, AllocatorConfig::default(), Caching::On)
            .expect("allocator"),
    );
    let mut g = c.benchmark_group("alloc");
    for (name, size) in [
        ("pair_512B", 512u64),
        ("pair_1MiB", 1 << 20),
        ("pair_100MiB", 100 << 20),
    ] {
        pair(&a, size);
        g.bench_function(name, |b| b.iter(|| pair(&a, size)));
    }
    // The same pair through the lock (what every request costs without the thread cache).
    let locked = CachingAllocator::new(
        driver.clone(),
        DEV,
        AllocatorConfig::parse("thread_cache:False").expect("config"),
        Caching::On,
    )
    .expect("allocator");
    pair(&locked, 1 << 20);
    g.bench_function("pair_1MiB_locked", |b| b.iter(|| pair(&locked, 1 << 20)));
    locked.empty_cache();
    // The headline figures for the default configuration, PyTorch's expandable segments
    // (its recommended setting) and ferrocuda's recommended set.
    headline(&mut g, "", &a);
    for (suffix, config) in [
        ("_expandable", "expandable_segments:True"),
        ("_recommended", "ferrocuda_recommended:True"),
    ] {
        let config = AllocatorConfig::parse(config).expect("config");
        let other = Arc::new(
            CachingAllocator::new(driver.clone(), DEV, config, Caching::On).expect("allocator"),
        );
        headline(&mut g, suffix, &other);
        other.empty_cache();
    }
    lock_floor(&mut g);
    g.finish();
    a.empty_cache();
}

/// One locked operation with nothing inside it: `lock_floor` once, `lock_floor_8threads`
/// twice per iteration (a pair's two operations) on each of 8 threads, timed as the pairs are,
/// with a parking mutex (as PyTorch's `std::mutex`); `lock_floor_spin` once with the
/// allocator's own lock type (a spin lock whose unlock is a plain store).
fn lock_floor(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    let mutex = Arc::new(parking_lot::Mutex::new(0u64));
    g.bench_function("lock_floor", |b| b.iter(|| *black_box(&mutex).lock() += 1));
    let spin = spin::mutex::SpinMutex::<u64, spin::relax::Yield>::new(0);
    g.bench_function("lock_floor_spin", |b| {
        b.iter(|| *black_box(&spin).lock() += 1)
    });
    g.bench_function("lock_floor_8threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..8 {
                    let mutex = mutex.clone();
                    s.spawn(move || {
                        for _ in 0..iters {
                            *black_box(&mutex).lock() += 1;
                            *black_box(&mutex).lock() += 1;
                        }
                    });
                }
            });
            start.elapsed() / 8
        })
    });
}

/// A cached 1 MiB pair (for a configuration other than the default: the default's is
/// measured beside the other sizes), the same on 8 threads, and the 1024-live mixed churn.
fn headline(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    suffix: &str,
    a: &Arc<CachingAllocator>,
) {
    if !suffix.is_empty() {
        pair(a, 1 << 20);
        g.bench_function(format!("pair_1MiB{suffix}"), |b| {
            b.iter(|| pair(a, 1 << 20))
        });
    }
    g.bench_function(format!("pair_1MiB_8threads{suffix}"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..8 {
                    let a = a.clone();
                    s.spawn(move || (0..iters).for_each(|_| pair(&a, 1 << 20)));
                }
            });
            start.elapsed() / 8
        })
    });
    // As the anchor runs it: one churn whose live set and generator carry over from sample
    // to sample (the anchor's single run of a million operations fills its live set once).
    let mut churn = Churn::new();
    g.bench_function(format!("churn_1024_live{suffix}"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            churn.run(a, iters);
            start.elapsed()
        })
    });
    churn.free_all(a);
    // Every sample from an empty live set and the same seed, freed again after it (untimed):
    // what a step that frees everything and allocates it again costs, page moves included.
    g.bench_function(format!("churn_refill_1024_live{suffix}"), |b| {
        b.iter_custom(|iters| {
            let mut churn = Churn::new();
            let start = Instant::now();
            churn.run(a, iters);
            let elapsed = start.elapsed();
            churn.free_all(a);
            elapsed
        })
    });
}

/// The anchor's mixed churn: 1 024 slots, each step frees the slot's block or allocates one
/// of 512 B to 8 MiB into it, slot and size from one xorshift generator.
struct Churn {
    live: Vec<Option<u64>>,
    state: u64,
}

impl Churn {
    fn new() -> Churn {
        Churn {
            live: vec![None; 1024],
            state: 88172645463325252,
        }
    }

    fn run(&mut self, a: &CachingAllocator, steps: u64) {
        for _ in 0..steps {
            let s = &mut self.state;
            *s ^= *s << 13;
            *s ^= *s >> 7;
            *s ^= *s << 17;
            let slot = (*s % 1024) as usize;
            match self.live[slot].take() {
                Some(p) => a.free(ferrocuda::types::DevicePtr(p)).expect("free"),
                None => {
                    let size = 512u64 << ((*s >> 40) % 15);
                    self.live[slot] = Some(a.allocate(size, STREAM).expect("allocate").ptr.0);
                }
            }
        }
    }

    fn free_all(&mut self, a: &CachingAllocator) {
        for p in self.live.iter_mut().filter_map(Option::take) {
            a.free(ferrocuda::types::DevicePtr(p)).expect("free");
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = hot_path
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
