//! `torch.cuda.memory` functions against PyTorch (CUDACachingAllocator.cpp,
//! torch/cuda/memory.py), written by an independent audit. Per-allocator tests on a private
//! fake driver; global-function tests re-run this binary as a child
//! (`FERROCUDA_MEMORY_API_SCENARIO=<name>`, `FERROCUDA_BACKEND=fake`).
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use ferrocuda::alloc::{Caching, DeviceAllocators};
use ferrocuda::driver::FakeDriver;
use ferrocuda::types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::collections::BTreeMap;
use std::sync::Arc;

type R = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;

fn fresh(capacity: Option<u64>) -> Arc<DeviceAllocators> {
    let mut b = FakeDriver::builder();
    if let Some(c) = capacity {
        b = b.capacity(c);
    }
    DeviceAllocators::new(Arc::new(b.build()), AllocatorConfig::default(), Caching::On)
}

fn s0() -> StreamHandle {
    StreamHandle::legacy(D0)
}

fn map(a: &DeviceAllocators) -> BTreeMap<String, i64> {
    a.device(D0).unwrap().stats().to_map()
}

/// Runs `name` in a child process with the global fake runtime; returns whether the child
/// body should run here (true in the child).
fn in_child(name: &str) -> Result<bool, Box<dyn std::error::Error>> {
    if std::env::var("FERROCUDA_MEMORY_API_SCENARIO").as_deref() == Ok(name) {
        return Ok(true);
    }
    let out = std::process::Command::new(std::env::current_exe()?)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("FERROCUDA_MEMORY_API_SCENARIO", name)
        .env("FERROCUDA_BACKEND", "fake")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .env_remove("FERROCUDA_ALLOC_CONF")
        .env_remove("PYTORCH_NO_CUDA_MEMORY_CACHING")
        .env_remove("FERROCUDA_NO_CUDA_MEMORY_CACHING")
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "child {name} failed:\n{text}"
    );
    Ok(false)
}

// ---------------------------------------------------------------------------------------
// resetPeakStats (CUDACachingAllocator.cpp DeviceCachingAllocator::resetPeakStats): every
// StatArray of the 9 + oversize_* gets peak = current.
#[test]
fn reset_peak_sets_every_peak_to_current() -> R {
    let a = fresh(None);
    let d = a.device(D0)?;
    let x = d.allocate(MIB, s0())?;
    let y = d.allocate(3 * MIB, s0())?;
    let z = d.allocate(100, s0())?;
    d.free(y.ptr)?;
    d.free(z.ptr)?;
    let before = map(&a);
    assert!(before["allocated_bytes.all.peak"] > before["allocated_bytes.all.current"]);
    d.reset_peak_stats();
    let m = map(&a);
    for (k, v) in &m {
        if let Some(base) = k.strip_suffix(".peak") {
            assert_eq!(*v, m[&format!("{base}.current")], "{k}");
        }
    }
    // accumulated untouched
    assert_eq!(
        m["allocated_bytes.all.allocated"],
        before["allocated_bytes.all.allocated"]
    );
    d.free(x.ptr)?;
    Ok(())
}

// resetAccumulatedStats: allocated/freed of the 9 arrays + oversize, and num_alloc_retries,
// num_ooms, num_sync_all_streams, num_device_alloc, num_device_free all zeroed; current and
// peak kept.
#[test]
fn reset_accumulated_zeroes_totals_and_counters() -> R {
    let a = fresh(None);
    let d = a.device(D0)?;
    let x = d.allocate(MIB, s0())?;
    let y = d.allocate(30 * MIB, s0())?;
    d.free(y.ptr)?;
    d.empty_cache();
    let before = map(&a);
    assert!(before["num_device_alloc"] >= 2 && before["num_device_free"] >= 1);
    assert_eq!(before["num_sync_all_streams"], 1);
    d.reset_accumulated_stats();
    let m = map(&a);
    for (k, v) in &m {
        if k.ends_with(".allocated") || k.ends_with(".freed") {
            assert_eq!(*v, 0, "{k}");
        }
        if k.ends_with(".current") || k.ends_with(".peak") {
            assert_eq!(*v, before[k], "{k} kept");
        }
    }
    for k in [
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
    ] {
        assert_eq!(m[k], 0, "{k}");
    }
    // freed counts from the reset: Stat::reset_accumulated sets freed = 0.
    d.free(x.ptr)?;
    let m = map(&a);
    assert_eq!(m["allocated_bytes.all.freed"], MIB as i64);
    assert_eq!(m["allocated_bytes.all.allocated"], 0);
    assert_eq!(m["allocation.all.freed"], 1);
    Ok(())
}

// emptyCache -> release_cached_blocks -> synchronize_and_free_events: num_sync_all_streams++
// unconditionally (no capture), each cudaFree counts in num_device_free and segment freed.
#[test]
fn empty_cache_counts() -> R {
    let a = fresh(None);
    let d = a.device(D0)?;
    d.empty_cache();
    assert_eq!(
        map(&a)["num_sync_all_streams"],
        1,
        "even with nothing cached"
    );
    let x = d.allocate(100, s0())?; // small segment 2 MiB
    let y = d.allocate(5 * MIB, s0())?; // large segment 20 MiB
    let keep = d.allocate(100, s0())?; // same small segment as x
    d.free(x.ptr)?;
    d.free(y.ptr)?;
    d.empty_cache();
    let m = map(&a);
    assert_eq!(m["num_sync_all_streams"], 2);
    assert_eq!(m["num_device_alloc"], 2);
    assert_eq!(
        m["num_device_free"], 1,
        "small segment still has a live block"
    );
    assert_eq!(m["segment.all.current"], 1);
    assert_eq!(m["segment.all.freed"], 1);
    assert_eq!(m["segment.large_pool.freed"], 1);
    assert_eq!(m["reserved_bytes.all.current"], 2 * MIB as i64);
    assert_eq!(m["reserved_bytes.all.peak"], 22 * MIB as i64);
    assert_eq!(
        m["inactive_split.all.current"], 2,
        "x's free block and the tail"
    );
    d.free(keep.ptr)?;
    Ok(())
}

// setMemoryFraction / getMemoryFraction: allowed = size_t(fraction * totalGlobalMem) for
// fraction < 1, nullopt at 1; get = allowed/total, 1.0 when unset.
#[test]
fn memory_fraction_rounding() -> R {
    let total = 1001u64 * MIB + 7;
    let a = fresh(Some(total));
    let d = a.device(D0)?;
    assert_eq!(d.memory_fraction(), 1.0);
    d.set_memory_fraction(0.3)?;
    let allowed = (0.3 * total as f64) as u64;
    assert_eq!(d.memory_fraction(), allowed as f64 / total as f64);
    d.set_memory_fraction(1.0)?;
    assert_eq!(d.memory_fraction(), 1.0);
    d.set_memory_fraction(0.0)?;
    assert_eq!(d.memory_fraction(), 0.0);
    // C++ TORCH_CHECK text (reached only when Python's check passes, e.g. NaN)
    let e = d.set_memory_fraction(1.5).unwrap_err().to_string();
    assert_eq!(e, "invalid fraction:1.5. Please set within [0, 1].");
    Ok(())
}

// With fraction, a growth beyond allowed is an OOM (num_ooms += 1) without driver malloc.
#[test]
fn memory_fraction_limits_reserved() -> R {
    let a = fresh(Some(100 * MIB));
    let d = a.device(D0)?;
    d.set_memory_fraction(0.25)?; // 25 MiB
    let x = d.allocate(20 * MIB, s0())?;
    let err = d.allocate(10 * MIB, s0()).unwrap_err().to_string();
    assert!(err.contains("25.00 MiB allowed"), "{err}");
    let m = map(&a);
    assert_eq!(m["num_ooms"], 1);
    // release_cached_blocks returns true -> alloc_block(isRetry=true) counts a retry.
    assert_eq!(m["num_alloc_retries"], 1);
    assert_eq!(m["num_sync_all_streams"], 1);
    d.free(x.ptr)?;
    Ok(())
}

// raw_alloc_with_stream: nbytes == 0 -> nullptr, no stats; 1 byte -> 512 allocated,
// requested 1.
#[test]
fn raw_alloc_zero_and_rounding() -> R {
    let a = fresh(None);
    let d = a.device(D0)?;
    let z = d.allocate(0, s0())?;
    assert_eq!(z.ptr, DevicePtr(0));
    let m = map(&a);
    assert_eq!(m["allocation.all.allocated"], 0);
    assert_eq!(m["num_device_alloc"], 0);
    a.free_anywhere(DevicePtr(0))?;
    let p = d.allocate(1, s0())?;
    let m = map(&a);
    assert_eq!(m["allocated_bytes.all.current"], 512);
    assert_eq!(m["requested_bytes.all.current"], 1);
    assert_eq!(m["reserved_bytes.all.current"], 2 * MIB as i64);
    assert_eq!(m["active_bytes.small_pool.current"], 512);
    a.free_anywhere(p.ptr)?;
    let e = a.free_anywhere(DevicePtr(0x1234)).unwrap_err().to_string();
    assert_eq!(e, "invalid device pointer: 0x1234");
    Ok(())
}

// memory_stats keys: 9 arrays x 3 pools x 4 + oversize 2x4 + counters; max_split_size -1.
#[test]
fn memory_stats_keys() -> R {
    let a = fresh(None);
    let m = map(&a);
    assert_eq!(m["max_split_size"], -1);
    let mut expected = 9 * 3 * 4 + 2 * 4 + 6;
    if m.contains_key("num_oom_rejections") {
        expected += 1;
    }
    assert_eq!(m.len(), expected, "{:?}", m.keys().collect::<Vec<_>>());
    Ok(())
}

// parseArgs resets max_split_size / roundup_power2_divisions / gc threshold; keeps
// expandable_segments.
#[test]
fn settings_reparse_resets() -> R {
    let a = fresh(None);
    a.device(D0)?;
    a.set_settings("max_split_size_mb:40,expandable_segments:True")?;
    assert_eq!(map(&a)["max_split_size"], 40 * MIB as i64);
    a.set_settings("garbage_collection_threshold:0.5")?;
    assert_eq!(map(&a)["max_split_size"], -1);
    let c = a.device(D0)?.config();
    assert!(c.expandable.enabled, "kept");
    Ok(())
}

// expandable segments: memory_stats keys same; segment counts per mapped range.
#[test]
fn expandable_stats() -> R {
    let a = fresh(None);
    a.set_settings("expandable_segments:True")?;
    let d = a.device(D0)?;
    let x = d.allocate(5 * MIB, s0())?;
    let m = map(&a);
    assert_eq!(m["reserved_bytes.all.current"], 20 * MIB as i64);
    // map_block: reserved_bytes and num_device_alloc only, no segment stat.
    assert_eq!(m["segment.all.current"], 0);
    assert_eq!(m["num_device_alloc"], 1);
    d.free(x.ptr)?;
    d.empty_cache();
    let m = map(&a);
    assert_eq!(m["reserved_bytes.all.current"], 0);
    assert_eq!(m["segment.all.current"], 0);
    assert_eq!(m["num_device_free"], 1);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Global functions (child processes).
use ferrocuda::memory as mem;

// caching_allocator_delete(0) -> raw_delete -> free(nullptr): returns without error.
#[test]
fn g_delete_null_fresh() -> R {
    if !in_child("g_delete_null_fresh")? {
        return Ok(());
    }
    mem::caching_allocator_delete(DevicePtr(0))?;
    Ok(())
}

// Python set_per_process_memory_fraction: ValueError
// "Invalid fraction value: 1.5. Allowed range: 0~1" (checked before the C++ call).
#[test]
fn g_fraction_message() -> R {
    if !in_child("g_fraction_message")? {
        return Ok(());
    }
    let e = mem::set_per_process_memory_fraction(1.5, D0)
        .unwrap_err()
        .to_string();
    assert_eq!(e, "Invalid fraction value: 1.5. Allowed range: 0~1");
    Ok(())
}

// get_per_process_memory_fraction / set: round trip with truncation on global runtime.
#[test]
fn g_fraction_roundtrip() -> R {
    if !in_child("g_fraction_roundtrip")? {
        return Ok(());
    }
    mem::set_per_process_memory_fraction(0.5, D0)?;
    assert_eq!(mem::get_per_process_memory_fraction(D0)?, 0.5);
    mem::set_per_process_memory_fraction(1.0, D0)?;
    assert_eq!(mem::get_per_process_memory_fraction(D0)?, 1.0);
    Ok(())
}

#[test]
fn g_misc() -> R {
    if !in_child("g_misc")? {
        return Ok(());
    }
    assert_eq!(mem::get_allocator_backend(), "native");
    // Before init: memory_stats empty; memory_allocated 0.
    assert!(mem::memory_stats(D0)?.is_empty());
    assert!(mem::host_memory_stats()?.is_empty());
    assert_eq!(mem::max_memory_allocated(D0)?, 0);
    let p = mem::caching_allocator_alloc(1000, D0, None)?;
    let q = mem::caching_allocator_alloc(3000, D0, None)?;
    assert_eq!(mem::memory_allocated(D0)?, 1024 + 3072);
    let (free, total) = mem::mem_get_info(D0)?;
    assert_eq!(total - free, 2 * MIB);
    mem::caching_allocator_delete(q)?;
    assert_eq!(mem::max_memory_allocated(D0)?, 4096);
    mem::reset_peak_memory_stats(D0)?;
    assert_eq!(mem::max_memory_allocated(D0)?, 1024);
    assert_eq!(mem::max_memory_reserved(D0)?, 2 * MIB);
    mem::caching_allocator_delete(p)?;
    mem::empty_cache()?;
    let m = mem::memory_stats(D0)?;
    assert_eq!(m["num_sync_all_streams"], 1);
    assert_eq!(m["num_device_free"], 1);
    assert_eq!(mem::memory_reserved(D0)?, 0);
    assert_eq!(mem::max_memory_reserved(D0)?, 2 * MIB);
    mem::reset_accumulated_memory_stats(D0)?;
    let m = mem::memory_stats(D0)?;
    assert_eq!(m["num_sync_all_streams"], 0);
    assert_eq!(m["num_device_alloc"], 0);
    let h = mem::host_memory_stats()?;
    assert!(h.contains_key("num_host_alloc") && h.contains_key("active_requests.current"));
    mem::reset_peak_host_memory_stats()?;
    mem::reset_accumulated_host_memory_stats()?;
    Ok(())
}

// _set_allocator_settings re-parse on the global runtime.
#[test]
fn g_settings() -> R {
    if !in_child("g_settings")? {
        return Ok(());
    }
    let p = mem::caching_allocator_alloc(1, D0, None)?;
    mem::set_allocator_settings("max_split_size_mb:40")?;
    assert_eq!(mem::memory_stats(D0)?["max_split_size"], 40 * MIB as i64);
    mem::set_allocator_settings("roundup_power2_divisions:4")?;
    assert_eq!(mem::memory_stats(D0)?["max_split_size"], -1);
    let e = mem::set_allocator_settings("max_split_size_mb:10")
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_split_size_mb too small"), "{e}");
    mem::caching_allocator_delete(p)?;
    Ok(())
}
