//! cuFFT through [`Fft`]'s plan cache on the GPU, measured as `xtask/anchors/torch_gemm.py`
//! measures `torch.fft.fft` on the same machine: a 2²⁰-point complex fp32 transform,
//! batch 16, with the plan cached (wall time of transforms queued back to back, then a
//! synchronize, after two seconds of them), and the host's cost of a call whose plan is
//! cached (a 256-point transform, 100 calls queued, the synchronize not timed).
//!
//! The GPU bundle runs it over the real driver (required there, `FERROCUDA_REQUIRE_GPU=1`);
//! elsewhere only the small call is measured, over the fake device (a host DFT: the figure
//! says nothing of a GPU).
#![allow(clippy::expect_used, missing_docs)]

mod common;

use criterion::{Criterion, criterion_group};
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::{CudaDriver, Driver, FakeDriver};
use ferrocuda_mathlib::{CudaFft, FakeFft, Fft, FftBackend, FftDesc, FftKind, FftLayout};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, StreamFlags, StreamHandle};
use std::sync::Arc;
use std::time::Duration;

const DEV: DeviceIndex = DeviceIndex(0);

fn c2c(n: i64, batch: i64) -> FftDesc {
    let layout = FftLayout {
        embed: vec![n],
        stride: 1,
        dist: n,
    };
    FftDesc {
        kind: FftKind::C2C,
        sizes: vec![n],
        batch,
        input: layout.clone(),
        output: layout,
    }
}

fn measure<B: FftBackend>(c: &mut Criterion, driver: Arc<dyn Driver>, backend: B, gpu: bool) {
    let alloc = Arc::new(
        CachingAllocator::new(driver.clone(), DEV, AllocatorConfig::default(), Caching::On)
            .expect("allocator"),
    );
    let fft = Fft::new(backend, alloc.clone()).expect("fft");
    let stream: StreamHandle = driver
        .stream_create(DEV, StreamFlags::default())
        .expect("stream");
    let mut g = c.benchmark_group("fft");
    let mut cases = vec![("c2c_256_call", c2c(256, 1))];
    if gpu {
        cases.push(("c2c_2p20_batch16", c2c(1 << 20, 16)));
    }
    for (name, desc) in cases {
        let bytes = (desc.sizes[0] * desc.batch * 8) as u64;
        let (x, y) = (
            alloc.allocate(bytes, stream).expect("x"),
            alloc.allocate(bytes, stream).expect("y"),
        );
        driver
            .memset_async(x.ptr, ferrocuda_types::MemsetValue::U8(0), bytes, stream)
            .expect("memset");
        fft.execute(stream, &desc, x.ptr, y.ptr, false)
            .expect("plan");
        driver.stream_synchronize(stream).expect("sync");
        if name.ends_with("_call") {
            g.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    common::host_time(
                        iters,
                        || {
                            fft.execute(stream, &desc, x.ptr, y.ptr, false)
                                .expect("fft")
                        },
                        || driver.stream_synchronize(stream).expect("sync"),
                    )
                })
            });
        } else {
            g.warm_up_time(Duration::from_secs(2));
            g.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    common::back_to_back(
                        iters,
                        || {
                            fft.execute(stream, &desc, x.ptr, y.ptr, false)
                                .expect("fft");
                        },
                        || driver.stream_synchronize(stream).expect("sync"),
                    )
                })
            });
        }
        for p in [x, y] {
            alloc.free(p.ptr).expect("free");
        }
    }
    g.finish();
}

fn fft(c: &mut Criterion) {
    let cuda = Arc::new(CudaDriver::new());
    let required = std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match (cuda.unavailable_reason(), CudaFft::new(cuda.clone())) {
        (None, Ok(backend)) => measure(c, cuda, backend, true),
        (reason, backend) => {
            let why = reason.map_or_else(|| format!("{:?}", backend.err()), |r| r.to_string());
            if required {
                eprintln!("fft bench: no GPU with cuFFT ({why})");
                std::process::exit(1);
            }
            eprintln!(
                "fft bench: no GPU with cuFFT ({why}); the small call on the fake device only"
            );
            let fake = Arc::new(FakeDriver::default());
            measure(c, fake.clone(), FakeFft::new(fake), false);
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = fft
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
