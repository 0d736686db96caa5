//! Dynamic shapes: one recording per size, a cap with least-recently-used eviction that
//! gives the evicted recording's memory back to the pool, and buckets.
use crate::{Setup, TestResult, expect, named, random, served_kinds};
use ferrocuda_graph::guards::CacheConfig;
use ferrocuda_graph::trees::{
    Arg, Buckets, Ctx, Input, Served, SkipReason, TreeConfig, TreeEvent, WrapOptions,
};
use ferrocuda_testkit::Harness;

/// Sizes 256, 512, 1024 with a cap of 2: each size warms up and records; the third
/// evicts the least recently used (its graph gone from the pool's users, its held output
/// freed, its handles stale); the evicted size then warms up and records anew. Past the
/// warning limit PyTorch's warning is reported once; with `skip_dynamic_graphs` only the
/// first size is graphed.
pub(crate) fn shapes_record_per_size_and_the_cap_evicts(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let config = TreeConfig {
        dynamic_shape_warn_limit: Some(2),
        ..TreeConfig::default()
    };
    let trees = s.trees(config)?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 2.0)?]),
        WrapOptions {
            max_recorded_shapes: Some(2),
            // One static specialisation per size (`dynamic=False`), so that a size seen
            // again finds its recording (see `guards.rs` for the dynamic default).
            guards: CacheConfig {
                automatic_dynamic_shapes: false,
                ..CacheConfig::default()
            },
            ..named("f")
        },
    );
    let inputs: Vec<(Vec<f32>, _)> = [256, 512, 1024]
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let v = random(n, i as u64);
            let b = s.buffer(&v);
            (v, b)
        })
        .collect();
    let run = |i: usize| -> Result<Served, crate::BoxError> {
        let (v, b) = &inputs[i];
        let b = b.as_ref().map_err(|e| e.to_string())?;
        let call = f.call(&[Input::buffer(b)])?;
        expect(
            &call.outputs[0],
            &v.iter().map(|x| 2.0 * x).collect::<Vec<_>>(),
            "2x",
        )?;
        Ok(call.served)
    };
    let mut served = Vec::new();
    for i in [0, 0, 0, 1, 1, 1] {
        trees.mark_step_begin();
        served.push(run(i)?);
    }
    assert_eq!(trees.nodes().len(), 2, "one recording per size");
    assert_eq!(s.pool_users(trees.pool())?, Some(3));
    // Size 1024 evicts size 256 (used least recently); keep its last output to see it go.
    trees.mark_step_begin();
    let (_, b0) = &inputs[0];
    let kept = f.call(&[Input::buffer(b0.as_ref().map_err(|e| e.to_string())?)])?;
    trees.mark_step_begin();
    let (_, b1) = &inputs[1];
    drop(f.call(&[Input::buffer(b1.as_ref().map_err(|e| e.to_string())?)])?);
    let before = trees.stats().evictions;
    for _ in 0..3 {
        trees.mark_step_begin();
        served.push(run(2)?);
    }
    assert_eq!(trees.stats().evictions, before + 1);
    assert!(
        !kept.outputs[0].is_valid(),
        "the evicted recording's outputs are stale"
    );
    assert_eq!(trees.nodes().len(), 2);
    assert_eq!(
        s.pool_users(trees.pool())?,
        Some(3),
        "the evicted graph gave its use back"
    );
    let (_, live) = s.pool_state(trees.pool())?;
    assert!(
        live.is_empty(),
        "no block of the evicted recording stays allocated: {live:?}"
    );
    for _ in 0..3 {
        trees.mark_step_begin();
        served.push(run(0)?);
    }
    let kinds = served_kinds(&served);
    assert_eq!(
        kinds[..6],
        [
            "warmup", "recorded", "replayed", "warmup", "recorded", "replayed"
        ]
    );
    assert_eq!(kinds[6..9], ["warmup", "recorded", "replayed"]);
    assert_eq!(
        kinds[9..],
        ["warmup", "recorded", "replayed"],
        "the evicted size starts over"
    );
    let events = trees.take_events();
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e, TreeEvent::Evicted { .. }))
            .count(),
        2
    );
    let warnings = events.iter().filter(|e| matches!(e, TreeEvent::Warning(w) if w.starts_with("CUDAGraph supports dynamic shapes by recording a new graph for each distinct input size."))).count();
    assert_eq!(warnings, 1);

    // skip_dynamic_graphs: the first size graphs, the others run eagerly.
    let config = TreeConfig {
        skip_dynamic_graphs: true,
        ..TreeConfig::default()
    };
    let trees = s.trees(config)?;
    let k = s.k.clone();
    let g = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 2.0)?]),
        named("g"),
    );
    let mut kinds = Vec::new();
    for (_, b) in &inputs {
        let b = b.as_ref().map_err(|e| e.to_string())?;
        for _ in 0..2 {
            trees.mark_step_begin();
            kinds.push(g.call(&[Input::buffer(b)])?.served);
        }
    }
    assert_eq!(
        served_kinds(&kinds),
        ["warmup", "recorded", "eager", "eager", "eager", "eager"]
    );
    assert_eq!(kinds[2], Served::Eager(SkipReason::DynamicShapes),);
    assert_eq!(
        SkipReason::DynamicShapes.to_string(),
        "skipping cudagraphs due to graph with symbolic shapes inputs and config.triton.cudagraph_skip_dynamic_graphs=True."
    );
    Ok(())
}

/// Buckets 128 and 256: inputs of 100, 120, 128, 200 and 256 elements share two
/// recordings; the function sees the padded size (zeros past the input), on every path.
pub(crate) fn buckets_pad_to_few_recordings(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 2.0)?]),
        WrapOptions {
            buckets: Some(Buckets::new(&[128, 256])?),
            ..named("f")
        },
    );
    let mut served = Vec::new();
    for (step, n) in [100usize, 120, 128, 100, 200, 256, 200, 250]
        .into_iter()
        .enumerate()
    {
        trees.mark_step_begin();
        let v = random(n, step as u64);
        let x = s.buffer(&v)?;
        let call = f.call(&[Input::buffer(&x)])?;
        let bucket = if n <= 128 { 128 } else { 256 };
        let mut want: Vec<f32> = v.iter().map(|x| 2.0 * x).collect();
        want.resize(bucket, 0.0);
        assert_eq!(call.outputs[0].shape().dims(), [bucket]);
        expect(&call.outputs[0], &want, &format!("{n} padded to {bucket}"))?;
        served.push(call.served);
    }
    assert_eq!(
        served_kinds(&served),
        [
            "warmup", "recorded", "replayed", "replayed", "warmup", "recorded", "replayed",
            "replayed"
        ]
    );
    assert_eq!(trees.nodes().len(), 2);
    let x = s.buffer(&random(300, 0))?;
    assert!(
        f.call(&[Input::buffer(&x)]).is_err(),
        "larger than every bucket"
    );
    Ok(())
}

/// `capture_sizes` [[128]] with buckets 128 and 256: sizes that pad to 128 are graphed,
/// those that pad to 256 run eagerly with the capture-size skip, outputs right on both.
pub(crate) fn only_capture_sizes_are_graphed(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 2.0)?]),
        WrapOptions {
            buckets: Some(Buckets::new(&[128, 256])?),
            capture_sizes: Some(vec![vec![128]]),
            ..named("f")
        },
    );
    let mut served = Vec::new();
    for (step, n) in [100usize, 200, 120, 250, 128].into_iter().enumerate() {
        trees.mark_step_begin();
        let v = random(n, step as u64);
        let x = s.buffer(&v)?;
        let call = f.call(&[Input::buffer(&x)])?;
        let mut want: Vec<f32> = v.iter().map(|x| 2.0 * x).collect();
        want.resize(if n <= 128 { 128 } else { 256 }, 0.0);
        expect(&call.outputs[0], &want, &format!("{n}"))?;
        served.push(call.served);
    }
    // 200 (padded to 256) made the guards' dynamic specialisation, which serves 120 next:
    // a new signature under it, so a warm-up before it records (PyTorch's behaviour too).
    assert_eq!(
        served_kinds(&served),
        ["warmup", "eager", "warmup", "eager", "recorded"]
    );
    let skip = SkipReason::CaptureSize { key: vec![256] };
    assert_eq!(served[1], Served::Eager(skip.clone()));
    assert_eq!(
        skip.to_string(),
        "skipping cudagraphs due to input sizes [256] not in cudagraph_capture_sizes"
    );
    Ok(())
}

/// Evicting a recording off the current path frees nothing: siblings share memory, so the
/// evicted `b`'s output had the address of its sibling `c`'s, held now. `a` then `b`
/// (capped at one shape) are recorded; `a` then `c` record `c` as `b`'s sibling in `b`'s
/// dead output's block; `b` at a new size evicts its recording while `c`'s output is held,
/// and warms up next to it. `c`'s output keeps its values and the pool's live blocks are
/// exactly the outputs held.
pub(crate) fn evicting_a_sibling_keeps_the_live_branch(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let scale = |a: f32, options: WrapOptions| {
        let k = s.k.clone();
        trees.wrap(
            move |ctx: &mut Ctx<'_>, x: &[Arg]| Ok(vec![k.scaled(ctx, &x[0], a)?]),
            options,
        )
    };
    let fa = scale(2.0, named("a"));
    let fb = scale(
        3.0,
        WrapOptions {
            max_recorded_shapes: Some(1),
            ..named("b")
        },
    );
    let fc = scale(5.0, named("c"));
    let n = 1024;
    let xv = random(n, 1);
    let x = s.buffer(&xv)?;
    let times = |v: &[f32], a: f32| v.iter().map(|x| a * x).collect::<Vec<_>>();
    for _ in 0..2 {
        trees.mark_step_begin();
        let p = fa.call(&[Input::buffer(&x)])?;
        let q = fb.call(&[Input::output(&p.outputs[0])])?;
        expect(&q.outputs[0], &times(&times(&xv, 2.0), 3.0), "b(a(x))")?;
    }
    let mut kept = None;
    for _ in 0..2 {
        trees.mark_step_begin();
        let p = fa.call(&[Input::buffer(&x)])?;
        let q = fc.call(&[Input::output(&p.outputs[0])])?;
        kept = Some((p, q));
    }
    let (p, q) = kept.ok_or("no call")?;
    assert_eq!(q.served, Served::Recorded, "c is recorded beside b");
    let c_values = times(&times(&xv, 2.0), 5.0);
    expect(&q.outputs[0], &c_values, "c(a(x))")?;
    // b at half the size: its recording is evicted, the new size warms up.
    let small = s.buffer(&random(n / 2, 2))?;
    let r = fb.call(&[Input::buffer(&small)])?;
    assert_eq!(r.served, Served::Warmup);
    assert_eq!(trees.stats().evictions, 1);
    expect(&q.outputs[0], &c_values, "c's output after b's eviction")?;
    let mut held = vec![
        p.outputs[0].ptr()?,
        q.outputs[0].ptr()?,
        r.outputs[0].ptr()?,
    ];
    held.sort_unstable_by_key(|p| p.0);
    assert_eq!(
        s.pool_state(trees.pool())?.1,
        held,
        "the pool's live blocks"
    );
    Ok(())
}
