//! Calls that cannot be graphed, and functions that fail.
use crate::{D0, N, Setup, TestResult, expect, named, random, served_kinds};
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_graph::trees::Trees;
use ferrocuda_graph::trees::{
    Arg, Ctx, Input, InputFeed, Served, SkipReason, TreeConfig, TreeError, TreeEvent, WrapOptions,
};
use ferrocuda_testkit::Harness;
use ferrocuda_types::AllocatorConfig;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// A function writing its input 0 (`x += 1`, then `y = 2 x`): with a non-static input the
/// write would be lost on the copy, so the call runs eagerly, reported once with PyTorch's
/// text, and the write lands; with the input static, the call is graphed and each replay
/// writes it. The same whether non-static inputs are copied or patched: a patched graph
/// would write the caller's buffer, but the call never reaches a graph.
pub(crate) fn mutating_a_copied_input_skips(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    for feed in [InputFeed::Copy, InputFeed::Patch, InputFeed::default()] {
        let config = TreeConfig {
            input_feed: feed,
            ..TreeConfig::default()
        };
        mutation_skips(&s, config).map_err(|e| format!("{feed:?}: {e}"))?;
    }
    Ok(())
}

fn mutation_skips(s: &Setup, config: TreeConfig) -> TestResult {
    let trees = s.trees(config)?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            k.add_one(ctx.stream(), a[0].arg(), a[0].numel())?;
            Ok(vec![k.scaled(ctx, &a[0], 2.0)?])
        },
        WrapOptions {
            mutated_inputs: vec![0],
            ..named("bump")
        },
    );
    let xv = random(N, 11);
    let x = s.buffer(&xv)?;
    let mut served = Vec::new();
    for round in 1..=3 {
        trees.mark_step_begin();
        let call = f.call(&[Input::buffer(&x)])?;
        let bumped: Vec<f32> = xv.iter().map(|v| v + round as f32).collect();
        expect(
            &call.outputs[0],
            &bumped.iter().map(|v| 2.0 * v).collect::<Vec<_>>(),
            "y",
        )?;
        assert_eq!(
            x.to_host()?,
            bumped,
            "the write reached the caller's buffer"
        );
        served.push(call.served);
    }
    let reason = SkipReason::MutatedInputs {
        count: 1,
        found_from: "bump: input 0".into(),
    };
    assert!(
        served.iter().all(|s| *s == Served::Eager(reason.clone())),
        "{served:?}"
    );
    assert_eq!(
        reason.to_string(),
        "skipping cudagraphs due to mutated inputs (1 instances). Found from : \n bump: input 0"
    );
    let skips: Vec<TreeEvent> = trees
        .take_events()
        .into_iter()
        .filter(|e| matches!(e, TreeEvent::Skipped(_)))
        .collect();
    assert_eq!(skips, [TreeEvent::Skipped(reason)], "reported once");
    assert_eq!(trees.nodes().len(), 0);
    // Static: graphed, and every replay applies the write.
    let y = s.buffer(&xv)?;
    let mut served = Vec::new();
    for round in 1..=4 {
        trees.mark_step_begin();
        let call = f.call(&[Input::buffer(&y).mark_static()])?;
        let bumped: Vec<f32> = xv.iter().map(|v| v + round as f32).collect();
        expect(
            &call.outputs[0],
            &bumped.iter().map(|v| 2.0 * v).collect::<Vec<_>>(),
            "static y",
        )?;
        served.push(call.served);
    }
    assert_eq!(
        served_kinds(&served),
        ["warmup", "recorded", "replayed", "replayed"]
    );
    // Recording does not run the function: the write happens once per call.
    let last: Vec<f32> = xv.iter().map(|v| v + 4.0).collect();
    assert_eq!(y.to_host()?, last);
    Ok(())
}

/// A function that fails (an error, or a panic) while warming up or recording leaves the
/// tree as it was: later calls warm up, record and replay, the pool holds no stray block,
/// and dropping the tree leaves nothing of the pool in use.
pub(crate) fn panic_or_error_leaves_the_tree_usable(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let pool = trees.pool();
    let k = s.k.clone();
    // 1: error, 2: panic, else succeed; the failure comes after allocating an output.
    let mode = Arc::new(AtomicU32::new(0));
    let m = mode.clone();
    // The function panics on purpose.
    #[allow(clippy::panic)]
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            let y = k.scaled(ctx, &a[0], 2.0)?;
            match m.load(Ordering::SeqCst) {
                1 => Err("the function failed".into()),
                2 => panic!("the function panicked"),
                _ => Ok(vec![y]),
            }
        },
        named("flaky"),
    );
    let xv = random(N, 4);
    let x = s.buffer(&xv)?;
    let twice: Vec<f32> = xv.iter().map(|v| 2.0 * v).collect();
    let mut served = Vec::new();
    // Fail in the warm-up, then in the recording (each with an error and with a panic).
    for _ in 0..2 {
        for failure in [1, 2] {
            trees.mark_step_begin();
            mode.store(failure, Ordering::SeqCst);
            let call = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                f.call(&[Input::buffer(&x)])
            }));
            match (failure, call) {
                (1, Ok(Err(TreeError::Function { function, message }))) => {
                    assert_eq!(
                        (function.as_str(), message.as_str()),
                        ("flaky", "the function failed")
                    );
                }
                (2, Err(_)) => {}
                (_, other) => {
                    return Err(format!(
                        "failure {failure}: {:?}",
                        other.map(|r| r.map(|c| c.served))
                    )
                    .into());
                }
            }
            assert_eq!(
                s.pool_state(pool)?.1,
                Vec::new(),
                "no stray block in the pool"
            );
            assert_eq!(s.pool_users(pool)?, Some(1 + trees.nodes().len() as u32));
        }
        mode.store(0, Ordering::SeqCst);
        trees.mark_step_begin();
        let call = f.call(&[Input::buffer(&x)])?;
        expect(&call.outputs[0], &twice, "after the failures")?;
        served.push(call.served);
    }
    trees.mark_step_begin();
    served.push(f.call(&[Input::buffer(&x)])?.served);
    assert_eq!(served_kinds(&served), ["warmup", "recorded", "replayed"]);
    let allocator = s.allocators.device(D0)?;
    assert!(allocator.check_invariants().is_ok());
    drop(f);
    drop(trees);
    assert_eq!(s.pool_users(pool)?, Some(0), "nothing holds the pool");
    assert_eq!(
        s.pool_state(pool)?.1,
        Vec::new(),
        "no block of the pool is allocated"
    );
    Ok(())
}

/// A function declaring an operation a graph cannot hold runs eagerly from then on, and
/// an allocator that does not cache (no private pools) graphs nothing; both say why with
/// PyTorch's texts.
pub(crate) fn incompatible_op_and_uncached_allocator_skip(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            ctx.incompatible_op("aten.nonzero.default");
            Ok(vec![k.scaled(ctx, &a[0], 2.0)?])
        },
        named("data_dependent"),
    );
    let xv = random(N, 8);
    let x = s.buffer(&xv)?;
    let twice: Vec<f32> = xv.iter().map(|v| 2.0 * v).collect();
    let mut served = Vec::new();
    for _ in 0..3 {
        trees.mark_step_begin();
        let call = f.call(&[Input::buffer(&x)])?;
        expect(&call.outputs[0], &twice, "2x")?;
        served.push(call.served);
    }
    assert_eq!(served_kinds(&served), ["warmup", "eager", "eager"]);
    assert_eq!(
        served[1].clone(),
        Served::Eager(SkipReason::IncompatibleOp {
            op: "aten.nonzero.default".into()
        })
    );
    assert_eq!(
        SkipReason::IncompatibleOp {
            op: "aten.nonzero.default".into()
        }
        .to_string(),
        "skipping cudagraphs due to incompatible op aten.nonzero.default"
    );
    assert!(trees.nodes().is_empty());
    let uncached = DeviceAllocators::new(
        h.rt.driver().clone(),
        AllocatorConfig::default(),
        Caching::Off,
    );
    let trees = Trees::new(h.rt.clone(), uncached, D0, TreeConfig::default())?;
    let k = s.k.clone();
    let g = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 2.0)?]),
        named("g"),
    );
    let call = g.call(&[Input::buffer(&x)])?;
    expect(&call.outputs[0], &twice, "uncached 2x")?;
    assert_eq!(call.served, Served::Eager(SkipReason::UncachedAllocator));
    assert_eq!(
        SkipReason::UncachedAllocator.to_string(),
        "skipping cudagraphs due to cudagraph capture requires the caching allocator; current allocator is uncached"
    );
    Ok(())
}

/// A shape larger than its buffer is a typed error before anything runs, even one whose
/// element count overflows (it would have read past the buffer, or overflowed a product).
pub(crate) fn a_shape_past_its_buffer_is_refused(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 2.0)?]),
        named("f"),
    );
    let x = s.buffer(&random(N, 1))?;
    for dims in [
        vec![N + 1],
        vec![usize::MAX, 2],
        vec![1 << 40, 1 << 40, 1 << 40],
    ] {
        match f.call(&[Input::shaped(&x, &dims)?]) {
            Err(TreeError::InputTooSmall { index: 0, .. }) => {}
            other => return Err(format!("{dims:?}: {other:?}").into()),
        }
    }
    assert!(trees.nodes().is_empty(), "nothing was recorded");
    trees.mark_step_begin();
    let call = f.call(&[Input::shaped(&x, &[N])?])?;
    expect(
        &call.outputs[0],
        &random(N, 1).iter().map(|v| 2.0 * v).collect::<Vec<_>>(),
        "2x",
    )?;
    Ok(())
}

/// A function that writes an output of another function's warm-up (`g`: `y += 1`, then
/// `z = 3 y`, after `y = f(x) = 2 x` in the same step). Warm-up outputs are tree-managed
/// as recorded ones are (PyTorch's mutation check, `_get_cuda_graph_recorded_tensor_checker`,
/// asks the current node whether it is a `CUDAGraphNode` or a `CUDAWarmupNode`), so `g`
/// warms up, records and replays like `f`, writing `y` in place: no "mutated inputs" skip.
pub(crate) fn mutating_a_warmup_output_is_graphed(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let (kf, kg) = (s.k.clone(), s.k.clone());
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![kf.scaled(ctx, &a[0], 2.0)?]),
        named("f"),
    );
    let g = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            kg.add_one(ctx.stream(), a[0].arg(), a[0].numel())?;
            Ok(vec![kg.scaled(ctx, &a[0], 3.0)?])
        },
        WrapOptions {
            mutated_inputs: vec![0],
            ..named("g")
        },
    );
    let mut served = Vec::new();
    for step in 0..4 {
        trees.mark_step_begin();
        let xv = random(N, 30 + step);
        let x = s.buffer(&xv)?;
        let y = f.call(&[Input::buffer(&x)])?;
        let z = g.call(&[Input::output(&y.outputs[0])])?;
        let bumped: Vec<f32> = xv.iter().map(|v| 2.0 * v + 1.0).collect();
        expect(&y.outputs[0], &bumped, "y, written by g")?;
        expect(
            &z.outputs[0],
            &bumped.iter().map(|v| 3.0 * v).collect::<Vec<_>>(),
            "z",
        )?;
        served.push(served_kinds(&[y.served, z.served]));
    }
    assert_eq!(
        served,
        [
            ["warmup", "warmup"],
            ["recorded", "recorded"],
            ["replayed", "replayed"],
            ["replayed", "replayed"],
        ]
    );
    let skips: Vec<TreeEvent> = (trees.take_events().into_iter())
        .filter(|e| matches!(e, TreeEvent::Skipped(_)))
        .collect();
    assert!(skips.is_empty(), "{skips:?}");
    Ok(())
}
