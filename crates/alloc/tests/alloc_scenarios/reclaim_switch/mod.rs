//! Page reclaim switched on and off at run time, and best fit beside reclaim's holes,
//! checked from outside (written by a helper asked to break both changes of 2026-12-01):
//! - `switching`: hand-made scenarios with work queued on freed blocks (manual
//!   completion): frees made while reclaim is off stamp no page, so switching it on must
//!   take no page as safe before a later mark completes; live data survives, no work
//!   touches an unmapped page, reserved bytes equal the device's used bytes.
//! - `random_toggles`: random programs of the same kind (three streams, toggles of reclaim,
//!   of expandable segments and of the page size, `empty_cache`, `record_stream`, small
//!   devices that run out of memory), shrunk to a short program when one fails.
//! - `best_fit_model`: every allocation best fit serves from a free block against a model
//!   of PyTorch's rule (a segment's tail only, under reclaim).
//! - `thread_cache_vs_single_lock`: the same program with the thread cache on and off
//!   (`thread_cache:False`, the single-lock path), eager and lagging devices, reclaim on
//!   and off: the same pointers, statistics and blocks, and the same reclaim marks.
//!
//! `PROBE_SCALE=N` runs N times as many random programs.
#![allow(clippy::unwrap_used, clippy::panic)]
use crate::Rng;
use crate::common;
use crate::reclaim_adversarial::probes;
use common::{D0, GIB, LEGACY, MIB, new_stream, setup, stat};
use ferrocuda_alloc::{AllocError, Allocation, BlockInfo, CachingAllocator};
use ferrocuda_driver::{Call, Driver, FakeDriver, fake::Completion};
use ferrocuda_types::{MemsetValue, PoolId, PoolKind, StreamHandle};
use std::sync::Arc;

mod best_fit_model;
mod random_toggles;
mod switching;
mod thread_cache_vs_single_lock;

const PLAIN: &str = "expandable_segments:True,expandable_segments_page_mb:2";
const RECLAIM: &str =
    "expandable_segments:True,expandable_segments_page_mb:2,expandable_segments_reclaim:True";

struct H {
    fake: Arc<FakeDriver>,
    a: CachingAllocator,
    streams: Vec<StreamHandle>,
    live: Vec<(Allocation, u8)>,
    tag: u8,
}

type R<T> = Result<T, String>;

impl H {
    fn new(capacity: u64, conf: &str, completion: Completion, nstreams: usize) -> H {
        let (fake, a) = setup(capacity, conf, completion);
        let mut streams = vec![LEGACY];
        for _ in 1..nstreams {
            streams.push(new_stream(&fake).unwrap());
        }
        H {
            fake,
            a,
            streams,
            live: Vec::new(),
            tag: 0,
        }
    }
    fn reserved(&self) -> u64 {
        stat(&self.a, "reserved_bytes.all.current") as u64
    }
    fn syncs(&self) -> u64 {
        self.fake.calls(Call::StreamSynchronize) + self.fake.calls(Call::DeviceSynchronize)
    }
    fn write(&self, x: &Allocation, tag: u8, s: StreamHandle) {
        for p in probes(x) {
            self.fake
                .memset_async(p, MemsetValue::U8(tag), 1, s)
                .unwrap();
        }
    }
    /// Writes a new tag into `x` on its own stream and keeps it as live.
    fn keep(&mut self, x: Allocation) {
        let tag = self.next_tag();
        self.write(&x, tag, x.stream);
        self.live.push((x, tag));
    }
    /// Writes a new tag into live block `i`.
    fn retag(&mut self, i: usize) {
        let tag = self.next_tag();
        let x = self.live[i].0;
        self.write(&x, tag, x.stream);
        self.live[i].1 = tag;
    }
    fn next_tag(&mut self) -> u8 {
        self.tag = self.tag % 250 + 1;
        self.tag
    }
    /// Allocate (must not synchronize unless the OOM retry ran), write a tag, keep live.
    fn alloc(&mut self, bytes: u64, s: StreamHandle) -> R<Option<Allocation>> {
        let (syncs, retries) = (self.syncs(), stat(&self.a, "num_alloc_retries"));
        match self.a.allocate(bytes, s) {
            Ok(x) => {
                if self.syncs() != syncs && stat(&self.a, "num_alloc_retries") == retries {
                    return Err(format!(
                        "allocate({bytes}) synchronized without an OOM retry"
                    ));
                }
                let t = self.next_tag();
                self.write(&x, t, s);
                self.live.push((x, t));
                Ok(Some(x))
            }
            Err(AllocError::OutOfMemory(_)) => Ok(None),
            Err(e) => Err(format!("allocate({bytes}): {e}")),
        }
    }
    fn free_at(&mut self, i: usize, late: bool) -> R<()> {
        let (x, _) = self.live.swap_remove(i);
        if late {
            self.write(&x, 0xEE, x.stream);
        }
        let syncs = self.syncs();
        self.a.free(x.ptr).map_err(|e| e.to_string())?;
        if self.syncs() != syncs {
            return Err("free synchronized".into());
        }
        Ok(())
    }
    fn free_elsewhere(&mut self, i: usize) -> R<()> {
        let (x, _) = self.live.swap_remove(i);
        let other = *self.streams.iter().find(|&&s| s != x.stream).unwrap();
        self.a
            .record_stream(x.ptr, other)
            .map_err(|e| e.to_string())?;
        self.write(&x, 0xEE, other);
        self.a.free(x.ptr).map_err(|e| e.to_string())
    }
    fn inv(&self) -> R<()> {
        self.a.check_invariants()?;
        no_overlap(&self.live)
    }
    fn finish(&self) -> R<()> {
        self.fake
            .device_synchronize(D0)
            .map_err(|e| format!("sticky error: {e:?}"))?;
        for (x, tag) in &self.live {
            for p in probes(x) {
                let mut byte = [0u8];
                self.fake
                    .memcpy_dtoh(&mut byte, p, x.stream)
                    .map_err(|e| format!("{e:?}"))?;
                if byte[0] != *tag {
                    return Err(format!(
                        "live block {:#x} (+{} MiB) lost its data at {:#x}: {} != {}",
                        x.ptr.0,
                        x.size / MIB,
                        p.0,
                        byte[0],
                        tag
                    ));
                }
            }
        }
        self.a.check_invariants()?;
        let (free, total) = self.fake.mem_get_info(D0).map_err(|e| format!("{e:?}"))?;
        if total - free != self.reserved() {
            return Err(format!(
                "reserved {} != device used {}",
                self.reserved(),
                total - free
            ));
        }
        Ok(())
    }
}

fn no_overlap(live: &[(Allocation, u8)]) -> R<()> {
    let mut v: Vec<_> = live.iter().map(|(x, _)| (x.ptr.0, x.size)).collect();
    v.sort();
    for w in v.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(format!("live allocations overlap: {:x?} {:x?}", w[0], w[1]));
        }
    }
    Ok(())
}

fn ok(r: R<()>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

fn py(on: bool) -> &'static str {
    if on { "True" } else { "False" }
}

/// Greedy shrink: drop ops one at a time while the program still fails.
pub(crate) fn shrink<T: Clone + std::fmt::Debug>(
    ops: &[T],
    fails: impl Fn(&[T]) -> bool,
) -> Vec<T> {
    let mut cur = ops.to_vec();
    let mut changed = true;
    while changed {
        changed = false;
        let mut i = 0;
        while i < cur.len() {
            let mut cand = cur.clone();
            cand.remove(i);
            if fails(&cand) {
                cur = cand;
                changed = true;
            } else {
                i += 1;
            }
        }
    }
    cur
}

/// `seeds`, made `PROBE_SCALE` times as long.
pub(crate) fn scaled(seeds: std::ops::Range<u64>) -> std::ops::Range<u64> {
    let scale: u64 = std::env::var("PROBE_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    seeds.start..seeds.start + (seeds.end - seeds.start) * scale
}
