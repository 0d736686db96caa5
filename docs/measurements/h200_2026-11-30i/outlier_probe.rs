//! The allocator bench's mixed churn (as `crates/alloc/examples/churn.rs`) on the real GPU,
//! each operation timed on its own: how much of the mean per operation the slow ones (over
//! 2 µs: the driver's calls) account for, per configuration, rounds rotated.
//! Built as an example of `ferrocuda-alloc` (copied there for the build, not kept).
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::{CudaDriver, Driver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::sync::Arc;
use std::time::Instant;

const STREAM: StreamHandle = StreamHandle::legacy(DeviceIndex(0));
const STEPS: u64 = 2_000_000;
const SLOW_NS: u64 = 2_000;

struct Churn {
    live: Vec<Option<u64>>,
    state: u64,
}

/// One round: (mean ns per op, slow ops, ns in slow ops per op, max op ns).
fn round(c: &mut Churn, a: &CachingAllocator, steps: u64) -> (f64, u64, f64, u64) {
    let (mut slow, mut slow_ns, mut max) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    for _ in 0..steps {
        let s = &mut c.state;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        let slot = (*s % 1024) as usize;
        let t = Instant::now();
        match c.live[slot].take() {
            Some(p) => a.free(DevicePtr(p)).expect("free"),
            None => {
                let size = 512u64 << ((*s >> 40) % 15);
                c.live[slot] = Some(a.allocate(size, STREAM).expect("allocate").ptr.0);
            }
        }
        let ns = t.elapsed().as_nanos() as u64;
        max = max.max(ns);
        if ns > SLOW_NS {
            slow += 1;
            slow_ns += ns;
        }
    }
    let total = start.elapsed().as_nanos() as f64;
    (total / steps as f64, slow, slow_ns as f64 / steps as f64, max)
}

fn main() {
    let confs = [
        "",
        "ferrocuda_recommended:True",
        "ferrocuda_recommended:True,expandable_segments_reclaim:False",
    ];
    let driver: Arc<dyn Driver> = Arc::new(CudaDriver::new());
    let allocators: Vec<(CachingAllocator, Churn)> = confs
        .iter()
        .map(|c| {
            let config = AllocatorConfig::parse(c).expect("config");
            let a = CachingAllocator::new(driver.clone(), DeviceIndex(0), config, Caching::On)
                .expect("allocator");
            let mut churn = Churn { live: vec![None; 1024], state: 88172645463325252 };
            round(&mut churn, &a, STEPS);
            (a, churn)
        })
        .collect();
    let mut allocators = allocators;
    for r in 0..4 {
        for k in 0..confs.len() {
            let i = (k + r) % confs.len();
            let (a, churn) = &mut allocators[i];
            let (mean, slow, slow_per_op, max) = round(churn, a, STEPS);
            println!(
                "round {r} {:62} mean {mean:6.1} ns  slow ops {slow:5}  their ns/op {slow_per_op:6.2}  max {:.1} us",
                format!("\"{}\"", confs[i]),
                max as f64 / 1e3
            );
        }
    }
}
