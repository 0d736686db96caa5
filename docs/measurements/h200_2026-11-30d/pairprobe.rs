// A locked or credited 1 MiB alloc+free pair, repeated, on the fake device: ns per pair and
// the driver calls made. Run as an example of ferrocuda-alloc (copy it to
// crates/alloc/examples/), e.g. `pairprobe "thread_cache:False,ferrocuda_recommended:True"
// 200000` under callgrind for instructions per pair.
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::{Call, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, StreamHandle};
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
    for _ in 0..1000 {
        let x = a.allocate(1 << 20, STREAM).unwrap();
        a.free(x.ptr).unwrap();
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
        let x = a.allocate(1 << 20, STREAM).unwrap();
        a.free(std::hint::black_box(x.ptr)).unwrap();
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    let d: Vec<String> = calls
        .iter()
        .zip(before)
        .map(|(c, b)| format!("{c:?} {}", fake.calls(*c) - b))
        .collect();
    println!("'{conf}': {ns:.1} ns per pair; {}", d.join(", "));
}
