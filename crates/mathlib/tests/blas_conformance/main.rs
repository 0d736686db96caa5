//! cuBLAS handles, workspaces and GEMM, written once and run on both backends: `fake::*` on
//! the fake device in CI, `cuda::*` on a GPU in the bundle (ignored elsewhere; there a
//! missing GPU or libcublas fails). PyTorch's rules from `CublasHandlePool.cpp` and
//! `CUDABlas.cpp`; results against a CPU reference.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

#[macro_use]
#[path = "../common/both_backends.rs"]
mod both_backends;

mod support;

use ferrocuda_amp::precision::{self, MatmulPrecision, NoTf32Guard, PrecisionError};
use ferrocuda_driver::cublas::{Batch, ComputeType, MathMode};
use ferrocuda_mathlib::tunable::{ResultsFile, Solution, ferrocuda_file};
use ferrocuda_mathlib::{BlasLibrary, Gemm, MathLibError};
use ferrocuda_types::{DType, DevicePtr};
use support::*;

both_backends!(
    "needs a GPU and libcublas: runs in the GPU bundle (cargo xtask gpu-bundle)",
    gemm_matches_a_cpu_reference,
    one_handle_per_thread_given_back_when_the_thread_ends,
    every_acquisition_sets_stream_workspace_and_math_mode,
    workspaces_are_allocator_memory_per_stream,
    precision_settings_pick_math_mode_and_compute_type,
    bad_gemms_are_typed_errors,
    cublaslt_path_matches_the_reference_and_takes_split_k_disallowed,
    tunableop_tunes_once_writes_pytorchs_file_and_reads_it_back,
);

/// `C = alpha op(A) op(B) + beta C` in f64, column-major, from the values as stored.
#[allow(clippy::too_many_arguments)]
fn reference(g: &Gemm, a: &[f64], b: &[f64], c: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut out = c.to_vec();
    let mut scale = vec![0.0; c.len()];
    for col in 0..g.n {
        for row in 0..g.m {
            let (mut dot, mut mag) = (0.0, 0.0);
            for x in 0..g.k {
                let av = if g.transa {
                    a[row * g.lda + x]
                } else {
                    a[x * g.lda + row]
                };
                let bv = if g.transb {
                    b[x * g.ldb + col]
                } else {
                    b[col * g.ldb + x]
                };
                dot += av * bv;
                mag += (av * bv).abs();
            }
            let i = col * g.ldc + row;
            let old = if g.beta == 0.0 { 0.0 } else { c[i] };
            out[i] = g.alpha * dot + g.beta * old;
            scale[i] = g.alpha.abs() * mag + (g.beta * old).abs();
        }
    }
    (out, scale)
}

/// Relative error allowed per element of the reference's scale: the type's unit roundoff
/// over a few accumulations (fp32 under "highest" is IEEE, not TF32).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 4e-3,
        _ => 2e-2,
    }
}

/// Random shapes (ones and odd sizes among them), transposes, padded leading dimensions,
/// alpha and beta, single and strided-batched, in every type with a GEMM: each element of
/// C within the type's tolerance of the CPU reference, and the padding of C untouched.
pub fn gemm_matches_a_cpu_reference(s: &Setup) -> TestResult {
    let _p = PRECISION.lock();
    let stream = s.stream()?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for round in 0..48 {
        let dtype = [DType::F32, DType::F64, DType::F16, DType::BF16][round % 4];
        let (m, n, k) = (
            1 + rng.below(37) as usize,
            1 + rng.below(29) as usize,
            1 + rng.below(45) as usize,
        );
        let (transa, transb) = (rng.below(2) == 1, rng.below(2) == 1);
        let pad = |r: &mut Rng| r.below(3) as usize;
        let (a_rows, a_cols) = if transa { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if transb { (n, k) } else { (k, n) };
        let (lda, ldb, ldc) = (
            a_rows + pad(&mut rng),
            b_rows + pad(&mut rng),
            m + pad(&mut rng),
        );
        let count = if round % 3 == 0 {
            1 + rng.below(3) as usize
        } else {
            1
        };
        let (sa, sb, sc) = (lda * a_cols + 3, ldb * b_cols + 1, ldc * n + 2);
        let mut fill =
            |len: usize| -> Vec<f64> { (0..len).map(|_| round_to(dtype, rng.unit())).collect() };
        let (a, b, c) = (fill(sa * count), fill(sb * count), fill(sc * count));
        let (alpha, beta) = if round % 2 == 0 {
            (1.0, 0.0)
        } else {
            (0.5, -1.5)
        };
        let (pa, pb, pc) = (
            s.upload(dtype, &a, stream)?,
            s.upload(dtype, &b, stream)?,
            s.upload(dtype, &c, stream)?,
        );
        let g = Gemm {
            dtype,
            transa,
            transb,
            m,
            n,
            k,
            a: pa,
            lda,
            b: pb,
            ldb,
            c: pc,
            ldc,
            alpha,
            beta,
            batch: (count > 1).then_some(Batch {
                count,
                strides: [sa as i64, sb as i64, sc as i64],
            }),
        };
        s.blas.gemm(stream, &g)?;
        let got = s.download(dtype, pc, sc * count, stream)?;
        for i in 0..count {
            let one = Gemm { batch: None, ..g };
            let (want, scale) =
                reference(&one, &a[i * sa..], &b[i * sb..], &c[i * sc..(i + 1) * sc]);
            for (j, ((&w, &sc_), &gv)) in want
                .iter()
                .zip(&scale)
                .zip(&got[i * sc..(i + 1) * sc])
                .enumerate()
            {
                let row = j % ldc;
                let inside = row < m && j / ldc < n;
                let err = (gv - w).abs();
                let allowed = if inside {
                    tolerance(dtype) * (sc_ + 1e-30) * (k as f64).sqrt().max(1.0)
                        + round_err(dtype, w)
                } else {
                    0.0
                };
                assert!(
                    err <= allowed,
                    "round {round} {dtype:?} m{m} n{n} k{k} ta{transa} tb{transb} batch {i}: element {j} {gv} vs {w} (err {err}, allowed {allowed}, inside {inside})"
                );
            }
        }
    }
    Ok(())
}

fn round_to(dtype: DType, v: f64) -> f64 {
    round(dtype, v)
}

/// Half an ulp of `w` in `dtype` (the final rounding of C).
fn round_err(dtype: DType, w: f64) -> f64 {
    let eps = match dtype {
        DType::F64 => f64::EPSILON,
        DType::F32 => f64::from(f32::EPSILON),
        DType::F16 => 9.77e-4,
        _ => 7.82e-3,
    };
    w.abs() * eps
}

fn gemm_on(
    s: &Setup,
    dtype: DType,
    stream: ferrocuda_types::StreamHandle,
) -> Result<Gemm, Box<dyn std::error::Error>> {
    let a = s.upload(dtype, &[1.0; 64], stream)?;
    let b = s.upload(dtype, &[1.0; 64], stream)?;
    let c = s.upload(dtype, &[0.0; 64], stream)?;
    Ok(Gemm::plain(dtype, 8, 8, 8, a, b, c))
}

/// PyTorch's `DeviceThreadHandlePool`: a thread keeps one handle; when it ends, the handle
/// goes back to the pool and the next new thread takes it instead of making one.
pub fn one_handle_per_thread_given_back_when_the_thread_ends(s: &Setup) -> TestResult {
    let _p = PRECISION.lock();
    let stream = s.stream()?;
    let g = gemm_on(s, DType::F32, stream)?;
    let creates = |acts: &[Act]| acts.iter().filter(|a| matches!(a, Act::Create(_))).count();
    s.blas.gemm(stream, &g)?;
    s.blas.gemm(stream, &g)?;
    assert_eq!(creates(&s.rec.acts()), 1, "one handle for this thread");
    let mine = s.blas.acquire(stream)?;
    let other = std::thread::scope(|t| t.spawn(|| s.blas.acquire(stream)).join().expect("thread"))?;
    assert_ne!(mine, other, "another thread, another handle");
    assert_eq!(creates(&s.rec.acts()), 2);
    let reused =
        std::thread::scope(|t| t.spawn(|| s.blas.acquire(stream)).join().expect("thread"))?;
    assert_eq!(reused, other, "the finished thread's handle is reused");
    assert_eq!(creates(&s.rec.acts()), 2);
    // Two threads alive at once: two handles (the pool's one, then a new one).
    let both = std::sync::Barrier::new(2);
    let handles = std::thread::scope(|t| {
        let run = || {
            let h = s.blas.acquire(stream);
            both.wait();
            h
        };
        let (a, b) = (t.spawn(run), t.spawn(run));
        (a.join().expect("a"), b.join().expect("b"))
    });
    assert_ne!(handles.0?, handles.1?);
    assert_eq!(creates(&s.rec.acts()), 3);
    Ok(())
}

/// `getCurrentCUDABlasHandle`: after an acquisition the handle has the stream, that
/// stream's workspace and the math mode the settings give, whatever it had before; what it
/// already has is not set again (PyTorch sets all three every time). A new stream is set
/// with its workspace (`cublasSetStream` resets the workspace).
pub fn every_acquisition_sets_stream_workspace_and_math_mode(s: &Setup) -> TestResult {
    let _p = PRECISION.lock();
    let (s1, s2) = (s.stream()?, s.stream()?);
    let h = s.blas.acquire(s1)?;
    let first = s.rec.take();
    let ws = |acts: &[Act]| {
        acts.iter()
            .any(|a| matches!(a, Act::Workspace(x, _, 33_554_432) if *x == h))
    };
    assert!(
        matches!(first.last(), Some(Act::Mode(x, MathMode::Default)) if *x == h),
        "{first:?}"
    );
    assert!(
        first.contains(&Act::Stream(h, s1)) && ws(&first),
        "{first:?}"
    );
    assert_eq!(s.blas.acquire(s1)?, h);
    assert_eq!(s.rec.take(), [], "nothing changed, nothing set");
    for stream in [s2, s1] {
        assert_eq!(s.blas.acquire(stream)?, h);
        let acts = s.rec.take();
        assert!(
            matches!(acts[0], Act::Stream(x, st) if x == h && st == stream),
            "{acts:?}"
        );
        assert!(
            matches!(acts[1], Act::Workspace(x, _, 33_554_432) if x == h),
            "{acts:?}"
        );
        assert_eq!(acts.len(), 2, "{acts:?}");
    }
    precision::update_global(|p| p.set_float32_matmul_precision(MatmulPrecision::High));
    let high = (s.blas.acquire(s1), s.rec.take());
    let guarded = {
        let _g = NoTf32Guard::new();
        s.blas.acquire(s1)?;
        s.rec.take()
    };
    precision::update_global(|p| p.set_float32_matmul_precision(MatmulPrecision::Highest));
    high.0?;
    assert_eq!(
        high.1,
        [Act::Mode(h, MathMode::Tf32TensorOp)],
        "high: TF32 math"
    );
    assert_eq!(
        guarded,
        [Act::Mode(h, MathMode::Default)],
        "NoTF32Guard: default math"
    );
    // A larger size chosen: the new workspace is set.
    s.blas.set_cublas_workspace_size(64 << 20)?;
    s.blas.acquire(s1)?;
    let bigger = s.rec.take();
    s.blas.reset_cublas_workspace_size();
    assert!(
        matches!(bigger[..], [Act::Workspace(x, _, 67_108_864)] if x == h),
        "{bigger:?}"
    );
    Ok(())
}

/// Workspaces are allocations of the caching allocator: 32 MiB per (handle, stream) on a
/// Hopper, on that stream, seen in its statistics; kept across calls; replaced when the
/// chosen size grows; given back by the clear functions and when their thread ends.
pub fn workspaces_are_allocator_memory_per_stream(s: &Setup) -> TestResult {
    let _p = PRECISION.lock();
    let (s1, s2) = (s.stream()?, s.stream()?);
    let g1 = gemm_on(s, DType::F32, s1)?;
    let g2 = gemm_on(s, DType::F32, s2)?;
    let base = s.alloc.stats().allocated_bytes.all.current;
    let ws = if s.gpu {
        s.blas.cublas_workspace_size()
    } else {
        32 << 20
    };
    assert_eq!(
        s.blas.cublas_workspace_size(),
        32 << 20,
        "the H200 and the fake's sm 9 default"
    );
    s.blas.gemm(s1, &g1)?;
    assert_eq!(
        s.alloc.stats().allocated_bytes.all.current - base,
        ws as i64
    );
    s.blas.gemm(s1, &g1)?;
    assert_eq!(
        s.alloc.stats().allocated_bytes.all.current - base,
        ws as i64,
        "kept"
    );
    s.blas.gemm(s2, &g2)?;
    assert_eq!(s.blas.workspace_bytes(), 2 * ws);
    assert_eq!(
        s.alloc.stats().allocated_bytes.all.current - base,
        2 * ws as i64
    );
    // Smaller chosen size: the held one serves; larger: replaced.
    s.blas.set_cublas_workspace_size(1 << 20)?;
    s.blas.gemm(s1, &g1)?;
    assert_eq!(s.blas.workspace_bytes(), 2 * ws);
    assert!(s.rec.acts().contains(&Act::Workspace(
        s.blas.acquire(s1)?,
        workspace_ptr(s, s1),
        1 << 20
    )));
    s.blas.set_cublas_workspace_size(64 << 20)?;
    s.blas.gemm(s1, &g1)?;
    assert_eq!(s.blas.workspace_bytes(), ws + (64 << 20));
    assert_eq!(
        s.alloc.stats().allocated_bytes.all.current - base,
        (ws + (64 << 20)) as i64
    );
    s.blas.reset_cublas_workspace_size();
    s.blas.clear_workspaces_for_stream(s2)?;
    assert_eq!(s.blas.workspace_bytes(), 64 << 20);
    s.blas.clear_workspaces()?;
    assert_eq!(s.blas.workspace_bytes(), 0);
    assert_eq!(
        s.alloc.stats().allocated_bytes.all.current,
        base,
        "all given back"
    );
    // A thread's workspaces go back when it ends.
    std::thread::scope(|t| t.spawn(|| s.blas.gemm(s2, &g2)).join().expect("thread"))?;
    assert_eq!(s.blas.workspace_bytes(), 0);
    assert_eq!(s.alloc.stats().allocated_bytes.all.current, base);
    Ok(())
}

fn workspace_ptr(s: &Setup, stream: ferrocuda_types::StreamHandle) -> DevicePtr {
    let h = s.blas.acquire(stream).expect("handle");
    s.rec
        .acts()
        .iter()
        .rev()
        .find_map(|a| match a {
            Act::Workspace(x, p, _) if *x == h => Some(*p),
            _ => None,
        })
        .expect("a workspace was set")
}

/// Every combination of the settings that reach a GEMM, against PyTorch's rules
/// (`CUDABlas.cpp`): fp32 under "highest" is IEEE (default math), under "high" TF32 tensor
/// ops unless a `NoTF32Guard` is alive; fp16 and bf16 compute in fp32 and disallow reduced
/// precision reductions unless allowed (the flag OR-ed into the math mode for the call, the
/// default math put back after it); split-K disallowed is an error on this path.
pub fn precision_settings_pick_math_mode_and_compute_type(s: &Setup) -> TestResult {
    let _p = PRECISION.lock();
    let stream = s.stream()?;
    // `torch.backends.cuda.matmul.allow_{fp16,bf16}_reduced_precision_reduction = ...`
    let options = [
        (true, None),
        (false, None),
        (false, Some(true)),
        (false, Some(false)),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let g = gemm_on(s, dtype, stream)?;
        for high in [false, true] {
            for guard in [false, true] {
                for option in options {
                    precision::update_global(|p| {
                        p.set_float32_matmul_precision(if high {
                            MatmulPrecision::High
                        } else {
                            MatmulPrecision::Highest
                        });
                        p.set_allow_fp16_reduced_precision_reduction(option.0, option.1)?;
                        p.set_allow_bf16_reduced_precision_reduction(option.0, option.1)
                    })?;
                    let _g = guard.then(NoTf32Guard::new);
                    s.rec.take();
                    let result = s.blas.gemm(stream, &g);
                    let acts = s.rec.take();
                    let case = format!("{dtype:?} high {high} guard {guard} {option:?}");
                    let half = dtype != DType::F32;
                    let (allow, splitk) = option;
                    if half && splitk == Some(false) {
                        assert!(
                            matches!(
                                result,
                                Err(MathLibError::Precision(
                                    PrecisionError::SplitKNeedsCublasLt(_)
                                ))
                            ),
                            "{case}: {result:?}"
                        );
                        continue;
                    }
                    result?;
                    let (mode, call) = acts
                        .iter()
                        .find_map(|a| match a {
                            Act::Gemm(_, m, c) => Some((*m, *c)),
                            _ => None,
                        })
                        .expect("a GEMM");
                    let want_mode = match (half, allow) {
                        (true, true) => MathMode::Default,
                        (true, false) => MathMode::DisallowReducedPrecisionReduction,
                        (false, _) if high && !guard => MathMode::Tf32TensorOp,
                        (false, _) => MathMode::Default,
                    };
                    assert_eq!(mode, want_mode, "{case}");
                    assert_eq!(call.compute, ComputeType::F32, "{case}");
                    if half {
                        // The math mode in force after the call: the default, as PyTorch leaves it.
                        let at = acts
                            .iter()
                            .position(|a| matches!(a, Act::Gemm(..)))
                            .expect("gemm");
                        let after = acts[at..].iter().rev().find_map(|a| match a {
                            Act::Mode(_, m) => Some(*m),
                            _ => None,
                        });
                        assert_eq!(
                            after.unwrap_or(mode),
                            MathMode::Default,
                            "{case}: default math after"
                        );
                    }
                }
            }
        }
    }
    precision::update_global(|p| {
        p.set_float32_matmul_precision(MatmulPrecision::Highest);
        p.set_allow_fp16_reduced_precision_reduction(true, None)?;
        p.set_allow_bf16_reduced_precision_reduction(true, None)
    })?;
    Ok(())
}

/// A GEMM that does not describe matrices, or has no GEMM for its type, is refused before
/// reaching cuBLAS; a stream of another device is cuBLAS's `DeviceMismatch`.
pub fn bad_gemms_are_typed_errors(s: &Setup) -> TestResult {
    let _p = PRECISION.lock();
    let stream = s.stream()?;
    let g = gemm_on(s, DType::F32, stream)?;
    for bad in [
        Gemm { lda: 7, ..g },
        Gemm { ldb: 0, ..g },
        Gemm { ldc: 3, ..g },
        Gemm {
            transa: true,
            k: 9,
            lda: 8,
            ..g
        },
    ] {
        assert!(
            matches!(s.blas.gemm(stream, &bad), Err(MathLibError::InvalidGemm(_))),
            "{bad:?}"
        );
    }
    assert!(matches!(
        s.blas.gemm(
            stream,
            &Gemm {
                dtype: DType::I32,
                ..g
            }
        ),
        Err(MathLibError::Precision(
            PrecisionError::UnsupportedGemmDtype(DType::I32)
        ))
    ));
    assert!(
        s.rec.acts().iter().all(|a| !matches!(a, Act::Gemm(..))),
        "nothing reached cuBLAS"
    );
    Ok(())
}

/// Without libcublas (CI, a machine without CUDA) `CudaBlas` is a typed "unavailable" that
/// says what to set; the GPU bundle (`FERROCUDA_REQUIRE_GPU=1`) must find it. With the
/// library but no GPU, making a handle is a typed error too.
#[test]
fn cublas_is_found_or_says_why() -> TestResult {
    use ferrocuda_driver::cublas::BlasError;
    use ferrocuda_driver::{CudaDriver, LIBRARY_PATH_VAR};
    use ferrocuda_mathlib::{BlasBackend, CudaBlas};
    let cuda = std::sync::Arc::new(CudaDriver::new());
    let required = std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match CudaBlas::new(cuda.clone()) {
        Ok(blas) => match cuda.unavailable_reason() {
            None => {
                let h = blas.create_handle(DEV)?;
                blas.destroy_handle(h);
            }
            Some(_) => assert!(matches!(
                blas.create_handle(DEV),
                Err(MathLibError::Blas(BlasError::Driver(_)))
            )),
        },
        Err(MathLibError::Blas(BlasError::Unavailable(why))) if !required => {
            assert!(
                why.contains(LIBRARY_PATH_VAR) && why.contains("libcublas"),
                "{why}"
            );
        }
        Err(e) => return Err(format!("cuBLAS on the GPU bundle: {e}").into()),
    }
    Ok(())
}

/// A GEMM of random values (C too, for beta), checked against the reference after `run`.
fn checked_gemm(
    s: &Setup,
    dtype: DType,
    (m, n, k): (usize, usize, usize),
    beta: f64,
    run: impl FnOnce(ferrocuda_types::StreamHandle, &Gemm) -> Result<(), MathLibError>,
) -> TestResult {
    let stream = s.stream()?;
    let mut rng = Rng(0x1234_5678_9abc_def1 ^ (m * 31 + n * 7 + k) as u64);
    let mut fill =
        |len: usize| -> Vec<f64> { (0..len).map(|_| round(dtype, rng.unit())).collect() };
    let (a, b, c) = (fill(m * k), fill(k * n), fill(m * n));
    let (pa, pb, pc) = (
        s.upload(dtype, &a, stream)?,
        s.upload(dtype, &b, stream)?,
        s.upload(dtype, &c, stream)?,
    );
    let g = Gemm {
        beta,
        alpha: 1.0,
        ..Gemm::plain(dtype, m, n, k, pa, pb, pc)
    };
    run(stream, &g)?;
    let got = s.download(dtype, pc, m * n, stream)?;
    let (want, scale) = reference(&g, &a, &b, &c);
    for (i, ((w, sc), g)) in want.iter().zip(&scale).zip(&got).enumerate() {
        let allowed = tolerance(dtype) * (sc + 1e-30) * (k as f64).sqrt() + round_err(dtype, *w);
        assert!(
            (g - w).abs() <= allowed,
            "{dtype:?} {m}x{n}x{k} beta {beta}: element {i} {g} vs {w}"
        );
    }
    Ok(())
}

/// With cuBLASLt preferred: the heuristic's first algorithm, results as the classic
/// path's; split-K disallowed (PyTorch's error on the classic path) runs with the
/// reduction mask that allows no split.
pub fn cublaslt_path_matches_the_reference_and_takes_split_k_disallowed(s: &Setup) -> TestResult {
    let _p = PRECISION.lock();
    s.blas.set_preferred_blas_library(BlasLibrary::CublasLt);
    for (dtype, shape) in [
        (DType::F32, (33, 17, 45)),
        (DType::F16, (64, 48, 80)),
        (DType::BF16, (16, 96, 24)),
        (DType::F64, (9, 9, 9)),
    ] {
        checked_gemm(s, dtype, shape, 0.5, |st, g| s.blas.gemm(st, g))?;
    }
    let lt = |acts: &[Act]| {
        acts.iter()
            .filter_map(|a| match a {
                Act::LtGemm(_, rank, mask) => Some((*rank, *mask)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        lt(&s.rec.take()),
        [(0, None); 4],
        "cuBLASLt's first candidate, no mask by default"
    );
    precision::update_global(|p| p.set_allow_fp16_reduced_precision_reduction(false, Some(false)))?;
    let split = checked_gemm(s, DType::F16, (32, 32, 512), 0.0, |st, g| {
        s.blas.gemm(st, g)
    });
    precision::update_global(|p| p.set_allow_fp16_reduced_precision_reduction(true, None))?;
    s.blas.set_preferred_blas_library(BlasLibrary::Cublas);
    split?;
    assert_eq!(
        lt(&s.rec.take()),
        [(0, Some(0))],
        "split-K disallowed: only CUBLASLT_REDUCTION_SCHEME_NONE"
    );
    Ok(())
}

/// PyTorch's TunableOp switch: a new signature is tuned once (the default call and
/// cuBLASLt's candidates timed on scratch memory, the caller's C written once by the
/// winner, so beta's C is read once), later calls use the result; the file is PyTorch's
/// format with its validator and ours; a fresh `Blas` reads it back and tunes nothing; a
/// file of another PyTorch version is rejected whole.
pub fn tunableop_tunes_once_writes_pytorchs_file_and_reads_it_back(s: &Setup) -> TestResult {
    let _p = PRECISION.lock();
    let dir = std::env::temp_dir().join(format!(
        "ferrocuda-tunableop-{}-{}",
        std::process::id(),
        s.gpu
    ));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("tunableop_results.csv");
    s.blas.update_tunable(|t| {
        t.enabled = true;
        t.tuning = true;
        t.filename = file.to_string_lossy().into_owned();
        t.max_candidates = 3;
    });
    let runs = |acts: &[Act]| {
        acts.iter()
            .filter(|a| matches!(a, Act::Gemm(..) | Act::LtGemm(..)))
            .count()
    };
    checked_gemm(s, DType::F32, (48, 40, 56), 1.0, |st, g| s.blas.gemm(st, g))?;
    let tuning = runs(&s.rec.take());
    assert!(
        tuning > 4,
        "the default call and cuBLASLt's candidates were timed ({tuning} runs)"
    );
    let results = s.blas.tunable().results();
    assert_eq!(results.len(), 1);
    assert_eq!(
        (results[0].op_sig.as_str(), results[0].param_sig.as_str()),
        ("GemmTunableOp_float_NN", "nn_48_40_56_ld_48_56_48")
    );
    assert!(results[0].ms > 0.0);
    checked_gemm(s, DType::F32, (48, 40, 56), 1.0, |st, g| s.blas.gemm(st, g))?;
    assert_eq!(runs(&s.rec.take()), 1, "tuned once: one run");
    let path = s.blas.tunable().filename_for(0);
    s.blas.write_tunable_file(&path)?;
    let written = ResultsFile::parse(&std::fs::read_to_string(&path)?)?;
    assert_eq!(
        written.validators,
        [("PT_VERSION".to_string(), "2.11.0".to_string())],
        "PyTorch's file has PyTorch's validator only"
    );
    let ours_path = ferrocuda_file(&path);
    let row = match results[0].solution {
        Solution::Default => {
            assert!(
                !std::path::Path::new(&ours_path).exists(),
                "no file of ours"
            );
            written.rows.clone()
        }
        Solution::CublasLt(_) => {
            assert!(
                written.rows.is_empty(),
                "our solution is not in PyTorch's file"
            );
            let ours = ResultsFile::parse(&std::fs::read_to_string(&ours_path)?)?;
            assert_eq!(ours.validators[1].0, "FERROCUDA_CUBLASLT_VERSION");
            ours.rows
        }
    };
    assert_eq!(row.len(), 1);
    let (w, r) = (&row[0], &results[0]);
    assert_eq!(
        (&w.op_sig, &w.param_sig, w.solution),
        (&r.op_sig, &r.param_sig, r.solution)
    );
    assert!(
        (w.ms - r.ms).abs() <= r.ms * 1e-5,
        "six significant digits: {} vs {}",
        w.ms,
        r.ms
    );
    // A fresh Blas on the same device reads the device's file at its first tuned GEMM.
    let fresh = ferrocuda_mathlib::Blas::new(s.rec.clone(), s.alloc.clone())?;
    fresh.update_tunable(|t| {
        t.enabled = true;
        t.filename = file.to_string_lossy().into_owned();
    });
    checked_gemm(s, DType::F32, (48, 40, 56), 1.0, |st, g| fresh.gemm(st, g))?;
    let acts = s.rec.take();
    assert_eq!(runs(&acts), 1, "the file's result: no tuning");
    let ran_lt = acts.iter().any(|a| matches!(a, Act::LtGemm(..)));
    assert_eq!(
        ran_lt,
        matches!(results[0].solution, Solution::CublasLt(_)),
        "the file's solution ran"
    );
    // Another PyTorch version's file is rejected whole.
    let old = dir.join("old.csv");
    std::fs::write(
        &old,
        std::fs::read_to_string(&path)?.replace("2.11.0", "2.10.0"),
    )?;
    assert!(matches!(
        fresh.read_tunable_file(&old.to_string_lossy()),
        Err(MathLibError::TunableOp(_))
    ));
    s.blas.update_tunable(|t| t.enabled = false);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
