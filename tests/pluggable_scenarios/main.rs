//! Scenarios for pluggable allocators ("in" direction, written by an independent audit),
//! judged by PyTorch's
//! `CUDAPluggableAllocator` / `change_current_allocator` / `MemPool(allocator=...)` rules.
//!
//! Scenarios that touch the process-wide allocator choice run in a fresh process each: the
//! test re-executes this binary with `--exact NAME` and `FERROCUDA_PLUGGABLE_SCENARIO=NAME`,
//! NAME the test's path in the binary (`global_choice::...`; fake backend). The others use
//! the library-level API in-process, serialised by the fixture's `Probe`.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ferrocuda::alloc::{AllocError, Caching, CachingAllocator, PluggableAllocator, Route};
use ferrocuda::driver::{Hook, PluggableError, PluggableLibrary};
use ferrocuda::memory::{self, MemPool};
use ferrocuda::stream::{DeviceBuffer, MemoryResource};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, DevicePtr, PoolId, StreamHandle};
use ferrocuda_pluggable_fixture::{Event, HOOK_FUNCTIONS, Probe, path};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Command;
use std::sync::{Barrier, Mutex};

const DEV: DeviceIndex = DeviceIndex(0);
const CHILD: &str = "FERROCUDA_PLUGGABLE_SCENARIO";
const MIB: u64 = 1 << 20;

// ---- helpers -------------------------------------------------------------------------------

/// Runs `body` in a fresh process of this test binary (fake backend, default allocator
/// configuration); in that process, runs it.
fn fresh(name: &str, body: impl FnOnce()) {
    match std::env::var(CHILD) {
        Ok(n) if n == name => return body(),
        Ok(_) => return,
        Err(_) => {}
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .env("FERROCUDA_BACKEND", "fake")
        .env_remove("FERROCUDA_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("FERROCUDA_NO_CUDA_MEMORY_CACHING")
        .env_remove("PYTORCH_NO_CUDA_MEMORY_CACHING")
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && so.contains("1 passed"),
        "scenario {name} failed in its own process ({}):\n--- stdout\n{so}\n--- stderr\n{se}",
        out.status
    );
}

/// Collects failed checks so that one scenario reports all of them.
#[derive(Default)]
struct Checks(Vec<String>);

impl Checks {
    fn check(&mut self, ok: bool, what: impl Into<String>) {
        if !ok {
            self.0.push(what.into());
        }
    }
    fn done(self) {
        assert!(
            self.0.is_empty(),
            "{} check(s) failed:\n  - {}",
            self.0.len(),
            self.0.join("\n  - ")
        );
    }
}

fn host_lib() -> PluggableLibrary {
    PluggableLibrary::load(path(), "fixture_host_alloc", "fixture_host_free").unwrap()
}

fn with_hooks(mut lib: PluggableLibrary, hooks: &[Hook]) -> PluggableLibrary {
    for (h, name) in Hook::ALL.iter().zip(HOOK_FUNCTIONS) {
        if hooks.contains(h) {
            lib = lib.with_hook(*h, name).unwrap();
        }
    }
    lib
}

#[derive(Copy, Clone, Debug, PartialEq)]
struct A {
    size: u64,
    device: i32,
    stream: u64,
    ptr: u64,
}
#[derive(Copy, Clone, Debug, PartialEq)]
struct F {
    ptr: u64,
    size: u64,
    device: i32,
    stream: u64,
}

fn allocs(ev: &[Event]) -> Vec<A> {
    ev.iter()
        .filter_map(|e| match *e {
            Event::Alloc {
                size,
                device,
                stream,
                ptr,
            } => Some(A {
                size,
                device,
                stream,
                ptr,
            }),
            _ => None,
        })
        .collect()
}

fn frees(ev: &[Event]) -> Vec<F> {
    ev.iter()
        .filter_map(|e| match *e {
            Event::Free {
                ptr,
                size,
                device,
                stream,
            } => Some(F {
                ptr,
                size,
                device,
                stream,
            }),
            _ => None,
        })
        .collect()
}

/// Replays the log: every alloc of a fresh address, every free of a live one with the
/// alloc's size, device and stream. Returns the problems.
fn replay(ev: &[Event]) -> Vec<String> {
    let mut live: BTreeMap<u64, (u64, i32, u64)> = BTreeMap::new();
    let mut bad = Vec::new();
    for e in ev {
        match *e {
            Event::Alloc {
                size,
                device,
                stream,
                ptr,
            } if ptr != 0 && live.insert(ptr, (size, device, stream)).is_some() => {
                bad.push(format!("address {ptr:#x} handed out while live"));
            }
            Event::Free {
                ptr,
                size,
                device,
                stream,
            } => match live.remove(&ptr) {
                None => bad.push(format!("free of {ptr:#x}, not live in the library")),
                Some(m) if m != (size, device, stream) => bad.push(format!(
                    "free of {ptr:#x} with {:?}, allocated with {m:?}",
                    (size, device, stream)
                )),
                Some(_) => {}
            },
            _ => {}
        }
    }
    bad
}

fn legacy() -> StreamHandle {
    StreamHandle::legacy(DEV)
}

/// The library level: a pluggable library as a caching allocator's segment source, in this
/// process.
mod library;

/// The process-wide allocator choice (a fresh process each): when it may change, what
/// reaches the library, hooks and raw allocations under it.
mod global_choice;

/// Memory pools over the chosen library (a fresh process each): segments, pools in use, a
/// null segment, threads, the memory fraction.
mod mem_pools;
