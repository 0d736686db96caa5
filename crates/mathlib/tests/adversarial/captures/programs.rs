//! Many GEMMs in one capture, TunableOp in captures, and the captured-against-eager differential.
use super::*;

// ---------------------------------------------------------------------------------------
// Many GEMMs in one capture
// ---------------------------------------------------------------------------------------

/// One capture of many GEMMs: same shape twice, other shapes, strided batches, transposes,
/// alpha and beta, fp16/bf16/f32/f64, with both libraries: each C right on replay (CPU
/// reference, exact), C untouched by the capture itself, every workspace in the pool.
#[test]
fn many_gemms_in_one_capture_all_right_on_replay() {
    let rig = Rig::new().unwrap();
    let mut specs = Vec::new();
    for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
        specs.push(Spec::plain(dtype, 24, 16, 32));
        specs.push(Spec::plain(dtype, 24, 16, 32));
        specs.push(Spec {
            transa: true,
            pad: 3,
            alpha: 2.0,
            beta: -1.0,
            ..Spec::plain(dtype, 17, 9, 13)
        });
        specs.push(Spec {
            transb: true,
            count: 4,
            beta: 1.0,
            ..Spec::plain(dtype, 8, 12, 20)
        });
    }
    let ops: Vec<Op> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| rig.op(*s, 70 + i as u64).unwrap())
        .collect();
    for lib in [BlasLibrary::Cublas, BlasLibrary::CublasLt] {
        rig.blas.set_preferred_blas_library(lib);
        for op in &ops {
            rig.eager(&rig.stream, op)
                .unwrap_or_else(|e| panic!("{lib:?} eager: {e}"));
        }
        for op in &ops {
            op.reset().unwrap();
        }
        rig.sync().unwrap();
        let refs: Vec<&Op> = ops.iter().collect();
        let (g, runs) = rig.capture_gemms(&refs).unwrap();
        assert_eq!(runs.len(), ops.len(), "{lib:?}: {runs:?}");
        rig.sync().unwrap();
        for op in &ops {
            op.c_is_first_value(&format!("{lib:?}: the capture ran a GEMM"))
                .unwrap();
        }
        let pool = g.pool().unwrap();
        for (i, ws) in Rig::workspaces(&runs).unwrap().iter().enumerate() {
            assert!(
                rig.block_at(pool, ws.0).is_some(),
                "{lib:?}: GEMM {i}'s workspace is not in the pool"
            );
        }
        assert!(rig.blocks(pool).iter().all(|b| !b.allocated));
        for round in 0..2 {
            rig.replay(&g, &rig.stream, &refs, &format!("{lib:?} round {round}"))
                .unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------
// TunableOp
// ---------------------------------------------------------------------------------------

fn tunable_on(rig: &Rig, tag: &str) -> std::path::PathBuf {
    let dir = temp_dir(tag);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("results.csv");
    rig.blas.update_tunable(|t| {
        t.enabled = true;
        t.tuning = true;
        t.filename = file.to_string_lossy().into_owned();
    });
    file
}

/// A signature met first inside a capture is not tuned there (no result, no host
/// synchronization); the capture and replays work; the next eager call tunes it.
#[test]
fn tunableop_does_not_tune_in_a_capture_nor_synchronize() {
    let rig = Rig::new().unwrap();
    tunable_on(&rig, "cap-tune");
    let warm = rig.op(Spec::plain(DType::F32, 8, 8, 8), 90).unwrap();
    rig.eager(&rig.stream, &warm).unwrap();
    let op = rig
        .op(
            Spec {
                count: 2,
                ..Spec::plain(DType::BF16, 16, 24, 32)
            },
            91,
        )
        .unwrap();
    let tuned = rig.blas.tunable().results();
    let syncs = rig.rec.syncs();
    let (g, runs) = rig.capture_gemms(&[&op, &op]).unwrap();
    assert_eq!(rig.rec.syncs(), syncs, "the capture synchronized a stream");
    assert_eq!(runs.len(), 2, "one run per captured GEMM: {runs:?}");
    assert_eq!(
        rig.blas.tunable().results(),
        tuned,
        "tuned inside the capture"
    );
    rig.replay(&g, &rig.stream, &[&op], "replay").unwrap();
    rig.eager(&rig.stream, &op).unwrap();
    assert_eq!(rig.blas.tunable().results().len(), tuned.len() + 1);
}

/// A signature tuned eagerly is used inside a capture: the solution read from a file
/// (`Gemm_Cublaslt_2`, and `Default` with cuBLASLt preferred) is what the captured call
/// runs, and the replay is right.
#[test]
fn tunableop_uses_eagerly_tuned_solutions_inside_a_capture() {
    let rig = Rig::new().unwrap();
    let file = tunable_on(&rig, "cap-tuned");
    let lt_op = rig.op(Spec::plain(DType::F32, 48, 48, 48), 92).unwrap();
    let def_op = rig.op(Spec::plain(DType::F32, 40, 40, 40), 93).unwrap();
    let path = file.to_string_lossy().into_owned();
    std::fs::write(
        &path,
        "Validator,PT_VERSION,2.11.0\n\
         GemmTunableOp_float_NN,nn_40_40_40_ld_40_40_40,Default,0.01\n",
    )
    .unwrap();
    std::fs::write(
        ferrocuda_mathlib::tunable::ferrocuda_file(&path),
        "Validator,PT_VERSION,2.11.0\nValidator,FERROCUDA_CUBLASLT_VERSION,fake\n\
         GemmTunableOp_float_NN,nn_48_48_48_ld_48_48_48,Gemm_Cublaslt_2,0.01\n",
    )
    .unwrap();
    assert_eq!(rig.blas.read_tunable_file(&path).unwrap(), 2);
    rig.blas.set_preferred_blas_library(BlasLibrary::CublasLt);
    rig.rec.take();
    rig.eager(&rig.stream, &lt_op).unwrap();
    rig.eager(&rig.stream, &def_op).unwrap();
    let eager: Vec<Option<usize>> = rig.rec.take().iter().map(|r| r.lt).collect();
    assert_eq!(
        eager,
        [Some(2), None],
        "the eager calls use the loaded solutions"
    );
    let results = rig.blas.tunable().results();
    let (g, runs) = rig.capture_gemms(&[&lt_op, &def_op]).unwrap();
    let captured: Vec<Option<usize>> = runs.iter().map(|r| r.lt).collect();
    for ws in Rig::workspaces(&runs).unwrap() {
        assert_capture_workspace(&rig, &g, ws, &rig.stream, 1, "tuned solution");
    }
    assert_eq!(
        captured,
        [Some(2), None],
        "the captured calls use the tuned solutions"
    );
    assert_eq!(rig.blas.tunable().results(), results);
    rig.replay(&g, &rig.stream, &[&lt_op, &def_op], "replay")
        .unwrap();
}

/// A signature tuned eagerly by the fake's own tuning: the capture runs whatever it chose.
#[test]
fn tunableop_capture_runs_what_eager_tuning_chose() {
    let rig = Rig::new().unwrap();
    tunable_on(&rig, "cap-tuned2");
    let op = rig.square(94).unwrap();
    rig.eager(&rig.stream, &op).unwrap();
    let results = rig.blas.tunable().results();
    assert_eq!(results.len(), 1, "{results:?}");
    let want = match results[0].solution {
        Solution::Default => None,
        Solution::CublasLt(r) => Some(r),
    };
    rig.rec.take();
    rig.eager(&rig.stream, &op).unwrap();
    assert_eq!(rig.rec.take()[0].lt, want, "the eager call after tuning");
    let (g, runs) = rig.capture_gemms(&[&op]).unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(
        runs[0].lt, want,
        "the captured call runs the tuned solution"
    );
    rig.replay(&g, &rig.stream, &[&op], "replay").unwrap();
}

// ---------------------------------------------------------------------------------------
// Differential: a random program, captured vs eager
// ---------------------------------------------------------------------------------------

/// Random programs of GEMMs (dtype, shape, transposes, padding, batch, alpha, beta,
/// library; some reading an earlier GEMM's C as their A, some accumulating into an earlier
/// C) run eagerly, then captured and replayed from the same start: every C equal byte for
/// byte, on two replays; nothing ran during the capture.
#[test]
fn differential_random_gemm_programs_captured_vs_eager() {
    for seed in [0x9e37_79b9_7f4a_7c15u64, 0xdead_beef_1234_5678, 42] {
        let rig = Rig::new().unwrap();
        let mut rng = Rng(seed);
        let dtypes = [DType::F16, DType::BF16, DType::F32, DType::F64];
        let mut ops: Vec<Op> = Vec::new();
        // Program: (index of op whose Gemm runs, its Gemm with possibly rewired pointers).
        let mut program: Vec<(Gemm, BlasLibrary)> = Vec::new();
        for _ in 0..14 {
            let lib = if rng.below(2) == 0 {
                BlasLibrary::Cublas
            } else {
                BlasLibrary::CublasLt
            };
            // Chain: A = an earlier unbatched C of the same type.
            if !ops.is_empty() && rng.below(3) == 0 {
                let j = rng.below(ops.len() as u64) as usize;
                let prev = ops[j].g;
                if prev.batch.is_none() {
                    let n = 1 + rng.below(24) as usize;
                    let spec = Spec {
                        beta: [0.0, 1.0][rng.below(2) as usize],
                        ..Spec::plain(prev.dtype, prev.m, n, prev.n)
                    };
                    let mut op = Op::new(rig.rt(), spec, &mut rng).unwrap();
                    op.g.a = prev.c;
                    op.g.lda = prev.ldc;
                    program.push((op.g, lib));
                    ops.push(op);
                    continue;
                }
            }
            // Accumulate into an earlier C with the same GEMM again (beta 1).
            if !program.is_empty() && rng.below(5) == 0 {
                let (g, _) = program[rng.below(program.len() as u64) as usize];
                program.push((Gemm { beta: 1.0, ..g }, lib));
                continue;
            }
            let spec = Spec {
                dtype: dtypes[rng.below(4) as usize],
                transa: rng.below(2) == 0,
                transb: rng.below(2) == 0,
                m: 1 + rng.below(40) as usize,
                n: 1 + rng.below(40) as usize,
                k: 1 + rng.below(40) as usize,
                count: [1, 1, 2, 3][rng.below(4) as usize],
                pad: rng.below(3) as usize,
                alpha: [1.0, 2.0, -1.0, 0.5][rng.below(4) as usize],
                beta: [0.0, 0.0, 1.0, -2.0][rng.below(4) as usize],
            };
            let op = Op::new(rig.rt(), spec, &mut rng).unwrap();
            program.push((op.g, lib));
            ops.push(op);
        }
        let reset = || {
            for op in &ops {
                op.reset().unwrap();
            }
            rig.sync().unwrap();
        };
        // Eager: warms up every library and stream first.
        reset();
        for (g, lib) in &program {
            rig.blas.set_preferred_blas_library(*lib);
            rig.blas.gemm(rig.stream.handle(), g).unwrap();
        }
        rig.sync().unwrap();
        let eager: Vec<Vec<u8>> = ops.iter().map(|o| o.c_bytes().unwrap()).collect();
        reset();
        let held = rig.blas.workspace_bytes();
        let g = rig
            .capture(&rig.stream, None, CaptureMode::Global, || {
                for (g, lib) in &program {
                    rig.blas.set_preferred_blas_library(*lib);
                    rig.blas.gemm(rig.stream.handle(), g)?;
                }
                Ok(())
            })
            .unwrap_or_else(|e| panic!("seed {seed:#x}: capture: {e}"));
        rig.sync().unwrap();
        for (i, op) in ops.iter().enumerate() {
            op.c_is_first_value(&format!("seed {seed:#x}: op {i} ran during the capture"))
                .unwrap();
        }
        assert_eq!(rig.blas.workspace_bytes(), held, "seed {seed:#x}");
        for round in 0..2 {
            reset();
            g.replay(&rig.stream).unwrap();
            rig.sync().unwrap();
            for (i, op) in ops.iter().enumerate() {
                let got = op.c_bytes().unwrap();
                if got != eager[i] {
                    let (gv, ev) = (decode(op.g.dtype, &got), decode(op.g.dtype, &eager[i]));
                    let at = gv.iter().zip(&ev).position(|(a, b)| a != b).unwrap_or(0);
                    panic!(
                        "seed {seed:#x} round {round}: op {i} ({:?}) C[{at}] replayed {} vs eager {}",
                        op.spec, gv[at], ev[at]
                    );
                }
            }
        }
    }
}
