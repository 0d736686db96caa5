//! Does the driver's copy from pageable memory (`DeviceBuffer::copy_from_host` with no
//! staging threads) depend on where the source starts? 64 MiB from a `Vec`'s start (glibc
//! puts a large block 16 bytes past a page boundary) and from offsets that are 64-byte and
//! 4 KiB aligned inside a larger `Vec`, each 30 copies and a sync, the ways alternated over
//! `ROUNDS` rounds; then the same for `copy_to_host` (into the same three places). Built as
//! an example of ferrocuda-stream (copied there for the build, not kept).
#![allow(clippy::expect_used)]
use ferrocuda_driver::CudaDriver;
use ferrocuda_stream::{DeviceBuffer, Runtime};
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;
use std::time::Instant;

const BYTES: usize = 64 << 20;
const REPS: usize = 30;

fn main() {
    let driver = Arc::new(CudaDriver::new());
    if let Some(reason) = driver.unavailable_reason() {
        eprintln!("no GPU: {reason}");
        std::process::exit(1);
    }
    let rt = Runtime::new(driver);
    let dev = DeviceIndex(0);
    let stream = rt.current_stream(dev).expect("stream");
    let buf = DeviceBuffer::<u8>::uninit(&rt, dev, BYTES).expect("buffer");
    let mut plain: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8).collect();
    let mut big: Vec<u8> = (0..BYTES + 8192).map(|i| (i % 251) as u8).collect();
    let base = big.as_ptr() as usize;
    let at64 = (64 - base % 64) % 64;
    let at4k = (4096 - base % 4096) % 4096;
    println!(
        "plain starts at {} mod 4096; aligned offsets {at64} and {at4k}",
        plain.as_ptr() as usize % 4096
    );
    let rounds: usize = std::env::args().nth(1).map_or(6, |a| a.parse().expect("rounds"));
    for round in 0..rounds {
        let mut line = format!("round {round} h2d");
        for way in 0..3 {
            let way = (way + round) % 3;
            let src: &[u8] = match way {
                0 => &plain,
                1 => &big[at64..at64 + BYTES],
                _ => &big[at4k..at4k + BYTES],
            };
            buf.copy_from_host(src).expect("warm-up");
            stream.synchronize().expect("sync");
            let t = Instant::now();
            for _ in 0..REPS {
                buf.copy_from_host(src).expect("copy");
                stream.synchronize().expect("sync");
            }
            let gbs = (BYTES * REPS) as f64 / t.elapsed().as_secs_f64() / 1e9;
            line += &format!(" {}:{gbs:.2}", ["malloc16", "align64", "align4k"][way]);
        }
        println!("{line}");
        let mut line = format!("round {round} d2h");
        for way in 0..3 {
            let way = (way + round) % 3;
            let dst: &mut [u8] = match way {
                0 => &mut plain,
                1 => &mut big[at64..at64 + BYTES],
                _ => &mut big[at4k..at4k + BYTES],
            };
            buf.copy_to_host(dst).expect("warm-up");
            let t = Instant::now();
            for _ in 0..REPS {
                buf.copy_to_host(dst).expect("copy");
            }
            let gbs = (BYTES * REPS) as f64 / t.elapsed().as_secs_f64() / 1e9;
            line += &format!(" {}:{gbs:.2}", ["malloc16", "align64", "align4k"][way]);
        }
        println!("{line}");
    }
}
