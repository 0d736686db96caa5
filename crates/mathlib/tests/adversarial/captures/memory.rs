//! Memory: pools given back, no growth, clears and failures inside captures.
use super::*;

// ---------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------

/// Dropping graphs (both libraries, several GEMMs each) and emptying the cache gives their
/// pools' memory back: reserved bytes as before the captures.
#[test]
fn dropping_graphs_and_emptying_the_cache_gives_the_memory_back() {
    let rig = Rig::new().unwrap();
    let ops: Vec<Op> = (0..3).map(|i| rig.square(40 + i).unwrap()).collect();
    rig.eager(&rig.stream, &ops[0]).unwrap();
    rig.blas.set_preferred_blas_library(BlasLibrary::CublasLt);
    rig.eager(&rig.stream, &ops[0]).unwrap();
    rig.alloc().empty_cache();
    let before = rig.reserved();
    let held = rig.blas.workspace_bytes();
    let mut graphs = Vec::new();
    for lib in [BlasLibrary::Cublas, BlasLibrary::CublasLt] {
        rig.blas.set_preferred_blas_library(lib);
        let refs: Vec<&Op> = ops.iter().collect();
        let (g, _) = rig.capture_gemms(&refs).unwrap();
        rig.replay(&g, &rig.stream, &refs, &format!("{lib:?}"))
            .unwrap();
        graphs.push(g);
    }
    assert!(rig.reserved() > before, "the captures reserved nothing?");
    let pools: Vec<PoolId> = graphs.iter().map(|g| g.pool().unwrap()).collect();
    drop(graphs);
    rig.sync().unwrap();
    rig.alloc().empty_cache();
    assert_eq!(
        rig.reserved(),
        before,
        "reserved bytes after dropping the graphs"
    );
    for p in pools {
        assert_eq!(rig.alloc().pool_use_count(p), None, "pool {p:?} still used");
    }
    assert_eq!(rig.blas.workspace_bytes(), held);
}

/// 100 capture/replay/drop cycles, alternating libraries, dtypes and shapes (some
/// batched): reserved bytes after emptying the cache are those before.
#[test]
fn a_hundred_mixed_capture_cycles_do_not_grow_reserved_bytes() {
    let rig = Rig::new().unwrap();
    let specs = [
        Spec::plain(DType::F32, 48, 48, 48),
        Spec::plain(DType::F16, 32, 16, 64),
        Spec {
            count: 3,
            ..Spec::plain(DType::BF16, 16, 24, 8)
        },
        Spec::plain(DType::F64, 8, 8, 8),
    ];
    let ops: Vec<Op> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| rig.op(*s, 50 + i as u64).unwrap())
        .collect();
    for lib in [BlasLibrary::Cublas, BlasLibrary::CublasLt] {
        rig.blas.set_preferred_blas_library(lib);
        for op in &ops {
            rig.eager(&rig.stream, op).unwrap();
        }
    }
    rig.alloc().empty_cache();
    let before = rig.reserved();
    let held = rig.blas.workspace_bytes();
    for i in 0..100 {
        let lib = if i % 2 == 0 {
            BlasLibrary::Cublas
        } else {
            BlasLibrary::CublasLt
        };
        rig.blas.set_preferred_blas_library(lib);
        let op = &ops[i % ops.len()];
        let (g, _) = rig.capture_gemms(&[op, op]).unwrap();
        if i % 10 == 0 {
            rig.replay(&g, &rig.stream, &[op], &format!("cycle {i}"))
                .unwrap();
        } else {
            g.replay(&rig.stream).unwrap();
        }
        drop(g);
        if i % 7 == 0 {
            rig.sync().unwrap();
            rig.alloc().empty_cache();
        }
    }
    rig.sync().unwrap();
    rig.alloc().empty_cache();
    assert_eq!(
        rig.reserved(),
        before,
        "reserved bytes grew over 100 cycles"
    );
    assert_eq!(rig.blas.workspace_bytes(), held);
}

/// `clear_workspaces()` or `clear_workspaces_for_stream(s)` between capture and replay,
/// with the freed memory handed to new buffers: replays are right and leave those buffers
/// alone; so is dropping the `Blas` altogether.
#[test]
fn clearing_workspaces_between_capture_and_replay_does_not_break_replays() {
    for how in ["all", "stream", "drop blas"] {
        let rig = Rig::new().unwrap();
        let op = rig.square(60).unwrap();
        let lt = rig.square(61).unwrap();
        rig.eager(&rig.stream, &op).unwrap();
        rig.blas.set_preferred_blas_library(BlasLibrary::CublasLt);
        rig.eager(&rig.stream, &lt).unwrap();
        rig.blas.set_preferred_blas_library(BlasLibrary::Cublas);
        rig.rec.take();
        let g = rig
            .capture(&rig.stream, None, CaptureMode::Global, || {
                rig.blas.gemm(rig.stream.handle(), &op.g)?;
                rig.blas.set_preferred_blas_library(BlasLibrary::CublasLt);
                rig.blas.gemm(rig.stream.handle(), &lt.g)?;
                rig.blas.set_preferred_blas_library(BlasLibrary::Cublas);
                Ok(())
            })
            .unwrap();
        match how {
            "all" => rig.blas.clear_workspaces().unwrap(),
            "stream" => rig
                .blas
                .clear_workspaces_for_stream(rig.stream.handle())
                .unwrap(),
            _ => {}
        }
        let Rig {
            h,
            allocators,
            blas,
            stream,
            rec,
        } = rig;
        if how == "drop blas" {
            drop(blas);
        } else {
            assert_eq!(
                blas.workspace_bytes(),
                0,
                "{how}: workspaces held after clearing"
            );
        }
        let alloc = allocators.device(DEV).unwrap();
        stream.synchronize().unwrap();
        alloc.empty_cache();
        let size = 64 << 20;
        let sentinels: Vec<DeviceBuffer<u8>> = (0..2)
            .map(|_| DeviceBuffer::filled(&h.rt, DEV, size, 5u8).unwrap())
            .collect();
        for round in 0..3 {
            op.reset().unwrap();
            lt.reset().unwrap();
            g.replay(&stream).unwrap();
            stream.synchronize().unwrap();
            op.check(&format!("{how}: round {round}, classic")).unwrap();
            lt.check(&format!("{how}: round {round}, cuBLASLt"))
                .unwrap();
        }
        for s in &sentinels {
            assert!(
                s.to_host().unwrap().iter().all(|&b| b == 5),
                "{how}: a replay wrote into memory a cleared workspace gave back"
            );
        }
        drop(rec);
    }
}

// ---------------------------------------------------------------------------------------
// Failures inside a capture
// ---------------------------------------------------------------------------------------

/// A GEMM whose check fails inside a capture (leading dimension below the rows, of A, B or
/// C; an element type with no GEMM) is a typed error, leaks no workspace (every block of the
/// pool free) and leaves the capture usable: a good GEMM after it replays right.
#[test]
fn a_failing_gemm_inside_a_capture_is_typed_and_leaks_nothing() {
    for lib in [BlasLibrary::Cublas, BlasLibrary::CublasLt] {
        let rig = Rig::new().unwrap();
        rig.blas.set_preferred_blas_library(lib);
        let op = rig.square(80).unwrap();
        rig.eager(&rig.stream, &op).unwrap();
        let held = rig.blas.workspace_bytes();
        let bad: Vec<(&str, Gemm)> = vec![
            ("lda", Gemm { lda: 47, ..op.g }),
            ("ldb", Gemm { ldb: 47, ..op.g }),
            ("ldc", Gemm { ldc: 47, ..op.g }),
            (
                "i32",
                Gemm {
                    dtype: DType::I32,
                    ..op.g
                },
            ),
        ];
        let mut errors = Vec::new();
        let g = rig
            .capture(&rig.stream, None, CaptureMode::Global, || {
                for (what, b) in &bad {
                    let e = no_panic(what, || rig.blas.gemm(rig.stream.handle(), b));
                    errors.push((*what, e));
                }
                rig.blas.gemm(rig.stream.handle(), &op.g)?;
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{lib:?}: the capture broke: {e}"));
        for (what, e) in &errors {
            match (what, e) {
                (
                    &"i32",
                    Err(
                        MathLibError::InvalidGemm(_)
                        | MathLibError::UnsupportedDtype(_)
                        | MathLibError::Precision(_),
                    ),
                ) => {}
                (_, Err(MathLibError::InvalidGemm(_))) => {}
                _ => panic!("{lib:?} {what}: {e:?}, expected a typed InvalidGemm"),
            }
        }
        let pool = g.pool().unwrap();
        let live: Vec<_> = rig
            .blocks(pool)
            .into_iter()
            .filter(|b| b.allocated)
            .collect();
        assert!(live.is_empty(), "{lib:?}: blocks left allocated: {live:?}");
        assert_eq!(rig.blas.workspace_bytes(), held, "{lib:?}");
        rig.replay(&g, &rig.stream, &[&op], &format!("{lib:?}: replay"))
            .unwrap();
    }
}

/// With TunableOp on and tuning, a failing GEMM inside a capture is still a typed error and
/// leaks nothing; no result is recorded for it.
#[test]
fn a_failing_gemm_inside_a_capture_with_tunableop_on_leaks_nothing() {
    let rig = Rig::new().unwrap();
    let file = temp_dir("cap-fail").join("r.csv");
    let op = rig.square(81).unwrap();
    rig.eager(&rig.stream, &op).unwrap();
    rig.blas.update_tunable(|t| {
        t.enabled = true;
        t.tuning = true;
        t.filename = file.to_string_lossy().into_owned();
    });
    let n = rig.blas.tunable().results().len();
    let g = rig
        .capture(&rig.stream, None, CaptureMode::Global, || {
            let e = no_panic("bad lda", || {
                rig.blas.gemm(rig.stream.handle(), &Gemm { lda: 3, ..op.g })
            });
            assert!(matches!(e, Err(MathLibError::InvalidGemm(_))), "{e:?}");
            rig.blas.gemm(rig.stream.handle(), &op.g)?;
            Ok(())
        })
        .unwrap();
    let pool = g.pool().unwrap();
    assert!(rig.blocks(pool).iter().all(|b| !b.allocated));
    assert_eq!(rig.blas.tunable().results().len(), n);
}

/// A capture before this thread ever made a handle: the GEMM is a typed error (making a
/// handle inside a capture is not allowed), not a panic, and nothing is left allocated.
#[test]
fn a_gemm_in_a_capture_before_any_handle_is_a_typed_error() {
    let rig = Rig::new().unwrap();
    let op = rig.square(82).unwrap();
    rig.sync().unwrap();
    let g = CudaGraph::new(rig.rt().clone(), rig.allocators.clone(), DEV).unwrap();
    g.capture_begin(&rig.stream, None, CaptureMode::Global)
        .unwrap();
    let got = catch(|| rig.blas.gemm(rig.stream.handle(), &op.g));
    let end = g.capture_end();
    let got = got.unwrap_or_else(|p| panic!("the GEMM panicked: {p}"));
    assert!(got.is_err(), "a handle was made inside a capture");
    eprintln!("no handle: {got:?}; capture_end: {end:?}");
    if let Some(pool) = g.pool() {
        assert!(rig.blocks(pool).iter().all(|b| !b.allocated));
    }
}

// ---------------------------------------------------------------------------------------
// More memory attacks
// ---------------------------------------------------------------------------------------

/// `empty_cache` while the graph lives keeps the graph pool's free workspace block (the
/// replay still writes there): memory handed out afterwards is never written by a replay.
#[test]
fn empty_cache_while_the_graph_lives_keeps_its_workspace() {
    let rig = Rig::new().unwrap();
    let op = rig.square(110).unwrap();
    rig.eager(&rig.stream, &op).unwrap();
    let (g, runs) = rig.capture_gemms(&[&op]).unwrap();
    let ws = Rig::workspaces(&runs).unwrap()[0];
    let pool = g.pool().unwrap();
    rig.sync().unwrap();
    rig.alloc().empty_cache();
    assert!(
        rig.block_at(pool, ws.0).is_some(),
        "empty_cache released the live graph's workspace block: {:?}",
        rig.blocks(pool)
    );
    let sentinels: Vec<DeviceBuffer<u8>> = (0..3)
        .map(|_| DeviceBuffer::filled(rig.rt(), DEV, ws.1 as usize, 3u8).unwrap())
        .collect();
    rig.replay(&g, &rig.stream, &[&op], "replay after empty_cache")
        .unwrap();
    for s in &sentinels {
        assert!(
            s.to_host().unwrap().iter().all(|&b| b == 3),
            "a replay wrote freed memory"
        );
    }
}

/// Small cuBLAS workspace sizes (0 bytes, 256 bytes, 4 KiB: smaller than C): captures
/// work, replays are right, and a buffer the capture allocated right after the GEMM (in
/// the same pool, on the same stream) is left as the capture filled it.
#[test]
fn small_workspace_sizes_in_captures() {
    for bytes in [0u64, 256, 4096] {
        let rig = Rig::new().unwrap();
        let set = rig.blas.set_cublas_workspace_size(bytes);
        if let Err(e) = set {
            eprintln!("{bytes}: refused ({e})");
            continue;
        }
        let op = rig.square(111).unwrap();
        rig.eager(&rig.stream, &op)
            .unwrap_or_else(|e| panic!("{bytes}: eager: {e}"));
        let mut after: Option<DeviceBuffer<u8>> = None;
        let g = rig
            .capture(&rig.stream, None, CaptureMode::Global, || {
                rig.blas.gemm(rig.stream.handle(), &op.g)?;
                let b = DeviceBuffer::<u8>::uninit(rig.rt(), DEV, 64 << 10)?;
                b.fill(4)?;
                after = Some(b);
                rig.blas.gemm(rig.stream.handle(), &op.g)?;
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{bytes}: capture: {e}"));
        let after = after.unwrap();
        for round in 0..2 {
            after.fill(0).unwrap();
            rig.replay(
                &g,
                &rig.stream,
                &[&op],
                &format!("{bytes} B, round {round}"),
            )
            .unwrap();
            assert!(
                after.to_host().unwrap().iter().all(|&b| b == 4),
                "{bytes} B: the second GEMM wrote past its workspace into the next block"
            );
        }
        let pool = g.pool().unwrap();
        drop(after);
        assert!(rig.blocks(pool).iter().all(|b| !b.allocated), "{bytes} B");
    }
}

/// `CudaGraph::reset` then a new capture with the same graph object: the new capture binds
/// a workspace of its new pool and replays right; the old pool goes away.
#[test]
fn reset_and_recapture_with_the_same_graph() {
    let rig = Rig::new().unwrap();
    let (op1, op2) = (rig.square(120).unwrap(), rig.square(121).unwrap());
    rig.eager(&rig.stream, &op1).unwrap();
    let (g, _) = rig.capture_gemms(&[&op1]).unwrap();
    rig.replay(&g, &rig.stream, &[&op1], "first capture")
        .unwrap();
    let old = g.pool().unwrap();
    g.reset().unwrap();
    rig.rec.take();
    g.capture_begin(&rig.stream, None, CaptureMode::Global)
        .unwrap();
    rig.blas.gemm(rig.stream.handle(), &op2.g).unwrap();
    g.capture_end().unwrap();
    let ws = Rig::workspaces(&rig.rec.take()).unwrap()[0];
    assert_capture_workspace(&rig, &g, ws, &rig.stream, 1, "recapture");
    assert_ne!(g.pool(), Some(old));
    rig.replay(&g, &rig.stream, &[&op2], "second capture")
        .unwrap();
    rig.sync().unwrap();
    rig.alloc().empty_cache();
    assert_eq!(
        rig.alloc().pool_use_count(old),
        None,
        "the old pool lives on"
    );
}

/// `clear_workspaces()` called inside a capture, between two GEMMs: no panic; if it is
/// allowed, the capture still replays right and the eager GEMM afterwards works.
#[test]
fn clear_workspaces_inside_a_capture_does_not_break_it() {
    let rig = Rig::new().unwrap();
    let (op1, op2) = (rig.square(130).unwrap(), rig.square(131).unwrap());
    rig.eager(&rig.stream, &op1).unwrap();
    let mut cleared = None;
    let g = rig
        .capture(&rig.stream, None, CaptureMode::Global, || {
            rig.blas.gemm(rig.stream.handle(), &op1.g)?;
            cleared = Some(no_panic("clear in capture", || rig.blas.clear_workspaces()));
            rig.blas.gemm(rig.stream.handle(), &op2.g)?;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("capture (clear gave {cleared:?}): {e}"));
    eprintln!("clear_workspaces inside a capture: {cleared:?}");
    rig.replay(&g, &rig.stream, &[&op1, &op2], "replay")
        .unwrap();
    rig.eager(&rig.stream, &op1).unwrap();
    rig.replay(&g, &rig.stream, &[&op1, &op2], "replay after an eager GEMM")
        .unwrap();
}

/// PyTorch's idiom (`with torch.cuda.graph(g): y = a @ b` after a warm-up on the current
/// stream): `CudaGraph::capture(None, ..)` captures on the device's default capture stream,
/// not the stream the warm-up ran on.
#[test]
fn the_torch_cuda_graph_idiom_on_the_default_capture_stream_works() {
    let rig = Rig::new().unwrap();
    let op = rig.square(140).unwrap();
    rig.eager(&rig.stream, &op).unwrap();
    op.reset().unwrap();
    rig.sync().unwrap();
    let g = CudaGraph::new(rig.rt().clone(), rig.allocators.clone(), DEV).unwrap();
    let guard = g.capture(None, None, CaptureMode::Global).unwrap();
    let s = guard.stream().clone();
    let got = rig.blas.gemm(s.handle(), &op.g);
    let end = guard.end();
    got.unwrap_or_else(|e| panic!("the captured GEMM: {e}"));
    end.unwrap();
    rig.replay(&g, &rig.stream, &[&op], "replay").unwrap();
}

/// The backend alone: `FakeBlas::set_stream` to a stream being captured. Real cuBLAS takes
/// `cublasSetStream` during a capture (PyTorch's `getCurrentCUDABlasHandle` calls it on
/// every acquisition, inside captures too); the capture must stay valid.
#[test]
fn fake_blas_set_stream_to_a_capturing_stream_is_allowed() {
    let fake = Arc::new(FakeDriver::default());
    let blas = FakeBlas::new(fake.clone(), 9);
    let handle = blas.create_handle(DEV).unwrap();
    let s = fake.stream_create(DEV, StreamFlags::default()).unwrap();
    fake.stream_begin_capture(s, CaptureMode::Global).unwrap();
    let got = blas.set_stream(handle, s);
    let status = fake.stream_capture_status(s);
    eprintln!("set_stream: {got:?}; capture status after: {status:?}");
    got.unwrap();
    assert!(
        matches!(status, Ok(ferrocuda_types::CaptureStatus::Active { .. })),
        "{status:?}"
    );
}
