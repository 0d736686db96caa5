//! Sibling recordings: another function after a replay (checkpoint restore), and a static
//! input at a new address (re-recording, its limit, its texts).
use crate::{N, Setup, TestResult, expect, named, random, served_kinds};
use ferrocuda_graph::trees::{
    Arg, CheckStatus, Ctx, Input, Served, SkipReason, TreeConfig, TreeError, TreeEvent,
};
use ferrocuda_testkit::Harness;

/// `a` then `b`, later `a` then `c`: `c` is recorded as `b`'s sibling after a replay of
/// `a`, once the pool is returned to `a`'s checkpoint. It reuses exactly the memory of
/// `b`'s dead output, the pool grows by nothing, and its live blocks are exactly the
/// outputs held; both branches then replay correctly.
pub(crate) fn branch_switching_restores_the_checkpoint(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig::default())?;
    let wrap = |a: f32, name: &str| {
        let k = s.k.clone();
        trees.wrap(
            move |ctx: &mut Ctx<'_>, x: &[Arg]| Ok(vec![k.scaled(ctx, &x[0], a)?]),
            named(name),
        )
    };
    let (fa, fb, fc) = (wrap(2.0, "a"), wrap(3.0, "b"), wrap(5.0, "c"));
    let mut served = Vec::new();
    let mut b_output = None;
    let mut b_pool = None;
    for (step, second) in ["b", "b", "c", "c", "b", "c", "b"].into_iter().enumerate() {
        trees.mark_step_begin();
        let xv = random(N, step as u64);
        let x = s.buffer(&xv)?;
        let p = fa.call(&[Input::buffer(&x)])?;
        let (f, factor) = if second == "b" {
            (&fb, 3.0)
        } else {
            (&fc, 5.0)
        };
        let q = f.call(&[Input::output(&p.outputs[0])])?;
        let want: Vec<f32> = xv.iter().map(|v| 2.0 * v * factor).collect();
        expect(&q.outputs[0], &want, second)?;
        if step == 1 {
            b_output = Some(q.outputs[0].ptr()?);
            b_pool = Some(s.pool_state(trees.pool())?);
        }
        if step == 3 {
            assert_eq!(q.served, Served::Recorded);
            assert_eq!(
                Some(q.outputs[0].ptr()?),
                b_output,
                "c takes b's dead output's block"
            );
            let (reserved, live) = s.pool_state(trees.pool())?;
            let (b_reserved, _) = b_pool.clone().ok_or("no state after b")?;
            assert_eq!(reserved, b_reserved, "the pool did not grow");
            let mut held = vec![p.outputs[0].ptr()?, q.outputs[0].ptr()?];
            held.sort_unstable_by_key(|p| p.0);
            assert_eq!(live, held, "live blocks are exactly the held outputs");
        }
        served.push(served_kinds(&[p.served, q.served]));
    }
    assert_eq!(
        served,
        [
            ["warmup", "warmup"],
            ["recorded", "recorded"],
            ["replayed", "warmup"],
            ["replayed", "recorded"],
            ["replayed", "replayed"],
            ["replayed", "replayed"],
            ["replayed", "replayed"],
        ]
    );
    let checkpoints = trees
        .take_events()
        .iter()
        .filter(|e| matches!(e, TreeEvent::Checkpointed { .. }))
        .count();
    assert_eq!(
        checkpoints, 2,
        "before c's warm-up and before c's recording"
    );
    assert_eq!(trees.stats().checkpoints, 2);
    let nodes = trees.nodes();
    let root = nodes.iter().find(|n| n.parent.is_none()).ok_or("no root")?;
    assert_eq!(
        nodes.iter().filter(|n| n.parent == Some(root.id)).count(),
        2,
        "b and c are siblings"
    );
    Ok(())
}

/// A static input at a new address records a sibling (reported with PyTorch's texts),
/// the old address replays the old recording; past the limit the call runs eagerly with
/// PyTorch's message, or fails under `cudagraph_or_error`.
pub(crate) fn static_input_move_rerecords(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    for (limit, or_error) in [(128, false), (0, false), (0, true)] {
        let config = TreeConfig {
            rerecord_limit: limit,
            cudagraph_or_error: or_error,
            ..TreeConfig::default()
        };
        let trees = s.trees(config)?;
        let k = s.k.clone();
        let f = trees.wrap(
            move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.sum(ctx, &a[0], &a[1])?]),
            named("f"),
        );
        let (xv, w1v, w2v) = (random(N, 1), random(N, 2), random(N, 3));
        let (x, w1, w2) = (s.buffer(&xv)?, s.buffer(&w1v)?, s.buffer(&w2v)?);
        let call = |w| {
            trees.mark_step_begin();
            f.call(&[Input::buffer(&x), Input::buffer(w).mark_static()])
        };
        let sum = |w: &[f32]| -> Vec<f32> { xv.iter().zip(w).map(|(a, b)| a + b).collect() };
        for _ in 0..3 {
            expect(&call(&w1)?.outputs[0], &sum(&w1v), "w1")?;
        }
        trees.take_events();
        let moved = call(&w2);
        if or_error {
            let err = moved.err().ok_or("cudagraph_or_error must refuse")?;
            assert!(matches!(
                err,
                TreeError::Skipped(SkipReason::RerecordLimit { .. })
            ));
            continue;
        }
        let moved = moved?;
        expect(&moved.outputs[0], &sum(&w2v), "w2")?;
        if limit == 0 {
            let Served::Eager(reason) = &moved.served else {
                return Err(format!("expected an eager run, got {:?}", moved.served).into());
            };
            assert_eq!(
                reason.to_string(),
                "skipping cudagraph due to function 0 exceeding max re-recording limit (=0) on cudagraph node None due to static input data pointer changed."
            );
            continue;
        }
        assert_eq!(moved.served, Served::Recorded);
        let events = trees.take_events();
        let detail = events.iter().find_map(|e| match e {
            TreeEvent::Rerecord {
                status: CheckStatus::StaticInputIdxMismatch,
                detail,
                ..
            } => Some(detail.clone()),
            _ => None,
        });
        let detail = detail.ok_or("no re-record event")?;
        let line = format!(
            "static input data pointer changed.\ninput name: arg1. data pointer changed from {} to {}. input stack trace: None\n",
            w1.ptr().0,
            w2.ptr().0
        );
        assert_eq!(detail, line);
        let back = call(&w1)?;
        assert_eq!(
            back.served,
            Served::Replayed,
            "the old address replays its recording"
        );
        expect(&back.outputs[0], &sum(&w1v), "w1 again")?;
        assert_eq!(call(&w2)?.served, Served::Replayed);
        assert_eq!(trees.nodes().len(), 2);
    }
    Ok(())
}
