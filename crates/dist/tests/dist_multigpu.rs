//! Two GPUs (the GPU bundle's `multi_dist_multigpu`, run only with `MULTI_GPU=1`): peer access
//! and copies between devices with expandable segments on the real driver, every collective on
//! two ranks against a reference (send and receive included), collectives captured into a
//! CUDA graph on each rank and replayed, and the bucketed all-reduce of an MLP's gradients
//! equal to their sum. Ignored by default; with `--include-ignored` on a machine with fewer
//! than two GPUs every test FAILS (never skips).
#![forbid(unsafe_code)]
mod common;
use common::{TestResult, each_rank, gpus, nccl_groups, rank_checks};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_types::DeviceIndex;

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);

#[test]
#[ignore = "needs two GPUs and libnccl: runs in the GPU bundle with MULTI_GPU=1"]
fn gpu2_peer_access_and_copies_between_devices_with_expandable_segments() -> TestResult {
    let g = gpus(2, "expandable_segments:True")?;
    let can = g.rt.can_device_access_peer(D0, D1)?;
    assert_eq!(g.rt.get_p2p_access(D0, D1)?, can);
    assert_eq!(g.rt.get_p2p_access(D0, D1)?, can, "cached, idempotent");
    let values: Vec<f32> = (0..(3 << 20)).map(|i| i as f32).collect();
    let a = DeviceBuffer::from_slice(&g.rt, D0, &values)?;
    let b = DeviceBuffer::<f32>::filled(&g.rt, D1, values.len(), 0.0)?;
    b.copy_from(&a)?;
    assert_eq!(b.to_host()?, values);
    b.fill(7.0)?;
    a.copy_from(&b)?;
    assert_eq!(a.to_host()?, vec![7.0; values.len()]);
    if can {
        assert_eq!(g.allocators.device(D1)?.peers(), vec![D0]);
    }
    // Memory mapped after access was enabled is open too.
    let c = DeviceBuffer::<f32>::filled(&g.rt, D1, 40 << 20, 1.0)?;
    let d = DeviceBuffer::<f32>::filled(&g.rt, D0, 40 << 20, 0.0)?;
    d.copy_from(&c)?;
    assert!(d.to_host()?.iter().all(|&x| x == 1.0));
    Ok(())
}

#[test]
#[ignore = "needs two GPUs and libnccl: runs in the GPU bundle with MULTI_GPU=1"]
fn gpu2_every_collective_matches_a_reference() -> TestResult {
    let g = gpus(2, "")?;
    let groups = nccl_groups(&g, 2)?;
    each_rank(&g, &groups, rank_checks::every_collective)?;
    Ok(())
}

#[test]
#[ignore = "needs two GPUs and libnccl: runs in the GPU bundle with MULTI_GPU=1"]
fn gpu2_collectives_captured_into_graphs_replay_on_both_ranks() -> TestResult {
    let g = gpus(2, "")?;
    let groups = nccl_groups(&g, 2)?;
    each_rank(&g, &groups, |r, pg, rt| {
        rank_checks::captured_all_reduce(r, pg, rt, &g.allocators)
    })?;
    Ok(())
}

#[test]
#[ignore = "needs two GPUs and libnccl: runs in the GPU bundle with MULTI_GPU=1"]
fn gpu2_bucketed_all_reduce_of_an_mlps_gradients_equals_their_sum() -> TestResult {
    let g = gpus(2, "")?;
    let groups = nccl_groups(&g, 2)?;
    each_rank(&g, &groups, |r, _, rt| {
        rank_checks::bucketed_mlp(r, &groups[r], rt)
    })?;
    Ok(())
}
