//! The graph-memory planner for trees against the trees themselves: a decode loop of nine
//! batch sizes (buckets 1 to 256 rows, each call a random size inside one), every size
//! warmed up, then planned (`Trees::plan`) and recorded one step at a time; the pool
//! reserves exactly what the plan said after every recording. Half the sizes are planned
//! into an empty-looking pool (only warm-ups there), the other half after recordings and
//! replays have filled it, in a seeded random order; outputs are checked on every step.
use crate::{BoxError, Kernels, Setup, TestResult, expect, named, random};
use ferrocuda_graph::guards::CacheConfig;
use ferrocuda_graph::trees::{
    Arg, Buckets, Ctx, FunctionId, Input, Out, Served, TreeConfig, TreeError, WrapOptions, Wrapped,
};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;
use ferrocuda_types::DType;

/// Batch sizes pad up to these rows.
const BUCKETS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];
/// Elements of one row.
const H: usize = 2048;

/// One decode step over `x` (`rows` × [`H`]) and the static `w` (at least as long):
/// `6x + w` through a widened temporary, its intermediate results dropped as they die.
fn step(
    k: &Kernels,
    ctx: &Ctx<'_>,
    x: &Arg,
    w: &Arg,
) -> Result<Out, ferrocuda_graph::CallableError> {
    let n = x.numel();
    let rows = n / H;
    let a = k.scaled(ctx, x, 2.0)?;
    let wide = ctx.alloc(DType::F32, &[rows, 4 * H])?;
    k.scale(ctx.stream(), &wide, a.arg(), 1.0, n)?;
    let b = k.scaled(ctx, &a.as_arg(), 3.0)?;
    drop(a);
    drop(wide);
    let out = ctx.alloc(DType::F32, &[rows, H])?;
    k.add(ctx.stream(), &out, b.arg(), w.arg(), n)?;
    Ok(out)
}

/// Small seeded generator for the orders and sizes.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    fn shuffled(&mut self, mut v: Vec<usize>) -> Vec<usize> {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

struct Loop<'s> {
    s: &'s Setup<'s>,
    f: Wrapped,
    w: DeviceBuffer<f32>,
    w_host: Vec<f32>,
    rng: Rng,
    steps: u64,
}

impl Loop<'_> {
    /// One step of a random size inside bucket `b`: checks the output, returns how it
    /// was served.
    fn step(&mut self, b: usize) -> Result<Served, BoxError> {
        let lo = b.checked_sub(1).map_or(0, |p| BUCKETS[p]);
        let rows = lo + 1 + self.rng.below(BUCKETS[b] - lo);
        self.steps += 1;
        let v = random(rows * H, self.steps);
        let x = self.s.buffer(&v)?;
        self.f.trees().mark_step_begin();
        let call = self.f.call(&[
            Input::shaped(&x, &[rows, H])?,
            Input::buffer(&self.w).mark_static(),
        ])?;
        let mut want: Vec<f32> = (v.iter().zip(&self.w_host))
            .map(|(x, w)| (x * 2.0) * 3.0 + w)
            .collect();
        // Padding rows are zeros: 6 * 0 + w.
        want.extend_from_slice(&self.w_host[rows * H..BUCKETS[b] * H]);
        expect(
            &call.outputs[0],
            &want,
            &format!("{rows} rows in bucket {}", BUCKETS[b]),
        )?;
        Ok(call.served)
    }

    fn reserved(&self) -> Result<u64, BoxError> {
        let pool = self.f.trees().pool();
        Ok(self
            .s
            .allocators
            .device(crate::D0)?
            .pool_reserved_bytes(pool))
    }

    /// Warms up buckets `order` (one step each); their function ids.
    fn warm_up(&mut self, order: &[usize]) -> Result<Vec<FunctionId>, BoxError> {
        let mut ids = Vec::new();
        for &b in order {
            assert_eq!(self.step(b)?, Served::Warmup, "bucket {}", BUCKETS[b]);
            ids.push(self.f.functions()[0]);
        }
        Ok(ids)
    }

    /// Plans buckets `order` (warmed up as `ids`), records them one step each, and checks
    /// the pool after every recording against the plan.
    fn plan_and_record(&mut self, order: &[usize], ids: &[FunctionId]) -> TestResult {
        let trees = self.f.trees().clone();
        let before = (trees.stats(), self.reserved()?);
        let plan = trees.plan(ids)?;
        assert_eq!(
            (trees.stats(), self.reserved()?),
            before,
            "a plan changes nothing"
        );
        let mut real = Vec::new();
        for &b in order {
            assert_eq!(self.step(b)?, Served::Recorded, "bucket {}", BUCKETS[b]);
            real.push(self.reserved()?);
        }
        let sizes: Vec<usize> = order.iter().map(|&b| BUCKETS[b]).collect();
        assert_eq!(
            plan.reserved_after, real,
            "buckets {sizes:?}: planned against recorded ({} bytes before)",
            before.1
        );
        Ok(())
    }
}

fn decode_loop(h: &Harness, seed: u64) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![step(&k, ctx, &a[0], &a[1])?]),
        WrapOptions {
            buckets: Some(Buckets::new(&BUCKETS)?),
            // One static specialisation per size (`dynamic=False`, room for nine), so that
            // a size's warm-up and recording are one function id: with automatic dynamic
            // shapes the first size seen would warm up again in the dynamic entry.
            guards: CacheConfig {
                automatic_dynamic_shapes: false,
                recompile_limit: 16,
                ..CacheConfig::default()
            },
            ..named("decode")
        },
    );
    let w_host = random(BUCKETS[8] * H, 999);
    let mut l = Loop {
        w: s.buffer(&w_host)?,
        w_host,
        s: &s,
        f,
        rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
        steps: 0,
    };
    let all = l.rng.shuffled((0..BUCKETS.len()).collect());
    let (first, second) = all.split_at(4 + l.rng.below(2));
    // First half: warmed up, then planned in another order and recorded.
    let ids = l.warm_up(first)?;
    let order = l.rng.shuffled((0..first.len()).collect());
    let planned: Vec<usize> = order.iter().map(|&i| first[i]).collect();
    let planned_ids: Vec<FunctionId> = order.iter().map(|&i| ids[i]).collect();
    l.plan_and_record(&planned, &planned_ids)?;
    // Replays of the recorded sizes between the second half's warm-ups.
    let mut ids = Vec::new();
    for &b in second {
        for _ in 0..2 {
            let r = first[l.rng.below(first.len())];
            assert_eq!(l.step(r)?, Served::Replayed);
        }
        ids.extend(l.warm_up(&[b])?);
    }
    let order = l.rng.shuffled((0..second.len()).collect());
    let planned: Vec<usize> = order.iter().map(|&i| second[i]).collect();
    let planned_ids: Vec<FunctionId> = order.iter().map(|&i| ids[i]).collect();
    l.plan_and_record(&planned, &planned_ids)?;
    // Everything is recorded: a plan of every size adds nothing to the pool.
    let now = l.reserved()?;
    let every = trees.plan(&l.f.functions())?;
    assert!(
        every.reserved_after.iter().all(|&r| r == now),
        "{every:?} against {now}"
    );
    assert!(
        now >= 20 << 20,
        "the largest sizes take large segments: {now}"
    );
    for _ in 0..6 {
        let b = l.rng.below(BUCKETS.len());
        assert_eq!(l.step(b)?, Served::Replayed);
    }
    Ok(())
}

/// Nine batch sizes, three seeded orders: the plan equals the pool after every recording.
pub(crate) fn the_plan_equals_the_trees_pool_after_each_recording(h: &Harness) -> TestResult {
    for seed in 1..=3 {
        decode_loop(h, seed).map_err(|e| format!("seed {seed}: {e}"))?;
    }
    Ok(())
}

/// A function whose warm-up failed has no requests to plan from: `NotWarmedUp`, naming
/// it; an id the tree never gave is a configuration error. Once warmed up, it plans.
pub(crate) fn a_plan_without_a_warm_up_is_a_typed_error(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    let failing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let fail = failing.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            if fail.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("not today".into());
            }
            Ok(vec![k.scaled(ctx, &a[0], 2.0)?])
        },
        named("late"),
    );
    let x = s.buffer(&random(1024, 5))?;
    trees.mark_step_begin();
    assert!(f.call(&[Input::buffer(&x)]).is_err());
    let ids = f.functions();
    assert_eq!(ids.len(), 1, "the failed call's signature has its id");
    match trees.plan(&ids) {
        Err(TreeError::NotWarmedUp { function, name }) => {
            assert_eq!((function, name.as_str()), (ids[0].0, "late"));
        }
        other => return Err(format!("expected NotWarmedUp, got {other:?}").into()),
    }
    assert!(matches!(
        trees.plan(&[FunctionId(4096)]),
        Err(TreeError::Config(_))
    ));
    failing.store(false, std::sync::atomic::Ordering::Relaxed);
    trees.mark_step_begin();
    assert_eq!(f.call(&[Input::buffer(&x)])?.served, Served::Warmup);
    let plan = trees.plan(&ids)?;
    // One 2 MiB small segment: the warm-up's, where the copy and the output fit.
    assert_eq!(plan.reserved_after, [2 << 20]);
    trees.mark_step_begin();
    assert_eq!(f.call(&[Input::buffer(&x)])?.served, Served::Recorded);
    let pool = trees.pool();
    assert_eq!(
        s.allocators.device(crate::D0)?.pool_reserved_bytes(pool),
        2 << 20
    );
    Ok(())
}
