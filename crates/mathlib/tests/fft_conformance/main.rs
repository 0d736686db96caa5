//! cuFFT through the plan cache, written once and run on both backends: `fake::*` in CI,
//! `cuda::*` on a GPU in the bundle (ignored elsewhere; there a missing GPU or libcufft
//! fails). PyTorch's cache rules (`CuFFTPlanCache.h`) and results against a CPU DFT.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

#[macro_use]
#[path = "../common/both_backends.rs"]
mod both_backends;

use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::cufft::FftError;
use ferrocuda_driver::{CudaDriver, Driver, FakeDriver};
use ferrocuda_mathlib::{
    CudaFft, FakeFft, Fft, FftBackend, FftDesc, FftKind, FftLayout, MathLibError,
};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, StreamFlags, StreamHandle};
use half::f16;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub type TestResult = Result<(), Box<dyn std::error::Error>>;
const DEV: DeviceIndex = DeviceIndex(0);

/// Counts the plans a backend makes and destroys.
#[derive(Debug)]
pub struct Counting<B> {
    inner: B,
    made: AtomicU64,
    destroyed: Arc<AtomicU64>,
}

#[derive(Debug)]
pub struct CountedPlan<P> {
    plan: P,
    destroyed: Arc<AtomicU64>,
}

impl<P> Drop for CountedPlan<P> {
    fn drop(&mut self) {
        self.destroyed.fetch_add(1, Ordering::Relaxed);
    }
}

impl<B: FftBackend> FftBackend for Counting<B> {
    type Plan = CountedPlan<B::Plan>;
    fn make_plan(
        &self,
        device: DeviceIndex,
        desc: &FftDesc,
    ) -> Result<(Self::Plan, u64), MathLibError> {
        let (plan, work) = self.inner.make_plan(device, desc)?;
        self.made.fetch_add(1, Ordering::Relaxed);
        Ok((
            CountedPlan {
                plan,
                destroyed: self.destroyed.clone(),
            },
            work,
        ))
    }
    fn work_size(&self, plan: &Self::Plan) -> u64 {
        self.inner.work_size(&plan.plan)
    }
    fn execute(
        &self,
        plan: &Self::Plan,
        stream: StreamHandle,
        work: DevicePtr,
        io: (DevicePtr, DevicePtr),
        inverse: bool,
    ) -> Result<(), MathLibError> {
        self.inner.execute(&plan.plan, stream, work, io, inverse)
    }
}

#[derive(Debug)]
pub struct Setup<B: FftBackend> {
    driver: Arc<dyn Driver>,
    alloc: Arc<CachingAllocator>,
    fft: Fft<Counting<B>>,
    stream: StreamHandle,
}

impl<B: FftBackend> Setup<B> {
    fn new(driver: Arc<dyn Driver>, backend: B) -> Setup<B> {
        let alloc = Arc::new(
            CachingAllocator::new(driver.clone(), DEV, AllocatorConfig::default(), Caching::On)
                .expect("allocator"),
        );
        let stream = driver
            .stream_create(DEV, StreamFlags::default())
            .expect("stream");
        let counting = Counting {
            inner: backend,
            made: AtomicU64::new(0),
            destroyed: Arc::default(),
        };
        Setup {
            fft: Fft::new(counting, alloc.clone()).expect("fft"),
            driver,
            alloc,
            stream,
        }
    }
    fn made(&self) -> u64 {
        self.fft.backend().made.load(Ordering::Relaxed)
    }
    fn destroyed(&self) -> u64 {
        self.fft.backend().destroyed.load(Ordering::Relaxed)
    }
    /// Device memory holding `values` as reals of `width` bytes (2, 4 or 8).
    fn upload(
        &self,
        values: &[f64],
        width: usize,
    ) -> Result<DevicePtr, Box<dyn std::error::Error>> {
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| match width {
                2 => f16::from_f64(v).to_le_bytes().to_vec(),
                4 => (v as f32).to_le_bytes().to_vec(),
                _ => v.to_le_bytes().to_vec(),
            })
            .collect();
        let a = self
            .alloc
            .allocate(bytes.len().max(1) as u64, self.stream)?;
        self.driver.memcpy_htod_async(a.ptr, &bytes, self.stream)?;
        Ok(a.ptr)
    }
    fn download(
        &self,
        ptr: DevicePtr,
        n: usize,
        width: usize,
    ) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
        let mut bytes = vec![0u8; n * width];
        self.driver.memcpy_dtoh(&mut bytes, ptr, self.stream)?;
        Ok(bytes
            .chunks_exact(width)
            .map(|c| match width {
                2 => f16::from_le_bytes([c[0], c[1]]).to_f64(),
                4 => f64::from(f32::from_le_bytes(c.try_into().unwrap())),
                _ => f64::from_le_bytes(c.try_into().unwrap()),
            })
            .collect())
    }
}

fn fake_setup() -> Setup<FakeFft> {
    let fake = Arc::new(FakeDriver::default());
    Setup::new(fake.clone(), FakeFft::new(fake))
}

fn cuda_setup() -> Setup<CudaFft> {
    let cuda = Arc::new(CudaDriver::new());
    if let Some(reason) = cuda.unavailable_reason() {
        panic!("no usable CUDA device ({reason}): this test needs a GPU");
    }
    let fft = CudaFft::new(cuda.clone()).unwrap_or_else(|e| panic!("{e}"));
    Setup::new(cuda, fft)
}

both_backends!(
    "needs a GPU and libcufft: runs in the GPU bundle (cargo xtask gpu-bundle)",
    transforms_match_a_cpu_dft,
    half_transforms_match_a_cpu_dft,
    half_transforms_refuse_sizes_not_powers_of_two,
    plans_are_kept_least_recently_used_first_out,
    work_areas_are_allocator_memory_for_the_call,
    a_work_area_budget_bounds_the_kept_plans,
);

/// Complex values, dense.
type Signal = Vec<(f64, f64)>;

fn dense(shape: &[i64]) -> FftLayout {
    FftLayout {
        embed: shape.to_vec(),
        stride: 1,
        dist: shape.iter().product(),
    }
}

/// The DFT of a dense row-major signal, one dimension at a time (separable), in f64.
fn reference_dft(x: &[(f64, f64)], shape: &[i64], inverse: bool) -> Vec<(f64, f64)> {
    let sign = if inverse { 1.0 } else { -1.0 };
    let mut cur = x.to_vec();
    for d in 0..shape.len() {
        let n = shape[d] as usize;
        let inner: usize = shape[d + 1..].iter().product::<i64>() as usize;
        let outer = cur.len() / (n * inner);
        let mut next = vec![(0.0, 0.0); cur.len()];
        for o in 0..outer {
            for i in 0..inner {
                for k in 0..n {
                    let mut acc = (0.0, 0.0);
                    for j in 0..n {
                        let (re, im) = cur[(o * n + j) * inner + i];
                        let a = sign * 2.0 * std::f64::consts::PI * ((j * k) % n) as f64 / n as f64;
                        acc = (
                            acc.0 + re * a.cos() - im * a.sin(),
                            acc.1 + re * a.sin() + im * a.cos(),
                        );
                    }
                    next[(o * n + k) * inner + i] = acc;
                }
            }
        }
        cur = next;
    }
    cur
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() % (1 << 20)) as f64 / (1 << 19) as f64 - 1.0
    }
}

/// Every kind in fp32 and fp64, ranks 1 to 3, batches, forward and inverse, contiguous
/// and strided layouts: each output element within the precision's tolerance of a CPU DFT.
pub fn transforms_match_a_cpu_dft<B: FftBackend>(s: &Setup<B>) -> TestResult {
    let kinds = [
        FftKind::C2C,
        FftKind::R2C,
        FftKind::C2R,
        FftKind::Z2Z,
        FftKind::D2Z,
        FftKind::Z2D,
    ];
    random_transforms(s, &kinds, 36, |rng, rank| {
        2 + (rng.next() % if rank == 1 { 31 } else { 7 }) as i64
    })
}

/// The half-precision kinds (`cufftXt`) likewise, on power-of-two sizes (2 to 64 in one
/// dimension, to 8 in more), within fp16's tolerance.
pub fn half_transforms_match_a_cpu_dft<B: FftBackend>(s: &Setup<B>) -> TestResult {
    let kinds = [FftKind::C2CHalf, FftKind::R2CHalf, FftKind::C2RHalf];
    random_transforms(s, &kinds, 36, |rng, rank| {
        1 << (1 + rng.next() % if rank == 1 { 6 } else { 3 })
    })
}

/// `rounds` random transforms cycling through `kinds`, each dimension's size from `size`
/// (given the rank).
fn random_transforms<B: FftBackend>(
    s: &Setup<B>,
    kinds: &[FftKind],
    rounds: usize,
    size: impl Fn(&mut Rng, usize) -> i64,
) -> TestResult {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for round in 0..rounds {
        let kind = kinds[round % kinds.len()];
        let width = kind.real_bytes();
        let rank = 1 + round / kinds.len() % 3;
        let shape: Vec<i64> = (0..rank).map(|_| size(&mut rng, rank)).collect();
        let batch = 1 + (rng.next() % 3) as i64;
        let stride = if round % 4 == 3 { 2 } else { 1 };
        let n: i64 = shape.iter().product();
        let mut half = shape.clone();
        half[rank - 1] = shape[rank - 1] / 2 + 1;
        let (complex_in, complex_out) = kind.complex_sides();
        let in_shape = if complex_in && !complex_out {
            &half
        } else {
            &shape
        };
        let out_shape = if complex_out && !complex_in {
            &half
        } else {
            &shape
        };
        let (in_n, out_n) = (
            in_shape.iter().product::<i64>(),
            out_shape.iter().product::<i64>(),
        );
        let layout = |sh: &Vec<i64>, cnt: i64| FftLayout {
            embed: sh.clone(),
            stride,
            dist: cnt * stride + 3,
        };
        let desc = FftDesc {
            kind,
            sizes: shape.clone(),
            batch,
            input: layout(in_shape, in_n),
            output: layout(out_shape, out_n),
        };
        let inverse = round % (2 * kinds.len()) >= kinds.len();
        // The signals, dense, each with the real signal it came from: for C2R the input is
        // the half spectrum of a real signal (Hermitian), whose inverse is that signal
        // times n.
        let signals: Vec<(Signal, Signal)> = (0..batch)
            .map(|_| {
                let x: Vec<(f64, f64)> = (0..n)
                    .map(|_| {
                        (
                            rng.unit(),
                            if complex_in && complex_out {
                                rng.unit()
                            } else {
                                0.0
                            },
                        )
                    })
                    .collect();
                if complex_in && !complex_out {
                    let full = reference_dft(&x, &shape, false);
                    let half_spec = full
                        .chunks(shape[rank - 1] as usize)
                        .flat_map(|r| r[..half[rank - 1] as usize].to_vec())
                        .collect();
                    (half_spec, x)
                } else {
                    (x.clone(), x)
                }
            })
            .collect();
        let elem_in = if complex_in { 2 } else { 1 };
        let elem_out = if complex_out { 2 } else { 1 };
        let in_len = ((batch - 1) * desc.input.dist + in_n * stride) as usize;
        let mut host = vec![0.0; in_len * elem_in];
        for (b, (sig, _)) in signals.iter().enumerate() {
            for (i, &(re, im)) in sig.iter().enumerate() {
                let at = (b as i64 * desc.input.dist + i as i64 * stride) as usize * elem_in;
                host[at] = re;
                if complex_in {
                    host[at + 1] = im;
                }
            }
        }
        let out_len = ((batch - 1) * desc.output.dist + out_n * stride) as usize;
        let input = s.upload(&host, width)?;
        let output = s.upload(&vec![0.0; out_len * elem_out], width)?;
        s.fft.execute(s.stream, &desc, input, output, inverse)?;
        let got = s.download(output, out_len * elem_out, width)?;
        for (b, (sig, origin)) in signals.iter().enumerate() {
            let want: Vec<(f64, f64)> = match (complex_in, complex_out) {
                (true, true) => reference_dft(sig, &shape, inverse),
                (false, true) => {
                    let full = reference_dft(sig, &shape, false);
                    full.chunks(shape[rank - 1] as usize)
                        .flat_map(|r| r[..half[rank - 1] as usize].to_vec())
                        .collect()
                }
                // The real signal the half spectrum came from, times n (unnormalised).
                _ => origin.iter().map(|&(re, _)| (re * n as f64, 0.0)).collect(),
            };
            let scale: f64 = sig
                .iter()
                .map(|(re, im)| re.abs() + im.abs())
                .sum::<f64>()
                .max(1.0);
            let tol = match width {
                2 => 1e-2,
                4 => 2e-5,
                _ => 1e-11,
            } * scale;
            for (i, &(re, im)) in want.iter().enumerate() {
                let at = (b as i64 * desc.output.dist + i as i64 * stride) as usize * elem_out;
                let (gr, gi) = (got[at], if complex_out { got[at + 1] } else { 0.0 });
                assert!(
                    (gr - re).abs() <= tol && (gi - im).abs() <= tol,
                    "round {round} {kind:?} {shape:?} batch {b} element {i}: got ({gr}, {gi}), want ({re}, {im}), tol {tol}"
                );
            }
        }
    }
    Ok(())
}

/// A half-precision transform with a size that is not a power of two is PyTorch's error,
/// word for word, before any plan is made; the backend asked directly refuses it too.
pub fn half_transforms_refuse_sizes_not_powers_of_two<B: FftBackend>(s: &Setup<B>) -> TestResult {
    let buf = s.upload(&vec![0.0; 2 * 80 * 80], 2)?;
    let desc = FftDesc {
        kind: FftKind::C2CHalf,
        sizes: vec![80, 80],
        batch: 1,
        input: dense(&[80, 80]),
        output: dense(&[80, 80]),
    };
    let made = s.made();
    let err = s.fft.execute(s.stream, &desc, buf, buf, false).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cuFFT only supports dimensions whose sizes are powers of two when computing in half \
         precision, but got a signal size of[80, 80]"
    );
    assert_eq!(s.made(), made, "no plan was made");
    for kind in [FftKind::C2CHalf, FftKind::R2CHalf, FftKind::C2RHalf] {
        let direct = s.fft.backend().inner.make_plan(DEV, &small(kind, 12));
        assert!(
            matches!(direct, Err(MathLibError::Fft(FftError::Cufft { .. }))),
            "{kind:?} of 12 made directly: {:?}",
            direct.map(|(_, work)| work)
        );
    }
    Ok(())
}

fn small(kind: FftKind, n: i64) -> FftDesc {
    FftDesc {
        kind,
        sizes: vec![n],
        batch: 1,
        input: dense(&[n]),
        output: dense(&[n]),
    }
}

fn run<B: FftBackend>(s: &Setup<B>, desc: &FftDesc) -> TestResult {
    let n: i64 = desc.sizes.iter().product::<i64>() * desc.batch;
    let buf = s.upload(&vec![0.0; 2 * n as usize], 4)?;
    s.fft.execute(s.stream, desc, buf, buf, false)?;
    Ok(())
}

/// PyTorch's `CuFFTParamsLRUCache`: a hit makes nothing, a miss beyond `max_size` destroys
/// the least recently used; lowering `max_size` destroys the oldest; 0 keeps nothing (each
/// call makes and destroys its plan); `clear` destroys all.
pub fn plans_are_kept_least_recently_used_first_out<B: FftBackend>(s: &Setup<B>) -> TestResult {
    assert_eq!(s.fft.plan_cache_max_size(), 4096);
    let (a, b, c) = (
        small(FftKind::C2C, 8),
        small(FftKind::C2C, 16),
        small(FftKind::C2C, 32),
    );
    s.fft.set_plan_cache_max_size(2);
    for d in [&a, &b, &a, &a, &c] {
        run(s, d)?;
    }
    assert_eq!(
        (s.made(), s.destroyed()),
        (3, 1),
        "a hit twice; b evicted by c"
    );
    assert_eq!(s.fft.plan_cache_keys(), [c.clone(), a.clone()]);
    run(s, &b)?;
    assert_eq!(
        s.fft.plan_cache_keys(),
        [b.clone(), c.clone()],
        "a was the oldest"
    );
    s.fft.set_plan_cache_max_size(1);
    assert_eq!(s.fft.plan_cache_keys(), std::slice::from_ref(&b));
    assert_eq!(s.destroyed(), 3);
    s.fft.set_plan_cache_max_size(0);
    assert_eq!(s.fft.plan_cache_size(), 0);
    let made = s.made();
    run(s, &a)?;
    run(s, &a)?;
    assert_eq!(
        (s.made() - made, s.fft.plan_cache_size()),
        (2, 0),
        "nothing kept at 0"
    );
    assert_eq!(s.made(), s.destroyed());
    s.fft.set_plan_cache_max_size(4096);
    run(s, &a)?;
    run(s, &b)?;
    s.fft.clear_plan_cache();
    assert_eq!(s.fft.plan_cache_size(), 0);
    assert_eq!(s.made(), s.destroyed(), "clear destroys every plan");
    Ok(())
}

/// Each execution's work area is an allocation of the caching allocator on the call's
/// stream, counted in its statistics and freed once the transform is queued.
pub fn work_areas_are_allocator_memory_for_the_call<B: FftBackend>(s: &Setup<B>) -> TestResult {
    let desc = FftDesc {
        kind: FftKind::C2C,
        sizes: vec![1 << 16],
        batch: 4,
        input: dense(&[1 << 16]),
        output: dense(&[1 << 16]),
    };
    let buf = s.upload(&vec![0.0; 2 << 18], 4)?;
    let out = s.upload(&vec![0.0; 2 << 18], 4)?;
    s.fft.execute(s.stream, &desc, buf, out, false)?;
    let work = s.fft.plan_cache_work_bytes();
    let before = s.alloc.stats();
    for _ in 0..3 {
        s.fft.execute(s.stream, &desc, buf, out, false)?;
    }
    let after = s.alloc.stats();
    let allocations = after.allocation.all.allocated - before.allocation.all.allocated;
    assert_eq!(
        allocations,
        if work > 0 { 3 } else { 0 },
        "one work area per execution (work {work})"
    );
    assert_eq!(
        after.allocated_bytes.all.current, before.allocated_bytes.all.current,
        "freed after each"
    );
    if work > 0 {
        assert!(
            after.allocated_bytes.all.allocated - before.allocated_bytes.all.allocated
                >= 3 * work as i64
        );
    }
    s.driver.stream_synchronize(s.stream)?;
    Ok(())
}

/// ferrocuda's budget: kept plans' work sizes stay within it, least recently used out
/// first; a plan over it alone is made for its call and destroyed after it.
pub fn a_work_area_budget_bounds_the_kept_plans<B: FftBackend>(s: &Setup<B>) -> TestResult {
    let descs: Vec<FftDesc> = [1 << 12, 1 << 13, 1 << 14]
        .iter()
        .map(|&n| FftDesc {
            kind: FftKind::C2C,
            sizes: vec![n],
            batch: 8,
            input: dense(&[n]),
            output: dense(&[n]),
        })
        .collect();
    let mut works = Vec::new();
    for d in &descs {
        run(s, d)?;
        works.push(s.fft.plan_cache_work_bytes() - works.iter().sum::<u64>());
    }
    assert_eq!(s.fft.plan_cache_size(), 3);
    let total: u64 = works.iter().sum();
    // Room for the two newest only.
    let budget = works[1] + works[2];
    s.fft.set_plan_cache_max_work_bytes(Some(budget));
    assert_eq!(s.fft.plan_cache_max_work_bytes(), Some(budget));
    assert!(s.fft.plan_cache_work_bytes() <= budget);
    if works[0] > 0 {
        assert_eq!(
            s.fft.plan_cache_keys(),
            [descs[2].clone(), descs[1].clone()],
            "works {works:?}"
        );
    }
    let made = s.made();
    s.fft
        .set_plan_cache_max_work_bytes(Some(works[2].saturating_sub(1)));
    if works[2] > 0 {
        run(s, &descs[2])?;
        run(s, &descs[2])?;
        assert_eq!(
            s.made() - made,
            2,
            "over the budget alone: made for each call"
        );
        assert!(!s.fft.plan_cache_keys().contains(&descs[2]));
    }
    s.fft.set_plan_cache_max_work_bytes(None);
    assert!(total >= s.fft.plan_cache_work_bytes());
    Ok(())
}

/// Without libcufft, `CudaFft` is a typed "unavailable" naming what to set; the GPU bundle
/// must find it.
#[test]
fn cufft_is_found_or_says_why() -> TestResult {
    use ferrocuda_driver::LIBRARY_PATH_VAR;
    use ferrocuda_driver::cufft::FftError;
    let required = std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match CudaFft::new(Arc::new(CudaDriver::new())) {
        Ok(_) => Ok(()),
        Err(MathLibError::Fft(FftError::Unavailable(why))) if !required => {
            assert!(
                why.contains(LIBRARY_PATH_VAR) && why.contains("libcufft"),
                "{why}"
            );
            Ok(())
        }
        Err(e) => Err(format!("cuFFT on the GPU bundle: {e}").into()),
    }
}
