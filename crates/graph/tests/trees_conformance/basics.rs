//! Warm-up, recording and replay; a forward and backward in one tree; steps and stale
//! outputs; PyTorch's generation heuristic.
use crate::{N, Setup, TestResult, expect, named, random, served_kinds};
use ferrocuda_graph::trees::{
    Arg, Ctx, FunctionMode, GenerationPolicy, Input, Served, TreeConfig, TreeError, TreeEvent,
    WrapOptions,
};

/// `y = 3 (x + w)`, `z = y + 1` with a temporary, `w` static: warmed up once, recorded once,
/// then replayed on new random inputs, always equal to the host computation.
pub(crate) fn warmup_record_replay_matches_eager(h: &ferrocuda_testkit::Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            let t = k.sum(ctx, &a[0], &a[1])?;
            let y = k.scaled(ctx, &t.as_arg(), 3.0)?;
            let z = k.scaled(ctx, &y.as_arg(), 1.0)?;
            k.add_one(ctx.stream(), z.arg(), a[0].numel())?;
            Ok(vec![y, z])
        },
        named("f"),
    );
    let wv = random(N, 99);
    let w = s.buffer(&wv)?;
    let mut served = Vec::new();
    for step in 0..6 {
        trees.mark_step_begin();
        let xv = random(N, step);
        let x = s.buffer(&xv)?;
        let call = f.call(&[Input::buffer(&x), Input::buffer(&w).mark_static()])?;
        let y: Vec<f32> = xv.iter().zip(&wv).map(|(a, b)| 3.0 * (a + b)).collect();
        let z: Vec<f32> = y.iter().map(|v| v + 1.0).collect();
        expect(&call.outputs[0], &y, "y")?;
        expect(&call.outputs[1], &z, "z")?;
        served.push(call.served);
    }
    assert_eq!(
        served_kinds(&served),
        [
            "warmup", "recorded", "replayed", "replayed", "replayed", "replayed"
        ]
    );
    let stats = trees.stats();
    assert_eq!((stats.warmups, stats.recordings, stats.replays), (1, 1, 4));
    assert_eq!(
        s.pool_users(trees.pool())?,
        Some(2),
        "the manager and the one graph"
    );
    Ok(())
}

/// A forward saving an activation and its backward reading it: the backward is recorded
/// as a child of the forward and takes the activation in place.
pub(crate) fn forward_backward_share_one_tree(h: &ferrocuda_testkit::Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let (k1, k2) = (s.k.clone(), s.k.clone());
    // Forward: h = x + w, y = 2 h. Backward: gx = 2 gy + h.
    let forward = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            let h = k1.sum(ctx, &a[0], &a[1])?;
            let y = k1.scaled(ctx, &h.as_arg(), 2.0)?;
            Ok(vec![h, y])
        },
        WrapOptions {
            mode: FunctionMode::Forward,
            ..named("forward")
        },
    );
    let backward = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            let g2 = k2.scaled(ctx, &a[1], 2.0)?;
            let gx = k2.sum(ctx, &g2.as_arg(), &a[0])?;
            Ok(vec![gx])
        },
        WrapOptions {
            mode: FunctionMode::Backward,
            ..named("backward")
        },
    );
    let wv = random(N, 7);
    let w = s.buffer(&wv)?;
    let mut served = Vec::new();
    for step in 0..5 {
        trees.mark_step_begin();
        let (xv, gv) = (random(N, 10 + step), random(N, 20 + step));
        let (x, gy) = (s.buffer(&xv)?, s.buffer(&gv)?);
        let fwd = forward.call(&[Input::buffer(&x), Input::buffer(&w).mark_static()])?;
        let bwd = backward.call(&[Input::output(&fwd.outputs[0]), Input::buffer(&gy)])?;
        let hv: Vec<f32> = xv.iter().zip(&wv).map(|(a, b)| a + b).collect();
        let yv: Vec<f32> = hv.iter().map(|v| 2.0 * v).collect();
        let gxv: Vec<f32> = gv.iter().zip(&hv).map(|(g, h)| 2.0 * g + h).collect();
        expect(&fwd.outputs[1], &yv, "y")?;
        expect(&bwd.outputs[0], &gxv, "gx")?;
        served.push((fwd.served, bwd.served));
    }
    let kinds: Vec<_> = served
        .iter()
        .map(|(f, b)| served_kinds(&[f.clone(), b.clone()]))
        .collect();
    assert_eq!(kinds[0], ["warmup", "warmup"]);
    assert_eq!(kinds[1], ["recorded", "recorded"]);
    assert!(
        kinds[2..].iter().all(|k| k == &["replayed", "replayed"]),
        "{kinds:?}"
    );
    let nodes = trees.nodes();
    assert_eq!(nodes.len(), 2, "{nodes:?}");
    let root = nodes.iter().find(|n| n.parent.is_none()).ok_or("no root")?;
    let child = nodes
        .iter()
        .find(|n| n.parent == Some(root.id))
        .ok_or("no child of the forward")?;
    assert_ne!(root.function, child.function);
    assert_eq!(s.pool_users(trees.pool())?, Some(3));
    Ok(())
}

/// Outputs of earlier steps are stale once a later run may overwrite them, whether the
/// later run records or replays (PyTorch raises only for warm-up and recording outputs);
/// `copy_out` keeps one; within a step, a held output makes the next call record a child.
pub(crate) fn stale_outputs_are_errors(h: &ferrocuda_testkit::Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 2.0)?]),
        named("double"),
    );
    let xv = random(N, 3);
    let x = s.buffer(&xv)?;
    let twice: Vec<f32> = xv.iter().map(|v| 2.0 * v).collect();
    let stale = |r: Result<Vec<f32>, TreeError>| matches!(r, Err(TreeError::StaleOutput { .. }));
    let y1 = f.call(&[Input::buffer(&x)])?.outputs.remove(0);
    trees.mark_step_begin();
    let y2 = f.call(&[Input::buffer(&x)])?.outputs.remove(0);
    assert!(
        stale(y1.to_host()) && y1.ptr().is_err() && !y1.is_valid(),
        "warm-up output"
    );
    expect(&y2, &twice, "recorded")?;
    trees.mark_step_begin();
    let y3 = f.call(&[Input::buffer(&x)])?;
    assert_eq!(y3.served, Served::Replayed);
    assert!(stale(y2.to_host()), "recorded output after a replay");
    let y3 = y3.outputs[0].clone();
    let kept = y3.copy_out()?;
    trees.mark_step_begin();
    let y4 = f.call(&[Input::buffer(&x)])?.outputs.remove(0);
    assert!(
        stale(y3.to_host()),
        "replayed output after a replay (PyTorch: silently aliased)"
    );
    expect(&kept, &twice, "the copy moved out")?;
    assert!(matches!(
        f.call(&[Input::output(&y3)]),
        Err(TreeError::StaleOutput { index: 0, .. })
    ));
    // Same step, y4 held: the call records a child instead of overwriting y4.
    let y5 = f.call(&[Input::buffer(&x)])?;
    assert_eq!(y5.served, Served::Recorded);
    expect(&y4, &twice, "y4 survives")?;
    assert_ne!(y4.ptr()?, y5.outputs[0].ptr()?);
    let y6 = f.call(&[Input::buffer(&x)])?;
    assert_eq!(y6.served, Served::Recorded);
    let warned = trees.take_events().iter().any(|e| {
        matches!(e, TreeEvent::Warning(w) if w.starts_with("double: Unable to hit fast path of CUDAGraphs"))
    });
    assert!(warned, "growing the path warns once");
    Ok(())
}

/// PyTorch's heuristic: each call a new generation unless a forward waits for its
/// backward; forwards without backwards keep the path open and warn; `mark_step_begin`
/// overrides the pending backward.
pub(crate) fn heuristic_generations_follow_pending_backwards(
    h: &ferrocuda_testkit::Harness,
) -> TestResult {
    let s = Setup::new(h)?;
    let config = TreeConfig {
        generations: GenerationPolicy::Heuristic,
        ..TreeConfig::default()
    };
    let trees = s.trees(config)?;
    let (k1, k2) = (s.k.clone(), s.k.clone());
    let forward = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k1.scaled(ctx, &a[0], 2.0)?]),
        WrapOptions {
            mode: FunctionMode::Forward,
            ..named("forward")
        },
    );
    let backward = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k2.scaled(ctx, &a[0], 3.0)?]),
        WrapOptions {
            mode: FunctionMode::Backward,
            ..named("backward")
        },
    );
    let x = s.buffer(&random(N, 5))?;
    // Forward then backward, no steps marked: the backward joins the forward's path.
    for _ in 0..4 {
        let y = forward.call(&[Input::buffer(&x)])?;
        let g = backward.call(&[Input::output(&y.outputs[0])])?;
        assert!(y.outputs[0].is_valid() && g.outputs[0].is_valid());
    }
    let nodes = trees.nodes();
    assert_eq!(nodes.len(), 2);
    assert!(
        nodes.iter().any(|n| n.parent.is_some()),
        "backward is the forward's child"
    );
    let replays = trees.stats().replays;
    // Forwards whose backward never runs: outputs held, the path grows.
    let a = forward.call(&[Input::buffer(&x)])?;
    let b = forward.call(&[Input::buffer(&x)])?;
    let c = forward.call(&[Input::buffer(&x)])?;
    assert!(
        a.outputs[0].is_valid() && b.outputs[0].is_valid(),
        "pending backward: same generation"
    );
    assert_eq!(c.served, Served::Recorded);
    let events = trees.take_events();
    assert!(events.iter().any(|e| matches!(e, TreeEvent::Warning(w) if w.contains("Unable to hit fast path of CUDAGraphs because of pending, uninvoked backwards"))));
    trees.mark_step_begin();
    let d = forward.call(&[Input::buffer(&x)])?;
    assert_eq!(d.served, Served::Replayed, "a marked step ends the path");
    assert!(!a.outputs[0].is_valid() && !c.outputs[0].is_valid());
    assert!(trees.stats().replays > replays);
    Ok(())
}

/// An output of one step passed to the first call of the next, under both generation
/// policies (the step marked, or PyTorch's rule: each call a new generation). The call
/// ends the old path first, as PyTorch's `dealloc_current_path_weakrefs` does before the
/// function reads its inputs, so the output is stale when the call would read it: the
/// call is `StaleOutput`, not a read of freed memory. `g` (`x + 0 x`, its temporary first)
/// warms up in place: before the fix its temporary took the freed block and `g(y)` was
/// `[0, 0, 0, 0]` for `[2, 4, 6, 8]`. Outputs of a warm-up, of a recording and of a replay
/// whose path the call ends are all refused; after a replay, a call that continues the
/// path (a warm-up of another function: PyTorch checkpoints, it does not end the path)
/// reads the output in place, correctly.
pub(crate) fn an_output_passed_into_the_next_step_is_stale(
    h: &ferrocuda_testkit::Harness,
) -> TestResult {
    let s = Setup::new(h)?;
    for policy in [GenerationPolicy::Explicit, GenerationPolicy::Heuristic] {
        let trees = s.trees(TreeConfig {
            generations: policy,
            ..TreeConfig::default()
        })?;
        let (kf, kg) = (s.k.clone(), s.k.clone());
        let f = trees.wrap(
            move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![kf.scaled(ctx, &a[0], 2.0)?]),
            named("f"),
        );
        // x + 0 x, the temporary allocated first: it lands on a freed input's block.
        let wrap_g = |name: &str| {
            let kg = kg.clone();
            trees.wrap(
                move |ctx: &mut Ctx<'_>, a: &[Arg]| {
                    let zero = kg.scaled(ctx, &a[0], 0.0)?;
                    Ok(vec![kg.sum(ctx, &a[0], &zero.as_arg())?])
                },
                named(name),
            )
        };
        let x = s.buffer(&[1.0, 2.0, 3.0, 4.0])?;
        let y_values = [2.0, 4.0, 6.0, 8.0];
        let step = || {
            if policy == GenerationPolicy::Explicit {
                trees.mark_step_begin();
            }
        };
        // f's calls: a warm-up, a recording, a replay; each output goes to the next step's
        // first call: a function never called before (it warms up in place) after the
        // warm-up and the recording, f itself after the replay (whose path it ends).
        for (round, kind) in ["warmup", "recorded", "replayed"].into_iter().enumerate() {
            step();
            let y = f.call(&[Input::buffer(&x)])?;
            assert_eq!(
                served_kinds(std::slice::from_ref(&y.served)),
                [kind],
                "{policy:?}"
            );
            expect(&y.outputs[0], &y_values, "y")?;
            step();
            let g = wrap_g(&format!("g{round}"));
            let next = if kind == "replayed" { &f } else { &g };
            match next.call(&[Input::output(&y.outputs[0])]) {
                Err(TreeError::StaleOutput { function, index: 0 }) if function == "f" => {}
                Err(e) => return Err(format!("{policy:?}, {kind} output: {e}").into()),
                Ok(call) => {
                    let got = call.outputs[0].to_host::<f32>()?;
                    return Err(format!(
                        "{policy:?}, {kind} output of the last step read as {got:?} ({:?})",
                        call.served
                    )
                    .into());
                }
            }
            assert!(!y.outputs[0].is_valid(), "{policy:?}: the old path ended");
            // The tree goes on: a call on a buffer is served correctly.
            let fresh = g.call(&[Input::buffer(&x)])?;
            expect(
                &fresh.outputs[0],
                &[1.0, 2.0, 3.0, 4.0],
                "g(x) after the refusal",
            )?;
        }
        if policy == GenerationPolicy::Explicit {
            // A replayed output passed to a function that continues the path in the next
            // step: the path does not end (PyTorch checkpoints and warms up after it), the
            // output stays valid and is read in place.
            step();
            let y = f.call(&[Input::buffer(&x)])?;
            assert_eq!(y.served, Served::Replayed);
            step();
            let g = wrap_g("g_after_replay");
            let z = g.call(&[Input::output(&y.outputs[0])])?;
            assert_eq!(z.served, Served::Warmup);
            expect(
                &z.outputs[0],
                &y_values,
                "g(y) continuing the replayed path",
            )?;
            assert!(y.outputs[0].is_valid());
        }
    }
    Ok(())
}
