//! `free`'s table of recent frees, plain rounding without the `roundup_power2_divisions`
//! table, and history entries that borrow the block's frames, tried through the public API
//! against PyTorch's rules: [`frees`] (one thread), [`threads`] (racing frees, a lock-step
//! differential against `thread_cache:False`), [`rounding`] and [`history`].
#![forbid(unsafe_code)]
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod frees;
mod history;
mod rounding;
mod threads;

use ferrocuda_alloc::CachingAllocator;
use ferrocuda_alloc::{AllocError, AllocError::InvalidPointer};
use ferrocuda_driver::{FakeDriver, fake::Completion};
use ferrocuda_types::DevicePtr;
use std::sync::Arc;

/// The allocator with and without its thread cache, with and without expandable segments.
pub(crate) const CONFIGS: [&str; 4] = [
    "",
    "thread_cache:False",
    "expandable_segments:True",
    "expandable_segments:True,thread_cache:False",
];

/// An allocator with `config` on an 80 GiB fake device whose work completes at once.
pub(crate) fn device(config: &str) -> (Arc<FakeDriver>, CachingAllocator) {
    common::setup(80 << 30, config, Completion::Eager)
}

/// What `free` gives for a pointer that is not the start of a live allocation.
pub(crate) fn invalid(ptr: u64) -> Result<(), AllocError> {
    Err(InvalidPointer(DevicePtr(ptr)))
}

/// Frees `ptr`, which PyTorch refuses: `InvalidPointer`, every statistic and block as was.
pub(crate) fn refuse(a: &CachingAllocator, ptr: u64, what: &str) {
    let before = (a.stats().to_map(), a.blocks());
    assert_eq!(a.free(DevicePtr(ptr)), invalid(ptr), "{what} at {ptr:#x}");
    let after = (a.stats().to_map(), a.blocks());
    let changed: Vec<_> = (before.0.iter())
        .filter(|(k, v)| after.0.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: {v} -> {:?}", after.0.get(k)))
        .collect();
    assert!(before == after, "{what} at {ptr:#x}: changed {changed:?}");
}

/// Frees `ptr`, live with `size` bytes: exactly those bytes and one allocation leave.
pub(crate) fn release(a: &CachingAllocator, ptr: u64, size: u64, what: &str) {
    let s = a.stats();
    let r = a.free(DevicePtr(ptr));
    assert_eq!(r, Ok(()), "{what} at {ptr:#x}");
    let t = a.stats();
    let bytes = s.allocated_bytes.all.current - t.allocated_bytes.all.current;
    let count = s.allocation.all.current - t.allocation.all.current;
    assert_eq!((bytes, count), (size as i64, 1), "{what} at {ptr:#x}");
}

/// The allocated blocks as (address, size), by address.
pub(crate) fn allocated(a: &CachingAllocator) -> Vec<(u64, u64)> {
    let blocks = a.blocks().into_iter().filter(|b| b.allocated);
    let mut v: Vec<_> = blocks.map(|b| (b.ptr.0, b.size)).collect();
    v.sort_unstable();
    v
}
