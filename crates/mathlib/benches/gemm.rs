//! GEMM through [`Blas`] on the GPU, measured as `xtask/anchors/torch_mathlib.py` measures
//! `torch.matmul` on the same machine: bf16 and fp16 at 4096³ and 8192×8192×1024, fp32 with
//! TF32 at 4096³ (wall time of many GEMMs queued back to back, then a synchronize: the
//! GPU's time per GEMM once the queue is full; after two seconds of warm-up, as the anchor
//! heats the GPU for two seconds: an H200 slows its clocks within a fraction of a second of
//! full load, and both sides are measured in that steady state), and the host's cost of one 64³ fp32 GEMM
//! call (100 calls queued, the synchronize after them not timed).
//!
//! The GPU bundle runs it over the real driver (required there, `FERROCUDA_REQUIRE_GPU=1`);
//! elsewhere only the 64³ call is measured, over the fake device (whose GEMM is a host
//! loop: the figure says nothing of a GPU).
#![allow(clippy::expect_used, missing_docs)]

mod common;

use criterion::{Criterion, criterion_group};
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_amp::precision::{self, MatmulPrecision};
use ferrocuda_driver::{CudaDriver, Driver, FakeDriver};
use ferrocuda_mathlib::{Blas, BlasBackend, CudaBlas, FakeBlas, Gemm};
use ferrocuda_types::{AllocatorConfig, DType, DeviceIndex, StreamFlags};
use std::sync::Arc;
use std::time::Duration;

const DEV: DeviceIndex = DeviceIndex(0);

fn backend() -> (Arc<dyn Driver>, Arc<dyn BlasBackend>, bool) {
    let cuda = Arc::new(CudaDriver::new());
    let required = std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match (cuda.unavailable_reason(), CudaBlas::new(cuda.clone())) {
        (None, Ok(blas)) => (cuda, Arc::new(blas), true),
        (reason, blas) => {
            let why = reason.map_or_else(|| format!("{:?}", blas.err()), |r| r.to_string());
            if required {
                eprintln!("gemm bench: no GPU with cuBLAS ({why})");
                std::process::exit(1);
            }
            eprintln!(
                "gemm bench: no GPU with cuBLAS ({why}); the 64³ call on the fake device only"
            );
            let fake = Arc::new(FakeDriver::default());
            (fake.clone(), Arc::new(FakeBlas::new(fake, 9)), false)
        }
    }
}

fn gemm(c: &mut Criterion) {
    let (driver, backend, gpu) = backend();
    let alloc = Arc::new(
        CachingAllocator::new(driver.clone(), DEV, AllocatorConfig::default(), Caching::On)
            .expect("allocator"),
    );
    let blas = Blas::new(backend, alloc.clone()).expect("blas");
    let stream = driver
        .stream_create(DEV, StreamFlags::default())
        .expect("stream");
    let mut g = c.benchmark_group("gemm");
    let mut shapes = vec![("f32_64_call", DType::F32, 64, 64, 64)];
    if gpu {
        shapes.extend([
            ("bf16_4096", DType::BF16, 4096, 4096, 4096),
            ("f16_4096", DType::F16, 4096, 4096, 4096),
            ("bf16_8192x8192x1024", DType::BF16, 8192, 8192, 1024),
            ("f16_8192x8192x1024", DType::F16, 8192, 8192, 1024),
            ("f32_tf32_4096", DType::F32, 4096, 4096, 4096),
        ]);
    }
    for (name, dtype, m, n, k) in shapes {
        let bytes = |r: usize, c: usize| (r * c * dtype.size()) as u64;
        let (a, b, out) = (
            alloc.allocate(bytes(m, k), stream).expect("a"),
            alloc.allocate(bytes(k, n), stream).expect("b"),
            alloc.allocate(bytes(m, n), stream).expect("c"),
        );
        driver
            .memset_async(
                a.ptr,
                ferrocuda_types::MemsetValue::U8(0),
                bytes(m, k),
                stream,
            )
            .expect("memset");
        driver
            .memset_async(
                b.ptr,
                ferrocuda_types::MemsetValue::U8(0),
                bytes(k, n),
                stream,
            )
            .expect("memset");
        let call = Gemm::plain(dtype, m, n, k, a.ptr, b.ptr, out.ptr);
        let tf32 = name.contains("tf32");
        precision::update_global(|p| {
            p.set_float32_matmul_precision(if tf32 {
                MatmulPrecision::High
            } else {
                MatmulPrecision::Highest
            })
        });
        blas.gemm(stream, &call).expect("warm-up gemm");
        driver.stream_synchronize(stream).expect("sync");
        if name.ends_with("_call") {
            // The host's cost of a call: 100 queued, the wait for them not timed.
            g.bench_function(name, |bch| {
                bch.iter_custom(|iters| {
                    common::host_time(
                        iters,
                        || blas.gemm(stream, &call).expect("gemm"),
                        || driver.stream_synchronize(stream).expect("sync"),
                    )
                })
            });
        } else {
            g.warm_up_time(Duration::from_secs(2));
            g.bench_function(name, |bch| {
                bch.iter_custom(|iters| {
                    common::back_to_back(
                        iters,
                        || {
                            blas.gemm(stream, &call).expect("gemm");
                        },
                        || driver.stream_synchronize(stream).expect("sync"),
                    )
                })
            });
        }
        for x in [a, b, out] {
            alloc.free(x.ptr).expect("free");
        }
    }
    precision::update_global(|p| p.set_float32_matmul_precision(MatmulPrecision::Highest));
    if gpu {
        tuned_against_untuned(&mut g, &blas, &alloc, &driver, stream);
    }
    g.finish();
}

/// TunableOp's promise: a tuned GEMM is never slower than the untuned call. Each shape
/// untuned (the default call), then tuned once and measured with its result.
fn tuned_against_untuned(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    blas: &Blas,
    alloc: &CachingAllocator,
    driver: &Arc<dyn Driver>,
    stream: ferrocuda_types::StreamHandle,
) {
    for (name, dtype, m, n, k) in [
        ("bf16_1024", DType::BF16, 1024, 1024, 1024),
        ("f32_333x4096x77", DType::F32, 333, 4096, 77),
    ] {
        let bytes = |r: usize, c: usize| (r * c * dtype.size()) as u64;
        let (a, b, out) = (
            alloc.allocate(bytes(m, k), stream).expect("a"),
            alloc.allocate(bytes(k, n), stream).expect("b"),
            alloc.allocate(bytes(m, n), stream).expect("c"),
        );
        for (p, len) in [(a.ptr, bytes(m, k)), (b.ptr, bytes(k, n))] {
            driver
                .memset_async(p, ferrocuda_types::MemsetValue::U8(0), len, stream)
                .expect("memset");
        }
        let call = Gemm::plain(dtype, m, n, k, a.ptr, b.ptr, out.ptr);
        for tuned in [false, true] {
            blas.update_tunable(|t| {
                t.enabled = tuned;
                t.tuning = true;
                t.filename = std::env::temp_dir()
                    .join("ferrocuda-bench-tunableop.csv")
                    .to_string_lossy()
                    .into_owned();
            });
            blas.gemm(stream, &call).expect("gemm (tuning)");
            driver.stream_synchronize(stream).expect("sync");
            if tuned {
                // What the tuning chose, for the log.
                for r in blas.tunable().results() {
                    eprintln!(
                        "tuned {name}: {} {} -> {} ({} ms)",
                        r.op_sig,
                        r.param_sig,
                        r.solution.name(),
                        r.ms
                    );
                }
            }
            let label = format!("{}_{name}", if tuned { "tuned" } else { "untuned" });
            g.bench_function(label, |bch| {
                bch.iter_custom(|iters| {
                    common::back_to_back(
                        iters,
                        || {
                            blas.gemm(stream, &call).expect("gemm");
                        },
                        || driver.stream_synchronize(stream).expect("sync"),
                    )
                })
            });
        }
        blas.update_tunable(|t| t.enabled = false);
        for x in [a, b, out] {
            alloc.free(x.ptr).expect("free");
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = gemm
}

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
