//! Where a capture's workspace comes from; several graphs, several streams.
use super::*;

// ---------------------------------------------------------------------------------------
// Where the capture's workspace comes from
// ---------------------------------------------------------------------------------------

/// With either library: the captured GEMM's workspace is a free block of the graph's
/// pool, allocated on the capture stream, never the eager workspace; the eager
/// workspace count and bytes do not move; replays are right.
#[test]
fn capture_workspace_is_a_free_block_of_the_graphs_pool_for_both_libraries() {
    let rig = Rig::new().unwrap();
    let op = rig.square(1).unwrap();
    for library in [BlasLibrary::Cublas, BlasLibrary::CublasLt] {
        rig.blas.set_preferred_blas_library(library);
        let eager_ws = rig.eager_workspace(&op).unwrap();
        let held = rig.blas.workspace_bytes();
        let size = rig.blas.cublas_workspace_size();
        op.reset().unwrap();
        rig.sync().unwrap();
        let (g, runs) = rig.capture_gemms(&[&op]).unwrap();
        assert_eq!(runs.len(), 1, "{library:?}: one GEMM recorded: {runs:?}");
        assert_eq!(
            runs[0].lt.is_some(),
            library == BlasLibrary::CublasLt,
            "{library:?}: the preferred library was used in the capture: {runs:?}"
        );
        let ws = Rig::workspaces(&runs).unwrap()[0];
        assert_ne!(
            ws.0, eager_ws.0,
            "{library:?}: the capture bound the eager workspace"
        );
        let want = if library == BlasLibrary::CublasLt {
            rig.blas.cublaslt_workspace_size().0
        } else {
            size
        };
        assert_capture_workspace(
            &rig,
            &g,
            ws,
            &rig.stream,
            want.min(ws.1),
            &format!("{library:?}"),
        );
        assert_eq!(
            rig.blas.workspace_bytes(),
            held,
            "{library:?}: eager bytes moved"
        );
        op.c_is_first_value("capturing does not run the GEMM")
            .unwrap();
        for i in 0..3 {
            rig.replay(&g, &rig.stream, &[&op], &format!("{library:?} replay {i}"))
                .unwrap();
        }
        // The eager GEMM after the capture goes back to the eager workspace.
        assert_eq!(
            rig.eager_workspace(&op).unwrap().0,
            eager_ws.0,
            "{library:?}"
        );
    }
}

/// A capture on a stream that never ran an eager GEMM (the thread's handle exists, made on
/// another stream): the capture makes no eager workspace for it (`workspace_bytes` stays),
/// and the next eager GEMM there makes one as usual.
#[test]
fn a_capture_on_a_stream_with_no_eager_workspace_leaves_none_behind() {
    let rig = Rig::new().unwrap();
    let op = rig.square(2).unwrap();
    rig.eager(&rig.stream, &op).unwrap();
    let held = rig.blas.workspace_bytes();
    let s2 = rig.rt().new_stream(DEV, 0).unwrap();
    rig.sync().unwrap();
    rig.rec.take();
    let g = rig
        .capture(&s2, None, CaptureMode::Global, || {
            rig.blas.gemm(s2.handle(), &op.g)?;
            Ok(())
        })
        .unwrap();
    let runs = rig.rec.take();
    let ws = Rig::workspaces(&runs).unwrap()[0];
    assert_capture_workspace(&rig, &g, ws, &s2, 1, "fresh stream");
    assert_eq!(
        rig.blas.workspace_bytes(),
        held,
        "the capture on a fresh stream left an eager workspace behind"
    );
    rig.replay(&g, &s2, &[&op], "replay on the fresh stream")
        .unwrap();
    rig.eager(&s2, &op).unwrap();
    assert_eq!(
        rig.blas.workspace_bytes(),
        held + rig.blas.cublas_workspace_size(),
        "the eager GEMM on the new stream makes its workspace"
    );
}

/// The commonest pattern: warm up on two streams (each has its eager workspace), the last
/// eager GEMM on the first, then capture on the second. PyTorch's `getCurrentCUDABlasHandle`
/// calls `cublasSetStream` inside captures all the time; here the handle must be moved to
/// the capture stream inside the capture, and that is refused, invalidating the capture.
#[test]
fn a_capture_on_a_stream_other_than_the_handles_last_one_works() {
    for lib in [BlasLibrary::Cublas, BlasLibrary::CublasLt] {
        let rig = Rig::new().unwrap();
        rig.blas.set_preferred_blas_library(lib);
        let op = rig.square(2).unwrap();
        let s2 = rig.rt().new_stream(DEV, 0).unwrap();
        rig.eager(&s2, &op).unwrap();
        rig.eager(&rig.stream, &op).unwrap();
        op.reset().unwrap();
        rig.sync().unwrap();
        let got = rig.capture(&s2, None, CaptureMode::Global, || {
            rig.blas.gemm(s2.handle(), &op.g)?;
            Ok(())
        });
        let g = got.unwrap_or_else(|e| {
            panic!(
                "{lib:?}: capture on the second stream: {e}; backend acts: {:?}",
                rig.rec.log.lock().unwrap().acts
            )
        });
        rig.replay(&g, &s2, &[&op], "replay").unwrap();
    }
}

/// A capture whose GEMM is that stream's very first use by this Blas, right after
/// `clear_workspaces`: still no eager workspace is made inside the capture.
#[test]
fn a_capture_right_after_clear_workspaces_makes_no_eager_workspace() {
    let rig = Rig::new().unwrap();
    let op = rig.square(3).unwrap();
    rig.eager(&rig.stream, &op).unwrap();
    rig.blas.clear_workspaces().unwrap();
    assert_eq!(rig.blas.workspace_bytes(), 0);
    let (g, runs) = rig.capture_gemms(&[&op]).unwrap();
    let ws = Rig::workspaces(&runs).unwrap()[0];
    assert_capture_workspace(&rig, &g, ws, &rig.stream, 1, "after clear");
    assert_eq!(
        rig.blas.workspace_bytes(),
        0,
        "an eager workspace made in the capture"
    );
    let pool = g.pool().unwrap();
    assert!(
        rig.blocks(pool).iter().all(|b| !b.allocated),
        "a block of the graph's pool stays allocated: {:?}",
        rig.blocks(pool)
    );
    rig.replay(&g, &rig.stream, &[&op], "replay").unwrap();
}

/// A larger cuBLAS workspace size set between the warm-up and the capture: the capture's
/// workspace has the new size; the eager one (smaller) is not replaced inside the capture.
#[test]
fn a_workspace_size_change_before_the_capture_does_not_touch_the_eager_workspace() {
    let rig = Rig::new().unwrap();
    let op = rig.square(4).unwrap();
    let eager_ws = rig.eager_workspace(&op).unwrap();
    let held = rig.blas.workspace_bytes();
    let bigger = 2 * rig.blas.cublas_workspace_size();
    rig.blas.set_cublas_workspace_size(bigger).unwrap();
    let (g, runs) = rig.capture_gemms(&[&op]).unwrap();
    let ws = Rig::workspaces(&runs).unwrap()[0];
    assert_ne!(ws.0, eager_ws.0);
    assert_capture_workspace(&rig, &g, ws, &rig.stream, bigger, "bigger size");
    assert_eq!(
        ws.1, bigger,
        "the capture's workspace has the size chosen now"
    );
    assert_eq!(
        rig.blas.workspace_bytes(),
        held,
        "eager workspace replaced in the capture"
    );
    rig.replay(&g, &rig.stream, &[&op], "replay").unwrap();
    // The next eager call replaces it (the documented rule).
    rig.eager(&rig.stream, &op).unwrap();
    assert_eq!(rig.blas.workspace_bytes(), bigger);
    rig.replay(&g, &rig.stream, &[&op], "replay after the eager resize")
        .unwrap();
}

/// In one capture, a GEMM's freed workspace is reusable by a later allocation of the same
/// capture on its stream: a buffer of exactly that size allocated next takes it (the only
/// free block of the pool); the buffer's fill, captured after the GEMM, and a second GEMM
/// after it all come out right on replay.
#[test]
fn a_freed_capture_workspace_is_reused_in_stream_order_within_the_capture() {
    let rig = Rig::new().unwrap();
    let (op1, op2) = (rig.square(5).unwrap(), rig.square(6).unwrap());
    rig.eager(&rig.stream, &op1).unwrap();
    let size = rig.blas.cublas_workspace_size();
    let mut scratch: Option<DeviceBuffer<u8>> = None;
    rig.rec.take();
    let g = rig
        .capture(&rig.stream, None, CaptureMode::Global, || {
            rig.blas.gemm(rig.stream.handle(), &op1.g)?;
            let buf = DeviceBuffer::<u8>::uninit(rig.rt(), DEV, size as usize)?;
            buf.fill(7)?;
            scratch = Some(buf);
            rig.blas.gemm(rig.stream.handle(), &op2.g)?;
            Ok(())
        })
        .unwrap();
    let runs = rig.rec.take();
    let ws = Rig::workspaces(&runs).unwrap();
    let scratch = scratch.unwrap();
    assert_eq!(
        scratch.ptr(),
        ws[0].0,
        "the first GEMM's workspace was not free for the capture's next allocation"
    );
    assert_ne!(
        ws[1].0, ws[0].0,
        "the second GEMM bound memory a live buffer holds"
    );
    for round in 0..2 {
        scratch.fill(0).unwrap();
        rig.replay(&g, &rig.stream, &[&op1, &op2], &format!("round {round}"))
            .unwrap();
        assert!(
            scratch.to_host().unwrap().iter().all(|&b| b == 7),
            "round {round}: the buffer captured after the first GEMM was overwritten"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Several graphs, several streams
// ---------------------------------------------------------------------------------------

/// Three graphs on one stream (classic, cuBLASLt, another shape), each its own pool: no
/// two bind the same workspace; replayed in a scrambled order, each gives its result;
/// replays on another stream too, and two graphs replayed on two streams at once.
#[test]
fn graphs_on_one_stream_never_share_workspaces_and_replay_anywhere() {
    let rig = Rig::new().unwrap();
    let ops = [
        rig.square(7).unwrap(),
        rig.square(8).unwrap(),
        rig.op(Spec::plain(DType::F32, 40, 24, 56), 9).unwrap(),
    ];
    let libs = [
        BlasLibrary::Cublas,
        BlasLibrary::CublasLt,
        BlasLibrary::Cublas,
    ];
    for (op, lib) in ops.iter().zip(libs) {
        rig.blas.set_preferred_blas_library(lib);
        rig.eager(&rig.stream, op).unwrap();
    }
    let held = rig.blas.workspace_bytes();
    let mut graphs = Vec::new();
    let mut seen = Vec::new();
    for (op, lib) in ops.iter().zip(libs) {
        rig.blas.set_preferred_blas_library(lib);
        let (g, runs) = rig.capture_gemms(&[op]).unwrap();
        let ws = Rig::workspaces(&runs).unwrap()[0];
        assert_capture_workspace(&rig, &g, ws, &rig.stream, 1, &format!("{lib:?}"));
        seen.push(ws.0);
        graphs.push(g);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 3, "graphs share a workspace");
    assert_eq!(rig.blas.workspace_bytes(), held);
    rig.blas.set_preferred_blas_library(BlasLibrary::Cublas);
    let mut rng = Rng(77);
    for round in 0..12 {
        let i = rng.below(3) as usize;
        rig.replay(
            &graphs[i],
            &rig.stream,
            &[&ops[i]],
            &format!("round {round}, graph {i}"),
        )
        .unwrap();
    }
    let other = rig.rt().new_stream(DEV, 0).unwrap();
    for (i, g) in graphs.iter().enumerate() {
        rig.replay(
            g,
            &other,
            &[&ops[i]],
            &format!("graph {i} on another stream"),
        )
        .unwrap();
    }
    // Two at once on two streams, then a third on the first.
    for op in &ops {
        op.reset().unwrap();
    }
    rig.sync().unwrap();
    graphs[0].replay(&rig.stream).unwrap();
    graphs[1].replay(&other).unwrap();
    graphs[2].replay(&rig.stream).unwrap();
    other.synchronize().unwrap();
    rig.sync().unwrap();
    for (i, op) in ops.iter().enumerate() {
        op.check(&format!("graph {i}, concurrent replays")).unwrap();
    }
}

/// Graphs sharing one pool (`capture_begin(.., Some(first.pool()))`) replay correctly in
/// capture order, repeatedly; each GEMM's workspace is a free block of that shared pool.
#[test]
fn graphs_sharing_a_pool_replay_in_capture_order() {
    let rig = Rig::new().unwrap();
    let ops: Vec<Op> = (0..4).map(|i| rig.square(20 + i).unwrap()).collect();
    rig.eager(&rig.stream, &ops[0]).unwrap();
    let mut graphs: Vec<CudaGraph> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let pool = graphs.first().map(|g| g.pool().unwrap());
        if i % 2 == 1 {
            rig.blas.set_preferred_blas_library(BlasLibrary::CublasLt);
        } else {
            rig.blas.set_preferred_blas_library(BlasLibrary::Cublas);
        }
        rig.rec.take();
        let g = rig
            .capture(&rig.stream, pool, CaptureMode::Global, || {
                rig.blas.gemm(rig.stream.handle(), &op.g)?;
                Ok(())
            })
            .unwrap();
        let ws = Rig::workspaces(&rig.rec.take()).unwrap()[0];
        assert_eq!(g.pool(), graphs.first().map_or(g.pool(), |f| f.pool()));
        assert_capture_workspace(&rig, &g, ws, &rig.stream, 1, &format!("graph {i}"));
        graphs.push(g);
    }
    for round in 0..3 {
        for (i, (g, op)) in graphs.iter().zip(&ops).enumerate() {
            rig.replay(g, &rig.stream, &[op], &format!("round {round}, graph {i}"))
                .unwrap();
        }
    }
}

/// Two threads capture at once (`ThreadLocal`), each on its own stream into its own graph:
/// different workspaces, each in its own graph's pool; replays (after the threads ended and
/// their handles' eager workspaces went back) are right.
#[test]
fn two_threads_capture_at_once_with_thread_local_mode() {
    let rig = Rig::new().unwrap();
    let rt = rig.rt().clone();
    let barrier = Barrier::new(2);
    let results: Vec<(CudaGraph, Op, Stream, Vec<Run>)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..2u64)
            .map(|t| {
                let (rt, blas, rig, barrier) = (rt.clone(), rig.blas.clone(), &rig, &barrier);
                sc.spawn(move || {
                    let stream = rt.new_stream(DEV, 0).unwrap();
                    rt.set_stream(&stream).unwrap();
                    let op = Op::new(
                        &rt,
                        Spec::plain(DType::F32, 32 + 8 * t as usize, 48, 40),
                        &mut Rng(100 + t),
                    )
                    .unwrap();
                    op.reset().unwrap();
                    blas.gemm(stream.handle(), &op.g).unwrap();
                    stream.synchronize().unwrap();
                    op.check("thread's eager GEMM").unwrap();
                    let g = CudaGraph::new(rt.clone(), rig.allocators.clone(), DEV).unwrap();
                    barrier.wait();
                    g.capture_begin(&stream, None, CaptureMode::ThreadLocal)
                        .unwrap();
                    barrier.wait();
                    let before = rig.rec.log.lock().unwrap().runs.len();
                    blas.gemm(stream.handle(), &op.g).unwrap();
                    barrier.wait();
                    g.capture_end().unwrap();
                    let runs: Vec<Run> = rig.rec.log.lock().unwrap().runs[before..].to_vec();
                    stream.synchronize().unwrap();
                    (g, op, stream, runs)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Each thread's run is the one whose handle is not the other's: find the workspace of
    // the run made under each graph by membership in its pool.
    let mut wss = Vec::new();
    for (i, (g, _, _, runs)) in results.iter().enumerate() {
        let pool = g.pool().unwrap();
        let in_pool: Vec<_> = runs
            .iter()
            .filter_map(|r| r.ws)
            .filter(|ws| rig.block_at(pool, ws.0).is_some())
            .collect();
        assert!(
            !in_pool.is_empty(),
            "thread {i}: no GEMM bound a block of its graph's pool: {runs:?}"
        );
        wss.push(in_pool[0].0);
        assert!(rig.blocks(pool).iter().all(|b| !b.allocated));
    }
    assert_ne!(
        wss[0], wss[1],
        "the two threads' captures share a workspace"
    );
    // The threads are gone: their eager workspaces went back. Cover freed memory.
    rig.alloc().empty_cache();
    let size = rig.blas.cublas_workspace_size() as usize;
    let sentinels: Vec<DeviceBuffer<u8>> = (0..2)
        .map(|_| DeviceBuffer::filled(rig.rt(), DEV, size, 9u8).unwrap())
        .collect();
    for round in 0..2 {
        for (i, (g, op, stream, _)) in results.iter().enumerate() {
            rig.replay(
                g,
                stream,
                &[op],
                &format!("round {round}, thread {i}'s graph"),
            )
            .unwrap();
        }
    }
    rig.sync().unwrap();
    for s in &sentinels {
        assert!(
            s.to_host().unwrap().iter().all(|&b| b == 9),
            "a replay wrote freed memory"
        );
    }
}

/// While one thread captures (`ThreadLocal`), another thread's eager GEMM on its own stream
/// stays eager: it runs at once with the right result, and its workspace is not a block of
/// the capturing graph's pool.
#[test]
fn an_eager_gemm_on_another_thread_during_a_capture_stays_eager() {
    let rig = Rig::new().unwrap();
    let op = rig.square(30).unwrap();
    rig.eager(&rig.stream, &op).unwrap();
    let g = CudaGraph::new(rig.rt().clone(), rig.allocators.clone(), DEV).unwrap();
    g.capture_begin(&rig.stream, None, CaptureMode::ThreadLocal)
        .unwrap();
    rig.blas.gemm(rig.stream.handle(), &op.g).unwrap();
    let pool = g.pool().unwrap();
    let rt = rig.rt().clone();
    let blas = rig.blas.clone();
    let (ws, ok) = std::thread::scope(|sc| {
        sc.spawn(|| {
            let s2 = rt.new_stream(DEV, 0).unwrap();
            rt.set_stream(&s2).unwrap();
            let other = Op::new(&rt, Spec::plain(DType::F32, 16, 16, 16), &mut Rng(31)).unwrap();
            other.reset().unwrap();
            let before = rig.rec.log.lock().unwrap().runs.len();
            blas.gemm(s2.handle(), &other.g).unwrap();
            s2.synchronize().unwrap();
            let runs: Vec<Run> = rig.rec.log.lock().unwrap().runs[before..].to_vec();
            (
                runs[0].ws,
                other.check("the other thread's eager GEMM").is_ok(),
            )
        })
        .join()
        .unwrap()
    });
    g.capture_end().unwrap();
    assert!(ok, "the eager GEMM on the other thread gave a wrong result");
    let ws = ws.expect("a workspace");
    assert!(
        rig.block_at(pool, ws.0).is_none(),
        "the other thread's eager GEMM took its workspace from the capture's pool"
    );
    rig.replay(&g, &rig.stream, &[&op], "replay").unwrap();
}
