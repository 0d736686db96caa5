//! Lazy capture under a byte budget ([`LazyGraphs`]): a graph per batch size captured on
//! first use, replayed after, the least recently used dropped when a new one's planned
//! pool would not fit, its memory back with the driver at once; a size too large for the
//! whole budget is a typed error that drops nothing.
use crate::{BoxError, D0, N, Setup, TestResult};
use ferrocuda_graph::{GraphError, LazyGraphs, LazyStats};
use ferrocuda_stream::{DeviceBuffer, Stream};
use ferrocuda_testkit::Harness;

const MIB: u64 = 1 << 20;

/// A step for `batch`: a temporary of `batch` × 2 MiB (a large-pool segment of its own)
/// and an output of `N` floats holding `batch * input`.
fn step(
    s: &Setup<'_>,
    stream: &Stream,
    input: &DeviceBuffer<f32>,
    batch: usize,
) -> Result<DeviceBuffer<f32>, BoxError> {
    let temporary = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, batch * (MIB as usize / 2))?;
    s.scale(stream, &temporary, input, batch as f32)?;
    let out = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(stream, &out, &temporary, 1.0)?;
    Ok(out)
}

/// Runs `batch` through `lazy` and checks its output.
fn run(
    s: &Setup<'_>,
    lazy: &mut LazyGraphs<usize, DeviceBuffer<f32>>,
    input: &DeviceBuffer<f32>,
    batch: usize,
) -> TestResult {
    let current = s.h.rt.current_stream(D0)?;
    let out = lazy.run(batch, &current, |stream| step(s, stream, input, batch))?;
    s.expect(&current, out, batch as f32, &format!("batch {batch}"))?;
    assert!(
        lazy.held_bytes() <= lazy.budget(),
        "{} held, budget {}",
        lazy.held_bytes(),
        lazy.budget()
    );
    Ok(())
}

/// Two sizes fit the budget, a third drops the least recently used; a dropped size comes
/// back by a new capture; the device's reserved memory follows what is held.
pub(crate) fn lazy_capture_keeps_to_its_budget(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let input = s.buffer(1.0)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    // Each size's pool: a 20 MiB segment for the temporary, a 2 MiB one for the output.
    let mut lazy = LazyGraphs::new(s.h.rt.clone(), s.allocators.clone(), D0, 50 * MIB)?;
    run(&s, &mut lazy, &input, 1)?;
    run(&s, &mut lazy, &input, 2)?;
    assert_eq!(lazy.held_bytes(), 44 * MIB);
    let reserved_two = alloc.stats().reserved_bytes.all.current;
    run(&s, &mut lazy, &input, 1)?; // a replay: 1 is now the most recent
    run(&s, &mut lazy, &input, 3)?; // 2 goes
    assert_eq!(lazy.keys_by_use(), vec![1, 3]);
    assert!(!lazy.contains(&2));
    assert_eq!(
        alloc.stats().reserved_bytes.all.current,
        reserved_two,
        "2's pool went back before 3's was taken"
    );
    run(&s, &mut lazy, &input, 2)?; // 1 goes, 2 is captured again
    assert_eq!(lazy.keys_by_use(), vec![3, 2]);
    run(&s, &mut lazy, &input, 3)?;
    assert_eq!(
        lazy.stats(),
        LazyStats {
            captures: 4,
            replays: 2,
            evictions: 2,
        }
    );
    assert!(lazy.evict(&3)?);
    assert!(!lazy.evict(&3)?);
    assert_eq!(lazy.held_bytes(), 22 * MIB);
    drop(lazy);
    alloc.empty_cache();
    assert_eq!(
        alloc.stats().reserved_bytes.all.current,
        2 * MIB as i64,
        "only the input's segment stays once every graph is gone"
    );
    alloc.check_invariants()?;
    Ok(())
}

/// A size whose planned pool exceeds the whole budget is `OverBudget` before any capture,
/// and the graphs held stay.
pub(crate) fn a_size_over_the_whole_budget_is_refused(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let input = s.buffer(1.0)?;
    s.h.rt.current_stream(D0)?.synchronize()?;
    let mut lazy = LazyGraphs::new(s.h.rt.clone(), s.allocators.clone(), D0, 30 * MIB)?;
    run(&s, &mut lazy, &input, 1)?;
    let current = s.h.rt.current_stream(D0)?;
    let big = lazy.run(16, &current, |stream| step(&s, stream, &input, 16));
    match big {
        Err(e) => match e.downcast_ref::<GraphError>() {
            Some(GraphError::OverBudget { planned, budget }) => {
                assert_eq!((*planned, *budget), (34 * MIB, 30 * MIB));
            }
            _ => return Err(format!("expected OverBudget, got {e}").into()),
        },
        Ok(_) => return Err("a 34 MiB pool fit a 30 MiB budget".into()),
    }
    assert_eq!(lazy.keys_by_use(), vec![1], "nothing was dropped");
    assert_eq!(lazy.stats().captures, 1);
    run(&s, &mut lazy, &input, 1)?;
    Ok(())
}
