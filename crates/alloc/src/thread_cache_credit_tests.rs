//! Which blocks the thread cache credits, seen from inside the crate (a credit is not
//! observable through the public API, only its exactness is: `alloc_scenarios` compares
//! programs with and without `thread_cache`).
use crate::{Caching, CachingAllocator};
use ferrocuda_driver::FakeDriver;
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const STREAM: StreamHandle = StreamHandle::legacy(DeviceIndex(0));
const MIB: u64 = 1 << 20;

fn allocator(config: &str) -> Result<CachingAllocator, Box<dyn std::error::Error>> {
    Ok(CachingAllocator::new(
        Arc::new(FakeDriver::default()),
        DeviceIndex(0),
        AllocatorConfig::parse(config)?,
        Caching::On,
    )?)
}

/// Allocates `bytes` and uses the credit that came with it once (freed and taken back),
/// so that credits are not granted less often for going unused.
fn allocate_used(a: &CachingAllocator, bytes: u64) -> Result<u64, Box<dyn std::error::Error>> {
    let first = a.allocate(bytes, STREAM)?.ptr;
    a.free(first)?;
    let again = a.allocate(bytes, STREAM)?.ptr;
    assert_eq!(again, first);
    Ok(again.0)
}

/// Six 1 MiB blocks in the small pool's expandable segment; the second and third freed
/// (one 2 MiB run) and the sixth (the block before the unmapped tail, which best fit
/// passes over for a block that could grow to less). The next 1 MiB request splits the run
/// and is handed its front. Returns the allocator, that block and whether it was credited.
fn split_past_the_frontier(
    config: &str,
) -> Result<(CachingAllocator, u64, bool), Box<dyn std::error::Error>> {
    let a = allocator(config)?;
    let p: Vec<u64> = (0..6)
        .map(|_| allocate_used(&a, MIB))
        .collect::<Result<_, _>>()?;
    for i in [5, 1, 2] {
        a.free(DevicePtr(p[i]))?;
    }
    let x = a.allocate(MIB, STREAM)?.ptr.0;
    assert_eq!(x, p[1], "best fit passes the frontier block for the run");
    let credited = a.engine.cache.credits() == 1;
    Ok((a, x, credited))
}

#[test]
fn a_block_split_from_a_run_past_the_frontier_is_credited() -> TestResult {
    for config in [
        "expandable_segments:True",
        "expandable_segments:True,expandable_segments_reclaim:True",
        "ferrocuda_recommended:True",
    ] {
        let (a, x, credited) = split_past_the_frontier(config)?;
        assert!(
            credited,
            "{config}: PyTorch's free and search would hand it out again"
        );
        let (reference, y, _) = split_past_the_frontier(&format!("{config},thread_cache:False"))?;
        assert_eq!(x, y);
        for (allocator, block) in [(&a, x), (&reference, y)] {
            allocator.free(DevicePtr(block))?;
            let again = allocator.allocate(MIB, STREAM)?.ptr.0;
            assert_eq!(again, block, "{config}: the same block comes back");
        }
        assert_eq!(a.stats().to_map(), reference.stats().to_map(), "{config}");
        a.check_invariants()?;
        reference.check_invariants()?;
    }
    Ok(())
}
