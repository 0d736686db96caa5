//! Device-to-host copies into pageable memory, into a `Vec` used again
//! (`DeviceBuffer::copy_to_host`, "into") and into a new one (`to_host`, "new"), by the
//! driver (0 threads) and staged by 1, 2, 4 and 8 threads (`pageable_copy_threads`), for 4,
//! 16, 64 and 256 MiB, the ways alternated round by round; every read compared with the
//! bytes uploaded. One line per round and size: GB/s per way. Built as an example of
//! ferrocuda-stream (copy it to crates/stream/examples/ first):
//! `cargo build --release -p ferrocuda-stream --example read_probe`.
#![allow(clippy::expect_used)]
use ferrocuda_driver::CudaDriver;
use ferrocuda_stream::{DeviceBuffer, Runtime};
use ferrocuda_testkit::StagedCopies;
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let driver = Arc::new(CudaDriver::new());
    if let Some(reason) = driver.unavailable_reason() {
        eprintln!("no GPU: {reason}");
        std::process::exit(1);
    }
    let rt = Runtime::new(driver);
    let dev = DeviceIndex(0);
    let rounds: usize = std::env::args().nth(1).map_or(5, |a| a.parse().expect("rounds"));
    for round in 0..rounds {
        for mib in [4usize, 16, 64, 256] {
            let bytes = mib << 20;
            let src: Vec<u8> = (0..bytes).map(|i| ((i * 7 + round) % 251) as u8).collect();
            StagedCopies::install(&rt, 0);
            let buf = DeviceBuffer::from_slice(&rt, dev, &src).expect("buffer");
            let reps = (1024 / mib).clamp(4, 64);
            let mut out = vec![0u8; bytes];
            for into in [true, false] {
                let mut line = format!(
                    "round {round} {mib:>3} MiB {}",
                    if into { "into" } else { "new " }
                );
                for threads in [0, 1, 2, 4, 8] {
                    StagedCopies::install(&rt, threads);
                    out.fill(0);
                    buf.copy_to_host(&mut out).expect("warm-up read");
                    assert!(out == src, "t{threads}: the read differs");
                    let t = Instant::now();
                    for _ in 0..reps {
                        if into {
                            buf.copy_to_host(std::hint::black_box(&mut out)).expect("read");
                        } else {
                            std::hint::black_box(buf.to_host().expect("read"));
                        }
                    }
                    let gbs = (bytes * reps) as f64 / t.elapsed().as_secs_f64() / 1e9;
                    line += &format!(" t{threads} {gbs:6.2}");
                }
                println!("{line}");
            }
        }
    }
}
