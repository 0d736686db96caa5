//! Pinned host memory, measured like `xtask/anchors/torch_pinned.py` measures PyTorch's:
//! - `pinned/pair_*`: a cached allocate + free pair through the host allocator (PyTorch:
//!   `getHostAllocator(kCUDA)->allocate(n)` and its deleter), and
//!   `pinned/empty_pair_*`: a [`PinnedBuffer`] made and dropped (PyTorch: `at::empty({n},
//!   pinned_memory(true))` and its destruction), for 4 KiB, 1 MiB and 64 MiB; and the 1 MiB
//!   pair on 8 threads (per pair per thread);
//! - `h2d/pinned_64MiB` and `h2d/pageable_64MiB`: a 64 MiB host-to-device copy and a stream
//!   sync, from a pinned buffer (non-blocking) and from a `Vec` (PyTorch: `copy_` from a
//!   pinned and from a pageable tensor), reported as bytes per second; and
//!   `h2d/pageable_64MiB_staged_4threads`, the copy from a `Vec` with
//!   `pageable_copy_threads:4` (ferrocuda's own key: staged by four threads);
//! - `d2h/pinned_64MiB`, `d2h/pageable_64MiB`, `d2h/to_host_64MiB` and the last two
//!   `_staged_4threads`: the same copies the other way, into a pinned buffer (non-blocking,
//!   then a stream sync), into a `Vec` used again (`DeviceBuffer::copy_to_host`) and into a
//!   new one (`DeviceBuffer::to_host`, whose fresh pages the copy faults in); PyTorch:
//!   `copy_` into a pinned tensor, `copy_` into a pageable one, and `Tensor.cpu()`.
//!
//! On the GPU bundle it runs over the real driver (required there); elsewhere over the fake
//! device, where the pairs run the same code and the copies are host memcpys.
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

mod common;

use criterion::{Criterion, Throughput, criterion_group};
use ferrocuda::alloc::{Caching, DeviceAllocators, HostAllocator};
use ferrocuda::stream::{DeviceBuffer, PinnedBuffer, Runtime};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, StreamHandle};
use std::hint::black_box;
use std::time::{Duration, Instant};

const DEV: DeviceIndex = DeviceIndex(0);
const STREAM: StreamHandle = StreamHandle::legacy(DEV);
const COPY_BYTES: usize = 64 << 20;

fn pair(a: &HostAllocator, size: u64) {
    let r = a.allocate(size, STREAM).expect("allocate");
    a.free(black_box(r.addr())).expect("free");
}

fn pairs(c: &mut Criterion) {
    let rt = Runtime::new(common::driver("pinned"));
    let allocators =
        DeviceAllocators::new(rt.driver().clone(), AllocatorConfig::default(), Caching::On);
    allocators.install(&rt);
    let a = allocators.host().clone();
    let mut g = c.benchmark_group("pinned");
    for (name, size) in [("4KiB", 4u64 << 10), ("1MiB", 1 << 20), ("64MiB", 64 << 20)] {
        pair(&a, size);
        g.bench_function(format!("pair_{name}"), |b| b.iter(|| pair(&a, size)));
        let len = size as usize;
        drop(PinnedBuffer::<u8>::uninit(&rt, len).expect("pinned"));
        g.bench_function(format!("empty_pair_{name}"), |b| {
            b.iter(|| {
                drop(black_box(
                    PinnedBuffer::<u8>::uninit(&rt, len).expect("pinned"),
                ))
            })
        });
    }
    g.bench_function("pair_1MiB_8threads", |b| {
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
    g.finish();

    let mut g = c.benchmark_group("h2d");
    g.throughput(Throughput::Bytes(COPY_BYTES as u64));
    let dev = DeviceBuffer::<u8>::uninit(&rt, DEV, COPY_BYTES).expect("device buffer");
    let stream = rt.current_stream(DEV).expect("stream");
    let pinned = PinnedBuffer::from_slice(&rt, &vec![7u8; COPY_BYTES]).expect("pinned");
    g.bench_function("pinned_64MiB", |b| {
        b.iter(|| {
            pinned.copy_to_device(&dev, true).expect("copy");
            stream.synchronize().expect("sync");
        })
    });
    let pageable = vec![7u8; COPY_BYTES];
    let mut copy_pageable = |name: &str| {
        g.bench_function(name, |b| {
            b.iter(|| {
                dev.copy_from_host(&pageable).expect("copy");
                stream.synchronize().expect("sync");
            })
        });
    };
    copy_pageable("pageable_64MiB");
    allocators
        .set_settings("pageable_copy_threads:4")
        .expect("settings");
    copy_pageable("pageable_64MiB_staged_4threads");
    allocators
        .set_settings("pageable_copy_threads:0")
        .expect("settings");
    g.finish();

    let mut g = c.benchmark_group("d2h");
    g.throughput(Throughput::Bytes(COPY_BYTES as u64));
    g.bench_function("pinned_64MiB", |b| {
        b.iter(|| {
            pinned.copy_from_device(&dev, true).expect("copy");
            stream.synchronize().expect("sync");
        })
    });
    let mut out = vec![0u8; COPY_BYTES];
    let mut read_pageable = |suffix: &str| {
        g.bench_function(format!("pageable_64MiB{suffix}"), |b| {
            b.iter(|| dev.copy_to_host(black_box(&mut out)).expect("copy"))
        });
        g.bench_function(format!("to_host_64MiB{suffix}"), |b| {
            b.iter(|| black_box(dev.to_host().expect("copy")))
        });
    };
    read_pageable("");
    allocators
        .set_settings("pageable_copy_threads:4")
        .expect("settings");
    read_pageable("_staged_4threads");
    allocators
        .set_settings("pageable_copy_threads:0")
        .expect("settings");
    g.finish();
    drop(pinned);
    stream.synchronize().expect("sync");
    a.empty_cache().expect("empty_cache");
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = pairs
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
