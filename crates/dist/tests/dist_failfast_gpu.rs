//! NCCL communicators that fail instead of hanging, on one GPU (the GPU bundle's
//! `test_dist_failfast_gpu`; ignored without a GPU, where the bundle's `--include-ignored`
//! makes a missing GPU or libnccl a failure): a non-blocking communicator that runs every
//! collective and aborts; a creation whose peer never joins, timed out and aborted; a
//! collective stuck behind a kernel that outlives the timeout, caught by the watchdog,
//! which aborts the communicator and fails the group.
#![forbid(unsafe_code)]
mod common;
use common::{Gpus, TestResult, gpus};
use ferrocuda_dist::{DistError, ProcessGroup, ReduceOp};
use ferrocuda_driver::nccl::{NcclComm, NcclError, UniqueId};
use ferrocuda_stream::{DeviceBuffer, Module};
use ferrocuda_types::{DeviceIndex, KernelArg, LaunchConfig};
use std::time::{Duration, Instant};

const D0: DeviceIndex = DeviceIndex(0);

/// A one-rank non-blocking communicator (its asynchronous error checked) in a group whose
/// watchdog has `timeout`.
fn watched_one_rank(
    g: &Gpus,
    timeout: Duration,
) -> Result<ProcessGroup, Box<dyn std::error::Error>> {
    let comm = NcclComm::init_rank_nonblocking(
        &g.driver,
        D0,
        1,
        &UniqueId::new()?,
        0,
        Duration::from_secs(30),
    )?;
    comm.async_error()?;
    Ok(ProcessGroup::new(g.rt.clone(), Box::new(comm))?.with_timeout(timeout)?)
}

#[test]
#[ignore = "needs a GPU and libnccl: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_a_nonblocking_communicator_runs_collectives_then_aborts() -> TestResult {
    let g = gpus(1, "")?;
    let pg = watched_one_rank(&g, Duration::from_secs(30))?;
    let b = DeviceBuffer::from_slice(&g.rt, D0, &[1.5f32, -2.0, 4.0])?;
    pg.all_reduce(&b, ReduceOp::Sum)?.synchronize()?;
    pg.broadcast(&b, 0)?.synchronize()?;
    assert_eq!(b.to_host()?, vec![1.5, -2.0, 4.0]);
    assert_eq!(pg.error(), None);
    pg.abort()?;
    assert!(matches!(
        pg.all_reduce(&b, ReduceOp::Sum),
        Err(DistError::Aborted { .. })
    ));
    Ok(())
}

#[test]
#[ignore = "needs a GPU and libnccl: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_a_peer_that_never_joins_times_the_creation_out() -> TestResult {
    let g = gpus(1, "")?;
    let t0 = Instant::now();
    // Rank 0 of 2; rank 1 never comes.
    let made = NcclComm::init_rank_nonblocking(
        &g.driver,
        D0,
        2,
        &UniqueId::new()?,
        0,
        Duration::from_secs(2),
    );
    let took = t0.elapsed();
    match made {
        Err(NcclError::Timeout {
            what: "communicator creation",
            ..
        }) => {}
        other => return Err(format!("expected a creation timeout, got {other:?}").into()),
    }
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(20),
        "{took:?}"
    );
    Ok(())
}

/// Spins its one thread for `cycles` clock cycles.
const SPIN: &str = r#"
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"#;

#[test]
#[ignore = "needs a GPU and libnccl: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_a_stuck_collective_is_caught_by_the_watchdog() -> TestResult {
    let g = gpus(1, "")?;
    let pg = watched_one_rank(&g, Duration::from_millis(300))?;
    let b = DeviceBuffer::from_slice(&g.rt, D0, &[1.0f32; 1024])?;
    pg.all_reduce(&b, ReduceOp::Sum)?.synchronize()?;
    // The current stream spins for three seconds or more (the kernel's clock rate measured
    // first); the collective waits behind it.
    let spin = Module::from_cuda_source(&g.rt, D0, "failfast_spin", SPIN)?.function("spin")?;
    let current = g.rt.current_stream(D0)?;
    let one = LaunchConfig::for_elements(1, 1);
    let probe: i64 = 200_000_000;
    let t = Instant::now();
    current.launch(&spin, &one, &[KernelArg::value(&probe)])?;
    current.synchronize()?;
    let hz = probe as f64 / t.elapsed().as_secs_f64();
    println!(
        "spin kernel: {probe} cycles in {:?} ({:.2} GHz)",
        t.elapsed(),
        hz / 1e9
    );
    let cycles = (3.0 * hz) as i64;
    current.launch(&spin, &one, &[KernelArg::value(&cycles)])?;
    let t0 = Instant::now();
    let work = pg.all_reduce(&b, ReduceOp::Sum)?;
    let enqueued = t0.elapsed();
    let waited = work.synchronize();
    let caught = t0.elapsed();
    println!(
        "enqueued in {enqueued:?}, the wait ended after {caught:?}: {waited:?}, group: {:?}",
        pg.error()
    );
    let e = waited
        .err()
        .ok_or("the stuck collective completed: the watchdog did not fire")?;
    assert!(
        matches!(e, DistError::CollectiveTimeout { seq: 2, .. }),
        "{e:?}"
    );
    assert!(
        caught < Duration::from_millis(2500),
        "caught after {caught:?}, before the spin ended"
    );
    assert!(matches!(
        pg.all_reduce(&b, ReduceOp::Sum),
        Err(DistError::Aborted { .. })
    ));
    println!("watchdog caught the stuck collective after {caught:?}: {e}");
    // The aborted communicator's work behind the spin: how the stream ends is reported, not
    // asserted (NCCL documents no state for a context after an abort).
    println!("the stream after the abort: {:?}", current.synchronize());
    Ok(())
}
