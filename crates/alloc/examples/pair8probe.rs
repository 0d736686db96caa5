// Eight 1 MiB slots on one stream, each step freeing or filling a random one, through the lock
// (what 8 threads of pairs look like to the lock holder).
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::{Call, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamHandle};
use std::sync::Arc;
use std::time::Instant;
const STREAM: StreamHandle = StreamHandle::legacy(DeviceIndex(0));
fn main() {
    let conf = std::env::args().nth(1).unwrap_or_default();
    let n: u64 = std::env::args()
        .nth(2)
        .map_or(5_000_000, |s| s.parse().unwrap());
    let fake = Arc::new(FakeDriver::default());
    let a = CachingAllocator::new(
        fake.clone(),
        DeviceIndex(0),
        AllocatorConfig::parse(&conf).unwrap(),
        Caching::On,
    )
    .unwrap();
    let mut live = [None::<u64>; 8];
    let mut s = 88172645463325252u64;
    let mut step = |a: &CachingAllocator| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let slot = (s % 8) as usize;
        match live[slot].take() {
            Some(p) => a.free(DevicePtr(p)).unwrap(),
            None => live[slot] = Some(a.allocate(1 << 20, STREAM).unwrap().ptr.0),
        }
    };
    for _ in 0..100_000 {
        step(&a);
    }
    let calls = [
        Call::EventRecord,
        Call::EventQuery,
        Call::StreamQuery,
        Call::VmMap,
        Call::VmUnmap,
        Call::Malloc,
    ];
    let before = calls.map(|c| fake.calls(c));
    let t = Instant::now();
    for _ in 0..n {
        step(&a);
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    let d: Vec<String> = calls
        .iter()
        .zip(before)
        .map(|(c, b)| format!("{c:?} {}", fake.calls(*c) - b))
        .collect();
    println!("'{conf}': {ns:.1} ns per op; {}", d.join(", "));
}
