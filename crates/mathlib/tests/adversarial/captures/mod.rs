//! Adversarial scenarios: GEMM workspaces inside CUDA graph captures on the fake device.
//!
//! The rule under attack: `Blas::gemm` on a stream being captured into a graph binds a
//! workspace of its own for that call, allocated on the capture stream from the graph's
//! private pool and freed right after the call is recorded (a free block of that pool
//! afterwards), never the stream's eager workspace; TunableOp never tunes inside a capture
//! but uses what was tuned eagerly.
use super::*;
use ferrocuda_alloc::DeviceAllocators;
use ferrocuda_driver::cublas::{GemmCall, MathMode};
use ferrocuda_graph::{CudaGraph, PoolId};
use ferrocuda_mathlib::{BlasBackend, BlasLibrary, HandleId, LtCall, LtCandidate};
use ferrocuda_stream::{DeviceBuffer, Runtime, Stream};
use ferrocuda_testkit::{Harness, fake_harness, temp_dir};
use ferrocuda_types::CaptureMode;
use std::sync::Mutex;

type R<T = ()> = Result<T, Box<dyn std::error::Error>>;

// ---------------------------------------------------------------------------------------
// A recording backend: which workspace each GEMM ran with, and host synchronizations.
// ---------------------------------------------------------------------------------------

/// One GEMM as the backend ran it.
#[derive(Copy, Clone, Debug, PartialEq)]
struct Run {
    handle: u64,
    /// The cuBLASLt candidate's rank, or `None` for the classic call.
    lt: Option<usize>,
    /// The workspace bound to the handle (classic) or given to the call (cuBLASLt).
    ws: Option<(DevicePtr, u64)>,
}

#[derive(Debug, Default)]
struct Log {
    bound: HashMap<u64, (DevicePtr, u64)>,
    runs: Vec<Run>,
    syncs: usize,
    handles: usize,
    /// Every act, in order (for failure messages).
    acts: Vec<String>,
}

#[derive(Debug)]
struct Rec {
    inner: Arc<dyn BlasBackend>,
    log: Mutex<Log>,
}

impl Rec {
    fn take(&self) -> Vec<Run> {
        std::mem::take(&mut self.log.lock().unwrap().runs)
    }
    fn syncs(&self) -> usize {
        self.log.lock().unwrap().syncs
    }
}

impl BlasBackend for Rec {
    fn sm_major(&self, device: DeviceIndex) -> Result<u32, MathLibError> {
        self.inner.sm_major(device)
    }
    fn create_handle(&self, device: DeviceIndex) -> Result<HandleId, MathLibError> {
        let h = self.inner.create_handle(device)?;
        self.log.lock().unwrap().handles += 1;
        Ok(h)
    }
    fn destroy_handle(&self, handle: HandleId) {
        self.inner.destroy_handle(handle)
    }
    fn set_stream(&self, handle: HandleId, stream: StreamHandle) -> Result<(), MathLibError> {
        let r = self.inner.set_stream(handle, stream);
        self.log
            .lock()
            .unwrap()
            .acts
            .push(format!("set_stream({handle:?}, {stream:?}) = {r:?}"));
        r
    }
    fn set_math_mode(&self, handle: HandleId, mode: MathMode) -> Result<(), MathLibError> {
        self.inner.set_math_mode(handle, mode)
    }
    fn set_workspace(
        &self,
        handle: HandleId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), MathLibError> {
        let r = self.inner.set_workspace(handle, ptr, bytes);
        self.log.lock().unwrap().acts.push(format!(
            "set_workspace({handle:?}, {ptr:?}, {bytes}) = {r:?}"
        ));
        r?;
        self.log
            .lock()
            .unwrap()
            .bound
            .insert(handle.0, (ptr, bytes));
        Ok(())
    }
    fn gemm(&self, handle: HandleId, call: &GemmCall) -> Result<(), MathLibError> {
        let r = self.inner.gemm(handle, call);
        self.log
            .lock()
            .unwrap()
            .acts
            .push(format!("gemm({handle:?}) = {r:?}"));
        r?;
        let mut log = self.log.lock().unwrap();
        let ws = log.bound.get(&handle.0).copied();
        log.runs.push(Run {
            handle: handle.0,
            lt: None,
            ws,
        });
        Ok(())
    }
    fn lt_candidates(
        &self,
        handle: HandleId,
        call: &GemmCall,
        workspace: u64,
        reduction_mask: Option<u32>,
        max: usize,
    ) -> Result<Vec<LtCandidate>, MathLibError> {
        self.inner
            .lt_candidates(handle, call, workspace, reduction_mask, max)
    }
    fn lt_gemm(
        &self,
        handle: HandleId,
        lt: &LtCall<'_>,
        stream: StreamHandle,
    ) -> Result<(), MathLibError> {
        self.inner.lt_gemm(handle, lt, stream)?;
        self.log.lock().unwrap().runs.push(Run {
            handle: handle.0,
            lt: Some(lt.candidate.index),
            ws: Some(lt.workspace),
        });
        Ok(())
    }
    fn synchronize(&self, stream: StreamHandle) -> Result<(), MathLibError> {
        self.log.lock().unwrap().syncs += 1;
        self.inner.synchronize(stream)
    }
    fn lt_version(&self) -> String {
        self.inner.lt_version()
    }
}

// ---------------------------------------------------------------------------------------
// GEMMs with their operands on the device (as bytes of their element type)
// ---------------------------------------------------------------------------------------

/// What a GEMM looks like; the operands are made from it.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Spec {
    pub(crate) dtype: DType,
    pub(crate) transa: bool,
    pub(crate) transb: bool,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    /// 1: no batch.
    pub(crate) count: usize,
    /// Extra rows in every leading dimension.
    pub(crate) pad: usize,
    pub(crate) alpha: f64,
    pub(crate) beta: f64,
}

impl Spec {
    pub(crate) fn plain(dtype: DType, m: usize, n: usize, k: usize) -> Spec {
        Spec {
            dtype,
            transa: false,
            transb: false,
            m,
            n,
            k,
            count: 1,
            pad: 0,
            alpha: 1.0,
            beta: 0.0,
        }
    }
    /// (stored rows, columns) of A, B and C.
    fn shapes(&self) -> [(usize, usize); 3] {
        let a = if self.transa {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let b = if self.transb {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        [a, b, (self.m, self.n)]
    }
    fn lds(&self) -> [usize; 3] {
        self.shapes().map(|(rows, _)| rows + self.pad)
    }
    /// Elements of one matrix of each operand (with a little slack between batch members).
    fn strides(&self) -> [usize; 3] {
        let lds = self.lds();
        let shapes = self.shapes();
        [0, 1, 2].map(|i| lds[i] * shapes[i].1 + if self.count > 1 { 3 } else { 0 })
    }
    fn lens(&self) -> [usize; 3] {
        self.strides().map(|s| s * self.count)
    }
}

/// A GEMM, its operands (bytes of its dtype) and C's first value.
pub(crate) struct Op {
    pub(crate) spec: Spec,
    pub(crate) g: Gemm,
    /// Kept alive for the GEMM.
    _a: DeviceBuffer<u8>,
    /// Kept alive for the GEMM.
    _b: DeviceBuffer<u8>,
    c: DeviceBuffer<u8>,
    av: Vec<f64>,
    bv: Vec<f64>,
    c0: Vec<f64>,
}

impl Op {
    /// Operands of small integers (every product and sum exact in every precision).
    pub(crate) fn new(rt: &Arc<Runtime>, spec: Spec, rng: &mut Rng) -> R<Op> {
        let [la, lb, lc] = spec.lens();
        let mut small = |_| rng.below(5) as f64 - 2.0;
        let av: Vec<f64> = (0..la).map(&mut small).collect();
        let bv: Vec<f64> = (0..lb).map(&mut small).collect();
        let c0: Vec<f64> = (0..lc).map(&mut small).collect();
        let up = |v: &[f64]| DeviceBuffer::from_slice(rt, DEV, &encode(spec.dtype, v));
        let (a, b, c) = (up(&av)?, up(&bv)?, up(&c0)?);
        let [lda, ldb, ldc] = spec.lds();
        let [sa, sb, sc] = spec.strides();
        let g = Gemm {
            dtype: spec.dtype,
            transa: spec.transa,
            transb: spec.transb,
            m: spec.m,
            n: spec.n,
            k: spec.k,
            a: a.ptr(),
            lda,
            b: b.ptr(),
            ldb,
            c: c.ptr(),
            ldc,
            alpha: spec.alpha,
            beta: spec.beta,
            batch: (spec.count > 1).then_some(Batch {
                count: spec.count,
                strides: [sa as i64, sb as i64, sc as i64],
            }),
        };
        Ok(Op {
            spec,
            g,
            _a: a,
            _b: b,
            c,
            av,
            bv,
            c0,
        })
    }

    /// C as the CPU computes it from the first values (padding kept).
    fn expected(&self) -> Vec<f64> {
        let s = &self.spec;
        let [lda, ldb, ldc] = s.lds();
        let [sa, sb, sc] = s.strides();
        let mut out = self.c0.clone();
        for batch in 0..s.count {
            for col in 0..s.n {
                for row in 0..s.m {
                    let mut dot = 0.0;
                    for x in 0..s.k {
                        let av = if s.transa {
                            self.av[batch * sa + row * lda + x]
                        } else {
                            self.av[batch * sa + x * lda + row]
                        };
                        let bv = if s.transb {
                            self.bv[batch * sb + x * ldb + col]
                        } else {
                            self.bv[batch * sb + col * ldb + x]
                        };
                        dot += av * bv;
                    }
                    let i = batch * sc + col * ldc + row;
                    let old = if s.beta == 0.0 { 0.0 } else { self.c0[i] };
                    out[i] = s.alpha * dot + s.beta * old;
                }
            }
        }
        out
    }

    /// C back to its first value (in the current stream's order).
    pub(crate) fn reset(&self) -> R {
        self.c.copy_from_host(&encode(self.spec.dtype, &self.c0))?;
        Ok(())
    }

    pub(crate) fn c_bytes(&self) -> R<Vec<u8>> {
        Ok(self.c.to_host()?)
    }

    /// C equals the CPU's result, element for element (exact: small integers).
    pub(crate) fn check(&self, what: &str) -> R {
        let got = decode(self.spec.dtype, &self.c_bytes()?);
        let want = self.expected();
        match got.iter().zip(&want).position(|(g, w)| g != w) {
            None => Ok(()),
            Some(i) => Err(format!(
                "{what}: {:?} C[{i}] = {}, expected {} ({:?})",
                self.spec.dtype, got[i], want[i], self.spec
            )
            .into()),
        }
    }

    pub(crate) fn c_is_first_value(&self, what: &str) -> R {
        let got = decode(self.spec.dtype, &self.c_bytes()?);
        if got != self.c0 {
            return Err(format!("{what}: C changed").into());
        }
        Ok(())
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

// ---------------------------------------------------------------------------------------
// The rig: installed allocators, a recording Blas over them, a capture stream.
// ---------------------------------------------------------------------------------------

struct Rig {
    h: Harness,
    allocators: Arc<DeviceAllocators>,
    rec: Arc<Rec>,
    blas: Blas,
    stream: Stream,
}

impl Rig {
    fn new() -> R<Rig> {
        let h = fake_harness();
        let allocators = DeviceAllocators::new(
            h.rt.driver().clone(),
            AllocatorConfig::default(),
            Caching::On,
        );
        allocators.install(&h.rt);
        let fake = h.fake.clone().expect("the fake harness");
        let rec = Arc::new(Rec {
            inner: Arc::new(FakeBlas::new(fake, 9)),
            log: Mutex::default(),
        });
        let blas = Blas::new(rec.clone(), (allocators.clone(), DEV))?;
        let stream = h.rt.new_stream(DEV, 0)?;
        h.rt.set_stream(&stream)?;
        Ok(Rig {
            h,
            allocators,
            rec,
            blas,
            stream,
        })
    }

    fn rt(&self) -> &Arc<Runtime> {
        &self.h.rt
    }

    fn op(&self, spec: Spec, seed: u64) -> R<Op> {
        Op::new(self.rt(), spec, &mut Rng(seed | 1))
    }

    fn square(&self, seed: u64) -> R<Op> {
        self.op(Spec::plain(DType::F32, 48, 48, 48), seed)
    }

    fn alloc(&self) -> &CachingAllocator {
        self.allocators.device(DEV).unwrap()
    }

    fn reserved(&self) -> i64 {
        self.alloc().stats().reserved_bytes.all.current
    }

    fn sync(&self) -> R {
        self.stream.synchronize()?;
        Ok(())
    }

    /// An eager GEMM of `op` on `stream`, checked.
    fn eager(&self, stream: &Stream, op: &Op) -> R {
        op.reset()?;
        self.sync()?;
        self.blas.gemm(stream.handle(), &op.g)?;
        stream.synchronize()?;
        op.check("the eager GEMM")
    }

    /// A graph of what `body` enqueues on `stream`, captured into a new pool or `pool`.
    /// The capture ends even when `body` fails.
    fn capture(
        &self,
        stream: &Stream,
        pool: Option<PoolId>,
        mode: CaptureMode,
        body: impl FnOnce() -> R,
    ) -> R<CudaGraph> {
        let g = CudaGraph::new(self.rt().clone(), self.allocators.clone(), DEV)?;
        g.capture_begin(stream, pool, mode)?;
        let r = body();
        let end = g.capture_end();
        r?;
        end?;
        Ok(g)
    }

    /// A graph of one GEMM on the rig's stream, and the runs it recorded.
    fn capture_gemms(&self, ops: &[&Op]) -> R<(CudaGraph, Vec<Run>)> {
        self.rec.take();
        let g = self.capture(&self.stream, None, CaptureMode::Global, || {
            for op in ops {
                self.blas.gemm(self.stream.handle(), &op.g)?;
            }
            Ok(())
        })?;
        Ok((g, self.rec.take()))
    }

    /// Resets C of each op, replays `g` on `stream` and checks every C.
    fn replay(&self, g: &CudaGraph, stream: &Stream, ops: &[&Op], what: &str) -> R {
        for op in ops {
            op.reset()?;
        }
        self.sync()?;
        g.replay(stream)?;
        stream.synchronize()?;
        for op in ops {
            op.check(what)?;
        }
        Ok(())
    }

    fn blocks(&self, pool: PoolId) -> Vec<ferrocuda_alloc::BlockInfo> {
        self.alloc().pool_blocks(pool)
    }

    /// The block of `pool` starting at `ptr`, if any.
    fn block_at(&self, pool: PoolId, ptr: DevicePtr) -> Option<ferrocuda_alloc::BlockInfo> {
        self.blocks(pool).into_iter().find(|b| b.ptr == ptr)
    }

    /// The workspace each recorded run had (one run expected per GEMM).
    fn workspaces(runs: &[Run]) -> R<Vec<(DevicePtr, u64)>> {
        runs.iter()
            .map(|r| {
                r.ws.ok_or_else(|| format!("a GEMM ran with no workspace: {r:?}").into())
            })
            .collect()
    }

    /// The eager workspace of the rig's stream, as the last eager GEMM on it saw it.
    fn eager_workspace(&self, op: &Op) -> R<(DevicePtr, u64)> {
        self.rec.take();
        self.eager(&self.stream, op)?;
        let runs = self.rec.take();
        Ok(Rig::workspaces(&runs)?[0])
    }
}

/// Asserts that the capture's workspace is a free block of the graph's pool, of at least
/// `bytes`, allocated on `stream`.
fn assert_capture_workspace(
    rig: &Rig,
    g: &CudaGraph,
    ws: (DevicePtr, u64),
    stream: &Stream,
    bytes: u64,
    what: &str,
) {
    let pool = g.pool().expect("a pool");
    let block = rig.block_at(pool, ws.0);
    let Some(block) = block else {
        panic!(
            "{what}: the workspace {:?} is no block of the graph's pool {pool:?}: {:?}",
            ws.0,
            rig.blocks(pool)
        )
    };
    assert!(
        !block.allocated,
        "{what}: the capture's workspace is still allocated after the call: {block:?}"
    );
    assert!(
        block.size >= bytes,
        "{what}: workspace block {block:?} smaller than {bytes}"
    );
    assert_eq!(
        block.stream,
        stream.handle(),
        "{what}: the workspace was not allocated on the capture stream"
    );
}

mod memory;
mod placement;
mod programs;
