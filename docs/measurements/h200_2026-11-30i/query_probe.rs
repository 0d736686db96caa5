//! What one `cuStreamQuery` of an idle stream costs on the GPU host: page reclaim's steady
//! state asks it about every 2 000 allocator operations. Built as an example of
//! `ferrocuda-alloc` (copied there for the build, not kept).
use ferrocuda_driver::{CudaDriver, Driver};
use ferrocuda_types::{DeviceIndex, StreamHandle};
use std::time::Instant;

fn main() {
    let driver = CudaDriver::new();
    let stream = StreamHandle::legacy(DeviceIndex(0));
    let _ = driver.malloc(DeviceIndex(0), 1 << 20).expect("a context");
    for round in 0..3 {
        let n = 100_000;
        let start = Instant::now();
        for _ in 0..n {
            assert!(driver.stream_query(stream).expect("query"));
        }
        println!("round {round}: stream_query of an idle stream {:.0} ns", start.elapsed().as_nanos() as f64 / n as f64);
    }
}
