//! A structure-aware fuzz of the allocator: random programs of allocations (up to a third
//! of the device, so out of memory is common), frees, streams, `record_stream`, event
//! completion, `empty_cache`, private pools (routed to, released), memory fractions, resets
//! and configuration changes, under random configurations that mix PyTorch's keys with
//! every ferrocuda-only key. After every step: the invariants and the books
//! (`check_invariants`), no two live allocations overlap, and every error is a typed one.
//! At the end the allocator is dropped and the device must have all its memory back.
//!
//! `FERROCUDA_FUZZ_PROGRAMS` (default 600) and `FERROCUDA_FUZZ_SEED` set the run, and
//! `FERROCUDA_FUZZ_TRAIL` how many of a failing program's last steps are shown (5);
//! `cargo xtask alloc-fuzz --programs N` runs it in release.
#![forbid(unsafe_code)]
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]
mod common;
use common::{D0, MIB, new_stream};
use ferrocuda_alloc::{AllocError, Caching, CachingAllocator, Route};
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{AllocatorConfig, PoolId, StreamHandle};
use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};
use std::sync::Arc;

/// Keys a configuration is drawn from; each program takes a random subset.
const KEYS: &[&[&str]] = &[
    &["expandable_segments:True", "expandable_segments:False"],
    &["max_split_size_mb:40", "max_split_size_mb:64"],
    &[
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[256:1,512:2,>:4]",
    ],
    &[
        "garbage_collection_threshold:0.5",
        "garbage_collection_threshold:0.8",
    ],
    &["large_segment_size_mb:12", "large_segment_size_mb:32"],
    &["max_non_split_rounding_mb:32"],
    &["throw_on_cudamalloc_oom:True"],
    &["expandable_segments_reclaim:True"],
    &[
        "expandable_segments_page_mb:2",
        "expandable_segments_page_mb:6",
    ],
    &["ferrocuda_recommended:True"],
    &["cross_stream_reuse:True"],
    &["thread_cache:False"],
    &["garbage_collection_without_fraction:True"],
    &["oom_release_partial:True"],
    &["oom_search_after_sync:True"],
    &[
        "per_process_memory_fraction:0.5",
        "per_process_memory_fraction:0.2",
    ],
];

const CAPACITY: u64 = 256 * MIB;

fn random_config(rng: &mut TestRng) -> String {
    let mut keys = Vec::new();
    for choices in KEYS {
        if rng.random_bool(0.3) {
            keys.push(choices[rng.random_range(0..choices.len())]);
        }
    }
    keys.join(",")
}

fn random_size(rng: &mut TestRng) -> u64 {
    match rng.random_range(0..10) {
        0..=3 => rng.random_range(1..=4096),
        4..=6 => rng.random_range(4096..=(2 * MIB)),
        7..=8 => rng.random_range((2 * MIB)..=(30 * MIB)),
        _ => rng.random_range((30 * MIB)..=(CAPACITY / 3)),
    }
}

struct Program {
    fake: Arc<FakeDriver>,
    alloc: CachingAllocator,
    streams: Vec<StreamHandle>,
    live: Vec<(u64, u64)>,
    pools: Vec<PoolId>,
    routed: Option<PoolId>,
}

impl Program {
    fn new(config: &str) -> Result<Program, Box<dyn std::error::Error>> {
        let fake = Arc::new(
            FakeDriver::builder()
                .capacity(CAPACITY)
                .completion(Completion::Manual)
                .backing(false)
                .build(),
        );
        let parsed = AllocatorConfig::parse(config)?;
        let alloc = CachingAllocator::new(fake.clone(), D0, parsed, Caching::On)?;
        let streams = (0..3)
            .map(|_| new_stream(&fake))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Program {
            fake,
            alloc,
            streams,
            live: Vec::new(),
            pools: Vec::new(),
            routed: None,
        })
    }

    /// One random step; `Err` only for an error that must not happen.
    fn step(&mut self, rng: &mut TestRng) -> Result<String, String> {
        let a = &self.alloc;
        let stream = self.streams[rng.random_range(0..self.streams.len())];
        let pick = |rng: &mut TestRng, n: usize| rng.random_range(0..n.max(1));
        let op = rng.random_range(0..100);
        let what = match op {
            0..=44 => {
                let size = random_size(rng);
                match a.allocate(size, stream) {
                    Ok(x) => self.live.push((x.ptr.0, x.size)),
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(e) => return Err(format!("allocate {size}: {e}")),
                }
                format!("alloc {size} on {:#x}", stream.raw)
            }
            45..=79 if !self.live.is_empty() => {
                let (ptr, _) = self.live.swap_remove(pick(rng, self.live.len()));
                a.free(ferrocuda_types::DevicePtr(ptr))
                    .map_err(|e| format!("free: {e}"))?;
                format!("free {ptr:#x}")
            }
            80..=84 if !self.live.is_empty() => {
                let (ptr, _) = self.live[pick(rng, self.live.len())];
                a.record_stream(ferrocuda_types::DevicePtr(ptr), stream)
                    .map_err(|e| format!("record_stream: {e}"))?;
                format!("record_stream {ptr:#x} {:#x}", stream.raw)
            }
            85..=88 => {
                self.fake
                    .advance(stream, None)
                    .map_err(|e| format!("advance: {e}"))?;
                "advance".into()
            }
            89..=90 => {
                a.empty_cache();
                "empty_cache".into()
            }
            91..=94 => self.pool_step(rng)?,
            95 => {
                let f = [0.1, 0.5, 1.0][pick(rng, 3)];
                a.set_memory_fraction(f).map_err(|e| e.to_string())?;
                format!("fraction {f}")
            }
            96 => {
                a.reset_peak_stats();
                a.reset_accumulated_stats();
                "resets".into()
            }
            97 => {
                let config = random_config(rng);
                // A valid string takes effect at once; an invalid one changes nothing.
                let before = a.config();
                match a.update_config(&config) {
                    Ok(()) => format!("config {config}"),
                    Err(_) if a.config() == before => format!("bad config {config}"),
                    Err(e) => return Err(format!("a refused config changed things: {e}")),
                }
            }
            _ => {
                let _ = a.stats();
                let _ = a.snapshot();
                "observe".into()
            }
        };
        Ok(what)
    }

    /// Routes this thread's allocations into a private pool, stops, or releases one.
    fn pool_step(&mut self, rng: &mut TestRng) -> Result<String, String> {
        let a = &self.alloc;
        if let Some(pool) = self.routed.take() {
            a.end_allocate_to_pool(pool).map_err(|e| e.to_string())?;
            return Ok(format!("end routing {pool}"));
        }
        if !self.pools.is_empty() && rng.random_bool(0.5) {
            let pool = self
                .pools
                .swap_remove(rng.random_range(0..self.pools.len()));
            a.release_pool(pool).map_err(|e| e.to_string())?;
            return Ok(format!("release {pool}"));
        }
        let pool = PoolId::handle();
        a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
            .map_err(|e| e.to_string())?;
        self.pools.push(pool);
        self.routed = Some(pool);
        Ok(format!("route to {pool}"))
    }

    fn check(&self) -> Result<(), String> {
        self.alloc.check_invariants()?;
        let mut spans: Vec<(u64, u64)> = self.live.clone();
        spans.sort_unstable();
        if let Some(w) = spans.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err(format!("live blocks overlap: {w:?}"));
        }
        Ok(())
    }

    /// Frees everything, ends every pool and drops the allocator: the device must have all
    /// its memory back.
    fn finish(mut self) -> Result<(), String> {
        let a = &self.alloc;
        if let Some(pool) = self.routed.take() {
            a.end_allocate_to_pool(pool).map_err(|e| e.to_string())?;
        }
        for (ptr, _) in self.live.drain(..) {
            a.free(ferrocuda_types::DevicePtr(ptr))
                .map_err(|e| e.to_string())?;
        }
        for s in &self.streams {
            self.fake.advance(*s, None).map_err(|e| e.to_string())?;
        }
        let fake = self.fake.clone();
        drop(self.alloc);
        let (free, total) = fake.mem_get_info(D0).map_err(|e| e.to_string())?;
        if free != total {
            return Err(format!("{} bytes still held after drop", total - free));
        }
        Ok(())
    }
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn random_programs_keep_every_invariant() {
    let programs = env_number("FERROCUDA_FUZZ_PROGRAMS", 600);
    let seed = env_number("FERROCUDA_FUZZ_SEED", 20261123);
    let mut failures = Vec::new();
    for n in 0..programs {
        let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &(seed + n).to_le_bytes().repeat(4));
        let config = random_config(&mut rng);
        let steps = rng.random_range(20..300);
        let mut p = Program::new(&config).unwrap_or_else(|e| panic!("{config}: {e}"));
        let mut trail = Vec::new();
        let mut outcome = Ok(());
        for _ in 0..steps {
            outcome = p.step(&mut rng).and_then(|what| {
                trail.push(what);
                p.check()
            });
            if outcome.is_err() {
                break;
            }
        }
        let outcome = outcome.and_then(|()| p.finish());
        if let Err(e) = outcome {
            let keep = env_number("FERROCUDA_FUZZ_TRAIL", 5) as usize;
            let last: Vec<_> = trail.iter().rev().take(keep).rev().collect();
            failures.push(format!(
                "program {n} (seed {}) config {config:?}: {e}; last steps {last:?}",
                seed + n
            ));
        }
    }
    eprintln!(
        "alloc fuzz: {programs} programs from seed {seed}, {} failed",
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
