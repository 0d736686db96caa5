//! Sleep and wake of a sleepable pool holding one large segment (1 GiB on a GPU, 64 MiB on
//! the fake device, whose memory is host memory), against the targets:
//! - `sleep/wake_restore`: a wake that maps the pages again and restores the offloaded
//!   contents from pinned host memory (the sleep before it untimed), beside
//!   `sleep/h2d_pinned`: one host-to-device copy of the same bytes from a pinned buffer and a
//!   stream synchronization, the bandwidth a restore cannot beat (target: at least 0.9 of it);
//! - `sleep/idle_sleep_wake`: a sleep that discards and a wake that restores nothing, the
//!   cost of the driver's unmapping and mapping (target: under 1 ms per GiB);
//! - `sleep/offload`: a sleep that copies the contents out (for the record).
//!
//! Each prints its figure per GiB or in GB/s, and the two ratios are printed at the end,
//! with the idle cycle's CPU time per GiB (the target's measure) and what each driver call
//! under it costs alone.
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

mod common;

use criterion::{Criterion, criterion_group};
use ferrocuda::alloc::{Caching, CachingAllocator, Route, SleepMode};
use ferrocuda::driver::Driver;
use ferrocuda::types::{AllocatorConfig, DeviceIndex, PoolId, StreamFlags};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEV: DeviceIndex = DeviceIndex(0);
const OFFLOAD: SleepMode = SleepMode::Offload { checksum: false };

/// A sleepable pool with one live block of `bytes`, and the block's address.
fn serving(driver: &Arc<dyn Driver>, bytes: u64) -> (CachingAllocator, PoolId, u64) {
    let a = CachingAllocator::new(driver.clone(), DEV, AllocatorConfig::default(), Caching::On)
        .expect("allocator");
    let pool = PoolId::handle();
    a.create_sleepable_pool(pool).expect("pool");
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
        .expect("route");
    let stream = ferrocuda::types::StreamHandle::legacy(DEV);
    let block = a.allocate(bytes, stream).expect("allocate");
    a.end_allocate_to_pool(pool).expect("end route");
    (a, pool, block.ptr.0)
}

/// Mean seconds per iteration of a criterion result, from its estimates.
fn mean_seconds(name: &str) -> Option<f64> {
    let dir = std::env::var("CRITERION_HOME").unwrap_or_else(|_| "target/criterion".into());
    let path = format!("{dir}/sleep/{name}/new/estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some(v["mean"]["point_estimate"].as_f64()? / 1e9)
}

fn sleep_wake(c: &mut Criterion) {
    let driver = common::driver("sleep");
    // The bundle requires the GPU; elsewhere the fake device's memory is host memory.
    let gpu = std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let bytes: u64 = if gpu { 1 << 30 } else { 64 << 20 };
    let (a, pool, ptr) = serving(&driver, bytes);
    let gib = bytes as f64 / (1u64 << 30) as f64;
    // Before anything has kept the GPU busy (its clocks low), and again after the benches.
    idle_cpu(&a, pool, gib, "first");
    let mut g = c.benchmark_group("sleep");
    g.bench_function("offload", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                a.sleep(pool, OFFLOAD).expect("sleep");
                spent += start.elapsed();
                a.wake(pool).expect("wake");
            }
            spent
        })
    });
    g.bench_function("wake_restore", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                a.sleep(pool, OFFLOAD).expect("sleep");
                let start = Instant::now();
                a.wake(pool).expect("wake");
                spent += start.elapsed();
            }
            spent
        })
    });
    // The CPU this thread spends in the timed cycles too: (ns, cycles).
    let mut idle_cpu_spent = (0u64, 0u64);
    g.bench_function("idle_sleep_wake", |b| {
        b.iter_custom(|iters| {
            let before = cpu_ns();
            let start = Instant::now();
            for _ in 0..iters {
                a.sleep(pool, SleepMode::Discard).expect("sleep");
                a.wake(pool).expect("wake");
            }
            let wall = start.elapsed();
            if let (Some(before), Some(after)) = (before, cpu_ns()) {
                idle_cpu_spent.0 += after.0 - before.0;
                idle_cpu_spent.1 += iters;
            }
            wall
        })
    });
    let host = driver.host_alloc(bytes).expect("pinned buffer");
    let flags = StreamFlags {
        non_blocking: true,
        priority: 0,
    };
    let stream = driver.stream_create(DEV, flags).expect("stream");
    g.bench_function("h2d_pinned", |b| {
        b.iter(|| {
            driver
                .memcpy_htod_pinned_async(
                    ferrocuda::types::DevicePtr(ptr),
                    (host, 0),
                    bytes,
                    stream,
                )
                .expect("copy");
            driver.stream_synchronize(stream).expect("sync");
        })
    });
    g.finish();
    driver.stream_destroy(stream).expect("stream");
    driver.host_free(host).expect("pinned buffer");
    if idle_cpu_spent.1 > 0 {
        println!(
            "sleep: idle sleep + wake per GiB (the benchmark's cycles): CPU {:.3} ms (this thread) over {} cycles",
            idle_cpu_spent.0 as f64 / 1e6 / idle_cpu_spent.1 as f64 / gib,
            idle_cpu_spent.1
        );
    }
    idle_cpu(&a, pool, gib, "last");
    driver_calls(&driver, bytes);
    if let (Some(wake), Some(h2d), Some(idle)) = (
        mean_seconds("wake_restore"),
        mean_seconds("h2d_pinned"),
        mean_seconds("idle_sleep_wake"),
    ) {
        let gbps = |s: f64| bytes as f64 / s / 1e9;
        println!(
            "sleep: wake with restore {:.2} GB/s, pinned H2D {:.2} GB/s, ratio {:.3} (target >= 0.9); idle sleep + wake {:.3} ms per GiB (target < 1); {} bytes",
            gbps(wake),
            gbps(h2d),
            h2d / wake,
            idle * 1e3 / gib,
            bytes
        );
    }
}

/// Nanoseconds of CPU this thread has used (`/proc/thread-self/schedstat`, Linux: brought up
/// to date at scheduler ticks, so only long intervals are exact) and this
/// process has used (`/proc/self/stat`, clock ticks of 10 ms), when readable.
fn cpu_ns() -> Option<(u64, u64)> {
    let thread = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some((
        thread.split_whitespace().next()?.parse().ok()?,
        ticks * 10_000_000,
    ))
}

/// The idle target is CPU time: 200 idle sleep + wake cycles, wall and CPU per GiB
/// (`when`: before the benches or after them).
fn idle_cpu(a: &CachingAllocator, pool: PoolId, gib: f64, when: &str) {
    const ROUNDS: u32 = 200;
    let (Some(before), start) = (cpu_ns(), Instant::now()) else {
        return;
    };
    for _ in 0..ROUNDS {
        a.sleep(pool, SleepMode::Discard).expect("sleep");
        a.wake(pool).expect("wake");
    }
    let wall = start.elapsed().as_secs_f64();
    let Some(after) = cpu_ns() else { return };
    let per_gib = |ns: u64| ns as f64 / 1e6 / f64::from(ROUNDS) / gib;
    println!(
        "sleep: idle sleep + wake per GiB ({when}): wall {:.3} ms, CPU {:.3} ms (this thread), {:.3} ms (process) (target < 1 ms CPU)",
        wall * 1e3 / f64::from(ROUNDS) / gib,
        per_gib(after.0 - before.0),
        per_gib(after.1 - before.1),
    );
}

/// What the driver's calls under an idle sleep and wake cost, each alone: 10 rounds of
/// creating, mapping, granting access to, unmapping and destroying `bytes` of physical memory.
fn driver_calls(driver: &Arc<dyn Driver>, bytes: u64) {
    let va = driver.vm_reserve(DEV, bytes).expect("reserve");
    let mut spent = [Duration::ZERO; 5];
    let mut timed = |i: usize, f: &mut dyn FnMut()| {
        let start = Instant::now();
        f();
        spent[i] += start.elapsed();
    };
    for _ in 0..10 {
        let mut handle = None;
        timed(0, &mut || {
            handle = Some(driver.vm_create(DEV, bytes).expect("create"))
        });
        let handle = handle.expect("created");
        timed(1, &mut || driver.vm_map(va.base, handle).expect("map"));
        timed(2, &mut || {
            driver.vm_set_access(DEV, va.base, bytes).expect("access")
        });
        timed(3, &mut || {
            driver.vm_unmap(DEV, va.base, bytes).expect("unmap")
        });
        timed(4, &mut || driver.vm_destroy(handle).expect("destroy"));
    }
    driver.vm_release(va).expect("release");
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / 10.0;
    println!(
        "sleep: driver calls for {bytes} bytes, ms each: create {:.3}, map {:.3}, set access {:.3}, unmap {:.3}, destroy {:.3}",
        ms(spent[0]),
        ms(spent[1]),
        ms(spent[2]),
        ms(spent[3]),
        ms(spent[4])
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10);
    targets = sleep_wake
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
