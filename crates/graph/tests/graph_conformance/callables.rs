//! Graphed callables (`make_graphed_callables`).
use crate::{D0, N, Setup, TestResult};
use ferrocuda_graph::{Callable, GraphError, GraphedOptions, make_graphed_callables};
use ferrocuda_stream::{DeviceBuffer, StreamError};
use ferrocuda_testkit::Harness;
use std::cell::Cell;

/// `y = 2x` (counting its runs) and `z = 3y`, each into a buffer it allocates.
pub(crate) fn double_and_triple<'a>(
    s: &'a Setup<'_>,
    runs: &'a Cell<usize>,
) -> Vec<Callable<'a, f32>> {
    let scaled = move |a: f32| -> Callable<'a, f32> {
        Box::new(move |inputs| {
            if a == 2.0 {
                runs.set(runs.get() + 1);
            }
            let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
            s.scale(&s.h.rt.current_stream(D0)?, &y, &inputs[0], a)?;
            Ok(vec![y])
        })
    };
    vec![scaled(2.0), scaled(3.0)]
}

/// `make_graphed_callables`: warm-up runs, one shared pool, static inputs copied into only
/// when a different buffer is passed, outputs chained from one callable to the next, the
/// replay order checked in debug builds.
pub(crate) fn graphed_callables_chain(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let runs = Cell::new(0);
    let graphed = make_graphed_callables(
        &s.h.rt,
        &s.allocators,
        D0,
        double_and_triple(&s, &runs),
        vec![vec![s.buffer(0.0)?], vec![s.buffer(0.0)?]],
        GraphedOptions::default(),
    )?;
    assert_eq!(runs.get(), 4, "3 warm-up runs and the capture");
    assert_eq!(
        s.pool_users(graphed.pool())?,
        Some(2),
        "both graphs share the pool"
    );
    let stream = s.h.rt.current_stream(D0)?;
    for v in [4.0f32, 5.0] {
        let x = s.buffer(v)?;
        let y = graphed.call(0, &[&x])?;
        assert!(s.in_pool(graphed.pool(), &y[0])?);
        let z = graphed.call(1, &[&y[0]])?;
        s.expect(&stream, &z[0], 6.0 * v, "triple(double(x))")?;
    }
    let static_x = &graphed.inputs(0)?[0];
    static_x.copy_from_host(&vec![7.0; N])?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    let y = graphed.call(0, &[static_x])?;
    s.expect(
        &stream,
        &y[0],
        14.0,
        "the static input itself is not copied",
    )?;
    if cfg!(debug_assertions) {
        assert_eq!(
            graphed.call(0, &[static_x]).err(),
            Some(GraphError::ReplayOrder {
                expected: 1,
                found: 0
            })
        );
    }
    assert!(matches!(
        graphed.call(1, &[]),
        Err(GraphError::InputCount {
            expected: 1,
            found: 0
        })
    ));
    assert!(matches!(
        graphed.call(2, &[]),
        Err(GraphError::NoSuchCallable { index: 2, count: 2 })
    ));

    let failing: Callable<'_, f32> = Box::new(|_| Err("no kernel for this".into()));
    let err = make_graphed_callables(
        &s.h.rt,
        &s.allocators,
        D0,
        vec![failing],
        vec![vec![]],
        GraphedOptions::default(),
    );
    assert!(matches!(err, Err(GraphError::Callable { index: 0, .. })));
    let err = make_graphed_callables::<f32>(
        &s.h.rt,
        &s.allocators,
        D0,
        vec![],
        vec![vec![]],
        GraphedOptions::default(),
    );
    assert!(matches!(
        err,
        Err(GraphError::SampleCount {
            callables: 0,
            samples: 1
        })
    ));
    Ok(())
}

/// A call refused for an input of the wrong length changes nothing: no static input is
/// written, and in debug builds the replay order does not advance, so the next correct call
/// of the same callable is served.
pub(crate) fn graphed_callable_refused_call_changes_nothing(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let scaled = |a: f32| -> Callable<'_, f32> {
        let s = &s;
        Box::new(move |inputs| {
            let y = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
            s.scale(&s.h.rt.current_stream(D0)?, &y, &inputs[0], a)?;
            Ok(vec![y])
        })
    };
    let graphed = make_graphed_callables(
        &s.h.rt,
        &s.allocators,
        D0,
        vec![scaled(2.0), scaled(3.0)],
        vec![vec![s.buffer(1.0)?], vec![s.buffer(1.0)?]],
        GraphedOptions::default(),
    )?;
    let stream = s.h.rt.current_stream(D0)?;
    let short = DeviceBuffer::<f32>::filled(&s.h.rt, D0, N / 2, 5.0)?;
    assert_eq!(
        graphed.call(0, &[&short]).err(),
        Some(GraphError::Stream(StreamError::LengthMismatch {
            expected: N,
            found: N / 2
        }))
    );
    s.expect(&stream, &graphed.inputs(0)?[0], 1.0, "the static input")?;
    let x = s.buffer(4.0)?;
    let y = graphed.call(0, &[&x])?;
    s.expect(&stream, &y[0], 8.0, "the next call of callable 0 runs")?;
    let z = graphed.call(1, &[&y[0]])?;
    s.expect(&stream, &z[0], 24.0, "then callable 1")
}
