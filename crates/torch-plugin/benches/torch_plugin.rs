//! What the exported functions add to the allocator's hot path: a cached 1 MiB alloc+free
//! pair straight into the allocator, then through the shims' safe halves (device check,
//! panic guard, dynamic dispatch, the per-thread stream adoption set) on the legacy stream
//! and on a stream of its own (what PyTorch's current stream usually is). PyTorch's own
//! wrapper (a mutex and a hash map per call) comes on top of either.
//!
//! On the GPU bundle it runs over the real driver (required there); elsewhere over the fake
//! device, where the hot path is the same code (it makes no driver call once cached).
// A benchmark has no caller to report to: setup failures abort it, loudly.
#![allow(clippy::expect_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use ferrocuda::alloc::{Caching, CachingAllocator, DeviceAllocators};
use ferrocuda::driver::interop::cudarc::driver::CudaContext;
use ferrocuda::driver::{CudaDriver, Driver, FakeDriver, ForeignStream};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, StreamHandle};
use ferrocuda_driver::c_export as c;
use ferrocuda_torch::TorchBackend;
use std::hint::black_box;
use std::sync::Arc;

const DEV: DeviceIndex = DeviceIndex(0);
const MIB: usize = 1 << 20;

/// The driver, and a stream another library made on it (cudarc's on the GPU, as PyTorch
/// makes its own; the fake's stand-in elsewhere).
fn driver() -> (Arc<dyn Driver>, ForeignStream) {
    let cuda = CudaDriver::new();
    match cuda.unavailable_reason() {
        None => {
            let ctx = CudaContext::new(0).expect("cudarc context");
            let stream = ctx.new_stream().expect("cudarc stream");
            let foreign = ForeignStream::cudarc(&stream).expect("foreign stream");
            (Arc::new(cuda), foreign)
        }
        Some(reason) => {
            if std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                eprintln!("torch_plugin bench: no usable GPU ({reason})");
                std::process::exit(1);
            }
            eprintln!("torch_plugin bench: no GPU ({reason}); measuring over the fake device");
            let fake = FakeDriver::default();
            let foreign = fake.foreign_stream(DEV).expect("foreign stream");
            (Arc::new(fake), foreign)
        }
    }
}

fn direct_pair(a: &CachingAllocator, stream: StreamHandle) {
    let x = a.allocate(MIB as u64, stream).expect("allocate");
    a.free(black_box(x.ptr)).expect("free");
}

fn shim_pair(b: &TorchBackend, stream: &ForeignStream) {
    let x = c::malloc(b, MIB, 0, stream).expect("alloc");
    c::free(b, black_box(x), MIB, 0, stream).expect("free");
}

fn shims(cr: &mut Criterion) {
    let (driver, foreign) = driver();
    let allocators = DeviceAllocators::new(driver.clone(), AllocatorConfig::default(), Caching::On);
    let b = TorchBackend::new(driver.clone(), allocators.clone());
    let a = allocators.device(DEV).expect("allocator");
    let mut g = cr.benchmark_group("torch_plugin");
    direct_pair(a, StreamHandle::legacy(DEV));
    g.bench_function("pair_1MiB_direct", |x| {
        x.iter(|| direct_pair(a, StreamHandle::legacy(DEV)))
    });
    let legacy = ForeignStream::legacy(DEV);
    shim_pair(&b, &legacy);
    g.bench_function("pair_1MiB_shim", |x| x.iter(|| shim_pair(&b, &legacy)));
    // Adopted at the first pair: the per-thread set is what the others pay.
    shim_pair(&b, &foreign);
    g.bench_function("pair_1MiB_shim_stream", |x| {
        x.iter(|| shim_pair(&b, &foreign))
    });
    g.finish();
}

criterion_group!(benches, shims);
criterion_main!(benches);
