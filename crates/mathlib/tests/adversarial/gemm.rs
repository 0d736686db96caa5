//! Adversarial scenarios: GEMMs, workspaces and threads on `Blas`.
use super::*;
use crate::workspace::env;

// ---------------------------------------------------------------------------------------
// Rule 6: Blas
// ---------------------------------------------------------------------------------------

struct BlasRig {
    fake: Arc<FakeDriver>,
    alloc: Arc<CachingAllocator>,
    backend: Arc<FakeBlas>,
    blas: Blas,
}

impl BlasRig {
    fn new(sm: u32) -> BlasRig {
        let fake = Arc::new(FakeDriver::default());
        let alloc = Arc::new(
            CachingAllocator::new(fake.clone(), DEV, AllocatorConfig::default(), Caching::On)
                .unwrap(),
        );
        let backend = Arc::new(FakeBlas::new(fake.clone(), sm));
        let sizes = WorkspaceSizes::from_env(|_| None, sm).unwrap();
        let blas = Blas::with_sizes(backend.clone(), alloc.clone(), sizes).unwrap();
        BlasRig {
            fake,
            alloc,
            backend,
            blas,
        }
    }
    fn stream(&self) -> StreamHandle {
        self.fake
            .stream_create(DEV, StreamFlags::default())
            .unwrap()
    }
    fn upload(&self, dtype: DType, values: &[f64], stream: StreamHandle) -> DevicePtr {
        let bytes = encode(dtype, values);
        let a = self
            .alloc
            .allocate(bytes.len().max(1) as u64, stream)
            .unwrap();
        self.fake.memcpy_htod_async(a.ptr, &bytes, stream).unwrap();
        a.ptr
    }
    fn download(&self, dtype: DType, ptr: DevicePtr, n: usize, stream: StreamHandle) -> Vec<f64> {
        let mut bytes = vec![0u8; n * dtype.size()];
        self.fake.memcpy_dtoh(&mut bytes, ptr, stream).unwrap();
        decode(dtype, &bytes)
    }
    fn current(&self) -> i64 {
        self.alloc.stats().allocated_bytes.all.current
    }
}

fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            DType::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
            DType::BF16 => bf16::from_f64(v).to_le_bytes().to_vec(),
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        })
        .collect()
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f64(),
            DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f64(),
            DType::F32 => f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            _ => f64::from_le_bytes(c.try_into().unwrap()),
        })
        .collect()
}

fn round_to(dtype: DType, v: f64) -> f64 {
    decode(dtype, &encode(dtype, &[v]))[0]
}

/// One column-major GEMM in f64 over the stored values; `None` where C is padding.
fn reference(g: &Gemm, a: &[f64], b: &[f64], c: &[f64]) -> Vec<Option<(f64, f64)>> {
    let mut out: Vec<Option<(f64, f64)>> = vec![None; c.len()];
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
            out[i] = Some((
                g.alpha * dot + g.beta * old,
                g.alpha.abs() * mag + (g.beta * old).abs(),
            ));
        }
    }
    out
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 4e-3,
        _ => 2e-2,
    }
}

struct Operands {
    a: Vec<f64>,
    b: Vec<f64>,
    c: Vec<f64>,
    strides: [usize; 3],
}

/// Runs `g` (operands from `ops`) and checks every batch's C, padding included.
fn run_and_check(rig: &BlasRig, stream: StreamHandle, g: &Gemm, ops: &Operands, count: usize) {
    let dtype = g.dtype;
    let pc_len = ops.c.len();
    let g = Gemm {
        a: rig.upload(dtype, &ops.a, stream),
        b: rig.upload(dtype, &ops.b, stream),
        c: rig.upload(dtype, &ops.c, stream),
        ..*g
    };
    rig.blas
        .gemm(stream, &g)
        .unwrap_or_else(|e| panic!("{g:?}: {e}"));
    let got = rig.download(dtype, g.c, pc_len, stream);
    let [sa, sb, sc] = ops.strides;
    let c_span = g.ldc * g.n;
    for i in 0..count {
        let one = Gemm { batch: None, ..g };
        let want = reference(
            &one,
            &ops.a[i * sa..],
            &ops.b[i * sb..],
            &ops.c[i * sc..i * sc + c_span],
        );
        for (j, w) in want.iter().enumerate() {
            let gv = got[i * sc + j];
            match *w {
                Some((w, scale)) => {
                    let allowed = tolerance(dtype) * (scale + 1e-30) * (g.k as f64).sqrt().max(1.0)
                        + w.abs() * tolerance(dtype);
                    assert!(
                        (gv - w).abs() <= allowed,
                        "{dtype:?} m{} n{} k{} ta{} tb{} lds {:?} batch {i} elem {j}: {gv} vs {w}",
                        g.m,
                        g.n,
                        g.k,
                        g.transa,
                        g.transb,
                        [g.lda, g.ldb, g.ldc]
                    );
                }
                None => assert!(
                    gv.to_bits() == ops.c[i * sc + j].to_bits(),
                    "padding of C written: batch {i} elem {j}: {gv} (was {})",
                    ops.c[i * sc + j]
                ),
            }
        }
    }
}

fn random_gemm(rng: &mut Rng, dtype: DType, zero_stride_a: bool) -> (Gemm, Operands, usize) {
    let (m, n, k) = (
        1 + rng.below(19) as usize,
        1 + rng.below(17) as usize,
        1 + rng.below(23) as usize,
    );
    let (transa, transb) = (rng.below(2) == 1, rng.below(2) == 1);
    let (a_rows, a_cols) = if transa { (k, m) } else { (m, k) };
    let (b_rows, b_cols) = if transb { (n, k) } else { (k, n) };
    let (lda, ldb, ldc) = (
        a_rows + rng.below(4) as usize,
        b_rows + rng.below(4) as usize,
        m + rng.below(4) as usize,
    );
    let count = if rng.below(2) == 0 {
        1
    } else {
        2 + rng.below(3) as usize
    };
    let sa = if zero_stride_a {
        0
    } else {
        lda * a_cols + rng.below(3) as usize
    };
    let (sb, sc) = (
        ldb * b_cols + rng.below(3) as usize,
        ldc * n + rng.below(3) as usize,
    );
    let mut fill =
        |len: usize| -> Vec<f64> { (0..len).map(|_| round_to(dtype, rng.unit())).collect() };
    let ops = Operands {
        a: fill(sa * (count - 1) + lda * a_cols),
        b: fill(sb * (count - 1) + ldb * b_cols),
        c: fill(sc * (count - 1) + ldc * n),
        strides: [sa, sb, sc],
    };
    let (alpha, beta) = match rng.below(4) {
        0 => (1.0, 0.0),
        1 => (0.5, -1.5),
        2 => (-2.0, 1.0),
        _ => (0.0, 0.75),
    };
    let g = Gemm {
        dtype,
        transa,
        transb,
        m,
        n,
        k,
        a: DevicePtr(0),
        lda,
        b: DevicePtr(0),
        ldb,
        c: DevicePtr(0),
        ldc,
        alpha,
        beta,
        batch: (count > 1 || zero_stride_a).then_some(Batch {
            count,
            strides: [sa as i64, sb as i64, sc as i64],
        }),
    };
    (g, ops, count)
}

#[test]
fn random_gemms_match_a_cpu_reference() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let mut rng = Rng(0x4242_4242_1111_7777);
    for round in 0..80 {
        let dtype = [DType::F32, DType::F64, DType::F16, DType::BF16][round % 4];
        let (g, ops, count) = random_gemm(&mut rng, dtype, false);
        run_and_check(&rig, stream, &g, &ops, count);
    }
}

/// cuBLAS's strided batch with stride 0 for A: one A broadcast over the batch.
#[test]
fn strided_batch_with_a_zero_stride_broadcasts() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let mut rng = Rng(0x9999_0000_1111_2222);
    for _ in 0..12 {
        let (g, ops, count) = random_gemm(&mut rng, DType::F64, true);
        run_and_check(&rig, stream, &g, &ops, count);
    }
}

/// beta = 0: C is not read, so NaN in C does not reach the result (cuBLAS's rule).
#[test]
fn beta_zero_does_not_read_c() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let a = rig.upload(dtype, &[1.0, 2.0, 3.0, 4.0], stream);
        let b = rig.upload(dtype, &[1.0, 0.0, 0.0, 1.0], stream);
        let c = rig.upload(
            dtype,
            &[f64::NAN, f64::INFINITY, f64::NAN, f64::NAN],
            stream,
        );
        rig.blas
            .gemm(stream, &Gemm::plain(dtype, 2, 2, 2, a, b, c))
            .unwrap();
        assert_eq!(
            rig.download(dtype, c, 4, stream),
            [1.0, 2.0, 3.0, 4.0],
            "{dtype:?}"
        );
    }
}

/// A transposed A is stored k × m: lda needs only k, even when k < m.
#[test]
fn transposed_leading_dimension_needs_only_the_stored_rows() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let mut rng = Rng(0x3141_5926_5358_9793);
    for (transa, transb, m, n, k) in [
        (true, false, 8, 3, 4),
        (false, true, 3, 8, 4),
        (true, true, 9, 7, 2),
    ] {
        let lda = if transa { k } else { m };
        let ldb = if transb { n } else { k };
        let a_cols = if transa { m } else { k };
        let b_cols = if transb { k } else { n };
        let mut fill = |len: usize| -> Vec<f64> { (0..len).map(|_| rng.unit()).collect() };
        let ops = Operands {
            a: fill(lda * a_cols),
            b: fill(ldb * b_cols),
            c: fill(m * n),
            strides: [0, 0, 0],
        };
        let g = Gemm {
            dtype: DType::F64,
            transa,
            transb,
            m,
            n,
            k,
            a: DevicePtr(0),
            lda,
            b: DevicePtr(0),
            ldb,
            c: DevicePtr(0),
            ldc: m,
            alpha: 1.0,
            beta: 0.5,
            batch: None,
        };
        run_and_check(&rig, stream, &g, &ops, 1);
    }
}

#[test]
fn leading_dimensions_below_the_stored_rows_are_invalid_gemm() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let buf = rig.upload(DType::F32, &[0.0; 1024], stream);
    let mut failures = Vec::new();
    for transa in [false, true] {
        for transb in [false, true] {
            let (m, n, k) = (6, 5, 4);
            let a_rows = if transa { k } else { m };
            let b_rows = if transb { n } else { k };
            let base = Gemm {
                dtype: DType::F32,
                transa,
                transb,
                m,
                n,
                k,
                a: buf,
                lda: a_rows,
                b: buf,
                ldb: b_rows,
                c: buf,
                ldc: m,
                alpha: 1.0,
                beta: 0.0,
                batch: None,
            };
            for (what, bad) in [
                (
                    "lda",
                    Gemm {
                        lda: a_rows - 1,
                        ..base
                    },
                ),
                (
                    "ldb",
                    Gemm {
                        ldb: b_rows - 1,
                        ..base
                    },
                ),
                ("ldc", Gemm { ldc: m - 1, ..base }),
                ("lda 0", Gemm { lda: 0, ..base }),
                ("ldb 0", Gemm { ldb: 0, ..base }),
                ("ldc 0", Gemm { ldc: 0, ..base }),
            ] {
                let r = no_panic(what, || rig.blas.gemm(stream, &bad));
                if !matches!(r, Err(MathLibError::InvalidGemm(_))) {
                    failures.push(format!("ta{transa} tb{transb} {what}: {r:?}"));
                }
            }
        }
    }
    assert_eq!(
        rig.backend.gemms().len(),
        0,
        "nothing reached the fake cuBLAS"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Degenerate shapes: no panic; k = 0 (when accepted) leaves C = beta C.
#[test]

fn degenerate_gemm_shapes_never_panic() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let c0 = [1.0, 2.0, 3.0, 4.0];
    let a = rig.upload(DType::F64, &[1.0; 16], stream);
    let b = rig.upload(DType::F64, &[1.0; 16], stream);
    let c = rig.upload(DType::F64, &c0, stream);
    let k0 = Gemm {
        beta: 0.5,
        lda: 2,
        ldb: 1,
        ..Gemm::plain(DType::F64, 2, 2, 0, a, b, c)
    };
    let r = no_panic("k = 0", || rig.blas.gemm(stream, &k0));
    eprintln!("k = 0: {r:?}");
    if r.is_ok() {
        assert_eq!(
            rig.download(DType::F64, c, 4, stream),
            [0.5, 1.0, 1.5, 2.0],
            "k = 0: C = beta C"
        );
    }
    let mut panics = Vec::new();
    for (what, g) in [
        (
            "m = 0",
            Gemm {
                lda: 1,
                ldc: 1,
                ..Gemm::plain(DType::F64, 0, 2, 2, a, b, c)
            },
        ),
        ("n = 0", Gemm::plain(DType::F64, 2, 0, 2, a, b, c)),
        (
            "batch count 0",
            Gemm {
                batch: Some(Batch {
                    count: 0,
                    strides: [4, 4, 4],
                }),
                ..Gemm::plain(DType::F64, 2, 2, 2, a, b, c)
            },
        ),
        (
            "m = usize::MAX",
            Gemm {
                ldc: usize::MAX,
                ..Gemm::plain(DType::F64, usize::MAX, 2, 2, a, b, c)
            },
        ),
        (
            "k = usize::MAX",
            Gemm {
                ldb: usize::MAX,
                ..Gemm::plain(DType::F64, 2, 2, usize::MAX, a, b, c)
            },
        ),
        (
            "stride i64::MAX",
            Gemm {
                batch: Some(Batch {
                    count: 2,
                    strides: [i64::MAX, 4, 4],
                }),
                ..Gemm::plain(DType::F64, 2, 2, 2, a, b, c)
            },
        ),
    ] {
        match catch(|| rig.blas.gemm(stream, &g)) {
            Ok(r) => eprintln!("{what}: {r:?}"),
            Err(panic) => panics.push(format!("{what}: PANIC {panic}")),
        }
    }
    assert!(panics.is_empty(), "{}", panics.join("\n"));
}

/// cuBLAS's strides are signed (`long long`): A given at its last matrix with a negative
/// stride walks the batch backwards through valid memory. A typed refusal is tolerated; a
/// panic or a wrong result is not.
#[test]

fn strided_batch_with_a_negative_stride_walks_backwards() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let (m, n, k, count) = (2usize, 2usize, 2usize, 3usize);
    let a_vals: Vec<f64> = (0..m * k * count).map(|i| i as f64).collect();
    let b_vals: Vec<f64> = (0..k * n * count).map(|i| 1.0 + (i % 3) as f64).collect();
    let a = rig.upload(DType::F64, &a_vals, stream);
    let b = rig.upload(DType::F64, &b_vals, stream);
    let c = rig.upload(DType::F64, &vec![0.0; m * n * count], stream);
    let last_a = DevicePtr(a.0 + ((count - 1) * m * k * 8) as u64);
    let g = Gemm {
        a: last_a,
        batch: Some(Batch {
            count,
            strides: [-((m * k) as i64), (k * n) as i64, (m * n) as i64],
        }),
        ..Gemm::plain(DType::F64, m, n, k, a, b, c)
    };
    let r = catch(|| rig.blas.gemm(stream, &g));
    let r = r.unwrap_or_else(|panic| panic!("PANIC {panic}"));
    if let Err(e) = r {
        eprintln!("negative stride refused: {e}");
        return;
    }
    let got = rig.download(DType::F64, c, m * n * count, stream);
    for i in 0..count {
        let ai = count - 1 - i;
        let one = Gemm { batch: None, ..g };
        let want = reference(
            &one,
            &a_vals[ai * m * k..],
            &b_vals[i * k * n..],
            &vec![0.0; m * n],
        );
        for (j, w) in want.iter().enumerate() {
            assert_eq!(got[i * m * n + j], w.unwrap().0, "batch {i} element {j}");
        }
    }
}

#[test]
fn workspaces_are_allocator_bytes_and_clear_gives_them_back() {
    for (sm, want) in [
        (9, MIB32),
        (8, LEGACY_DEFAULT),
        (12, MIB32),
        (7, LEGACY_DEFAULT),
    ] {
        let rig = BlasRig::new(sm);
        let (s1, s2) = (rig.stream(), rig.stream());
        let a = rig.upload(DType::F32, &[1.0; 4], s1);
        let c = rig.upload(DType::F32, &[0.0; 4], s1);
        let base = rig.current();
        assert_eq!(rig.blas.cublas_workspace_size(), want, "sm {sm}");
        rig.blas
            .gemm(s1, &Gemm::plain(DType::F32, 2, 2, 2, a, a, c))
            .unwrap();
        assert_eq!(rig.current() - base, want as i64, "sm {sm}: one workspace");
        assert_eq!(rig.blas.workspace_bytes(), want);
        rig.blas
            .gemm(s2, &Gemm::plain(DType::F32, 2, 2, 2, a, a, c))
            .unwrap();
        assert_eq!(rig.current() - base, 2 * want as i64, "sm {sm}: per stream");
        rig.blas.clear_workspaces_for_stream(s1).unwrap();
        assert_eq!(rig.current() - base, want as i64, "sm {sm}: s1's back");
        rig.blas.clear_workspaces().unwrap();
        assert_eq!(rig.current(), base, "sm {sm}: all back");
        assert_eq!(rig.blas.workspace_bytes(), 0);
        // And again after the clear: a fresh workspace, correct result.
        rig.blas
            .gemm(s1, &Gemm::plain(DType::F32, 2, 2, 2, a, a, c))
            .unwrap();
        assert_eq!(rig.download(DType::F32, c, 4, s1), [2.0; 4]);
        assert_eq!(rig.current() - base, want as i64);
        rig.blas.clear_workspaces().unwrap();
        assert_eq!(rig.current(), base);
    }
}

/// `Blas::new` reads the process environment: with none of the variables set (as in this
/// test process), the same defaults as `with_sizes` and no warnings.
#[test]
fn blas_new_reads_the_same_defaults() {
    if [
        "CUBLAS_WORKSPACE_CONFIG",
        "CUBLASLT_WORKSPACE_SIZE",
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
    {
        eprintln!("skipped: a workspace variable is set in this process");
        return;
    }
    for (sm, want) in [(9, MIB32), (8, LEGACY_DEFAULT)] {
        let fake = Arc::new(FakeDriver::default());
        let alloc = Arc::new(
            CachingAllocator::new(fake.clone(), DEV, AllocatorConfig::default(), Caching::On)
                .unwrap(),
        );
        let blas = Blas::new(Arc::new(FakeBlas::new(fake, sm)), alloc).unwrap();
        assert_eq!(blas.cublas_workspace_size(), want, "sm {sm}");
        assert!(blas.unified_workspaces());
        assert_eq!(blas.cublaslt_workspace_size(), (want, None));
        assert!(blas.warnings().is_empty(), "{:?}", blas.warnings());
    }
}

/// Many threads at once: a distinct handle each while alive, correct results; when they end
/// the handles go back to the pool (a second wave makes none) and so do the workspaces.
#[test]
fn concurrent_threads_get_distinct_handles_and_correct_results() {
    const THREADS: usize = 8;
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let base = rig.current();
    let wave = |seed: u64| {
        let barrier = Barrier::new(THREADS);
        std::thread::scope(|t| {
            let joins: Vec<_> = (0..THREADS)
                .map(|i| {
                    let (rig, barrier) = (&rig, &barrier);
                    t.spawn(move || {
                        let mut rng = Rng(seed ^ ((i as u64 + 1) * 0x9e37_79b9));
                        let mut handles = Vec::new();
                        for _ in 0..4 {
                            let dtype = [DType::F32, DType::F64][rng.below(2) as usize];
                            let (g, ops, count) = random_gemm(&mut rng, dtype, false);
                            run_and_check(rig, stream, &g, &ops, count);
                            handles.push(rig.blas.acquire(stream).unwrap());
                        }
                        barrier.wait(); // every thread alive, each holding its handle
                        let mine = rig.blas.acquire(stream).unwrap();
                        barrier.wait();
                        assert!(handles.iter().all(|h| *h == mine), "one handle per thread");
                        mine
                    })
                })
                .collect();
            joins
                .into_iter()
                .map(|j| j.join().expect("thread"))
                .collect::<Vec<_>>()
        })
    };
    let first = wave(1);
    for i in 0..THREADS {
        for j in i + 1..THREADS {
            assert_ne!(first[i], first[j], "threads {i} and {j} shared a handle");
        }
    }
    assert_eq!(rig.backend.handles_created(), THREADS as u64);
    assert_eq!(
        rig.blas.workspace_bytes(),
        0,
        "workspaces back at thread end"
    );
    let after_first = rig.current();
    let second = wave(2);
    assert_eq!(
        rig.backend.handles_created(),
        THREADS as u64,
        "the second wave reuses the pool's handles"
    );
    let mut sorted_first: Vec<String> = first.iter().map(|h| format!("{h:?}")).collect();
    let mut sorted_second: Vec<String> = second.iter().map(|h| format!("{h:?}")).collect();
    sorted_first.sort();
    sorted_second.sort();
    assert_eq!(sorted_first, sorted_second, "the same handles");
    assert_eq!(rig.blas.workspace_bytes(), 0);
    // Only the operands the threads uploaded remain allocated (no workspace bytes).
    assert!(after_first >= base);
    let operand_growth = rig.current() - after_first;
    assert!(
        operand_growth < 32 << 20,
        "no workspace left behind by the second wave ({operand_growth} bytes)"
    );
}

/// After a GEMM that fails (a typed error, or a panic inside the fake), the thread's handle
/// still gives correct results and the workspace accounting is unchanged.
#[test]
fn blas_still_works_after_a_failing_gemm() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let a = rig.upload(DType::F64, &[1.0, 2.0, 3.0, 4.0], stream);
    let b = rig.upload(DType::F64, &[1.0, 0.0, 0.0, 1.0], stream);
    let c = rig.upload(DType::F64, &[0.0; 4], stream);
    let good = Gemm::plain(DType::F64, 2, 2, 2, a, b, c);
    rig.blas.gemm(stream, &good).unwrap();
    let held = rig.blas.workspace_bytes();
    for bad in [
        Gemm { lda: 1, ..good },
        Gemm {
            batch: Some(Batch {
                count: 2,
                strides: [i64::MAX, 0, 0],
            }),
            ..good
        },
    ] {
        let r = catch(|| rig.blas.gemm(stream, &bad));
        eprintln!("{bad:?}: {r:?}");
        let c2 = rig.upload(DType::F64, &[9.0; 4], stream);
        rig.blas.gemm(stream, &Gemm { c: c2, ..good }).unwrap();
        assert_eq!(
            rig.download(DType::F64, c2, 4, stream),
            [1.0, 2.0, 3.0, 4.0]
        );
        assert_eq!(rig.blas.workspace_bytes(), held);
    }
}

/// `read_tunable_file` of a missing or malformed file: a typed error, nothing loaded.
#[test]
fn reading_a_missing_or_bad_tunable_file_is_a_typed_error() {
    let rig = BlasRig::new(9);
    let dir = std::env::temp_dir().join(format!("ferrocuda-adversarial-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("nope.csv");
    let r = rig.blas.read_tunable_file(&missing.to_string_lossy());
    assert!(matches!(r, Err(MathLibError::TunableOp(_))), "{r:?}");
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "Validator,PT_VERSION,2.11.0\nnot,a,row\n").unwrap();
    let r = rig.blas.read_tunable_file(&bad.to_string_lossy());
    assert!(matches!(r, Err(MathLibError::TunableOp(_))), "{r:?}");
    let binary = dir.join("binary.csv");
    std::fs::write(&binary, [0xff, 0xfe, 0x00, b',', 0x80]).unwrap();
    let r = catch(|| rig.blas.read_tunable_file(&binary.to_string_lossy()));
    assert!(matches!(r, Ok(Err(_))), "{r:?}");
    assert!(rig.blas.tunable().results().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `clear_workspaces` clears every thread's, even while another thread is alive and holds
/// its handle: the allocator gets the bytes back, and that thread's next GEMM takes a fresh
/// workspace and is still right.
#[test]
fn clear_workspaces_while_another_thread_is_alive() {
    let rig = BlasRig::new(9);
    let stream = rig.stream();
    let a = rig.upload(DType::F64, &[1.0, 2.0, 3.0, 4.0], stream);
    let b = rig.upload(DType::F64, &[0.0, 1.0, 1.0, 0.0], stream);
    let base = rig.current();
    let (ran, cleared) = (Barrier::new(2), Barrier::new(2));
    std::thread::scope(|t| {
        let worker = t.spawn(|| {
            let c = rig.upload(DType::F64, &[0.0; 4], stream);
            rig.blas
                .gemm(stream, &Gemm::plain(DType::F64, 2, 2, 2, a, b, c))
                .unwrap();
            ran.wait();
            cleared.wait();
            let c2 = rig.upload(DType::F64, &[0.0; 4], stream);
            rig.blas
                .gemm(stream, &Gemm::plain(DType::F64, 2, 2, 2, a, b, c2))
                .unwrap();
            (
                rig.download(DType::F64, c2, 4, stream),
                rig.blas.workspace_bytes(),
            )
        });
        ran.wait();
        assert_eq!(rig.blas.workspace_bytes(), MIB32, "the worker's workspace");
        let with_ws = rig.current();
        rig.blas.clear_workspaces().unwrap();
        assert_eq!(rig.blas.workspace_bytes(), 0);
        assert_eq!(
            with_ws - rig.current(),
            MIB32 as i64,
            "given back to the allocator"
        );
        cleared.wait();
        let (got, held) = worker.join().expect("worker");
        assert_eq!(got, [3.0, 4.0, 1.0, 2.0]);
        assert_eq!(held, MIB32, "a fresh workspace for the worker");
    });
    assert_eq!(rig.blas.workspace_bytes(), 0, "given back at thread end");
    assert!(rig.current() >= base);
}

/// Every variable bad at once: each warned about, nothing panics.
#[test]
fn every_workspace_variable_bad_at_once() {
    let w = WorkspaceSizes::from_env(
        env(&[
            ("CUBLAS_WORKSPACE_CONFIG", "nonsense"),
            ("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "maybe"),
            ("CUBLASLT_WORKSPACE_SIZE", "lots"),
        ]),
        9,
    )
    .unwrap();
    eprintln!("{:#?}", w.warnings);
    assert_eq!((w.cublas, w.cublaslt, w.unified), (MIB32, MIB32, true));
    for needle in [
        "CUBLAS_WORKSPACE_CONFIG",
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE",
        "CUBLASLT_WORKSPACE_SIZE",
    ] {
        assert!(
            w.warnings.iter().any(|t| t.contains(needle)),
            "{needle}: {:?}",
            w.warnings
        );
    }
}
