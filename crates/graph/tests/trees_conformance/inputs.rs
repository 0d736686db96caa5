//! How replays feed non-static inputs: copied into the recording's static inputs, or
//! patched (the graph repointed at the caller's buffer). The same outputs either way and as
//! eager, no copy when patched, the size rule of `InputFeed::Auto`, and the fallback to
//! copies when a graph cannot be repointed.
use crate::{D0, N, Setup, TestResult, expect, named, random, served_kinds};
use ferrocuda_driver::Call as DriverCall;
use ferrocuda_graph::trees::{
    Arg, Buckets, Ctx, Input, InputFeed, PATCH_MIN_BYTES, Served, TreeConfig, TreeEvent, TreeStats,
    TreeTensor, Trees, WrapOptions, Wrapped,
};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;
use ferrocuda_types::DType;
use std::sync::Arc;

/// One instance per recording: every move is a graph update (the costs these tests count).
fn config(feed: InputFeed) -> TreeConfig {
    TreeConfig {
        input_feed: feed,
        kept_instances: 1,
        ..TreeConfig::default()
    }
}

/// What one call of a patched tree is expected to cost: graph updates, input copies.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Cost {
    updates: u64,
    copies: u64,
}

const fn cost(updates: u64, copies: u64) -> Cost {
    Cost { updates, copies }
}

/// Calls `f` and checks what the call cost against `expected` (skipped for warm-ups and
/// recordings): the tree's counters on both backends, and the driver's own count of graph
/// updates and device-to-device copies on the fake device.
fn call_costing(
    h: &Harness,
    trees: &Trees,
    f: &Wrapped,
    inputs: &[Input<'_>],
    expected: Cost,
    what: &str,
) -> Result<ferrocuda_graph::trees::Call, crate::BoxError> {
    let driver = |kind| h.fake.as_ref().map(|f| f.calls(kind));
    let (stats, updates, copies) = (
        trees.stats(),
        instance_updates(h),
        driver(DriverCall::MemcpyDtoD),
    );
    let call = f.call(inputs)?;
    if call.served != Served::Replayed {
        return Ok(call);
    }
    let now: TreeStats = trees.stats();
    let counted = cost(
        now.input_updates - stats.input_updates,
        now.input_copies - stats.input_copies,
    );
    assert_eq!(counted, expected, "{what}: the tree's counters");
    if let (Some(u0), Some(u1), Some(c0), Some(c1)) = (
        updates,
        instance_updates(h),
        copies,
        driver(DriverCall::MemcpyDtoD),
    ) {
        assert_eq!(
            cost(u1 - u0, c1 - c0),
            expected,
            "{what}: the driver's calls"
        );
    }
    Ok(call)
}

/// The fake driver's updates of instances so far: node sets in an instance, and whole
/// updates from the captured graph.
fn instance_updates(h: &Harness) -> Option<u64> {
    (h.fake.as_ref())
        .map(|f| f.calls(DriverCall::GraphExecSetNodes) + f.calls(DriverCall::GraphExecUpdate))
}

/// `u = 3 (x + w)`, `v = u + y` over inputs `(x, y, w)`, `w` static.
fn wrap_affine(s: &Setup, trees: &Arc<Trees>) -> Wrapped {
    let k = s.k.clone();
    trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            let t = k.sum(ctx, &a[0], &a[2])?;
            let u = k.scaled(ctx, &t.as_arg(), 3.0)?;
            let v = k.sum(ctx, &u.as_arg(), &a[1])?;
            Ok(vec![u, v])
        },
        named("affine"),
    )
}

/// The same function in two trees, one copying its inputs and one patching them, called
/// with `(x, y)` moving between three buffers (swapped, one moved, unchanged, one buffer
/// for both). Every output is moved out and read only at the end, so that on the fake
/// device (manual completion) graph updates happen while earlier replays are still queued:
/// each replay reads the buffers of its own call. Both trees give the eager values; the
/// patched one copies only when one buffer is both inputs, and updates its graph only when
/// an address moves; the copying one copies inside its graph, updated likewise.
pub(crate) fn patched_inputs_match_copied_inputs_and_eager(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let (copying, patching) = (
        s.trees(config(InputFeed::Copy))?,
        s.trees(config(InputFeed::Patch))?,
    );
    let (fc, fp) = (wrap_affine(&s, &copying), wrap_affine(&s, &patching));
    let wv = random(N, 5);
    let w = s.buffer(&wv)?;
    let values: Vec<Vec<f32>> = (0..3).map(|i| random(N, 40 + i)).collect();
    let bufs: Vec<DeviceBuffer<f32>> =
        (values.iter().map(|v| s.buffer(v))).collect::<Result<_, _>>()?;
    let plan = [
        (0, 1, cost(0, 0)), // warm-up
        (0, 1, cost(0, 0)), // recording
        (1, 0, cost(1, 0)), // swapped: one update moves both
        (0, 1, cost(1, 0)),
        (2, 1, cost(1, 0)), // x moves
        (2, 1, cost(0, 0)), // nothing moves: free
        (1, 2, cost(1, 0)),
        (0, 0, cost(1, 2)), // one buffer for both: copied, the graph pointed back
        (0, 2, cost(1, 0)),
    ];
    let mut kept: Vec<(Vec<TreeTensor>, Vec<f32>, Vec<f32>)> = Vec::new();
    let mut served = (Vec::new(), Vec::new());
    for (i, &(xi, yi, expected)) in plan.iter().enumerate() {
        copying.mark_step_begin();
        patching.mark_step_begin();
        let inputs = [
            Input::buffer(&bufs[xi]),
            Input::buffer(&bufs[yi]),
            Input::buffer(&w).mark_static(),
        ];
        let c = fc.call(&inputs)?;
        let p = call_costing(h, &patching, &fp, &inputs, expected, &format!("call {i}"))?;
        let u: Vec<f32> = (values[xi].iter().zip(&wv))
            .map(|(x, w)| 3.0 * (x + w))
            .collect();
        let v: Vec<f32> = u.iter().zip(&values[yi]).map(|(u, y)| u + y).collect();
        let outs = (c.outputs.iter().chain(&p.outputs)).map(TreeTensor::copy_out);
        kept.push((outs.collect::<Result<_, _>>()?, u, v));
        served.0.push(c.served);
        served.1.push(p.served);
    }
    for (i, (outs, u, v)) in kept.iter().enumerate() {
        for (j, out) in outs.iter().enumerate() {
            let (expected, tree) = (
                if j % 2 == 0 { u } else { v },
                ["copying", "patching"][j / 2],
            );
            expect(out, expected, &format!("call {i}, {tree} tree, output {j}"))?;
        }
    }
    let replays = plan.len() - 2;
    let mut kinds = vec!["warmup", "recorded"];
    kinds.resize(plan.len(), "replayed");
    assert_eq!(served_kinds(&served.0), kinds);
    assert_eq!(served_kinds(&served.1), kinds);
    let (c, p) = (copying.stats(), patching.stats());
    // The copying tree copies inside its graph: one update of its copies at each call whose
    // buffers differ from the previous call's.
    let moved = plan
        .windows(2)
        .skip(1)
        .filter(|w| (w[0].0, w[0].1) != (w[1].0, w[1].1));
    assert_eq!(
        (c.input_copies, c.input_updates),
        (2 * replays as u64, moved.count() as u64)
    );
    let expected: Cost = plan[2..].iter().fold(cost(0, 0), |a, &(_, _, b)| {
        cost(a.updates + b.updates, a.copies + b.copies)
    });
    assert_eq!(cost(p.input_updates, p.input_copies), expected);
    for (buf, v) in bufs.iter().zip(&values) {
        assert_eq!(&buf.to_host()?, v, "the callers' buffers are only read");
    }
    Ok(())
}

/// What one replay of a tree keeping instances costs: graph updates (an instance updated or
/// added), launches of another kept instance, input copies, and, on the fake device, the
/// driver's instance updates and instantiations.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct KeptCost {
    updates: u64,
    kept: u64,
    copies: u64,
    driver_updates: u64,
    driver_instances: u64,
}

const fn kept_cost(updates: u64, kept: u64, copies: u64, driver: (u64, u64)) -> KeptCost {
    KeptCost {
        updates,
        kept,
        copies,
        driver_updates: driver.0,
        driver_instances: driver.1,
    }
}

/// `TreeConfig::kept_instances` (2, the default): a patched recording keeps two instances
/// of its graph, each holding the addresses it was last given. Inputs moving back to
/// addresses the other instance holds launch it with no driver call; new addresses add an
/// instance while there is room, then update the least recently launched one (an LRU of
/// address sets, written out below). Every output is read only at the end, so that on the
/// fake device (manual completion) replays of both instances are queued together: each
/// reads its own call's buffers, and the values equal the host's.
pub(crate) fn kept_instances_serve_inputs_that_come_back(h: &Harness) -> TestResult {
    assert_eq!(TreeConfig::default().kept_instances, 2);
    let s = Setup::new(h)?;
    let trees = s.trees(TreeConfig {
        input_feed: InputFeed::Patch,
        ..TreeConfig::default()
    })?;
    let f = wrap_affine(&s, &trees);
    let wv = random(N, 7);
    let w = s.buffer(&wv)?;
    let values: Vec<Vec<f32>> = (0..3).map(|i| random(N, 80 + i)).collect();
    let bufs: Vec<DeviceBuffer<f32>> =
        (values.iter().map(|v| s.buffer(v))).collect::<Result<_, _>>()?;
    // (x, y, cost); instances named by the buffers they read, C for the recording's copies.
    let plan = [
        (0, 1, None),                             // warm-up
        (0, 1, None),                             // recording: A(C, C)
        (0, 1, Some(kept_cost(1, 0, 0, (0, 1)))), // added: B(0, 1)
        (1, 0, Some(kept_cost(1, 0, 0, (1, 0)))), // A updated: A(1, 0), B(0, 1)
        (0, 1, Some(kept_cost(0, 1, 0, (0, 0)))), // B held (0, 1)
        (1, 0, Some(kept_cost(0, 1, 0, (0, 0)))), // A held (1, 0)
        (1, 0, Some(kept_cost(0, 0, 0, (0, 0)))), // nothing moves
        (2, 1, Some(kept_cost(1, 0, 0, (1, 0)))), // B, least recent, updated: B(2, 1)
        (1, 0, Some(kept_cost(0, 1, 0, (0, 0)))), // A held (1, 0)
        (0, 0, Some(kept_cost(1, 0, 2, (1, 0)))), // one buffer for both: B(C, C), copied
        (2, 1, Some(kept_cost(1, 0, 0, (1, 0)))), // A updated: A(2, 1)
        (0, 0, Some(kept_cost(0, 1, 2, (0, 0)))), // B held (C, C), copied
    ];
    let driver = |kind| h.fake.as_ref().map(|f| f.calls(kind));
    let mut kept = Vec::new();
    for (i, &(xi, yi, expected)) in plan.iter().enumerate() {
        trees.mark_step_begin();
        let (before, updates, instances) = (
            trees.stats(),
            instance_updates(h),
            driver(DriverCall::GraphInstantiate),
        );
        let inputs = [
            Input::buffer(&bufs[xi]),
            Input::buffer(&bufs[yi]),
            Input::buffer(&w).mark_static(),
        ];
        let call = f.call(&inputs)?;
        let now = trees.stats();
        let delta = |n: Option<u64>, b: Option<u64>| n.zip(b).map_or(0, |(n, b)| n - b);
        let (driver_updates, driver_instances) = (
            delta(instance_updates(h), updates),
            delta(driver(DriverCall::GraphInstantiate), instances),
        );
        if let Some(mut expected) = expected {
            assert_eq!(call.served, Served::Replayed, "call {i}");
            if h.fake.is_none() {
                (expected.driver_updates, expected.driver_instances) = (0, 0);
            }
            let counted = KeptCost {
                updates: now.input_updates - before.input_updates,
                kept: now.kept_instance_launches - before.kept_instance_launches,
                copies: now.input_copies - before.input_copies,
                driver_updates,
                driver_instances,
            };
            assert_eq!(counted, expected, "call {i}");
        }
        let u: Vec<f32> = (values[xi].iter().zip(&wv))
            .map(|(x, w)| 3.0 * (x + w))
            .collect();
        let v: Vec<f32> = u.iter().zip(&values[yi]).map(|(u, y)| u + y).collect();
        let outs: Vec<TreeTensor> =
            (call.outputs.iter().map(TreeTensor::copy_out)).collect::<Result<_, _>>()?;
        kept.push((outs, u, v));
    }
    for (i, (outs, u, v)) in kept.iter().enumerate() {
        expect(&outs[0], u, &format!("call {i}, u"))?;
        expect(&outs[1], v, &format!("call {i}, v"))?;
    }
    for (buf, v) in bufs.iter().zip(&values) {
        assert_eq!(&buf.to_host()?, v, "the callers' buffers are only read");
    }
    Ok(())
}

/// `InputFeed::Copy` copies an unpadded input inside the recording's graph: a replay with
/// the same buffer enqueues no copy of its own yet reads what the buffer holds at that
/// replay (its contents change between calls, replays queued on the fake device); a moved
/// buffer costs one update (here another instance, `Added`), and a buffer a kept instance
/// reads costs none.
/// A function padded to buckets copies before the replay, one copy per call.
pub(crate) fn copied_inputs_are_copied_by_the_graph(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let copy = TreeConfig {
        input_feed: InputFeed::Copy,
        ..TreeConfig::default()
    };
    let (trees, bucketed) = (s.trees(copy.clone())?, s.trees(copy)?);
    let wrap = |trees: &Arc<Trees>, options: WrapOptions| {
        let k = s.k.clone();
        trees.wrap(
            move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 2.0)?]),
            options,
        )
    };
    let f = wrap(&trees, named("in_graph"));
    let g = wrap(
        &bucketed,
        WrapOptions {
            buckets: Some(Buckets::new(&[N])?),
            ..named("bucketed")
        },
    );
    let (a, b) = (s.buffer(&random(N, 90))?, s.buffer(&random(N, 91))?);
    let memcpys = || h.fake.as_ref().map(|f| f.calls(DriverCall::MemcpyDtoD));
    let mut kept = Vec::new();
    // (buffer, new contents, copy-node updates): warm-up, recording, then replays.
    let plan = [
        (0, 1, 0),
        (0, 2, 0),
        (0, 3, 0),
        (0, 4, 0),
        (1, 5, 1),
        (1, 6, 0),
        (0, 7, 0),
    ];
    for (i, &(which, seed, updates)) in plan.iter().enumerate() {
        let buffer = [&a, &b][which];
        let values = random(N, seed);
        buffer.copy_from_host(&values)?;
        trees.mark_step_begin();
        bucketed.mark_step_begin();
        let (before, copies) = (trees.stats(), memcpys());
        let call = f.call(&[Input::buffer(buffer)])?;
        let now = trees.stats();
        if call.served == Served::Replayed {
            assert_eq!(
                (
                    now.input_copies - before.input_copies,
                    now.input_updates - before.input_updates
                ),
                (1, updates),
                "call {i}: one copy, made by the graph"
            );
            assert_eq!(memcpys(), copies, "call {i}: no copy enqueued");
        }
        let copies = memcpys();
        let padded = g.call(&[Input::buffer(buffer)])?;
        if padded.served == Served::Replayed && h.fake.is_some() {
            assert_eq!(
                memcpys(),
                copies.map(|c| c + 1),
                "call {i}: the bucketed copy"
            );
        }
        let twice: Vec<f32> = values.iter().map(|v| 2.0 * v).collect();
        let outs = [&call, &padded].map(|c| c.outputs[0].copy_out());
        kept.push((outs, twice));
        // The next contents are written only once this call's replays read theirs.
        s.h.rt.current_stream(D0)?.synchronize()?;
    }
    assert_eq!(trees.stats().kept_instance_launches, 1, "the last move");
    for (i, (outs, twice)) in kept.into_iter().enumerate() {
        for out in outs {
            expect(&out?, &twice, &format!("call {i}"))?;
        }
    }
    Ok(())
}

/// `InputFeed::Auto`: an input of at least `min_bytes` is patched whenever it moves; a
/// smaller one is copied while it moves and patched once it comes back at the previous
/// call's address (then free); it is copied again, the graph pointed back, when it moves
/// again. Outputs equal the host's at every call.
pub(crate) fn auto_feed_patches_large_and_reused_inputs(h: &Harness) -> TestResult {
    assert_eq!(
        TreeConfig::default().input_feed,
        InputFeed::Auto {
            min_bytes: PATCH_MIN_BYTES
        }
    );
    let s = Setup::new(h)?;
    let large = 4 * N;
    let min_bytes = (large * size_of::<f32>()) as u64;
    let trees = s.trees(config(InputFeed::Auto { min_bytes }))?;
    let k = s.k.clone();
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            Ok(vec![k.scaled(ctx, &a[0], 2.0)?, k.scaled(ctx, &a[1], 3.0)?])
        },
        named("two_sizes"),
    );
    let small_values: Vec<Vec<f32>> = (0..2).map(|i| random(N, 60 + i)).collect();
    let large_values: Vec<Vec<f32>> = (0..2).map(|i| random(large, 70 + i)).collect();
    let small: Vec<DeviceBuffer<f32>> =
        (small_values.iter().map(|v| s.buffer(v))).collect::<Result<_, _>>()?;
    let large_bufs: Vec<DeviceBuffer<f32>> =
        (large_values.iter().map(|v| s.buffer(v))).collect::<Result<_, _>>()?;
    let plan = [
        (0, 0, cost(0, 0)), // warm-up
        (0, 0, cost(0, 0)), // recording
        (1, 1, cost(1, 1)), // the large input patched, the small one copied
        (0, 0, cost(1, 1)),
        (0, 0, cost(1, 0)), // the small input at the previous call's address: patched
        (0, 0, cost(0, 0)), // nothing moves: free
        (1, 0, cost(1, 1)), // the small input moves: copied, its slot pointed back
        (1, 1, cost(1, 0)), // both move, the small one to the previous call's address
    ];
    let mut served = Vec::new();
    for (i, &(si, li, expected)) in plan.iter().enumerate() {
        trees.mark_step_begin();
        let inputs = [Input::buffer(&small[si]), Input::buffer(&large_bufs[li])];
        let call = call_costing(h, &trees, &f, &inputs, expected, &format!("call {i}"))?;
        let times = |v: &[f32], a: f32| v.iter().map(|x| a * x).collect::<Vec<_>>();
        expect(&call.outputs[0], &times(&small_values[si], 2.0), "2 x")?;
        expect(&call.outputs[1], &times(&large_values[li], 3.0), "3 y")?;
        served.push(call.served);
    }
    assert_eq!(served_kinds(&served)[2..], ["replayed"; 6]);
    Ok(())
}

/// A recording whose graph reads an input through a copy that runs past the input's end
/// (`z`'s upper half and what follows it) cannot be repointed at `z`. The large input `x`
/// is patched until the small `z` comes back at the previous call's address; then the
/// update is refused, reported once (`TreeEvent::CopyingInputs`, naming the copy node),
/// `x`'s slot is pointed back at its copy, and the recording copies both from then on.
/// Outputs equal the host's throughout.
pub(crate) fn an_unpatchable_recording_copies_from_then_on(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let (nx, nz) = (2 * N, N);
    let trees = s.trees(config(InputFeed::Auto {
        min_bytes: (nx * size_of::<f32>()) as u64,
    }))?;
    let k = s.k.clone();
    let driver = s.h.rt.driver().clone();
    // [2 x, 2 z[n/2..n]], z read through a window of n elements from z + n/2.
    let f = trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| {
            let half = a[1].numel() / 2;
            let window = ctx.alloc(DType::F32, &[a[1].numel()])?;
            let bytes = (a[1].numel() * size_of::<f32>()) as u64;
            let from = a[1].ptr().offset((half * size_of::<f32>()) as u64);
            driver.memcpy_dtod_async(window.ptr(), from, bytes, ctx.stream().handle())?;
            let upper = ctx.alloc(DType::F32, &[half])?;
            k.scale(ctx.stream(), &upper, window.arg(), 2.0, half)?;
            Ok(vec![k.scaled(ctx, &a[0], 2.0)?, upper])
        },
        named("window"),
    );
    let xs: Vec<Vec<f32>> = (0..2).map(|i| random(nx, 80 + i)).collect();
    let zs: Vec<Vec<f32>> = (0..2).map(|i| random(2 * nz, 90 + i)).collect();
    let xb: Vec<DeviceBuffer<f32>> = (xs.iter().map(|v| s.buffer(v))).collect::<Result<_, _>>()?;
    // Twice z's shape: the window's read past z stays inside the caller's buffer.
    let zb: Vec<DeviceBuffer<f32>> = (zs.iter().map(|v| s.buffer(v))).collect::<Result<_, _>>()?;
    let plan = [
        (0, 0, cost(0, 0)), // warm-up
        (0, 0, cost(0, 0)), // recording
        (1, 1, cost(1, 1)), // x patched, z copied
        (0, 0, cost(1, 1)),
        (1, 0, cost(1, 2)), // z wants patching: refused; x pointed back; both copied
        (0, 1, cost(0, 2)),
        (0, 1, cost(0, 2)), // z again at the previous call's address: still copied
    ];
    for (i, &(xi, zi, expected)) in plan.iter().enumerate() {
        trees.mark_step_begin();
        let inputs = [Input::buffer(&xb[xi]), Input::shaped(&zb[zi], &[nz])?];
        let call = call_costing(h, &trees, &f, &inputs, expected, &format!("call {i}"))?;
        let x2: Vec<f32> = xs[xi].iter().map(|v| 2.0 * v).collect();
        let z2: Vec<f32> = zs[zi][nz / 2..nz].iter().map(|v| 2.0 * v).collect();
        expect(&call.outputs[0], &x2, &format!("call {i}: 2 x"))?;
        expect(&call.outputs[1], &z2, &format!("call {i}: 2 z[n/2..n]"))?;
    }
    let refusals: Vec<TreeEvent> = (trees.take_events().into_iter())
        .filter(|e| matches!(e, TreeEvent::CopyingInputs { .. }))
        .collect();
    let [TreeEvent::CopyingInputs { reason, .. }] = refusals.as_slice() else {
        return Err(format!("one refusal expected: {refusals:?}").into());
    };
    assert!(
        reason.contains("cannot repoint graph node") && reason.contains("(memcpy)"),
        "{reason}"
    );
    Ok(())
}
