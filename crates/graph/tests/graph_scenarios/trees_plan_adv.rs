//! Adversarial tests of `Trees::plan` and `plan_pool_from` on the fake device, from their
//! contract: seeded programs of two wrapped functions sharing a tree (inputs of several
//! dtypes, zero-sized and scalar ones, a static one, buckets, temporaries and outputs on
//! both sides of 1 MiB and 10 MiB, allocator configurations changed at run time, one or
//! two warm-ups, every input feed), each recording planned before it and compared with the
//! pool after it, and a twin that never plans; skips, repeats, typed errors; failing and
//! panicking calls; evictions; roots recorded in the middle of a step; `plan_pool_from`
//! against a real pool with live blocks, and malformed layouts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use ferrocuda_alloc::PlannedRequest as Req;
use ferrocuda_alloc::{AfterCapture, Caching, CachingAllocator, CaptureRequests, DeviceAllocators};
use ferrocuda_alloc::{PlanError, PoolPlan, Route, plan_pool, plan_pool_from};
use ferrocuda_driver::{Driver, FakeDriver, fake::Completion};
use ferrocuda_graph::trees::Served::{self, Eager, Recorded, Replayed, Warmup};
use ferrocuda_graph::trees::{Arg, Buckets, Call, Ctx, FunctionId, Input, InputFeed, Out};
use ferrocuda_graph::trees::{RunKind, TreeConfig, TreeError, TreeFn, TreeTensor, Trees};
use ferrocuda_graph::{CallableError, trees::WrapOptions, trees::Wrapped};
use ferrocuda_stream::{DeviceBuffer, Function, KernelCache, Module, Runtime};
use ferrocuda_testkit::{KERNELS, register_fake_kernels};
use ferrocuda_types::{AllocatorConfig, DType, DeviceIndex, DevicePtr, KernelArg, LaunchConfig};
use ferrocuda_types::{PoolId, StreamFlags, StreamHandle};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::{panic::AssertUnwindSafe, sync::Arc};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TestResult = Result<(), BoxError>;
type Res<T> = Result<T, BoxError>;
type Planned = Result<PoolPlan, TreeError>;
const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;
const CONFIGS: [&str; 7] = [
    "",
    "max_split_size_mb:40",
    "roundup_power2_divisions:4",
    "expandable_segments:True",
    "garbage_collection_threshold:0.6",
    "large_segment_size_mb:64",
    "max_split_size_mb:24,roundup_power2_divisions:[256:4,>:1]",
];
/// Bytes: both sides of 1 MiB (small/large), of 10 MiB (20 MiB segments), a few more.
const FIXED: [u64; 12] = [
    0, 512, 1_048_064, 1_048_576, 1_049_088, 2_097_152, 10_485_248, 10_485_760, 10_486_272,
    20_971_520, 22_020_429, 49_283_072,
];
const PER_ROW: [u64; 6] = [0, 0, 1000, 65_536, 300_000, MIB];
const DTYPES: [DType; 5] = [DType::U8, DType::F16, DType::F64, DType::Bool, DType::I64];
/// Columns of a scalar input.
const SCALAR: usize = usize::MAX;

fn sorted(v: impl IntoIterator<Item = u64>) -> Vec<u64> {
    let mut v: Vec<u64> = v.into_iter().collect();
    v.sort_unstable();
    v
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len())]
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

struct Env {
    rt: Arc<Runtime>,
    fake: Arc<FakeDriver>,
    allocators: Arc<DeviceAllocators>,
    fill: Function,
}

impl Env {
    fn new(config: &str) -> Result<Env, BoxError> {
        let fake = Arc::new(FakeDriver::builder().completion(Completion::Eager).build());
        register_fake_kernels(&fake);
        let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
        let config = AllocatorConfig::parse(config)?;
        let allocators = DeviceAllocators::new(fake.clone(), config, Caching::On);
        allocators.install(&rt);
        let fill = Module::from_cuda_source(&rt, D0, "plan_adv", KERNELS)?.function("fill_f32")?;
        Ok(Env {
            rt,
            fake,
            allocators,
            fill,
        })
    }
    fn alloc(&self) -> &CachingAllocator {
        self.allocators.device(D0).unwrap()
    }
    fn trees(&self, warmup_runs: u32, input_feed: InputFeed) -> Arc<Trees> {
        let mut config = TreeConfig::default();
        (config.warmup_runs, config.input_feed) = (warmup_runs, input_feed);
        Trees::new(self.rt.clone(), self.allocators.clone(), D0, config).unwrap()
    }
    fn reserved(&self, t: &Trees) -> u64 {
        self.alloc().pool_reserved_bytes(t.pool())
    }
    /// The pool's segments in address order, each as its blocks (bytes, live).
    fn layout(&self, pool: PoolId) -> Vec<Vec<(u64, bool)>> {
        let blocks = |s: ferrocuda_types::SegmentCheckpoint| {
            s.blocks.iter().map(|b| (b.size, b.allocated)).collect()
        };
        self.alloc()
            .pool_layout(pool)
            .into_iter()
            .map(blocks)
            .collect()
    }
}

/// Each segment's bytes, in address order.
fn segments(alloc: &CachingAllocator, pool: PoolId) -> Vec<u64> {
    let layout = alloc.pool_layout(pool);
    layout
        .iter()
        .map(|s| s.blocks.iter().map(|b| b.size).sum())
        .collect()
}

/// One allocation: `.0 + .1 * rows` bytes of `.2`, an output (`.3: None`) or a temporary
/// dropped after `.3` more allocations.
#[derive(Clone, Copy, Debug)]
struct Op(u64, u64, DType, Option<usize>);

fn op(fixed: u64, per_row: u64, life: Option<usize>) -> Op {
    Op(fixed, per_row, DType::U8, life)
}

/// Non-static inputs (dtype, columns or [`SCALAR`]), a static input or not, allocations,
/// buckets.
#[derive(Clone, Debug)]
struct Spec(Vec<(DType, usize)>, bool, Vec<Op>, Option<Vec<usize>>);

fn spec(ops: Vec<Op>) -> Spec {
    Spec(vec![(DType::F64, 256), (DType::U8, 0)], true, ops, None)
}

fn random_spec(r: &mut Rng) -> Spec {
    let mut inputs = Vec::new();
    for _ in 0..1 + r.below(3) {
        inputs.push((
            r.pick(&[DType::U8, DType::F64]),
            r.pick(&[0, 1, 7, 256, 3000, SCALAR]),
        ));
    }
    // Half the functions allocate little beside their input copies (up to 2 MiB, and
    // 64 KiB a row): their recordings grow the pool.
    let light = r.chance(50);
    let (fixed, per_row) = if light {
        (&FIXED[..6], &PER_ROW[..4])
    } else {
        (&FIXED[..], &PER_ROW[..])
    };
    let mut ops = Vec::new();
    for _ in 0..2 + r.below(6) {
        let life = (!r.chance(35)).then(|| r.below(3));
        ops.push(Op(r.pick(fixed), r.pick(per_row), r.pick(&DTYPES), life));
    }
    Spec(
        inputs,
        r.chance(50),
        ops,
        r.chance(40).then(|| vec![2, 8, 24, 48]),
    )
}

/// The function of `ops`, sized by the leading dimension of its first input (padded to
/// its bucket: one signature, one sequence of requests). `fail`: 1 fails half-way in any
/// run, 2 panics half-way in a recording, 3 declares an incompatible op.
fn workload(fill: Function, ops: Vec<Op>, fail: Arc<AtomicU32>) -> impl TreeFn {
    move |ctx: &mut Ctx<'_>, args: &[Arg]| -> Result<Vec<Out>, CallableError> {
        let rows = args[0].shape().dims().first().copied().unwrap_or(1) as u64;
        let (mut temps, mut outs): (Vec<(Out, usize)>, _) = (Vec::new(), Vec::new());
        for (i, &Op(fixed, per_row, dtype, life)) in ops.iter().enumerate() {
            let numel = (fixed + per_row * rows).div_ceil(dtype.size() as u64);
            let out = ctx.alloc(dtype, &[numel as usize])?;
            let mode = fail.load(Relaxed);
            if i == ops.len() / 2 && (mode == 1 || (mode == 2 && ctx.kind() == RunKind::Record)) {
                assert_ne!(mode, 2, "a recording panics on purpose");
                return Err("failing on purpose".into());
            }
            if mode == 3 {
                ctx.incompatible_op("aten::item");
            }
            let n = (numel * dtype.size() as u64 / 4).min(64) as u32;
            if n > 0 {
                let (v, cfg) = (rows as f32, LaunchConfig::for_elements(n as usize, 64));
                let kargs = [out.arg(), KernelArg::value(&v), KernelArg::value(&n)];
                ctx.stream().launch(&fill, &cfg, &kargs)?;
            }
            temps.iter_mut().for_each(|t| t.1 -= 1);
            temps.retain(|t| t.1 > 0);
            match life {
                None => outs.push(out),
                Some(0) => drop(out),
                Some(l) => temps.push((out, l)),
            }
        }
        Ok(outs)
    }
}

enum Buf {
    U8(DeviceBuffer<u8>),
    F64(DeviceBuffer<f64>),
}

struct Fun {
    w: Wrapped,
    spec: Spec,
    bufs: Vec<Buf>,
    stat: DeviceBuffer<f32>,
    fail: Arc<AtomicU32>,
}

impl Fun {
    /// `spec` wrapped in `trees` as `name`, with at most `cap` shapes.
    fn new(env: &Env, t: &Arc<Trees>, spec: Spec, name: &str, cap: Option<usize>) -> Res<Fun> {
        let fail = Arc::new(AtomicU32::new(0));
        let mut o = WrapOptions::default();
        (o.name, o.max_recorded_shapes) = (name.into(), cap);
        o.buckets = spec.3.as_deref().map(Buckets::new).transpose()?;
        // One static specialisation per shape (`dynamic=False`).
        (o.guards.automatic_dynamic_shapes, o.guards.recompile_limit) = (false, 64);
        let w = t.wrap(workload(env.fill.clone(), spec.2.clone(), fail.clone()), o);
        let mut bufs = Vec::new();
        for &(dtype, cols) in &spec.0 {
            let n = if cols == SCALAR { 1 } else { 48 * cols };
            bufs.push(match dtype {
                DType::U8 => Buf::U8(DeviceBuffer::filled(&env.rt, D0, n, 3)?),
                _ => Buf::F64(DeviceBuffer::filled(&env.rt, D0, n, 1.5)?),
            });
        }
        let stat = DeviceBuffer::filled(&env.rt, D0, 1000, 1.0f32)?;
        Ok(Fun {
            w,
            spec,
            bufs,
            stat,
            fail,
        })
    }

    fn call(&self, rows: usize) -> Result<Call, TreeError> {
        let mut inputs = Vec::new();
        for (b, &(_, cols)) in self.bufs.iter().zip(&self.spec.0) {
            let dims: &[usize] = if cols == SCALAR { &[] } else { &[rows, cols] };
            inputs.push(match b {
                Buf::U8(x) => Input::shaped(x, dims)?,
                Buf::F64(x) => Input::shaped(x, dims)?,
            });
        }
        if self.spec.1 {
            inputs.push(Input::buffer(&self.stat).mark_static());
        }
        self.w.call(&inputs)
    }

    /// What tells its signatures apart: the padded leading dimension, if any input has one.
    fn key(&self, rows: usize) -> usize {
        let bucket = |b: &Vec<usize>| *b.iter().find(|&&s| s >= rows).unwrap();
        let scalars = self.spec.0.iter().all(|i| i.1 == SCALAR);
        let key = self.spec.3.as_ref().map_or(rows, bucket);
        key * usize::from(!scalars)
    }

    fn id(&self) -> FunctionId {
        self.w.functions()[0]
    }
}

fn step(trees: &Trees, f: &Fun, rows: usize) -> Result<Served, TreeError> {
    trees.mark_step_begin();
    f.call(rows).map(|c| c.served)
}

/// `t.plan(fids)`, checking that it changes nothing (statistics, events, the pool's
/// layout, the functions' ids) and that its totals agree.
fn plan_checked(env: &Env, t: &Trees, fs: &[&Fun], ids: &[FunctionId]) -> Planned {
    let _ = t.take_events();
    let state = || {
        let fids: Vec<_> = fs.iter().map(|f| f.w.functions()).collect();
        (t.stats(), env.layout(t.pool()), fids)
    };
    let before = state();
    let plan = t.plan(ids);
    assert_eq!(before, state(), "planning {ids:?} changed the tree");
    assert!(t.take_events().is_empty(), "planning reported events");
    if let Ok(p) = &plan {
        assert_eq!(p.reserved_after.len(), ids.len());
        let last = p.reserved_after.last().copied();
        assert_eq!(p.reserved_bytes, last.unwrap_or(env.reserved(t)));
    }
    plan
}

#[derive(Clone, Copy, Debug, Default)]
struct KeyState {
    fid: Option<FunctionId>,
    warmups: u32,
    root: bool,
}

/// Per step: how its calls were served, then the pool's layout.
type Trace = Vec<(Vec<Served>, Vec<Vec<(u64, bool)>>)>;

/// A seeded program over two functions sharing one tree, planning (if `plans`) before
/// every call that records a root.
struct Program<'e> {
    env: &'e Env,
    trees: Arc<Trees>,
    funs: Vec<Fun>,
    runs: u32,
    /// Sizes, ascending, and the one the program is at.
    rows: Vec<usize>,
    at: usize,
    rng: Rng,
    plans: bool,
    keys: BTreeMap<(usize, usize), KeyState>,
    held: Vec<TreeTensor>,
    trace: Trace,
    /// Recordings planned, and those among them that grew the pool.
    checked: (usize, usize),
}

impl Program<'_> {
    /// One call of `f` at `rows` (`first` of its step), checked against a plan taken right
    /// before it and against `expect`, a figure of an earlier plan of several recordings.
    fn call(&mut self, f: usize, rows: usize, first: bool, expect: Option<u64>) -> TestResult {
        let key = (f, self.funs[f].key(rows));
        let k = self.keys.get(&key).copied().unwrap_or_default();
        let want = match () {
            // Later calls of a step warm up while outputs of the step live.
            _ if !first && !self.held.is_empty() => Warmup,
            _ if k.root => Replayed,
            _ if k.warmups >= self.runs => Recorded,
            _ => Warmup,
        };
        let plan = match k.fid {
            Some(fid) if self.plans && want != Warmup => {
                let funs: Vec<&Fun> = self.funs.iter().collect();
                Some(plan_checked(self.env, &self.trees, &funs, &[fid])?)
            }
            _ => None,
        };
        let before = self.env.reserved(&self.trees);
        let call = self.funs[f].call(rows)?;
        let now = self.env.reserved(&self.trees);
        let what = format!("{key:?}: {rows} rows, {k:?}, {:?}", self.funs[f].spec);
        assert_eq!(call.served, want, "{what}");
        let entry = self.keys.entry(key).or_default();
        match (&want, &plan) {
            (Warmup, _) => {
                let fid = self.funs[f].id();
                assert!(entry.fid.is_none_or(|old| old == fid), "{what}: a new id");
                (entry.fid, entry.warmups) = (Some(fid), entry.warmups + 1);
            }
            (Recorded, Some(p)) => {
                assert_eq!(p.reserved_after[0], now, "{what}: planned vs recorded");
                let real = segments(self.env.alloc(), self.trees.pool());
                assert_eq!(sorted(p.segments.clone()), sorted(real), "{what}: segments");
                self.checked.0 += 1;
                self.checked.1 += usize::from(now > before);
            }
            (Replayed, p) => {
                assert_eq!(now, before, "{what}: a replay grew the pool");
                let p = p.as_ref().map(|p| p.reserved_after[0]);
                assert!(p.is_none_or(|p| p == now), "{what}: {p:?} planned, {now}");
            }
            _ => {}
        }
        entry.root |= want == Recorded;
        assert!(
            expect.is_none_or(|e| e == now),
            "{what}: {expect:?} planned, {now}"
        );
        if first {
            self.held = call.outputs;
            self.trace.push((vec![call.served], Vec::new()));
        } else {
            self.held.extend(call.outputs);
            self.trace.last_mut().unwrap().0.push(call.served);
        }
        Ok(())
    }

    fn step(&mut self) -> TestResult {
        let r = self.rng.below(100);
        if r < 15 {
            // Every key warmed up and not recorded (one recorded and a repeat among
            // them) planned in a random order, then called one step each.
            let keys = self.keys.iter().filter(|(_, k)| k.warmups >= self.runs);
            let mut list: Vec<_> = keys.map(|(k, _)| *k).collect();
            for i in (1..list.len()).rev() {
                list.swap(i, self.rng.below(i + 1));
            }
            let root = list.iter().find(|k| self.keys[k].root).copied();
            list.retain(|k| !self.keys[k].root || Some(*k) == root);
            list.extend(list.first().copied());
            let fids: Vec<_> = list.iter().map(|k| self.keys[k].fid.unwrap()).collect();
            let funs: Vec<&Fun> = self.funs.iter().collect();
            let plan = self
                .plans
                .then(|| plan_checked(self.env, &self.trees, &funs, &fids));
            let plan = plan.transpose()?;
            for (i, &(f, padded)) in list.iter().enumerate() {
                let rows = *self
                    .rows
                    .iter()
                    .find(|&&r| self.funs[f].key(r) == padded)
                    .unwrap();
                self.trees.mark_step_begin();
                self.call(f, rows, true, plan.as_ref().map(|p| p.reserved_after[i]))?;
                self.trace.last_mut().unwrap().1 = self.env.layout(self.trees.pool());
            }
            return Ok(());
        }
        if r < 20 {
            self.env.alloc().empty_cache();
        } else if r < 25 {
            let _ = self.env.alloc().update_config(self.rng.pick(&CONFIGS));
        }
        // Sizes drift upwards (each new size warmed up then recorded grows the pool, its
        // input copies on top of its warm-up), with random jumps.
        let up = (self.rows.len() - 1).min(self.at + self.rng.below(3) / 2);
        self.at = if self.rng.chance(70) {
            up
        } else {
            self.rng.below(self.rows.len())
        };
        let (f, rows) = (self.rng.below(2), self.rows[self.at]);
        self.trees.mark_step_begin();
        self.call(f, rows, true, None)?;
        while self.trace.last().unwrap().0.last() == Some(&Warmup) && self.rng.chance(25) {
            let (f, rows) = (self.rng.below(2), self.rng.pick(&self.rows));
            self.call(f, rows, false, None)?;
        }
        self.trace.last_mut().unwrap().1 = self.env.layout(self.trees.pool());
        Ok(())
    }
}

/// Program `seed` over `steps` steps: its trace and how many recordings it planned.
fn run_program(seed: u64, plans: bool, steps: usize) -> Res<(Trace, (usize, usize))> {
    let config = CONFIGS[seed as usize % CONFIGS.len()];
    let env = Env::new(config)?;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let feed = rng.pick(&[InputFeed::Copy, InputFeed::Patch, InputFeed::default()]);
    let runs = rng.pick(&[1, 1, 2]);
    let trees = env.trees(runs, feed);
    let mut funs = Vec::new();
    for name in ["f0", "f1"] {
        funs.push(Fun::new(&env, &trees, random_spec(&mut rng), name, None)?);
    }
    let mut rows: Vec<_> = (0..5)
        .map(|_| rng.pick(&[0, 1, 2, 3, 5, 8, 13, 21, 34, 48]))
        .collect();
    rows.sort_unstable();
    let (keys, held, trace, checked) = (BTreeMap::new(), Vec::new(), Vec::new(), (0, 0));
    let env = &env;
    let mut p = Program {
        env,
        trees,
        funs,
        runs,
        rows,
        at: 0,
        rng,
        plans,
        keys,
        held,
        trace,
        checked,
    };
    for s in 0..steps {
        let e = |e: &dyn std::fmt::Debug| format!("seed {seed} ({config:?}), step {s}: {e:?}");
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| p.step()));
        r.map_err(|p| e(&p.downcast_ref::<String>()))?
            .map_err(|x| e(&x))?;
    }
    Ok((std::mem::take(&mut p.trace), p.checked))
}

/// 32 seeded programs of 40 steps (`PLAN_SEEDS` for more): before every call that
/// records a root, the plan of its function equals the pool after it (bytes, and segments
/// as a multiset); a plan of every pending recording, in a random order with a recorded
/// root and a repeat among them, equals the pool after each; recorded roots add nothing.
#[test]
fn random_programs_plan_every_recording_exactly() -> TestResult {
    let seeds: u64 = std::env::var("PLAN_SEEDS").map_or(32, |v| v.parse().unwrap());
    let (mut checked, mut grew) = (0, 0);
    for seed in 1..=seeds {
        let (n, g) = run_program(seed, true, 40)?.1;
        (checked, grew) = (checked + n, grew + g);
    }
    let seeds = seeds as usize;
    // Most recordings fit in segments that earlier warm-ups left: few grow the pool.
    assert!(
        checked >= 5 * seeds && grew * 8 >= seeds,
        "{checked}, {grew} grew"
    );
    Ok(())
}

/// Plans change nothing later either: the same programs without plans serve every call
/// alike and leave the pool in the same layout after every step (6 seeds).
#[test]
fn a_twin_that_never_plans_behaves_the_same() -> TestResult {
    for seed in [3, 8, 13, 19, 26, 30] {
        let with = run_program(seed, true, 30)?.0;
        let without = run_program(seed, false, 30)?.0;
        assert_eq!(with.len(), without.len(), "seed {seed}");
        for (i, (a, b)) in with.iter().zip(&without).enumerate() {
            assert_eq!(a, b, "seed {seed}, step {i}");
        }
    }
    Ok(())
}

fn tmp(bytes: u64) -> Op {
    op(bytes, 0, Some(0))
}

fn out(bytes: u64) -> Op {
    op(bytes, 0, None)
}

/// A function of `ops` over an f64 and an empty u8 input and a static one.
fn fun(env: &Env, t: &Arc<Trees>, name: &str, ops: &[Op]) -> Res<Fun> {
    Fun::new(env, t, spec(ops.to_vec()), name, None)
}

/// Skipped functions (a size outside `capture_sizes`, an incompatible op), repeats and
/// recorded roots add nothing wherever they stand; a function not warmed up and ids never
/// issued are typed errors.
#[test]
fn skips_repeats_and_typed_errors() -> TestResult {
    let env = Env::new("roundup_power2_divisions:4")?;
    let trees = env.trees(1, InputFeed::default());
    let f = fun(&env, &trees, "f", &[tmp(30 * MIB), op(4096, MIB, None)])?;
    let mut g = fun(&env, &trees, "g", &[tmp(70 * MIB), out(2 * MIB)])?;
    let o = WrapOptions {
        capture_sizes: Some(vec![vec![4, 4]]),
        ..WrapOptions::default()
    };
    g.w = trees.wrap(
        workload(env.fill.clone(), g.spec.2.clone(), g.fail.clone()),
        o,
    );
    let h = fun(&env, &trees, "h", &[tmp(90 * MIB), out(2 * MIB)])?;
    let e = fun(&env, &trees, "e", &[tmp(5 * MIB), out(2 * MIB)])?;
    h.fail.store(3, Relaxed);
    e.fail.store(1, Relaxed);
    let all = [&f, &g, &h, &e];
    let p = plan_checked(&env, &trees, &all, &[])?;
    assert_eq!((p.reserved_bytes, p.reserved_after.len()), (0, 0));
    assert_eq!(step(&trees, &f, 4)?, Warmup);
    assert!(matches!(step(&trees, &g, 8)?, Eager(_)));
    assert_eq!(step(&trees, &h, 4)?, Warmup);
    assert!(step(&trees, &e, 4).is_err());
    let (fi, gi, hi, ei) = (f.id(), g.id(), h.id(), e.id());
    let now = env.reserved(&trees);
    let p = plan_checked(&env, &trees, &all, &[gi, hi, fi, fi, gi, hi])?;
    let grown = p.reserved_after[2];
    assert_eq!(p.reserved_after, [now, now, grown, grown, grown, grown]);
    assert!(grown > now, "f's input copies take the first small segment");
    let r = plan_checked(&env, &trees, &all, &[fi, ei]);
    let Err(TreeError::NotWarmedUp { function, name }) = r else {
        panic!("{r:?}")
    };
    assert_eq!((function, &*name), (ei.0, "e"));
    let next = FunctionId([fi, gi, hi, ei].iter().map(|i| i.0).max().unwrap() + 1);
    for bad in [next, FunctionId(u32::MAX)] {
        let r = plan_checked(&env, &trees, &all, &[fi, bad]);
        assert!(matches!(r, Err(TreeError::Config(_))), "{bad:?}: {r:?}");
    }
    assert_eq!(
        (step(&trees, &f, 4)?, env.reserved(&trees)),
        (Recorded, grown)
    );
    assert!(matches!(step(&trees, &h, 4)?, Eager(_)));
    assert!(matches!(step(&trees, &g, 8)?, Eager(_)));
    let p = plan_checked(&env, &trees, &all, &[fi, gi, hi])?;
    assert_eq!(
        (p.reserved_after, env.reserved(&trees)),
        (vec![grown; 3], grown)
    );
    Ok(())
}

/// A warm-up that fails half-way, a recording that fails and one that panics leave the
/// pool grown but no block live, and plans taken after each are exact.
#[test]
fn failed_and_panicking_calls_then_exact_plans() -> TestResult {
    let env = Env::new("max_split_size_mb:40")?;
    let trees = env.trees(1, InputFeed::default());
    let ops = [
        op(3 * MIB, MIB, Some(1)),
        tmp(30 * MIB),
        op(512, 4096, None),
        out(11 * MIB),
    ];
    let f = fun(&env, &trees, "f", &ops)?;
    let g = fun(&env, &trees, "g", &[tmp(45 * MIB), out(MIB)])?;
    let no_live = |what: &str| {
        let layout = env.layout(trees.pool());
        assert!(layout.iter().flatten().all(|b| !b.1), "{what}: {layout:?}");
    };
    f.fail.store(1, Relaxed);
    assert!(step(&trees, &f, 8).is_err());
    no_live("a failed warm-up");
    let (fi, all) = (f.id(), [&f, &g]);
    let r = plan_checked(&env, &trees, &all, &[fi]);
    assert!(matches!(r, Err(TreeError::NotWarmedUp { .. })), "{r:?}");
    assert_eq!(step(&trees, &g, 3)?, Warmup);
    f.fail.store(0, Relaxed);
    assert_eq!(step(&trees, &f, 8)?, Warmup);
    let gi = g.id();
    let p = plan_checked(&env, &trees, &all, &[gi, fi])?;
    assert_eq!(
        (step(&trees, &g, 3)?, env.reserved(&trees)),
        (Recorded, p.reserved_after[0])
    );
    let recordings = trees.stats().recordings;
    for mode in [1, 2] {
        f.fail.store(mode, Relaxed);
        trees.mark_step_begin();
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| f.call(8)));
        assert!(
            matches!(r, Err(_) | Ok(Err(_))),
            "mode {mode}: the call went through"
        );
        no_live(&format!("a recording failing in mode {mode}"));
        assert_eq!(trees.stats().recordings, recordings);
    }
    f.fail.store(0, Relaxed);
    let p = plan_checked(&env, &trees, &all, &[fi, gi])?;
    assert_eq!(
        (step(&trees, &f, 8)?, env.reserved(&trees)),
        (Recorded, p.reserved_after[0])
    );
    assert_eq!(
        (step(&trees, &g, 3)?, env.reserved(&trees)),
        (Replayed, p.reserved_after[1])
    );
    Ok(())
}

/// Evictions (a cap of two shapes) between warm-ups, replays and recordings of another
/// function sharing the tree: plans taken after each eviction are exact.
#[test]
fn evictions_and_a_second_function() -> TestResult {
    let env = Env::new("")?;
    let trees = env.trees(1, InputFeed::Copy);
    let ops = vec![
        op(10 * MIB - 512, MIB, Some(1)),
        op(MIB + 512, 65_536, None),
        op(0, MIB / 2, Some(0)),
    ];
    let f = Fun::new(&env, &trees, spec(ops), "f", Some(2))?;
    let g = fun(&env, &trees, "g", &[tmp(21 * MIB), out(MIB)])?;
    let mut ids = BTreeMap::new();
    for (rows, served) in [(2, Warmup), (5, Warmup), (2, Recorded), (5, Recorded)] {
        assert_eq!(step(&trees, &f, rows)?, served, "{rows} rows");
        ids.insert(rows, f.id());
    }
    let (_, gi) = (step(&trees, &g, 3)?, g.id());
    for (new, evicted) in [(9, 2), (17, 5), (2, 9)] {
        assert_eq!(step(&trees, &f, new)?, Warmup, "{new} rows");
        assert_eq!(
            trees.stats().evictions as usize,
            ids.len() - 1,
            "{new} evicts"
        );
        assert!(
            !f.w.functions().contains(&ids[&evicted]),
            "{evicted} evicted"
        );
        ids.insert(new, f.id());
        let p = plan_checked(&env, &trees, &[&f, &g], &[f.id(), gi])?;
        assert_eq!(
            (step(&trees, &f, new)?, env.reserved(&trees)),
            (Recorded, p.reserved_after[0])
        );
        let want = if new == 9 { Recorded } else { Replayed };
        assert_eq!(
            (step(&trees, &g, 3)?, env.reserved(&trees)),
            (want, p.reserved_after[1])
        );
    }
    Ok(())
}

/// An evicted function's id is no longer any signature's (a call of its signature warms up
/// again under a new id): a plan of it is refused.
#[test]
fn an_evicted_id_is_not_planned() -> TestResult {
    let env = Env::new("")?;
    let trees = env.trees(1, InputFeed::default());
    let f = Fun::new(
        &env,
        &trees,
        spec(vec![op(0, 3 * MIB, Some(0)), out(MIB)]),
        "f",
        Some(1),
    )?;
    assert_eq!(step(&trees, &f, 9)?, Warmup);
    let old = f.id();
    assert_eq!(step(&trees, &f, 2)?, Warmup);
    assert!(!f.w.functions().contains(&old), "9 rows evicted");
    let plan = trees.plan(&[old]);
    assert_eq!(
        step(&trees, &f, 9)?,
        Warmup,
        "the evicted signature warms up again"
    );
    assert!(plan.is_err(), "planned {plan:?} for evicted {old:?}");
    Ok(())
}

/// A call in the middle of a step once every output of the step died ends the path and
/// records a root: planned exactly after a replay, a warm-up or a recording before it.
/// With two warm-up runs, a plan taken after the first (in the middle of a step, beside
/// another function's outputs) equals the pool once the second and the recording ran.
#[test]
fn roots_recorded_mid_step_and_plans_between_two_warm_ups() -> TestResult {
    for config in CONFIGS {
        let env = Env::new(config)?;
        let trees = env.trees(1, InputFeed::default());
        let a_ops = [tmp(25 * MIB), op(0, 7 * MIB, None)];
        let b_ops = [
            op(0, 5 * MIB, Some(1)),
            out(MIB - 512),
            op(9 * MIB, 600_000, None),
        ];
        let (a, b) = (
            fun(&env, &trees, "a", &a_ops)?,
            fun(&env, &trees, "b", &b_ops)?,
        );
        assert_eq!(
            (step(&trees, &a, 4)?, step(&trees, &a, 4)?),
            (Warmup, Recorded)
        );
        let mut ids = BTreeMap::new();
        for rows in [6, 7, 10] {
            assert_eq!(step(&trees, &b, rows)?, Warmup);
            ids.insert(rows, b.id());
        }
        for (a_rows, first, rows) in [(4, Replayed, 6), (9, Warmup, 7), (9, Recorded, 10)] {
            trees.mark_step_begin();
            assert_eq!(a.call(a_rows)?.served, first, "its outputs dropped at once");
            let p = plan_checked(&env, &trees, &[&a, &b], &[ids[&rows]])?;
            let got = (b.call(rows)?.served, env.reserved(&trees));
            assert_eq!(
                got,
                (Recorded, p.reserved_after[0]),
                "{config:?}: after {first:?}"
            );
        }
        let t2 = env.trees(2, InputFeed::default());
        let (a, b) = (fun(&env, &t2, "a", &a_ops)?, fun(&env, &t2, "b", &b_ops)?);
        for rows in [3, 11] {
            t2.mark_step_begin();
            let held = a.call(rows)?;
            assert_eq!(b.call(rows)?.served, Warmup);
            let p = plan_checked(&env, &t2, &[&a, &b], &[b.id()])?;
            drop(held);
            assert_eq!(
                (step(&t2, &b, rows)?, step(&t2, &b, rows)?),
                (Warmup, Recorded)
            );
            assert_eq!(
                env.reserved(&t2),
                p.reserved_after[0],
                "{config:?}, {rows} rows"
            );
        }
    }
    Ok(())
}

fn random_capture(rng: &mut Rng, streams: &[u64]) -> CaptureRequests {
    let (mut c, mut live) = (CaptureRequests::new(), Vec::new());
    for _ in 0..1 + rng.below(12) {
        let bytes = rng.pick(&FIXED).max(1) + rng.pick(&[0, 1, 4000]);
        match rng.below(10) {
            0..=5 => live.push(c.alloc(bytes, rng.pick(streams))),
            _ if live.is_empty() => {}
            6..=8 => c.free(live.swap_remove(rng.below(live.len()))),
            _ => c.free_at_end(live.swap_remove(rng.below(live.len()))),
        }
    }
    if rng.chance(30) {
        c.append(&random_capture(rng, streams));
    }
    c
}

/// A caching allocator of its own over the fake device, a private pool, two streams' keys.
fn real_pool(config: &str) -> Res<(Env, CachingAllocator, PoolId, [u64; 2])> {
    let (env, config) = (Env::new("")?, AllocatorConfig::parse(config)?);
    let alloc = CachingAllocator::new(env.fake.clone(), D0, config, Caching::On)?;
    let keys = [0, 1].map(|_| {
        env.fake
            .stream_create(D0, StreamFlags::default())
            .unwrap()
            .raw
    });
    let pool = PoolId::handle();
    alloc.retain_pool(pool);
    Ok((env, alloc, pool, keys))
}

/// Runs `c`'s requests in `pool` as a capture does; the blocks it leaves allocated.
fn run_capture(alloc: &CachingAllocator, pool: PoolId, c: &CaptureRequests) -> Res<Vec<DevicePtr>> {
    alloc.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let (mut blocks, mut at_end) = (BTreeMap::new(), Vec::new());
    for r in c.requests() {
        match *r {
            Req::Alloc {
                block,
                bytes,
                stream: raw,
            } => {
                blocks.insert(
                    block,
                    alloc.allocate(bytes, StreamHandle { device: D0, raw })?.ptr,
                );
            }
            Req::Free { block } => alloc.free(blocks.remove(&block).unwrap())?,
            Req::FreeAtEnd { block } => at_end.push(blocks.remove(&block).unwrap()),
        }
    }
    at_end.into_iter().try_for_each(|p| alloc.free(p))?;
    alloc.end_allocate_to_pool(pool)?;
    Ok(blocks.into_values().collect())
}

/// `plan_pool_from` against a real caching allocator: a private pool on two streams left
/// with live blocks by random requests, then random captures (appended ones among them)
/// replayed into it, outputs kept or freed (42 seeds over the configurations): the plan's
/// bytes after each capture and its segments equal the real pool's. Malformed layouts
/// (no blocks, a gap, a zero-sized block, an overlap, a repeated or reversed segment)
/// are `PlanError::Layout`; an empty start is `plan_pool`.
#[test]
fn plan_pool_from_matches_a_real_pool_with_live_blocks() -> TestResult {
    for seed in 0..42u64 {
        let (mut rng, (_env, alloc, pool, keys)) =
            (Rng(seed + 1000), real_pool(CONFIGS[seed as usize % 7])?);
        let mut start = CaptureRequests::new();
        for _ in 0..4 + rng.below(20) {
            start.alloc(
                rng.pick(&FIXED).max(700) + rng.pick(&[0, 3000]),
                rng.pick(&keys),
            );
        }
        (0..start.requests().len())
            .filter(|_| rng.chance(40))
            .for_each(|b| start.free(b));
        run_capture(&alloc, pool, &start)?;
        let (start, config) = (alloc.pool_layout(pool), alloc.config());
        let captures: Vec<_> = (0..1 + rng.below(4))
            .map(|_| random_capture(&mut rng, &keys))
            .collect();
        let after = rng.pick(&[AfterCapture::KeepOutputs, AfterCapture::FreeOutputs]);
        let plan = plan_pool_from(&config, &start, &captures, after)?;
        let mut real = Vec::new();
        for c in &captures {
            let left = run_capture(&alloc, pool, c)?;
            if after == AfterCapture::FreeOutputs {
                left.into_iter().try_for_each(|p| alloc.free(p))?;
            }
            real.push(alloc.pool_reserved_bytes(pool));
        }
        let planned = (
            &plan.reserved_after,
            sorted(plan.segments),
            plan.reserved_bytes,
        );
        let segments = sorted(segments(&alloc, pool));
        assert_eq!(
            planned,
            (&real, segments, *real.last().unwrap()),
            "seed {seed}: {after:?}"
        );
        let empty = plan_pool_from(&config, &[], &captures, after);
        assert_eq!(empty?, plan_pool(&config, &captures, after)?);
        let Some(i) = start.iter().position(|s| s.blocks.len() >= 2) else {
            continue;
        };
        let mut bad = vec![start.clone(); 5];
        bad[0][i].blocks.clear();
        bad[1][i].blocks[1].ptr = DevicePtr(start[i].blocks[1].ptr.0 + 512);
        bad[2][i].blocks[1].size = 0;
        bad[3][i].blocks[0].size += 512;
        bad[4].insert(i, start[i].clone());
        bad.extend((start.len() >= 2).then(|| start.iter().rev().cloned().collect()));
        for (n, s) in bad.iter().enumerate() {
            let r = plan_pool_from(&config, s, &captures, after);
            assert!(
                matches!(r, Err(PlanError::Layout(_))),
                "seed {seed}, malformed {n}: {r:?}"
            );
        }
    }
    Ok(())
}

/// `PoolPlan::segments` lists the segments in the order they were taken: two small
/// blocks (one 2 MiB segment), 12 MiB, the small ones freed, then 14 MiB. The real pool
/// takes 2, 12 then 14 MiB, and so does the plan (the merge frees a block record's slot
/// below the 12 MiB one, which the 14 MiB segment's first block takes).
#[test]
fn plan_segments_are_in_the_order_taken() -> TestResult {
    let (_env, alloc, pool, [key, _]) = real_pool("")?;
    let mut c = CaptureRequests::new();
    let (a, b) = (c.alloc(512, key), c.alloc(512, key));
    c.alloc(12 * MIB, key);
    c.free(a);
    c.free(b);
    c.alloc(14 * MIB, key);
    run_capture(&alloc, pool, &c)?;
    let real = segments(&alloc, pool);
    assert_eq!(real, [2 * MIB, 12 * MIB, 14 * MIB]);
    let plan = plan_pool(&alloc.config(), &[c], AfterCapture::KeepOutputs)?;
    assert_eq!(plan.segments, real);
    Ok(())
}

/// `pool_layout` of a private pool is a plan's start; the default pool's under expandable
/// segments (pages unmapped by `empty_cache` between two live blocks) has gaps, and
/// `plan_pool_from` refuses it as a layout, typed (private pools never expand).
#[test]
fn an_expandable_pools_layout_is_refused() -> TestResult {
    let (_env, alloc, _, [key, _]) = real_pool("expandable_segments:True")?;
    let s = StreamHandle {
        device: D0,
        raw: key,
    };
    let blocks: Vec<_> = (0..3)
        .map(|_| alloc.allocate(30 * MIB, s).unwrap().ptr)
        .collect();
    alloc.free(blocks[1])?;
    alloc.empty_cache();
    let layout = alloc.pool_layout(PoolId::DEFAULT);
    let plan = plan_pool_from(&alloc.config(), &layout, &[], AfterCapture::KeepOutputs);
    assert!(matches!(plan, Err(PlanError::Layout(_))), "{plan:?}");
    Ok(())
}
