//! cuBLAS workspaces inside CUDA graph captures, on both backends (`fake::*` in CI,
//! `cuda::*` in the GPU bundle): a GEMM captured into a graph takes its workspace from the
//! graph's private pool and the workspace goes with the graph; 100 captures do not grow
//! memory (PyTorch's `test_repeat_graph_capture_cublas_workspace_memory`); two graphs
//! captured on one stream never share a workspace (PyTorch issue 193402: theirs do), so
//! interleaved replays give each its eager result and one graph's replay never writes into
//! memory the other let go; and workspaces placed in a sleepable pool sleep with it.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

#[allow(dead_code)]
#[path = "blas_conformance/support.rs"]
mod support;

use ferrocuda_alloc::{AllocError, Caching, DeviceAllocators, SleepError, SleepMode};
use ferrocuda_graph::{CudaGraph, PoolId};
use ferrocuda_mathlib::{Blas, BlasBackend, BlasLibrary, CudaBlas, FakeBlas, Gemm, MathLibError};
use ferrocuda_stream::{DeviceBuffer, Stream};
use ferrocuda_testkit::{Harness, both_backends};
use ferrocuda_types::{AllocatorConfig, CaptureMode, DType, DeviceIndex, DevicePtr};
use std::sync::Arc;
use support::{Act, Recording, Rng};

type TestResult = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
/// Matrices are N × N.
const N: usize = 48;

both_backends!(
    a_captured_gemm_takes_its_workspace_from_the_graphs_pool,
    a_hundred_captures_do_not_grow_memory,
    two_graphs_on_one_stream_never_share_a_workspace,
    tunableop_does_not_tune_inside_a_capture,
    a_capture_on_a_stream_the_handle_has_not_used,
    workspaces_sleep_with_their_pool,
);

/// The installed allocators, a recording [`Blas`] over them and a capture stream.
struct Setup<'h> {
    h: &'h Harness,
    allocators: Arc<DeviceAllocators>,
    rec: Arc<Recording>,
    blas: Blas,
    stream: Stream,
}

/// A product `C = A * B` of small integers (exact in every precision), its operands on
/// the device and its expected value.
struct Product {
    a: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    c: DeviceBuffer<f32>,
    expected: Vec<f32>,
}

impl Product {
    fn gemm(&self) -> Gemm {
        Gemm::plain(
            DType::F32,
            N,
            N,
            N,
            self.a.ptr(),
            self.b.ptr(),
            self.c.ptr(),
        )
    }
}

impl<'h> Setup<'h> {
    fn new(h: &'h Harness) -> Result<Setup<'h>, Box<dyn std::error::Error>> {
        let allocators = DeviceAllocators::new(
            h.rt.driver().clone(),
            AllocatorConfig::default(),
            Caching::On,
        );
        allocators.install(&h.rt);
        // cuBLAS calls CUDA through the runtime's driver, which knows its streams.
        let backend: Arc<dyn BlasBackend> = match (&h.fake, &h.cuda) {
            (Some(fake), _) => Arc::new(FakeBlas::new(fake.clone(), 9)),
            (None, Some(cuda)) => Arc::new(CudaBlas::new(cuda.clone())?),
            (None, None) => return Err("a harness with neither driver".into()),
        };
        let rec = Arc::new(Recording::new(backend));
        let blas = Blas::new(rec.clone(), (allocators.clone(), D0))?;
        let stream = h.rt.new_stream(D0, 0)?;
        // The buffers' copies and fills go on the current stream: this one.
        h.rt.set_stream(&stream)?;
        Ok(Setup {
            h,
            allocators,
            rec,
            blas,
            stream,
        })
    }

    fn product(&self, seed: u64) -> Result<Product, Box<dyn std::error::Error>> {
        let mut rng = Rng(seed);
        let mut small = |_| rng.below(5) as f32 - 2.0;
        let a: Vec<f32> = (0..N * N).map(&mut small).collect();
        let b: Vec<f32> = (0..N * N).map(&mut small).collect();
        let mut expected = vec![0.0f32; N * N];
        for col in 0..N {
            for row in 0..N {
                expected[col * N + row] = (0..N).map(|x| a[x * N + row] * b[col * N + x]).sum();
            }
        }
        let rt = &self.h.rt;
        Ok(Product {
            a: DeviceBuffer::from_slice(rt, D0, &a)?,
            b: DeviceBuffer::from_slice(rt, D0, &b)?,
            c: DeviceBuffer::filled(rt, D0, N * N, 0.0)?,
            expected,
        })
    }

    /// An eager GEMM, so that the handle and its stream's workspace exist before any
    /// capture (the warm-up PyTorch's docs ask for).
    fn warm_up(&self, p: &Product) -> TestResult {
        self.blas.gemm(self.stream.handle(), &p.gemm())?;
        self.expect(p, "the eager GEMM")
    }

    /// A graph of `p`'s GEMM captured on the setup's stream, and the workspace the capture
    /// bound.
    fn capture(&self, p: &Product) -> Result<(CudaGraph, DevicePtr), Box<dyn std::error::Error>> {
        self.capture_on(&self.stream, p)
    }

    /// As [`Setup::capture`], on `stream`.
    fn capture_on(
        &self,
        stream: &Stream,
        p: &Product,
    ) -> Result<(CudaGraph, DevicePtr), Box<dyn std::error::Error>> {
        let graph = CudaGraph::new(self.h.rt.clone(), self.allocators.clone(), D0)?;
        self.rec.take();
        graph.capture_begin(stream, None, CaptureMode::Global)?;
        let gemm = self.blas.gemm(stream.handle(), &p.gemm());
        graph.capture_end()?;
        gemm?;
        let bound: Vec<DevicePtr> = self
            .rec
            .take()
            .into_iter()
            .filter_map(|act| match act {
                Act::Workspace(_, ptr, _) => Some(ptr),
                _ => None,
            })
            .collect();
        match bound[..] {
            [ptr] => Ok((graph, ptr)),
            _ => Err(format!("the capture bound {bound:?}, not one workspace").into()),
        }
    }

    /// Zeroes C, replays `graph` and checks C.
    fn replay(&self, graph: &CudaGraph, p: &Product, what: &str) -> TestResult {
        p.c.fill(0.0)?;
        graph.replay(&self.stream)?;
        self.expect(p, what)
    }

    fn expect(&self, p: &Product, what: &str) -> TestResult {
        self.stream.synchronize()?;
        let got = p.c.to_host()?;
        match got.iter().zip(&p.expected).position(|(g, e)| g != e) {
            None => Ok(()),
            Some(i) => {
                Err(format!("{what}: C[{i}] = {}, expected {}", got[i], p.expected[i]).into())
            }
        }
    }

    /// Whether `ptr` starts a block of `pool` of at least `bytes`, and that block is free
    /// (the capture gave it back to the pool after recording the call).
    fn free_in_pool(
        &self,
        pool: PoolId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<bool, Box<dyn std::error::Error>> {
        let blocks = self.allocators.device(D0)?.pool_blocks(pool);
        Ok(blocks
            .iter()
            .any(|b| b.ptr == ptr && b.size >= bytes && !b.allocated))
    }

    fn reserved(&self) -> Result<i64, Box<dyn std::error::Error>> {
        Ok(self
            .allocators
            .device(D0)?
            .stats()
            .reserved_bytes
            .all
            .current)
    }
}

/// With either library, the workspace a capture binds is a block of the graph's pool, not
/// the stream's eager workspace, and free once the call is recorded; replays give the eager
/// result; the next eager GEMM binds the eager workspace again; dropping the graph and
/// emptying the cache gives the pool's memory back.
fn a_captured_gemm_takes_its_workspace_from_the_graphs_pool(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let p = s.product(1)?;
    for library in [BlasLibrary::Cublas, BlasLibrary::CublasLt] {
        s.blas.set_preferred_blas_library(library);
        s.warm_up(&p)?;
        let eager_bytes = s.blas.workspace_bytes();
        let size = s.blas.cublas_workspace_size();
        assert_eq!(eager_bytes, size, "{library:?}: one eager workspace");
        s.allocators.device(D0)?.empty_cache();
        let reserved_before = s.reserved()?;
        let (graph, ws) = s.capture(&p)?;
        let pool = graph.pool().expect("a pool");
        assert!(
            s.free_in_pool(pool, ws, size)?,
            "{library:?}: the captured workspace {ws} is not a free block of the graph's pool"
        );
        assert_eq!(
            s.blas.workspace_bytes(),
            eager_bytes,
            "{library:?}: no workspace kept"
        );
        for i in 0..3 {
            s.replay(&graph, &p, &format!("{library:?}: replay {i}"))?;
        }
        s.rec.take();
        s.warm_up(&p)?;
        let rebound = s
            .rec
            .take()
            .into_iter()
            .any(|a| matches!(a, Act::Workspace(_, ptr, _) if ptr != ws));
        assert!(
            rebound,
            "{library:?}: the eager GEMM after the capture rebinds the eager workspace"
        );
        drop(graph);
        s.allocators.device(D0)?.empty_cache();
        assert_eq!(s.allocators.device(D0)?.pool_use_count(pool), None);
        assert_eq!(
            s.reserved()?,
            reserved_before,
            "{library:?}: the pool's memory went back"
        );
    }
    Ok(())
}

/// A workspace made while `set_workspace_pool` names a sleepable pool is a block of it;
/// while the pool sleeps a GEMM that would bind it is the typed `Asleep` error with either
/// library (cuBLAS would write to unmapped memory); after wake the GEMM gives the eager
/// result; cleared, the workspace is a free block of the pool, and with no pool named the
/// next one comes from the stream's pool.
fn workspaces_sleep_with_their_pool(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let p = s.product(8)?;
    let alloc = s.allocators.device(D0)?;
    let pool = PoolId::handle();
    alloc.create_sleepable_pool(pool)?;
    s.blas.set_workspace_pool(Some(pool));
    s.rec.take();
    s.warm_up(&p)?;
    let acts = s.rec.take();
    let ws = acts
        .iter()
        .find_map(|a| match a {
            Act::Workspace(_, ptr, _) => Some(*ptr),
            _ => None,
        })
        .ok_or_else(|| format!("no workspace bound: {acts:?}"))?;
    let size = s.blas.cublas_workspace_size();
    assert!(
        alloc
            .pool_blocks(pool)
            .iter()
            .any(|b| b.ptr == ws && b.allocated && b.size >= size),
        "the workspace {ws} is not a live block of the sleepable pool"
    );
    for library in [BlasLibrary::Cublas, BlasLibrary::CublasLt] {
        s.blas.set_preferred_blas_library(library);
        alloc.sleep(pool, SleepMode::Discard)?;
        match s.blas.gemm(s.stream.handle(), &p.gemm()) {
            Err(MathLibError::Alloc(AllocError::Sleep(SleepError::Asleep(p)))) if p == pool => {}
            other => {
                return Err(
                    format!("{library:?}: a GEMM over a sleeping workspace: {other:?}").into(),
                );
            }
        }
        alloc.wake(pool)?;
        p.c.fill(0.0)?;
        s.warm_up(&p)?;
    }
    s.blas.clear_workspaces()?;
    assert!(
        alloc.pool_blocks(pool).iter().all(|b| !b.allocated),
        "cleared workspaces go back to the pool"
    );
    s.blas.set_workspace_pool(None);
    s.warm_up(&p)?;
    assert!(
        alloc.pool_blocks(pool).iter().all(|b| !b.allocated),
        "with no pool named, a new workspace comes from the stream's pool"
    );
    Ok(())
}

/// A capture on a stream the handle has not used (the `torch.cuda.graph` idiom: warm up on
/// one stream, capture on another): the handle is set to the capturing stream
/// (`cublasSetStream` inside the capture, as PyTorch does at every acquisition), and the
/// replay, on the first stream after the second's work, gives the eager result.
fn a_capture_on_a_stream_the_handle_has_not_used(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let p = s.product(6)?;
    s.warm_up(&p)?;
    let other = h.rt.new_stream(D0, 0)?;
    let (graph, ws) = s.capture_on(&other, &p)?;
    let size = s.blas.cublas_workspace_size();
    assert!(s.free_in_pool(graph.pool().expect("pool"), ws, size)?);
    s.replay(&graph, &p, "the replay on the warm-up stream")?;
    Ok(())
}

/// PyTorch's `test_repeat_graph_capture_cublas_workspace_memory`: 100 graphs of a GEMM,
/// each captured (`CudaGraph::capture` empties the cache first, as `torch.cuda.graph`
/// does), replayed and dropped, leave the allocator's reserved bytes and the device's used
/// memory where they were.
fn a_hundred_captures_do_not_grow_memory(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let p = s.product(2)?;
    s.warm_up(&p)?;
    let alloc = s.allocators.device(D0)?;
    alloc.empty_cache();
    let reserved_before = s.reserved()?;
    let (free_before, total) = h.rt.mem_get_info(D0)?;
    for i in 0..100 {
        let graph = CudaGraph::new(h.rt.clone(), s.allocators.clone(), D0)?;
        let capture = graph.capture(Some(&s.stream), None, CaptureMode::Global)?;
        s.blas.gemm(s.stream.handle(), &p.gemm())?;
        capture.end()?;
        if i % 25 == 0 {
            s.replay(&graph, &p, &format!("graph {i}"))?;
        } else {
            graph.replay(&s.stream)?;
        }
    }
    s.stream.synchronize()?;
    alloc.empty_cache();
    assert_eq!(
        s.reserved()?,
        reserved_before,
        "reserved bytes after 100 captures"
    );
    let (free_after, _) = h.rt.mem_get_info(D0)?;
    let grown = free_before.saturating_sub(free_after);
    assert!(
        grown < 100 << 20,
        "the device's used memory grew by {grown} of {total} bytes over 100 captures"
    );
    Ok(())
}

/// Two graphs captured one after the other on one stream bind different workspaces, each
/// from its own pool. Replayed interleaved, each gives its eager result. After the first
/// is dropped and its memory handed to a new buffer, replaying the second leaves that
/// buffer as it was (a workspace shared with the first graph would be written there).
fn two_graphs_on_one_stream_never_share_a_workspace(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let (p1, p2) = (s.product(3)?, s.product(4)?);
    s.warm_up(&p1)?;
    s.warm_up(&p2)?;
    let (g1, ws1) = s.capture(&p1)?;
    let (g2, ws2) = s.capture(&p2)?;
    assert_ne!(ws1, ws2, "the two graphs share a workspace");
    let size = s.blas.cublas_workspace_size();
    assert!(s.free_in_pool(g1.pool().expect("pool"), ws1, size)?);
    assert!(s.free_in_pool(g2.pool().expect("pool"), ws2, size)?);
    for round in 0..3 {
        s.replay(&g1, &p1, &format!("round {round}, first graph"))?;
        s.replay(&g2, &p2, &format!("round {round}, second graph"))?;
    }
    drop(g1);
    s.allocators.device(D0)?.empty_cache();
    let sentinel = DeviceBuffer::filled(&h.rt, D0, (size / 4) as usize, 7.0f32)?;
    s.replay(&g2, &p2, "the second graph after the first was dropped")?;
    let kept = sentinel.to_host()?;
    if let Some(i) = kept.iter().position(|&v| v != 7.0) {
        return Err(format!(
            "the second graph's replay wrote {} at element {i} of memory the first let go",
            kept[i]
        )
        .into());
    }
    Ok(())
}

/// With TunableOp tuning on, a GEMM signature first met inside a capture is not tuned
/// there (timing synchronizes, which a capture forbids): the capture and its replays
/// work, nothing is recorded, and the next eager call tunes it.
fn tunableop_does_not_tune_inside_a_capture(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let p = s.product(5)?;
    let file = ferrocuda_testkit::temp_dir("tunable-capture").join("results.csv");
    s.blas.update_tunable(|t| {
        t.enabled = true;
        t.tuning = true;
        t.filename = file.to_string_lossy().into_owned();
    });
    // Warm up on another shape: the handle exists, this signature is new.
    let warm = Gemm {
        m: N - 1,
        ldc: N,
        ..p.gemm()
    };
    s.blas.gemm(s.stream.handle(), &warm)?;
    let tuned_before = s.blas.tunable().results().len();
    let (graph, _) = s.capture(&p)?;
    assert_eq!(
        s.blas.tunable().results().len(),
        tuned_before,
        "tuned inside the capture"
    );
    s.replay(&graph, &p, "the replay")?;
    s.blas.gemm(s.stream.handle(), &p.gemm())?;
    s.expect(&p, "the eager GEMM")?;
    assert_eq!(
        s.blas.tunable().results().len(),
        tuned_before + 1,
        "the eager call tunes"
    );
    Ok(())
}
