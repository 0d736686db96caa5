//! Scenarios for the pinned host caching allocator (written by an independent audit), judged by PyTorch's
//! `CachingHostAllocator` rules (and docs/pinned.md where ferrocuda deliberately differs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ferrocuda_alloc::{AllocError, HostAllocator, Route};
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver};
use ferrocuda_stream::{DeviceBuffer, PinnedBuffer, Stream};
use ferrocuda_testkit::{Harness, fake_harness};
use ferrocuda_types::{
    AllocatorConfig, CaptureMode, CaptureStatus, DeviceIndex, MemsetValue, PinnedConfig, PoolId,
    StreamHandle,
};
use std::collections::BTreeMap;
use std::sync::Arc;

type R = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;

struct Env {
    h: Harness,
    fake: Arc<FakeDriver>,
    drv: Arc<dyn Driver>,
    host: Arc<HostAllocator>,
}

fn env(conf: &str) -> Result<Env, Box<dyn std::error::Error>> {
    let h = fake_harness();
    let fake = h.fake.clone().expect("fake");
    let drv = h.rt.driver().clone();
    let cfg = if conf.is_empty() {
        AllocatorConfig::default()
    } else {
        AllocatorConfig::parse(conf)?
    };
    let host = HostAllocator::new(drv.clone(), cfg.pinned);
    Ok(Env { h, fake, drv, host })
}

impl Env {
    /// Begins a capture of `stream` and routes the host allocator's allocations of that
    /// capture to a new private pool.
    fn capture(
        &self,
        stream: &Stream,
        mode: CaptureMode,
    ) -> Result<PoolId, Box<dyn std::error::Error>> {
        self.drv.stream_begin_capture(stream.handle(), mode)?;
        let CaptureStatus::Active { id } = self.drv.stream_capture_status(stream.handle())? else {
            return Err("not capturing".into());
        };
        let pool = PoolId::for_capture();
        self.host.begin_allocate_to_pool(pool, Route::Capture(id))?;
        Ok(pool)
    }

    fn stream(&self) -> Result<Stream, Box<dyn std::error::Error>> {
        Ok(self.h.rt.new_stream(D0, 0)?)
    }
    /// Enqueues work on `s` that stays pending (manual completion) until advanced.
    fn busy(&self, s: StreamHandle) -> R {
        let p = self.drv.malloc(D0, 256)?;
        self.drv.memset_async(p, MemsetValue::U8(7), 256, s)?;
        Ok(())
    }
    fn m(&self) -> BTreeMap<String, i64> {
        self.host.stats().to_map()
    }
    fn inv(&self) {
        if let Err(e) = self.host.check_invariants() {
            panic!("invariants: {e}");
        }
    }
}

fn leg() -> StreamHandle {
    StreamHandle::legacy(D0)
}

// Power-of-two rounding, no splitting, reuse in the same bucket only, LIFO.
#[test]
fn rounding_no_split_same_bucket_reuse() -> R {
    let e = env("")?;
    let a = e.host.allocate(1000, leg())?;
    assert_eq!(a.bytes, 1024, "1000 B rounds to 1024");
    let b = e.host.allocate(1025, leg())?;
    assert_eq!(b.bytes, 2048);
    let one = e.host.allocate(1, leg())?;
    assert_eq!(one.bytes, 1);
    let exact = e.host.allocate(4096, leg())?;
    assert_eq!(exact.bytes, 4096);
    assert_eq!(e.fake.calls(Call::HostAlloc), 4);
    e.host.free(a.addr())?;
    // A smaller request of another bucket never takes the 1024 B block (no split).
    let c = e.host.allocate(100, leg())?;
    assert_ne!(c.addr(), a.addr());
    assert_eq!(c.bytes, 128);
    // A larger request of another bucket neither.
    let d = e.host.allocate(1500, leg())?;
    assert_ne!(d.addr(), a.addr());
    assert_eq!(e.fake.calls(Call::HostAlloc), 6);
    // Same bucket: reused.
    let a2 = e.host.allocate(513, leg())?;
    assert_eq!((a2.addr(), a2.bytes), (a.addr(), 1024));
    assert_eq!(e.fake.calls(Call::HostAlloc), 6);
    // LIFO within a bucket.
    let x = e.host.allocate(300, leg())?;
    let y = e.host.allocate(300, leg())?;
    e.host.free(x.addr())?;
    e.host.free(y.addr())?;
    let z = e.host.allocate(257, leg())?;
    assert_eq!(z.addr(), y.addr(), "newest cached block first");
    e.inv();
    Ok(())
}

// Threshold: above pinned_max_round_threshold_mb sizes are exact; a smaller cached
// block of the same bucket is skipped, a larger one taken.
#[test]
fn round_threshold_exact_sizes_and_bucket_sharing() -> R {
    let e = env("pinned_max_round_threshold_mb:1")?;
    let at = e.host.allocate(MIB, leg())?;
    assert_eq!(at.bytes, MIB);
    let below = e.host.allocate(MIB - 1, leg())?;
    assert_eq!(below.bytes, MIB);
    let above = e.host.allocate(MIB + 1, leg())?;
    assert_eq!(above.bytes, MIB + 1, "above the threshold: exact");
    e.host.free(above.addr())?;
    let bigger = e.host.allocate(MIB + 100, leg())?;
    assert_ne!(
        bigger.addr(),
        above.addr(),
        "smaller cached block must be skipped"
    );
    assert_eq!(bigger.bytes, MIB + 100);
    e.host.free(bigger.addr())?;
    // Newest large-enough block of the bucket: `bigger` (MIB+100) fits MIB+50.
    let fits = e.host.allocate(MIB + 50, leg())?;
    assert_eq!(fits.addr(), bigger.addr());
    assert_eq!(fits.bytes, MIB + 100);
    let m = e.m();
    assert_eq!(m["active_bytes.current"], (MIB + MIB + MIB + 100) as i64);
    assert_eq!(
        m["allocated_bytes.current"],
        (MIB + MIB + MIB + 1 + MIB + 100) as i64
    );
    e.inv();
    Ok(())
}

// Events: reuse only after every using stream's event completed; one event per stream.
#[test]
fn events_gate_reuse_per_stream() -> R {
    let e = env("")?;
    let s1 = e.stream()?;
    let s2 = e.stream()?;
    e.busy(s1.handle())?;
    e.busy(s2.handle())?;
    let a = e.host.allocate(4096, leg())?;
    assert!(e.host.record_event(a.addr(), s1.handle())?);
    assert!(e.host.record_event(a.addr(), s1.handle())?);
    assert!(e.host.record_event(a.addr(), s2.handle())?);
    let rec0 = e.fake.calls(Call::EventRecord);
    e.host.free(a.addr())?;
    assert_eq!(
        e.fake.calls(Call::EventRecord) - rec0,
        2,
        "one event per distinct stream"
    );
    assert_eq!(e.m()["active_requests.current"], 1, "not available yet");
    let b = e.host.allocate(4096, leg())?;
    assert_ne!(b.addr(), a.addr(), "both events pending");
    e.fake.advance(s1.handle(), None)?;
    let c = e.host.allocate(4096, leg())?;
    assert_ne!(c.addr(), a.addr(), "s2's event still pending");
    e.fake.advance(s2.handle(), None)?;
    let d = e.host.allocate(4096, leg())?;
    assert_eq!(d.addr(), a.addr(), "reused after all events");
    assert_eq!(e.fake.calls(Call::HostAlloc), 3);
    let m = e.m();
    assert_eq!(m["active_requests.current"], 3);
    assert_eq!(m["allocations.current"], 3);
    e.inv();
    // The event pool: many cycles do not create events without bound.
    let created = e.fake.calls(Call::EventCreate);
    let ha = e.fake.calls(Call::HostAlloc);
    for _ in 0..50 {
        let x = e.host.allocate(64, leg())?;
        e.host.record_event(x.addr(), s1.handle())?;
        e.host.free(x.addr())?;
        e.fake.advance(s1.handle(), None)?; // the fake's record is itself queued work
    }
    let _ = e.host.allocate(64, leg())?;
    assert!(
        e.fake.calls(Call::HostAlloc) - ha <= 2,
        "blocks reused after events"
    );
    assert!(
        e.fake.calls(Call::EventCreate) - created <= 2,
        "events are pooled: {} made",
        e.fake.calls(Call::EventCreate) - created
    );
    e.inv();
    Ok(())
}

// Active stats for an event-driven free drop once the event completes, by the block's
// bytes (PyTorch #169561), even when processed by an allocation of another bucket.
#[test]
fn event_driven_free_updates_active_stats() -> R {
    let e = env("")?;
    let s = e.stream()?;
    e.busy(s.handle())?;
    let a = e.host.allocate(3000, leg())?; // 4096
    e.host.record_event(a.addr(), s.handle())?;
    e.host.free(a.addr())?;
    let m = e.m();
    assert_eq!(
        (m["active_requests.current"], m["active_bytes.current"]),
        (1, 4096)
    );
    e.fake.advance(s.handle(), None)?;
    let other = e.host.allocate(10, leg())?; // processes events
    let m = e.m();
    assert_eq!(
        (m["active_requests.current"], m["active_bytes.current"]),
        (1, 16),
        "only the 16 B block is active"
    );
    assert_eq!(m["active_bytes.freed"], 4096);
    assert_eq!(m["active_requests.freed"], 1);
    e.host.free(other.addr())?;
    e.inv();
    Ok(())
}

// Oldest-first event pass stops at the first event not ready (documented PyTorch way).
#[test]
fn oldest_first_pass_stops_at_pending() -> R {
    let e = env("")?;
    let slow = e.stream()?;
    let fast = e.stream()?;
    e.busy(slow.handle())?;
    e.busy(fast.handle())?;
    let a = e.host.allocate(4096, leg())?;
    let b = e.host.allocate(4096, leg())?;
    e.host.record_event(a.addr(), slow.handle())?;
    e.host.record_event(b.addr(), fast.handle())?;
    e.host.free(a.addr())?;
    e.host.free(b.addr())?;
    e.fake.advance(fast.handle(), None)?;
    let c = e.host.allocate(4096, leg())?;
    assert!(c.addr() != a.addr() && c.addr() != b.addr());
    e.fake.advance(slow.handle(), None)?;
    let d = e.host.allocate(4096, leg())?;
    assert!(d.addr() == a.addr() || d.addr() == b.addr());
    e.inv();
    Ok(())
}

// empty_cache gives back exactly the cached free blocks.
#[test]
fn empty_cache_only_cached_blocks() -> R {
    let e = env("")?;
    let s = e.stream()?;
    e.busy(s.handle())?;
    let used = e.host.allocate(100, leg())?; // 128, stays in use
    let cached = e.host.allocate(200, leg())?; // 256, freed plainly
    let pending = e.host.allocate(300, leg())?; // 512, freed with pending event
    e.host.record_event(pending.addr(), s.handle())?;
    e.host.free(cached.addr())?;
    e.host.free(pending.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    let m = e.m();
    assert_eq!(m["allocations.current"], 2);
    assert_eq!(m["allocated_bytes.current"], 128 + 512);
    assert_eq!(m["num_host_free"], 1);
    assert_eq!(m["allocated_bytes.freed"], 256);
    e.fake.advance(s.handle(), None)?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 2);
    let m = e.m();
    assert_eq!(m["allocations.current"], 1);
    assert_eq!(m["allocated_bytes.current"], 128);
    assert_eq!(m["active_requests.current"], 1);
    assert_eq!(m["host_free_time.count"], 2);
    e.host.free(used.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 3);
    let m = e.m();
    assert_eq!(
        (m["allocations.current"], m["allocated_bytes.current"]),
        (0, 0)
    );
    e.inv();
    Ok(())
}

// Statistics exact (PyTorch's keys), peaks and accumulated resets.
#[test]
fn statistics_exact_and_resets() -> R {
    let e = env("")?;
    let a = e.host.allocate(100, leg())?; // 128
    let b = e.host.allocate(200, leg())?; // 256
    let c = e.host.allocate(100, leg())?; // 128
    e.host.free(a.addr())?;
    let d = e.host.allocate(128, leg())?; // reuse a
    assert_eq!(d.addr(), a.addr());
    let m = e.m();
    let want: &[(&str, i64)] = &[
        ("allocations.current", 3),
        ("allocations.peak", 3),
        ("allocations.allocated", 3),
        ("allocations.freed", 0),
        ("allocated_bytes.current", 512),
        ("allocated_bytes.peak", 512),
        ("allocated_bytes.allocated", 512),
        ("active_requests.current", 3),
        ("active_requests.allocated", 4),
        ("active_requests.freed", 1),
        ("active_requests.peak", 3),
        ("active_bytes.current", 512),
        ("active_bytes.allocated", 640),
        ("active_bytes.freed", 128),
        ("active_bytes.peak", 512),
        ("num_host_alloc", 3),
        ("num_host_free", 0),
        ("host_alloc_time.count", 3),
        ("host_free_time.count", 0),
    ];
    for (k, v) in want {
        assert_eq!(m[*k], *v, "{k}");
    }
    for x in [b, c, d] {
        e.host.free(x.addr())?;
    }
    e.host.empty_cache()?;
    let m = e.m();
    for (k, v) in [
        ("allocations.current", 0),
        ("allocations.freed", 3),
        ("allocated_bytes.freed", 512),
        ("num_host_free", 3),
        ("host_free_time.count", 3),
        ("active_requests.current", 0),
        ("active_bytes.current", 0),
        ("allocations.peak", 3),
    ] {
        assert_eq!(m[k], v, "{k}");
    }
    e.host.reset_peak_stats();
    let m = e.m();
    for k in [
        "allocations.peak",
        "allocated_bytes.peak",
        "active_requests.peak",
        "active_bytes.peak",
        "host_alloc_time.max",
        "host_free_time.max",
    ] {
        assert_eq!(m[k], 0, "{k} after reset_peak");
    }
    e.host.reset_accumulated_stats();
    let m = e.m();
    for k in [
        "allocations.allocated",
        "allocations.freed",
        "allocated_bytes.allocated",
        "active_requests.allocated",
        "active_bytes.freed",
        "num_host_alloc",
        "num_host_free",
        "host_alloc_time.count",
        "host_free_time.total",
    ] {
        assert_eq!(m[k], 0, "{k} after reset_accumulated");
    }
    // Documented per-bucket approximation: 64 B, free, 128 B => active peak 2.
    let p = e.host.allocate(64, leg())?;
    e.host.free(p.addr())?;
    let q = e.host.allocate(128, leg())?;
    let m = e.m();
    assert_eq!(m["active_requests.peak"], 2);
    assert_eq!(m["allocations.peak"], 2);
    assert_eq!(m["num_host_alloc"], 2);
    e.host.free(q.addr())?;
    e.inv();
    Ok(())
}

// Register path: malloc + prefault split + register, and the way back is remembered.
#[test]
fn register_path_and_config_change() -> R {
    let e = env("pinned_use_cuda_host_register:True,pinned_num_register_threads:4")?;
    let big = e.host.allocate(60 * 1024, leg())?; // 64 KiB: 4 parts
    assert_eq!(big.bytes, 64 * 1024);
    assert_eq!(e.fake.calls(Call::HostMalloc), 1);
    assert_eq!(e.fake.calls(Call::HostRegister), 1);
    assert_eq!(e.fake.calls(Call::HostPrefault), 4);
    assert_eq!(e.fake.calls(Call::HostAlloc), 0);
    let small = e.host.allocate(8 * 1024, leg())?; // < 4 KiB * 4: one part
    assert_eq!(e.fake.calls(Call::HostPrefault), 5);
    e.host
        .update_config("pinned_use_cuda_host_register:False")?;
    let plain = e.host.allocate(1 << 20, leg())?;
    assert_eq!(e.fake.calls(Call::HostAlloc), 1);
    assert_eq!(e.fake.calls(Call::HostMalloc), 2);
    for x in [big, small, plain] {
        e.host.free(x.addr())?;
    }
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostUnregister), 2);
    assert_eq!(e.fake.calls(Call::HostMfree), 2);
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    let m = e.m();
    assert_eq!((m["num_host_alloc"], m["num_host_free"]), (3, 3));
    assert_eq!(m["host_alloc_time.count"], 3);
    assert_eq!(m["host_free_time.count"], 3);
    // Register round trip through a PinnedBuffer.
    let e2 = env("pinned_use_cuda_host_register:True,pinned_num_register_threads:2")?;
    e2.h.rt.set_host_memory(e2.host.clone());
    let v: Vec<f32> = (0..5000).map(|i| i as f32).collect();
    let pb = PinnedBuffer::from_slice(&e2.h.rt, &v)?;
    let dev = DeviceBuffer::<f32>::uninit(&e2.h.rt, D0, v.len())?;
    pb.copy_to_device(&dev, false)?;
    assert_eq!(dev.to_host()?, v);
    e.inv();
    e2.inv();
    Ok(())
}

// Reserve segment: one slab, 4 KiB pieces, never freed, space not handed out again.
#[test]
fn reserve_segment_carving() -> R {
    let e = env("pinned_reserve_segment_size_mb:1")?;
    let a = e.host.allocate(100, leg())?;
    assert_eq!(a.bytes, 128);
    assert_eq!(e.fake.calls(Call::HostAlloc), 1, "the slab");
    let b = e.host.allocate(5000, leg())?;
    assert_eq!(b.bytes, 8192);
    assert_eq!(e.fake.calls(Call::HostAlloc), 1, "carved from the slab");
    assert_eq!(b.base, a.base, "same slab");
    assert!(b.addr() >= a.addr() + 4096, "4 KiB steps");
    let m = e.m();
    assert_eq!(m["allocations.current"], 2, "slab not counted, pieces are");
    assert_eq!(m["allocated_bytes.current"], 128 + 8192);
    assert_eq!(m["num_host_alloc"], 2);
    assert_eq!(
        m["host_alloc_time.count"], 1,
        "only the slab's driver call is timed"
    );
    e.host.free(a.addr())?;
    e.host.free(b.addr())?;
    let a2 = e.host.allocate(120, leg())?;
    assert_eq!(a2.addr(), a.addr(), "cached piece reused");
    e.host.free(a2.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 0, "slab never freed");
    let m = e.m();
    assert_eq!(m["allocations.current"], 0);
    assert_eq!(m["allocated_bytes.current"], 0);
    assert_eq!(m["num_host_free"], 2);
    assert_eq!(m["host_free_time.count"], 0, "no driver free was made");
    let c = e.host.allocate(100, leg())?;
    assert_eq!(e.fake.calls(Call::HostAlloc), 1);
    assert!(
        c.addr() >= b.addr() + 8192,
        "forgotten slab space not handed out again"
    );
    // Exhaust the slab: the rest goes to cudaHostAlloc.
    let big = e.host.allocate(600 * 1024, leg())?; // 1 MiB rounded: does not fit
    assert_eq!(e.fake.calls(Call::HostAlloc), 2);
    assert_ne!(big.base, a.base);
    e.host.free(big.addr())?;
    e.host.free(c.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    e.inv();
    Ok(())
}

// pinned_max_cached_size_mb: larger blocks go back to the driver when free.
#[test]
fn max_cached_size_releases_large_blocks() -> R {
    let e = env("pinned_max_cached_size_mb:1")?;
    let s = e.stream()?;
    let a = e.host.allocate(MIB + MIB / 2, leg())?;
    assert_eq!(a.bytes, MIB + MIB / 2, "above the cache limit: exact");
    e.host.free(a.addr())?;
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    let m = e.m();
    assert_eq!(
        (
            m["allocations.current"],
            m["num_host_free"],
            m["active_requests.current"]
        ),
        (0, 1, 0)
    );
    let small = e.host.allocate(MIB, leg())?;
    e.host.free(small.addr())?;
    assert_eq!(e.fake.calls(Call::HostFree), 1, "1 MiB is cached");
    e.busy(s.handle())?;
    let b = e.host.allocate(3 * MIB, leg())?;
    e.host.record_event(b.addr(), s.handle())?;
    e.host.free(b.addr())?;
    assert_eq!(e.fake.calls(Call::HostFree), 1, "waits for its event");
    e.fake.advance(s.handle(), None)?;
    let _t = e.host.allocate(16, leg())?;
    assert_eq!(
        e.fake.calls(Call::HostFree),
        2,
        "released once its event completed"
    );
    let m = e.m();
    assert_eq!(m["allocations.current"], 2);
    assert_eq!(m["allocated_bytes.current"], (MIB + 16) as i64);
    assert_eq!(m["active_requests.current"], 1);
    e.inv();
    Ok(())
}

// Captures: private pool, no events recorded during capture, used blocks retired,
// event queries of the default pool do not break a global-mode capture.
#[test]
fn capture_private_pool_and_retirement() -> R {
    let e = env("")?;
    let cap = e.stream()?;
    let other = e.stream()?;
    let slow = e.stream()?;
    // A default-pool block cached, and one waiting on a pending event.
    let p = e.host.allocate(4096, leg())?;
    e.host.free(p.addr())?;
    e.busy(slow.handle())?;
    let q = e.host.allocate(8192, leg())?;
    e.host.record_event(q.addr(), slow.handle())?;
    e.host.free(q.addr())?;

    let pool = e.capture(&cap, CaptureMode::Global)?;
    let a = e.host.allocate(4096, cap.handle())?;
    assert_ne!(
        a.addr(),
        p.addr(),
        "capture must not take a default-pool block"
    );
    // Default pool allocation on another stream during capture (processes events).
    let o = e.host.allocate(4096, other.handle())?;
    assert_eq!(
        o.addr(),
        p.addr(),
        "non-capturing stream uses the default pool"
    );
    assert!(
        matches!(
            e.drv.stream_capture_status(cap.handle())?,
            CaptureStatus::Active { .. }
        ),
        "allocator broke the capture"
    );
    let rec0 = e.fake.calls(Call::EventRecord);
    e.host.record_event(a.addr(), cap.handle())?;
    e.host.free(a.addr())?;
    assert_eq!(
        e.fake.calls(Call::EventRecord),
        rec0,
        "no events during capture"
    );
    let b = e.host.allocate(4096, cap.handle())?;
    assert_ne!(b.addr(), a.addr(), "a captured-and-used block is retired");
    assert!(
        matches!(
            e.drv.stream_capture_status(cap.handle())?,
            CaptureStatus::Active { .. }
        ),
        "capture invalidated"
    );
    e.drv.stream_end_capture(cap.handle())?;
    e.host.end_allocate_to_pool(pool)?;
    // After the capture, allocations on that stream go to the default pool again.
    let after = e.host.allocate(4096, cap.handle())?;
    assert_ne!(after.addr(), a.addr());
    assert_ne!(after.addr(), b.addr());
    e.host.free(b.addr())?;
    let after2 = e.host.allocate(4096, leg())?;
    assert_ne!(
        after2.addr(),
        b.addr(),
        "private-pool block must not leak into default"
    );
    e.host.release_pool(pool)?;
    e.fake.advance(slow.handle(), None)?;
    let hf = e.fake.calls(Call::HostFree);
    e.host.empty_cache()?;
    // q (default, event done) and b (freeable private pool) go back; a stays retired.
    assert_eq!(e.fake.calls(Call::HostFree) - hf, 2);
    e.inv();
    Ok(())
}

// PinnedBuffer non-blocking copies hold the block until the copy completes.
#[test]
fn pinned_buffer_nonblocking_copy_holds_block() -> R {
    let e = env("")?;
    e.h.rt.set_host_memory(e.host.clone());
    let rt = &e.h.rt;
    let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let staged = PinnedBuffer::from_slice(rt, &v)?;
    let addr = staged.range().unwrap().addr();
    let dev = DeviceBuffer::<f32>::uninit(rt, D0, v.len())?;
    staged.copy_to_device(&dev, true)?;
    drop(staged);
    let other = PinnedBuffer::<f32>::uninit(rt, 1000)?;
    let other_addr = other.range().unwrap().addr();
    assert_ne!(other_addr, addr, "reused before the copy completed");
    drop(other);
    rt.synchronize(D0)?;
    assert_eq!(dev.to_host()?, v);
    let again = PinnedBuffer::<f32>::uninit(rt, 1000)?;
    let a2 = again.range().unwrap().addr();
    assert!(a2 == addr || a2 == other_addr);
    assert_eq!(e.fake.calls(Call::HostAlloc), 2);
    // D2H non-blocking, read after sync.
    let back = PinnedBuffer::<f32>::uninit(rt, 1000)?;
    back.copy_from_device(&dev, true)?;
    rt.synchronize(D0)?;
    assert_eq!(back.to_vec()?, v);
    // Empty buffer: null range, nothing counted.
    let before = e.m();
    let empty = PinnedBuffer::<f32>::uninit(rt, 0)?;
    assert!(empty.range().is_none());
    drop(empty);
    assert_eq!(e.m(), before);
    drop((again, back));
    rt.synchronize(D0)?;
    let probe = e.host.allocate(1 << 20, leg())?; // processes the events
    e.host.free(probe.addr())?;
    let m = e.m();
    assert_eq!(m["active_requests.current"], 0);
    e.inv();
    Ok(())
}

// Bad input: typed errors, no panic, statistics untouched.
#[test]
fn bad_inputs_are_typed_errors() -> R {
    let e = env("")?;
    let keep = e.host.allocate(4096, leg())?;
    let zero = e.host.allocate(0, leg())?;
    assert_eq!(zero.bytes, 0);
    e.host.free(zero.addr())?;
    let before = e.m();
    assert!(matches!(
        e.host.allocate(u64::MAX, leg()),
        Err(AllocError::HostRequestTooLarge(_))
    ));
    assert!(matches!(
        e.host.allocate((1 << 63) + 1, leg()),
        Err(AllocError::HostRequestTooLarge(_))
    ));
    // Exactly 2^63: the driver refuses, a typed error.
    let huge = e.host.allocate(1 << 63, leg());
    assert!(huge.is_err(), "{huge:?}");
    let huge = e.host.allocate((1 << 62) + 1, leg());
    assert!(huge.is_err(), "{huge:?}");
    assert!(matches!(
        e.host.free(0xdead_beef),
        Err(AllocError::InvalidHostPointer(0xdead_beef))
    ));
    assert!(matches!(
        e.host.free(keep.addr() + 1),
        Err(AllocError::InvalidHostPointer(_))
    ));
    assert!(!e.host.record_event(0x1234, leg())?);
    let mut after = e.m();
    // failed allocations may be timed? they must not count as allocations
    after.retain(|k, _| !k.starts_with("host_"));
    let mut b2 = before.clone();
    b2.retain(|k, _| !k.starts_with("host_"));
    assert_eq!(after, b2, "errors changed statistics");
    e.host.free(keep.addr())?;
    let snap = e.m();
    assert!(matches!(
        e.host.free(keep.addr()),
        Err(AllocError::InvalidHostPointer(_))
    ));
    assert!(matches!(
        e.host.record_event(keep.addr(), leg()),
        Err(AllocError::HostBlockNotAllocated(_))
    ));
    assert_eq!(e.m(), snap, "double free changed statistics");
    e.inv();
    // Malformed configuration strings.
    for bad in [
        "pinned_num_register_threads:3",
        "pinned_num_register_threads:0",
        "pinned_num_register_threads:256",
        "pinned_num_register_threads:-4",
        "pinned_use_cuda_host_register:maybe",
        "pinned_max_cached_size_mb:",
        "pinned_max_cached_size_mb:abc",
        "pinned_max_round_threshold_mb:-1",
        "pinned_reserve_segment_size_mb:99999999999999999999999",
        "pinned_bogus_key:1",
        "pinned_use_background_threads",
        ":::",
    ] {
        let r = std::panic::catch_unwind(|| AllocatorConfig::parse(bad));
        match r {
            Ok(Ok(c)) => panic!("{bad:?} accepted: {c:?}"),
            Ok(Err(_)) => {}
            Err(_) => panic!("{bad:?} panicked"),
        }
        let cfg_before = e.host.config();
        assert!(e.host.update_config(bad).is_err(), "update {bad:?}");
        assert_eq!(
            e.host.config(),
            cfg_before,
            "failed update changed config: {bad:?}"
        );
    }
    Ok(())
}

// A stream of a device that does not exist; driver failures in free/query.
#[test]
fn wrong_device_and_driver_failures() -> R {
    let e = env("")?;
    let bad = StreamHandle {
        device: DeviceIndex(9),
        raw: 0,
    };
    let a = e.host.allocate(4096, bad)?; // default pool, no routing: fine
    let rec = e.host.record_event(a.addr(), bad);
    let freed = e.host.free(a.addr());
    assert!(
        rec.is_err() || freed.is_err(),
        "bad device accepted: {rec:?} {freed:?}"
    );
    e.inv();
    assert!(matches!(
        e.host.free(a.addr()),
        Err(AllocError::InvalidHostPointer(_))
    ));
    assert!(DeviceBuffer::<f32>::uninit(&e.h.rt, DeviceIndex(9), 4).is_err());
    // Event record failure: returned, block retired; with catch-all swallowed.
    let s = e.stream()?;
    let b = e.host.allocate(4096, leg())?;
    e.host.record_event(b.addr(), s.handle())?;
    e.fake
        .fail_nth(Call::EventRecord, 1, DriverError::INVALID_VALUE);
    assert!(e.host.free(b.addr()).is_err());
    let c = e.host.allocate(4096, leg())?;
    assert_ne!(c.addr(), b.addr(), "retired block reused");
    e.inv();
    e.host.update_config("pinned_free_catch_all:True")?;
    e.host.record_event(c.addr(), s.handle())?;
    e.fake
        .fail_nth(Call::EventRecord, 1, DriverError::INVALID_VALUE);
    e.host.free(c.addr())?;
    assert_eq!(e.host.suppressed_free_errors(), 1);
    e.inv();
    // Event query failure: the allocation errors, the block is never reused, later fine.
    e.busy(s.handle())?;
    let d = e.host.allocate(64, leg())?;
    e.host.record_event(d.addr(), s.handle())?;
    e.host.free(d.addr())?;
    e.fake.advance(s.handle(), None)?;
    e.fake
        .fail_nth(Call::EventQuery, 1, DriverError::INVALID_VALUE);
    assert!(e.host.allocate(64, leg()).is_err());
    let f = e.host.allocate(64, leg())?;
    assert_ne!(f.addr(), d.addr());
    e.inv();
    // Failing host alloc: typed error, nothing counted.
    let before = e.m();
    e.fake
        .fail_nth(Call::HostAlloc, 1, DriverError::OUT_OF_MEMORY);
    assert!(e.host.allocate(1 << 20, leg()).is_err());
    let mut a1 = e.m();
    let mut b1 = before.clone();
    a1.retain(|k, _| !k.starts_with("host_"));
    b1.retain(|k, _| !k.starts_with("host_"));
    assert_eq!(a1, b1);
    // Failing host free in empty_cache: error, stats stay consistent.
    let g = e.host.allocate(1 << 16, leg())?;
    e.host.free(g.addr())?;
    e.fake
        .fail_nth(Call::HostFree, 1, DriverError::INVALID_VALUE);
    let _ = e.host.empty_cache();
    e.inv();
    Ok(())
}

// Many threads: exact totals.
#[test]
fn concurrent_threads_exact_statistics() -> R {
    let e = env("")?;
    let s = e.stream()?;
    const T: usize = 6;
    const N: usize = 400;
    let sh = s.handle();
    std::thread::scope(|sc| {
        for t in 0..T {
            let host = e.host.clone();
            sc.spawn(move || {
                let mut live = Vec::new();
                let mut seed = (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                for i in 0..N {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let size = 1 + seed % 20_000;
                    let r = host.allocate(size, leg()).unwrap();
                    assert!(r.bytes >= size);
                    if i % 3 == 0 {
                        host.record_event(r.addr(), sh).unwrap();
                    }
                    live.push(r);
                    if live.len() > 4 || i % 2 == 0 {
                        let x = live.remove((seed % live.len() as u64) as usize);
                        host.free(x.addr()).unwrap();
                    }
                }
                for x in live {
                    host.free(x.addr()).unwrap();
                }
            });
        }
    });
    e.fake.advance_all();
    e.host.empty_cache()?;
    let m = e.m();
    let total = (T * N) as i64;
    assert_eq!(m["active_requests.allocated"], total);
    assert_eq!(m["active_requests.freed"], total);
    assert_eq!(m["active_requests.current"], 0);
    assert_eq!(m["active_bytes.current"], 0);
    assert_eq!(m["active_bytes.allocated"], m["active_bytes.freed"]);
    assert_eq!(m["allocations.current"], 0);
    assert_eq!(m["allocated_bytes.current"], 0);
    assert_eq!(m["num_host_alloc"], e.fake.calls(Call::HostAlloc) as i64);
    assert_eq!(m["num_host_free"], e.fake.calls(Call::HostFree) as i64);
    assert_eq!(m["num_host_alloc"], m["num_host_free"]);
    assert_eq!(m["host_alloc_time.count"], m["num_host_alloc"]);
    assert_eq!(m["allocated_bytes.allocated"], m["allocated_bytes.freed"]);
    e.inv();
    Ok(())
}

// Background thread processes events of the default pool.
#[test]
fn background_thread_processes_events() -> R {
    let e = env("pinned_use_background_threads:True")?;
    let s = e.stream()?;
    e.busy(s.handle())?;
    let a = e.host.allocate(4096, leg())?;
    e.host.record_event(a.addr(), s.handle())?;
    e.host.free(a.addr())?;
    e.fake.advance(s.handle(), None)?;
    let mut ok = false;
    for _ in 0..200 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        if e.m()["active_requests.current"] == 0 {
            ok = true;
            break;
        }
    }
    assert!(ok, "background thread never processed the event");
    let b = e.host.allocate(4096, leg())?;
    assert_eq!(b.addr(), a.addr());
    e.inv();
    Ok(())
}

fn env2() -> Result<Env, Box<dyn std::error::Error>> {
    use ferrocuda_driver::Completion;
    let fake = Arc::new(
        FakeDriver::builder()
            .devices(2)
            .completion(Completion::Manual)
            .build(),
    );
    let rt = ferrocuda_stream::Runtime::new(fake.clone());
    let h = Harness::new(rt, Some(fake.clone()));
    let drv = h.rt.driver().clone();
    let host = HostAllocator::new(drv.clone(), PinnedConfig::default());
    Ok(Env { h, fake, drv, host })
}

// Two devices: events are pooled per device; a block used on device 1 then one used on
// device 0 (and a non-blocking copy to device 1) all work.
#[test]
fn two_devices_event_pool_per_device() -> R {
    let e = env2()?;
    let s1 = e.h.rt.new_stream(DeviceIndex(1), 0)?;
    let s0 = e.h.rt.new_stream(D0, 0)?;
    for round in 0..3 {
        let a = e.host.allocate(4096, leg())?;
        e.host.record_event(a.addr(), s1.handle())?;
        e.host.free(a.addr())?;
        e.fake.advance_all();
        let b = e.host.allocate(8192, leg())?; // processes: event back to its pool
        e.host.record_event(b.addr(), s0.handle())?;
        e.host
            .free(b.addr())
            .map_err(|x| format!("round {round}: dev0 free: {x}"))?;
        e.fake.advance_all();
        let c = e.host.allocate(16, leg())?;
        e.host.record_event(c.addr(), s1.handle())?;
        e.host.record_event(c.addr(), s0.handle())?;
        e.host
            .free(c.addr())
            .map_err(|x| format!("round {round}: both free: {x}"))?;
        e.fake.advance_all();
    }
    e.host.empty_cache()?;
    let m = e.m();
    assert_eq!(m["allocations.current"], 0);
    assert_eq!(m["active_requests.current"], 0);
    e.inv();
    // PinnedBuffer non-blocking copy to device 1.
    e.h.rt.set_host_memory(e.host.clone());
    let v: Vec<i32> = (0..3000).collect();
    let pb = PinnedBuffer::from_slice(&e.h.rt, &v)?;
    let d1 = DeviceBuffer::<i32>::uninit(&e.h.rt, DeviceIndex(1), v.len())?;
    pb.copy_to_device(&d1, true)?;
    let addr = pb.range().unwrap().addr();
    drop(pb);
    let other = PinnedBuffer::<i32>::uninit(&e.h.rt, 3000)?;
    assert_ne!(other.range().unwrap().addr(), addr);
    e.h.rt.synchronize(DeviceIndex(1))?;
    assert_eq!(d1.to_host()?, v);
    e.inv();
    Ok(())
}

// Reset peaks with live blocks: peaks equal the current values (per-bucket sums).
#[test]
fn reset_peaks_with_live_blocks() -> R {
    let e = env("")?;
    let xs: Vec<_> = (0..4)
        .map(|i| e.host.allocate(64 << i, leg()))
        .collect::<Result<_, _>>()?;
    for x in &xs[..2] {
        e.host.free(x.addr())?;
    }
    e.host.reset_peak_stats();
    let m = e.m();
    for k in [
        "allocations",
        "allocated_bytes",
        "active_requests",
        "active_bytes",
    ] {
        assert_eq!(
            m[&format!("{k}.peak")],
            m[&format!("{k}.current")],
            "{k} peak after reset"
        );
    }
    assert_eq!(m["active_requests.current"], 2);
    assert_eq!(m["active_bytes.current"], 256 + 512);
    assert_eq!(m["allocated_bytes.current"], 64 + 128 + 256 + 512);
    e.host.reset_accumulated_stats();
    for x in &xs[2..] {
        e.host.free(x.addr())?;
    }
    e.host.empty_cache()?;
    let m = e.m();
    assert_eq!(m["allocations.freed"], 4);
    assert_eq!(m["num_host_free"], 4);
    assert_eq!(m["num_host_alloc"], 0);
    assert_eq!(m["active_requests.freed"], 2);
    e.inv();
    Ok(())
}

// Driver failures on the register path: no leak, nothing counted.
#[test]
fn register_path_failures_do_not_leak() -> R {
    let e = env("pinned_use_cuda_host_register:True,pinned_num_register_threads:2")?;
    e.fake
        .fail_nth(Call::HostRegister, 1, DriverError::OUT_OF_MEMORY);
    let r = e.host.allocate(1 << 16, leg());
    assert!(r.is_err(), "{r:?}");
    assert_eq!(
        e.fake.calls(Call::HostMalloc),
        e.fake.calls(Call::HostMfree),
        "malloc'd memory leaked after a failed cudaHostRegister"
    );
    let m = e.m();
    assert_eq!((m["allocations.current"], m["num_host_alloc"]), (0, 0));
    e.fake
        .fail_nth(Call::HostPrefault, 1, DriverError::INVALID_VALUE);
    let r = e.host.allocate(1 << 16, leg());
    assert!(r.is_err(), "{r:?}");
    assert_eq!(
        e.fake.calls(Call::HostMalloc),
        e.fake.calls(Call::HostMfree),
        "malloc'd memory leaked after a failed pre-fault"
    );
    let ok = e.host.allocate(1 << 16, leg())?;
    e.host.free(ok.addr())?;
    e.host.empty_cache()?;
    assert_eq!(
        e.fake.calls(Call::HostRegister),
        e.fake.calls(Call::HostUnregister) + 1
    );
    e.inv();
    Ok(())
}

// A default-pool block used by the capturing stream during a capture and freed then:
// its event is recorded into the capture (PyTorch's `free`), so the next default-pool
// allocation's event query fails with CUDA_ERROR_CAPTURED_EVENT and the capture is
// invalidated, as PyTorch's throwing query does (docs/pinned.md); the block is never handed
// out while the graph might read it.
#[test]
fn default_block_used_in_capture() -> R {
    let e = env("")?;
    let cap = e.stream()?;
    let other = e.stream()?;
    let a = e.host.allocate(4096, leg())?;
    let pool = e.capture(&cap, CaptureMode::Global)?;
    e.host.record_event(a.addr(), cap.handle())?; // non_blocking copy during capture
    e.host.free(a.addr())?;
    let status = e.drv.stream_capture_status(cap.handle())?;
    assert!(
        matches!(status, CaptureStatus::Active { .. }),
        "after free: {status:?}"
    );
    // An eager allocation on another stream, same thread, during the capture.
    let b = e.host.allocate(4096, other.handle());
    assert!(
        matches!(&b, Err(AllocError::Driver(d)) if *d == DriverError::CAPTURED_EVENT),
        "eager allocation during capture: {b:?}"
    );
    let status = e.drv.stream_capture_status(cap.handle())?;
    assert_eq!(status, CaptureStatus::Invalidated);
    let _ = e.drv.stream_end_capture(cap.handle());
    e.host.end_allocate_to_pool(pool)?;
    let c = e.host.allocate(4096, other.handle())?;
    assert_ne!(
        c.addr(),
        a.addr(),
        "the block whose event failed is never reused"
    );
    Ok(())
}

// Concurrent allocate/free/record with empty_cache, stats and resets on other threads.
#[test]
fn concurrent_with_empty_cache_and_readers() -> R {
    let e = env("pinned_max_cached_size_mb:1")?;
    let s = e.stream()?;
    let sh = s.handle();
    let stop = std::sync::atomic::AtomicBool::new(false);
    const T: usize = 4;
    const N: usize = 300;
    std::thread::scope(|sc| {
        let host = &e.host;
        let stop = &stop;
        let fake = &e.fake;
        sc.spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                host.empty_cache().unwrap();
                let m = host.stats().to_map();
                assert!(m["allocations.current"] >= 0 && m["active_requests.current"] >= 0);
                host.check_invariants().unwrap();
                fake.advance_all();
                std::thread::yield_now();
            }
        });
        let hs: Vec<_> = (0..T)
            .map(|t| {
                sc.spawn(move || {
                    let mut seed = (t as u64 + 7).wrapping_mul(0x2545_f491_4f6c_dd1d);
                    for i in 0..N {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        let size = if i % 10 == 0 {
                            (1 << 20) + seed % (1 << 20)
                        } else {
                            1 + seed % 9000
                        };
                        let r = host.allocate(size, leg()).unwrap();
                        if i % 2 == 0 {
                            host.record_event(r.addr(), sh).unwrap();
                        }
                        host.free(r.addr()).unwrap();
                        // Racing record on a freed block: typed error or Ok(false).
                        let _ = host.record_event(r.addr(), sh);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    e.fake.advance_all();
    e.host.empty_cache()?;
    let m = e.m();
    let total = (T * N) as i64;
    assert_eq!(m["active_requests.allocated"], total);
    assert_eq!(m["active_requests.freed"], total);
    assert_eq!(m["active_requests.current"], 0);
    assert_eq!(m["allocations.current"], 0, "{m:?}");
    assert_eq!(m["num_host_alloc"], e.fake.calls(Call::HostAlloc) as i64);
    assert_eq!(m["num_host_free"], e.fake.calls(Call::HostFree) as i64);
    assert_eq!(m["allocated_bytes.allocated"], m["allocated_bytes.freed"]);
    e.inv();
    Ok(())
}

// Private pool lifecycle: an in-use private block freed after the pool was released
// goes back to the driver at empty_cache and the pool is forgotten.
#[test]
fn private_pool_forgotten_after_release() -> R {
    let e = env("")?;
    let cap = e.stream()?;
    let pool = e.capture(&cap, CaptureMode::ThreadLocal)?;
    let a = e.host.allocate(1000, cap.handle())?;
    let b = e.host.allocate(3000, cap.handle())?;
    e.drv.stream_end_capture(cap.handle())?;
    e.host.end_allocate_to_pool(pool)?;
    assert_eq!(e.host.private_pool_count(), 1);
    e.host.free(a.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 0, "held pool is not emptied");
    e.host.release_pool(pool)?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 1);
    assert_eq!(e.host.private_pool_count(), 1, "b still owned");
    e.host.free(b.addr())?;
    e.host.empty_cache()?;
    assert_eq!(e.fake.calls(Call::HostFree), 2);
    assert_eq!(e.host.private_pool_count(), 0);
    let m = e.m();
    assert_eq!((m["allocations.current"], m["num_host_free"]), (0, 2));
    // Releasing again / unknown pools: typed errors, no panic.
    assert!(e.host.release_pool(pool).is_err());
    assert!(e.host.end_allocate_to_pool(PoolId(999, 0)).is_err());
    e.inv();
    Ok(())
}

// Dropping the allocator gives cached blocks back and leaves in-use ones alone.
#[test]
fn drop_returns_cached_blocks() -> R {
    let e = env("")?;
    let a = e.host.allocate(100, leg())?;
    let _b = e.host.allocate(200, leg())?;
    e.host.free(a.addr())?;
    let Env {
        h,
        fake,
        drv: _,
        host,
    } = e;
    drop(host);
    assert_eq!(fake.calls(Call::HostFree), 1);
    drop(h);
    Ok(())
}

// Reserve pieces are disjoint (data round trip) and pieces above the cache limit are
// not handed to cudaFreeHost.
#[test]
fn reserve_pieces_disjoint_and_cache_limit() -> R {
    let e = env("pinned_reserve_segment_size_mb:4,pinned_max_cached_size_mb:1")?;
    e.h.rt.set_host_memory(e.host.clone());
    let bufs: Vec<PinnedBuffer<i32>> = (0..6)
        .map(|i| PinnedBuffer::from_slice(&e.h.rt, &vec![i; 1000 + 700 * i as usize]))
        .collect::<Result<_, _>>()?;
    assert_eq!(e.fake.calls(Call::HostAlloc), 1);
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(
            b.to_vec()?,
            vec![i as i32; 1000 + 700 * i],
            "piece {i} overwritten"
        );
    }
    drop(bufs);
    // 2 MiB exact (above the cache limit), carved from the 4 MiB slab.
    let big = e.host.allocate(2 * MIB, leg())?;
    assert_eq!(e.fake.calls(Call::HostAlloc), 1, "carved");
    let freed = e.host.free(big.addr());
    assert!(freed.is_ok(), "{freed:?}");
    assert_eq!(
        e.fake.calls(Call::HostFree),
        0,
        "slab piece handed to cudaFreeHost"
    );
    assert!(
        matches!(
            e.host.free(big.addr()),
            Err(AllocError::InvalidHostPointer(_))
        ),
        "piece still known"
    );
    let m = e.m();
    assert_eq!(m["active_requests.current"], 0);
    e.inv();
    // The slab's rest is now under 2 MiB: a new driver allocation, released at its free.
    let again = e.host.allocate(2 * MIB, leg())?;
    assert!(again.bytes >= 2 * MIB);
    e.host.free(again.addr())?;
    e.host.empty_cache()?;
    assert_eq!(
        e.fake.calls(Call::HostFree),
        e.fake.calls(Call::HostAlloc) - 1
    );
    e.inv();
    Ok(())
}

// Toggling the register path while threads allocate: every block goes back the way it
// was made.
#[test]
fn concurrent_config_toggle_way_back() -> R {
    let e = env("pinned_num_register_threads:2")?;
    std::thread::scope(|sc| {
        let host = &e.host;
        let t = sc.spawn(move || {
            for i in 0..200 {
                let v = if i % 2 == 0 { "True" } else { "False" };
                host.update_config(&format!("pinned_use_cuda_host_register:{v}"))
                    .unwrap();
                if i % 7 == 0 {
                    host.empty_cache().unwrap();
                }
                std::thread::yield_now();
            }
        });
        for k in 0..3u64 {
            sc.spawn(move || {
                for i in 0..300u64 {
                    let r = host
                        .allocate(4096 + ((i * 7919 + k) % 60_000), leg())
                        .unwrap();
                    host.free(r.addr()).unwrap();
                }
            });
        }
        t.join().unwrap();
    });
    e.host.empty_cache()?;
    let f = &e.fake;
    assert_eq!(f.calls(Call::HostAlloc), f.calls(Call::HostFree));
    assert_eq!(f.calls(Call::HostMalloc), f.calls(Call::HostMfree));
    assert_eq!(f.calls(Call::HostRegister), f.calls(Call::HostUnregister));
    let m = e.m();
    assert_eq!(
        m["num_host_alloc"] as u64,
        f.calls(Call::HostAlloc) + f.calls(Call::HostRegister)
    );
    assert_eq!(m["allocations.current"], 0);
    e.inv();
    Ok(())
}

// Pool API misuse: typed errors, no panic.
#[test]
fn pool_api_misuse_typed() -> R {
    let e = env("")?;
    let pool = PoolId::for_capture();
    assert!(e.host.end_allocate_to_pool(pool).is_err());
    assert!(e.host.release_pool(pool).is_err());
    e.host
        .begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    assert!(
        e.host
            .begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
            .is_err(),
        "already recording to this pool"
    );
    // Routing active: a stream of a device that does not exist.
    let bad = StreamHandle {
        device: DeviceIndex(9),
        raw: 77,
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.host.allocate(64, bad)));
    assert!(r.is_ok(), "panicked");
    // Thread route: allocations of this thread go to the private pool.
    let a = e.host.allocate(64, leg())?;
    e.host.end_allocate_to_pool(pool)?;
    e.host.free(a.addr())?;
    let b = e.host.allocate(64, leg())?;
    assert_ne!(
        b.addr(),
        a.addr(),
        "private block leaked into the default pool"
    );
    e.host.release_pool(pool)?;
    assert!(e.host.release_pool(pool).is_err(), "released twice");
    e.host.empty_cache()?;
    assert_eq!(e.host.private_pool_count(), 0);
    e.inv();
    Ok(())
}

// Background thread releases a block above the cache limit once its event completed.
#[test]
fn background_thread_releases_large_block() -> R {
    let e = env("pinned_use_background_threads:True,pinned_max_cached_size_mb:1")?;
    let s = e.stream()?;
    e.busy(s.handle())?;
    let a = e.host.allocate(3 * MIB, leg())?;
    e.host.record_event(a.addr(), s.handle())?;
    e.host.free(a.addr())?;
    e.fake.advance(s.handle(), None)?;
    let mut done = false;
    for _ in 0..200 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        if e.fake.calls(Call::HostFree) == 1 {
            done = true;
            break;
        }
    }
    assert!(done, "never released");
    let m = e.m();
    assert_eq!(
        (
            m["allocations.current"],
            m["active_requests.current"],
            m["num_host_free"]
        ),
        (0, 0, 1)
    );
    e.inv();
    let Env { host, .. } = e;
    drop(host); // the background thread ends with it
    Ok(())
}

// Blocking copies record no event (the block is reusable at once); absurd PinnedBuffer
// lengths are errors.
#[test]
fn blocking_copy_and_huge_buffers() -> R {
    let e = env("")?;
    e.h.rt.set_host_memory(e.host.clone());
    let rt = &e.h.rt;
    let v: Vec<f32> = vec![1.5; 2000];
    let dev = DeviceBuffer::<f32>::uninit(rt, D0, v.len())?;
    let pb = PinnedBuffer::from_slice(rt, &v)?;
    let addr = pb.range().unwrap().addr();
    let rec = e.fake.calls(Call::EventRecord);
    pb.copy_to_device(&dev, false)?;
    assert_eq!(dev.to_host()?, v);
    drop(pb);
    assert_eq!(
        e.fake.calls(Call::EventRecord),
        rec,
        "blocking copy recorded an event"
    );
    let pb2 = PinnedBuffer::<f32>::uninit(rt, 2000)?;
    assert_eq!(pb2.range().unwrap().addr(), addr);
    pb2.copy_from_device(&dev, false)?;
    assert_eq!(pb2.to_vec()?, v);
    // Length mismatch: error, nothing recorded.
    let short = DeviceBuffer::<f32>::uninit(rt, D0, 10)?;
    assert!(pb2.copy_to_device(&short, true).is_err());
    drop(pb2);
    let before = e.m();
    for len in [usize::MAX, usize::MAX / 8, 1usize << 61] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            PinnedBuffer::<f64>::uninit(rt, len).map(|_| ())
        }));
        match r {
            Ok(Err(_)) => {}
            Ok(Ok(())) => panic!("{len} elements accepted"),
            Err(_) => panic!("{len} elements panicked"),
        }
    }
    let mut a = e.m();
    let mut b = before;
    a.retain(|k, _| !k.starts_with("host_"));
    b.retain(|k, _| !k.starts_with("host_"));
    assert_eq!(a, b);
    e.inv();
    Ok(())
}

// Reserve segment configured by update before the first slow path; not after. Drop
// frees the slab only when no piece is in use.
#[test]
fn reserve_config_update_and_drop() -> R {
    let e = env("")?;
    e.host.update_config("pinned_reserve_segment_size_mb:1")?;
    let a = e.host.allocate(100, leg())?;
    let b = e.host.allocate(100, leg())?;
    assert_eq!(
        e.fake.calls(Call::HostAlloc),
        1,
        "slab from the updated config"
    );
    assert_eq!(a.base, b.base);
    e.host.free(a.addr())?;
    e.host.free(b.addr())?;
    let Env { h, fake, host, .. } = e;
    drop(host);
    assert_eq!(fake.calls(Call::HostFree), 1, "slab given back at drop");
    drop(h);

    let e = env("")?;
    let first = e.host.allocate(100, leg())?;
    e.host.update_config("pinned_reserve_segment_size_mb:1")?;
    let second = e.host.allocate(5000, leg())?;
    assert_eq!(
        e.fake.calls(Call::HostAlloc),
        2,
        "no slab after the first slow path"
    );
    assert_ne!(first.base, second.base);
    e.inv();

    let e = env("pinned_reserve_segment_size_mb:1")?;
    let keep = e.host.allocate(100, leg())?;
    let Env { h, fake, host, .. } = e;
    drop(host);
    assert_eq!(
        fake.calls(Call::HostFree),
        0,
        "slab freed under a live piece"
    );
    let _ = keep;
    drop(h);
    Ok(())
}

// A failed driver allocation is not timed (PyTorch throws before timing); 128 register
// threads on a small block pre-fault in one part.
#[test]
fn failed_alloc_not_timed_and_thread_cap() -> R {
    let e = env("pinned_use_cuda_host_register:True,pinned_num_register_threads:128")?;
    let a = e.host.allocate(64 * 1024, leg())?; // < 4 KiB * 128
    assert_eq!(e.fake.calls(Call::HostPrefault), 1);
    let big = e.host.allocate(1 << 20, leg())?; // 256 pages / 128 parts
    assert_eq!(e.fake.calls(Call::HostPrefault), 1 + 128);
    let before = e.m();
    e.fake
        .fail_nth(Call::HostRegister, 1, DriverError::OUT_OF_MEMORY);
    assert!(e.host.allocate(1 << 22, leg()).is_err());
    let after = e.m();
    assert_eq!(
        after["host_alloc_time.count"], before["host_alloc_time.count"],
        "failed allocation timed"
    );
    assert_eq!(after, before, "failed allocation changed statistics");
    e.host.free(a.addr())?;
    e.host.free(big.addr())?;
    e.inv();
    Ok(())
}

// Partial event failures: a block whose free recorded only some of its events (or one
// of whose events failed its query) is never handed out again, even when the surviving
// events complete.
#[test]
fn partial_event_failures_never_reuse() -> R {
    let e = env("")?;
    let s1 = e.stream()?;
    let s2 = e.stream()?;
    let a = e.host.allocate(4096, leg())?;
    e.host.record_event(a.addr(), s1.handle())?;
    e.host.record_event(a.addr(), s2.handle())?;
    e.fake
        .fail_nth(Call::EventRecord, 2, DriverError::INVALID_VALUE);
    let r = e.host.free(a.addr());
    assert!(r.is_err(), "{r:?}");
    e.fake.advance_all();
    let mut got = Vec::new();
    for _ in 0..4 {
        let x = e.host.allocate(4096, leg())?;
        e.fake.advance_all();
        got.push(x.addr());
    }
    assert!(!got.contains(&a.addr()), "retired block handed out again");
    e.inv();
    for x in got {
        e.host.free(x)?;
    }
    // A failed query of one of two events.
    let b = e.host.allocate(1 << 16, leg())?;
    e.host.record_event(b.addr(), s1.handle())?;
    e.host.record_event(b.addr(), s2.handle())?;
    e.host.free(b.addr())?;
    e.fake.advance_all();
    e.fake
        .fail_nth(Call::EventQuery, 1, DriverError::INVALID_VALUE);
    let r = e.host.allocate(1 << 16, leg());
    let mut got = Vec::new();
    if let Ok(x) = r {
        got.push(x.addr());
    }
    for _ in 0..3 {
        got.push(e.host.allocate(1 << 16, leg())?.addr());
    }
    assert!(
        !got.contains(&b.addr()),
        "block with a failed query handed out again"
    );
    e.inv();
    // empty_cache with a failing query: error, books intact.
    let c = e.host.allocate(1 << 10, leg())?;
    e.host.record_event(c.addr(), s1.handle())?;
    e.host.free(c.addr())?;
    e.fake.advance_all();
    e.fake
        .fail_nth(Call::EventQuery, 1, DriverError::INVALID_VALUE);
    assert!(e.host.empty_cache().is_err());
    e.inv();
    Ok(())
}

// Private-pool blocks count in the statistics like any other (PyTorch's stats_ are
// global).
#[test]
fn private_pool_blocks_in_stats() -> R {
    let e = env("")?;
    let cap = e.stream()?;
    let pool = e.capture(&cap, CaptureMode::Relaxed)?;
    let a = e.host.allocate(1000, cap.handle())?;
    let b = e.host.allocate(1000, cap.handle())?;
    let m = e.m();
    assert_eq!(
        (
            m["allocations.current"],
            m["allocated_bytes.current"],
            m["active_requests.current"]
        ),
        (2, 2048, 2)
    );
    e.host.free(a.addr())?; // unused: back to its pool
    let m = e.m();
    assert_eq!(m["active_requests.current"], 1);
    let c = e.host.allocate(600, cap.handle())?;
    assert_eq!(
        c.addr(),
        a.addr(),
        "unused capture block reused within its pool"
    );
    e.host.record_event(b.addr(), cap.handle())?;
    e.host.free(b.addr())?; // used: retired
    e.drv.stream_end_capture(cap.handle())?;
    e.host.end_allocate_to_pool(pool)?;
    e.host.free(c.addr())?;
    e.host.release_pool(pool)?;
    e.host.empty_cache()?;
    let m = e.m();
    assert_eq!(
        m["allocations.current"], 1,
        "only the retired block remains"
    );
    assert_eq!(m["num_host_free"], 1);
    e.inv();
    Ok(())
}

// ---- The scenarios (15), each running its parts in order. ----
