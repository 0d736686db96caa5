//! Adversarial scenario tests of `ferrocuda-mathlib`'s public API on the fake backend.
//!
//! Expectations come from PyTorch 2.11's rules (`aten/src/ATen/cuda/CublasHandlePool.cpp`,
//! `CuFFTPlanCache.h`, TunableOp) and the crate's documented API, never from its sources:
//! 1. `CUBLAS_WORKSPACE_CONFIG`'s grammar (`std::regex_iterator` over `:([0-9]+):([0-9]+)`);
//! 2. `WorkspaceSizes::from_env` (defaults, warnings, `std::stoi` for the cuBLASLt size);
//! 3. the FFT plan cache (LRU against a model, the work-bytes budget);
//! 4. FFT results (unnormalised DFTs; bad descriptors are typed errors);
//! 5. the TunableOp results file, signatures and file names;
//! 6. `Blas::gemm` against a CPU reference, leading dimensions, workspaces and threads.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::cublas::Batch;
use ferrocuda_driver::{Driver, FakeDriver};
use ferrocuda_mathlib::tunable::{ResultsFile, Solution, TunableState, TunedGemm, signatures};
use ferrocuda_mathlib::workspace_config::{WorkspaceSizes, parse_workspace_config};
use ferrocuda_mathlib::{
    Blas, FakeBlas, FakeFft, Fft, FftDesc, FftKind, FftLayout, Gemm, MathLibError,
};
use ferrocuda_types::{AllocatorConfig, DType, DeviceIndex, DevicePtr, StreamFlags, StreamHandle};
use half::{bf16, f16};
use std::collections::HashMap;
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Barrier};

const DEV: DeviceIndex = DeviceIndex(0);
const MIB32: u64 = 33_554_432;
const LEGACY_DEFAULT: u64 = 8_519_680;

/// xorshift64, for reproducible programs.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// In [-1, 1).
    fn unit(&mut self) -> f64 {
        (self.below(1 << 20) as f64 / (1 << 19) as f64) - 1.0
    }
}

/// Runs `f`, turning a panic into `Err(message)` so a table of cases reports every panic.
fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_default();
            panic!("{what}: PANICKED ({msg}) where a value or a typed error was expected")
        }
    }
}

/// Runs `f`: `Err(message)` if it panicked.
fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_default()
    })
}

mod captures;
mod fft;
mod gemm;
mod half_fft;
mod tunable;
mod tunable_files;
mod workspace;
