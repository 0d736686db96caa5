//! The guards in front of the trees: a changed size recompiles once with that dim dynamic
//! (Dynamo's automatic dynamic shapes), after which the dynamic specialisation serves every
//! size (cudagraph trees then record per size under it, as PyTorch's do); a change of the
//! autocast state makes a new specialisation; past the recompile limit calls run eagerly
//! with Dynamo's warning, or fail with `fail_on_recompile_limit_hit`.
use crate::{Setup, TestResult, expect, named, random, served_kinds};
use ferrocuda_amp::autocast::{Autocast, DeviceKind};
use ferrocuda_graph::guards::CacheConfig;
use ferrocuda_graph::trees::{
    Arg, Ctx, Input, Served, SkipReason, TreeConfig, TreeError, TreeEvent, WrapOptions, Wrapped,
};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;

/// `y = 3 x` over each size in turn (a step each), checking every output.
fn calls(s: &Setup<'_>, f: &Wrapped, sizes: &[usize]) -> Result<Vec<Served>, crate::BoxError> {
    let mut served = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let v = random(n, i as u64);
        let b: DeviceBuffer<f32> = s.buffer(&v)?;
        f.trees().mark_step_begin();
        let call = f.call(&[Input::buffer(&b)])?;
        expect(
            &call.outputs[0],
            &v.iter().map(|x| 3.0 * x).collect::<Vec<_>>(),
            "3x",
        )?;
        served.push(call.served);
    }
    Ok(served)
}

fn recompiles(events: &[TreeEvent]) -> Vec<&str> {
    events
        .iter()
        .filter_map(|e| match e {
            TreeEvent::Recompile(log) => Some(log.as_str()),
            _ => None,
        })
        .collect()
}

fn wrap(s: &Setup<'_>, options: WrapOptions) -> Result<Wrapped, crate::BoxError> {
    let trees = s.trees(TreeConfig::default())?;
    let k = s.k.clone();
    Ok(trees.wrap(
        move |ctx: &mut Ctx<'_>, a: &[Arg]| Ok(vec![k.scaled(ctx, &a[0], 3.0)?]),
        options,
    ))
}

/// 256, 256, 512, 512, 1024, 256: the second size recompiles once (the log names the size
/// guard that failed) into a dynamic specialisation, which then serves 1024 and 256 too,
/// each recorded under it.
pub(crate) fn guards_recompile_once_then_go_dynamic(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let f = wrap(&s, named("f"))?;
    let served = calls(&s, &f, &[256, 256, 512, 512, 1024, 256])?;
    assert_eq!(
        served_kinds(&served),
        [
            "warmup", "recorded", "warmup", "recorded", "warmup", "warmup"
        ]
    );
    let events = f.trees().take_events();
    let logs = recompiles(&events);
    assert_eq!(logs.len(), 1, "one recompile: {logs:?}");
    assert!(
        logs[0].contains("size mismatch at index 0. expected 256, actual 512"),
        "{}",
        logs[0]
    );
    Ok(())
}

/// The same size under autocast is another specialisation (the global-state guard), with
/// a recompile naming autocast; back outside, the first one serves again.
pub(crate) fn guards_follow_the_autocast_state(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let f = wrap(&s, named("f"))?;
    let mut served = calls(&s, &f, &[256, 256])?;
    {
        let _region = Autocast::new(DeviceKind::Cuda).enter()?;
        served.extend(calls(&s, &f, &[256, 256])?);
    }
    served.extend(calls(&s, &f, &[256])?);
    assert_eq!(
        served_kinds(&served),
        ["warmup", "recorded", "warmup", "recorded", "replayed"]
    );
    let events = f.trees().take_events();
    let logs = recompiles(&events);
    assert_eq!(logs.len(), 1, "{logs:?}");
    assert!(logs[0].contains("autocast"), "{}", logs[0]);
    Ok(())
}

/// With `dynamic=False` and a recompile limit of 2, a third size runs eagerly with Dynamo's
/// warning (once), and later misses run eagerly too; the sizes seen first still replay.
/// With `fail_on_recompile_limit_hit` the third size is an error instead.
pub(crate) fn guards_recompile_limit_runs_eagerly(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let guards = CacheConfig {
        recompile_limit: 2,
        automatic_dynamic_shapes: false,
        ..CacheConfig::default()
    };
    let f = wrap(
        &s,
        WrapOptions {
            guards,
            ..named("f")
        },
    )?;
    let served = calls(&s, &f, &[256, 256, 512, 512, 1024, 2048, 256])?;
    assert_eq!(
        served_kinds(&served),
        [
            "warmup", "recorded", "warmup", "recorded", "eager", "eager", "replayed"
        ]
    );
    let Served::Eager(SkipReason::RecompileLimit { warning }) = &served[4] else {
        return Err(format!("{:?}", served[4]).into());
    };
    assert!(
        warning.starts_with("torch._dynamo hit config.recompile_limit (2)\n   function: 'f'"),
        "{warning}"
    );
    let failing = wrap(
        &s,
        WrapOptions {
            guards: CacheConfig {
                fail_on_recompile_limit_hit: true,
                ..guards
            },
            ..named("g")
        },
    )?;
    calls(&s, &failing, &[256, 512])?;
    match calls(&s, &failing, &[1024]) {
        Err(e) => match e.downcast_ref::<TreeError>() {
            Some(TreeError::Skipped(SkipReason::RecompileLimit { .. })) => Ok(()),
            _ => Err(format!("another error: {e}").into()),
        },
        Ok(served) => Err(format!("served {served:?}").into()),
    }
}

/// Calls PyTorch refuses before Dynamo looks at its cache leave no trace in the guards: an
/// input too small for its shape (of the function's rank or another; a view past its
/// storage cannot be made), a wrong number of inputs (Python's `TypeError`), a stale
/// output passed in. None compiles an entry, uses a recompile slot or makes a dim dynamic:
/// the next good call replays the recording of the static specialisation, and with a
/// recompile limit of 2 a second size still compiles (warms up, records), once.
pub(crate) fn refused_calls_leave_no_trace(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let guards = CacheConfig {
        recompile_limit: 2,
        ..CacheConfig::default()
    };
    let f = wrap(
        &s,
        WrapOptions {
            guards,
            ..named("f")
        },
    )?;
    let trees = f.trees().clone();
    let n = 256;
    let v = random(n, 1);
    let x: DeviceBuffer<f32> = s.buffer(&v)?;
    let three_x: Vec<f32> = v.iter().map(|a| 3.0 * a).collect();
    let mut served = Vec::new();
    let mut kept = None;
    for _ in 0..2 {
        trees.mark_step_begin();
        let call = f.call(&[Input::buffer(&x)])?;
        expect(&call.outputs[0], &three_x, "3x")?;
        served.push(call.served);
        kept = Some(call.outputs[0].clone());
    }
    let kept = kept.ok_or("no output")?;
    for dims in [
        vec![n + 1],
        vec![usize::MAX, 2],
        vec![1 << 40, 1 << 40, 1 << 40],
    ] {
        match f.call(&[Input::shaped(&x, &dims)?]) {
            Err(TreeError::InputTooSmall { index: 0, .. }) => {}
            other => return Err(format!("{dims:?}: {:?}", other.map(|c| c.served)).into()),
        }
    }
    match f.call(&[Input::buffer(&x), Input::buffer(&x)]) {
        Err(TreeError::InputCount {
            expected: 1,
            found: 2,
            ..
        }) => {}
        other => return Err(format!("two inputs: {:?}", other.map(|c| c.served)).into()),
    }
    assert_eq!(trees.nodes().len(), 1, "the refusals recorded nothing");
    trees.mark_step_begin();
    let call = f.call(&[Input::buffer(&x)])?;
    expect(&call.outputs[0], &three_x, "3x after the refusals")?;
    served.push(call.served);
    match f.call(&[Input::output(&kept)]) {
        Err(TreeError::StaleOutput { .. }) => {}
        other => return Err(format!("a stale input: {:?}", other.map(|c| c.served)).into()),
    }
    // A second size: the only recompile, within the limit of 2.
    served.extend(calls(&s, &f, &[2 * n, 2 * n])?);
    assert_eq!(
        served_kinds(&served),
        ["warmup", "recorded", "replayed", "warmup", "recorded"]
    );
    let events = trees.take_events();
    let logs = recompiles(&events);
    assert_eq!(logs.len(), 1, "{logs:?}");
    assert!(
        logs[0].contains("size mismatch at index 0. expected 256, actual 512"),
        "{}",
        logs[0]
    );
    assert_eq!(f.functions().len(), 2, "one signature per good size");
    Ok(())
}
