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

/// The register path, the reserve segment and the cache limit: how blocks are made and
/// given back, driver failures on the way included.
mod segments;

/// Captures and private pools: blocks a graph may read, retired blocks, pool lifecycles and
/// their statistics.
mod captures_and_pools;

/// Bad input, driver failures, buffers and copies, several threads and two devices.
mod errors_and_threads;
