//! A graph captured into a sleepable pool: its replay is refused while the pool sleeps,
//! and after wake it replays to its eager result at the same addresses, the offloaded
//! contents restored (ferrocuda's own sleep and wake).
use crate::{D0, N, Setup, TestResult};
use ferrocuda_alloc::{AllocError, SleepError, SleepMode};
use ferrocuda_graph::{CaptureMode, GraphError, PoolId};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::Harness;

/// A scratch buffer of `f32`s in a large segment of its own, so the pool holds memory worth
/// a sleep: 64 MiB on the fake device (host memory), 1 GiB on a GPU, where the driver keeps
/// small physical allocations (the pool's 2 MiB segment of the output) in chunks of its own
/// and the 99% is judged on what a server would put to sleep.
fn scratch_len(h: &Harness) -> usize {
    if h.fake.is_some() {
        16 << 20
    } else {
        256 << 20
    }
}

pub(crate) fn a_graph_over_a_sleeping_pool_replays_after_wake(h: &Harness) -> TestResult {
    let s = Setup::new(h)?;
    let alloc = s.allocators.device(D0)?;
    let pool = PoolId::handle();
    alloc.create_sleepable_pool(pool)?;
    let g = s.graph()?;
    let input = s.buffer(1.0)?;
    let capture = g.capture(None, Some(pool), CaptureMode::ThreadLocal)?;
    let stream = capture.stream().clone();
    let scratch = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, scratch_len(h))?;
    s.scale(&stream, &scratch, &input, 3.0)?;
    let output = DeviceBuffer::<f32>::uninit(&s.h.rt, D0, N)?;
    s.scale(&stream, &output, &scratch, 2.0)?;
    capture.end()?;
    assert!(
        s.in_pool(pool, &output)?,
        "the output lives in the sleepable pool"
    );
    let current = s.h.rt.current_stream(D0)?;
    input.copy_from_host(&vec![2.0; N])?;
    g.replay(&current)?;
    s.expect(&current, &output, 12.0, "before sleep")?;
    let (output_ptr, scratch_ptr) = (output.ptr(), scratch.ptr());

    let free_awake = s.h.rt.driver().mem_get_info(D0)?.0;
    let report = alloc.sleep(pool, SleepMode::Offload { checksum: true })?;
    let free_asleep = s.h.rt.driver().mem_get_info(D0)?.0;
    assert!(report.released_bytes >= (scratch_len(h) * 4) as u64);
    // At least 99% of what the pool held comes back to the device.
    let returned = free_asleep.saturating_sub(free_awake);
    assert!(
        returned * 100 >= report.released_bytes * 99,
        "{returned} bytes returned of {} released",
        report.released_bytes
    );
    match g.replay(&current) {
        Err(GraphError::Alloc(AllocError::Sleep(SleepError::Asleep(p)))) => assert_eq!(p, pool),
        other => return Err(format!("a replay over a sleeping pool: {other:?}").into()),
    }

    let woken = alloc.wake(pool)?;
    assert_eq!(woken.verified_segments, report.segments);
    assert_eq!((output.ptr(), scratch.ptr()), (output_ptr, scratch_ptr));
    s.expect(&current, &output, 12.0, "the output restored by wake")?;
    input.copy_from_host(&vec![5.0; N])?;
    g.replay(&current)?;
    s.expect(&current, &output, 30.0, "a replay after wake")?;
    drop((output, scratch));
    drop(g);
    alloc.release_pool(pool)?;
    alloc.empty_cache();
    assert!(
        alloc.pool_blocks(pool).is_empty(),
        "the pool's segments went back"
    );
    alloc.check_invariants()?;
    Ok(())
}
