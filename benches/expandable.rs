//! Expandable-segment growth: the allocator's cost per 2 MiB mapped, against the raw
//! driver's `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` of one 2 MiB chunk, same device,
//! same run. Each state change is measured once (a page is mapped once), so this is a
//! plain timed loop rather than criterion's repeated samples.
//!
//! Needs a GPU: without one it says it was skipped, and fails when
//! `FERROCUDA_REQUIRE_GPU=1` (the GPU bundle sets it).
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

use ferrocuda::alloc::{Caching, CachingAllocator};
use ferrocuda::driver::{CudaDriver, Driver};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::sync::Arc;
use std::time::Instant;

const DEV: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;
const CHUNKS: u64 = 512; // 1 GiB each round

/// Raw driver: one 2 MiB physical chunk created, mapped and made accessible at a time.
fn raw_ns_per_chunk(d: &CudaDriver) -> f64 {
    let page = d.vm_granularity(DEV).expect("granularity");
    assert_eq!(page, 2 * MIB, "the comparison assumes 2 MiB granularity");
    let va = d.vm_reserve(DEV, CHUNKS * page).expect("reserve");
    let mut handles = Vec::new();
    let t = Instant::now();
    for i in 0..CHUNKS {
        let h = d.vm_create(DEV, page).expect("create");
        d.vm_map(va.base.offset(i * page), h).expect("map");
        d.vm_set_access(DEV, va.base.offset(i * page), page)
            .expect("access");
        handles.push(h);
    }
    let ns = t.elapsed().as_nanos() as f64 / CHUNKS as f64;
    for (i, h) in handles.into_iter().enumerate() {
        d.vm_unmap(DEV, va.base.offset(i as u64 * page), page)
            .expect("unmap");
        d.vm_destroy(h).expect("destroy");
    }
    d.vm_release(va).expect("release");
    ns
}

/// The allocator growing its small-pool range by one 2 MiB page per two 1 MiB requests.
fn ours_ns_per_chunk(d: Arc<CudaDriver>) -> f64 {
    let config = AllocatorConfig::parse("expandable_segments:True").expect("config");
    let a = CachingAllocator::new(d, DEV, config, Caching::On).expect("allocator");
    let stream = StreamHandle::legacy(DEV);
    let warm = a.allocate(MIB, stream).expect("warm-up"); // the reservation, out of the timing
    let t = Instant::now();
    let ptrs: Vec<DevicePtr> = (0..2 * CHUNKS)
        .map(|_| a.allocate(MIB, stream).expect("allocate").ptr)
        .collect();
    let elapsed = t.elapsed().as_nanos() as f64;
    let maps = a.stats().num_device_alloc - 1;
    for p in ptrs.into_iter().chain([warm.ptr]) {
        a.free(p).expect("free");
    }
    a.empty_cache();
    elapsed / maps as f64
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // cargo test --benches asks for a list of benchmarks
    }
    let d = Arc::new(CudaDriver::new());
    if let Some(reason) = d.unavailable_reason() {
        eprintln!("expandable bench skipped: no usable GPU ({reason})");
        if std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            std::process::exit(1);
        }
        return;
    }
    let mut ratios = Vec::new();
    for round in 0..5 {
        let (raw, ours) = if round % 2 == 0 {
            let raw = raw_ns_per_chunk(&d);
            (raw, ours_ns_per_chunk(d.clone()))
        } else {
            let ours = ours_ns_per_chunk(d.clone());
            (raw_ns_per_chunk(&d), ours)
        };
        println!(
            "round {round}: raw map+access {:.2} us per 2 MiB, allocator growth {:.2} us per 2 MiB",
            raw / 1e3,
            ours / 1e3
        );
        ratios.push(ours / raw);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "expandable growth per 2 MiB chunk: median ratio {:.3} over 5 alternating rounds (target <= 1.1)",
        ratios[2]
    );
}
