//! A replay through the command's library, on the fake device, of a trace whose events use
//! many streams (`tests/cli_scenarios/synthetic.rs`): each of 20 000, 40 000 or 100 000 side
//! streams in turn allocates a small block and frees it, so every stream gets a 2 MiB segment
//! of its own (PyTorch's pools are per stream). Past 80 GiB (40 960 segments) the allocator
//! gives cached segments back to make room, and dropping the allocator gives back the rest: a
//! driver free each, which drains the device. Timed: the replay (allocator, driver calls) and
//! the drop.
//!
//! The fake device used to drain every stream it had at each free, so this was quadratic:
//! one run each on an idle Xeon core, 20 000 streams 11.7 s, 40 000 55.8 s, 100 000 294 s.
//! It now visits only the streams with work queued (`crates/driver/src/fake/busy.rs`):
//! this bench's means there, 0.17 s, 0.35 s and 0.90 s.
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

#[path = "../tests/cli_scenarios/synthetic.rs"]
mod synthetic;

use criterion::{BenchmarkId, Criterion, SamplingMode, criterion_group, criterion_main};
use ferrocuda_cli::replay::replay;
use std::hint::black_box;
use std::time::Duration;

/// The device: 80 GiB, as an H100's.
const CAPACITY: u64 = 80 << 30;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("many_streams");
    // Iterations of a second or so: the same number in every sample.
    g.sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(20));
    for streams in [20_000, 40_000, 100_000] {
        let events = synthetic::many_streams(streams);
        g.bench_with_input(BenchmarkId::new("replay", streams), &events, |b, events| {
            b.iter(|| {
                let (figures, allocator) =
                    replay(black_box(events), "", CAPACITY, |_| {}).expect("replay");
                drop(allocator); // gives every segment back: a driver free each
                figures.timed_events
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
