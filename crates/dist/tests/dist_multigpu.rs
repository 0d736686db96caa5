//! Two GPUs (the GPU bundle's `multi_dist_multigpu`, run only with `MULTI_GPU=1`): peer access
//! and copies between devices with expandable segments on the real driver, every collective on
//! two ranks against a reference (send and receive included), collectives captured into a
//! CUDA graph on each rank and replayed, and the bucketed all-reduce of an MLP's gradients
//! equal to their sum. Ignored by default; with `--include-ignored` on a machine with fewer
//! than two GPUs every test FAILS (never skips).
#![forbid(unsafe_code)]
mod common;
use common::{Res, TestResult, each_rank, gpus, nccl_groups};
use ferrocuda_dist::{BucketCaps, ReduceOp, Reducer, reduce_found_inf};
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;

const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);

fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 1000 + i) as f32 * 0.5).collect()
}

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
    let n = 4099;
    let sum: Vec<f32> = (0..n).map(|i| input(0, n)[i] + input(1, n)[i]).collect();
    let got = each_rank(&g, &groups, |r, pg, rt| {
        let dev = pg.device();
        let b = DeviceBuffer::from_slice(rt, dev, &input(r, n))?;
        pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
        let reduced = b.to_host()?;
        let b = DeviceBuffer::from_slice(rt, dev, &input(r, n))?;
        pg.broadcast(&b, 1)?.wait()?;
        let broadcast = b.to_host()?;
        let gathered = DeviceBuffer::<f32>::filled(rt, dev, 2 * n, 0.0)?;
        pg.all_gather(&gathered, &DeviceBuffer::from_slice(rt, dev, &input(r, n))?)?
            .wait()?;
        let big: Vec<f32> = [input(r, n), input(r, n)].concat();
        let scattered = DeviceBuffer::<f32>::filled(rt, dev, n, 0.0)?;
        pg.reduce_scatter(
            &scattered,
            &DeviceBuffer::from_slice(rt, dev, &big)?,
            ReduceOp::Sum,
        )?
        .wait()?;
        let p2p = DeviceBuffer::from_slice(rt, dev, &input(r, n))?;
        if r == 0 {
            pg.send(&p2p, 1)?.wait()?;
        } else {
            pg.recv(&p2p, 0)?.wait()?;
        }
        Ok((
            reduced,
            broadcast,
            gathered.to_host()?,
            scattered.to_host()?,
            p2p.to_host()?,
        ))
    })?;
    for (r, (reduced, broadcast, gathered, scattered, p2p)) in got.iter().enumerate() {
        assert_eq!(reduced, &sum);
        assert_eq!(broadcast, &input(1, n));
        assert_eq!(gathered, &[input(0, n), input(1, n)].concat());
        assert_eq!(scattered, &sum);
        assert_eq!(
            p2p,
            &input(0, n),
            "rank {r}: rank 0's data on both after send/recv"
        );
    }
    Ok(())
}

#[test]
#[ignore = "needs two GPUs and libnccl: runs in the GPU bundle with MULTI_GPU=1"]
fn gpu2_collectives_captured_into_graphs_replay_on_both_ranks() -> TestResult {
    let g = gpus(2, "")?;
    let groups = nccl_groups(&g, 2)?;
    let got = each_rank(&g, &groups, |r, pg, rt| -> Res<Vec<Vec<f32>>> {
        let dev = pg.device();
        let b = DeviceBuffer::from_slice(rt, dev, &[1.0f32 + r as f32; 512])?;
        pg.all_reduce(&b, ReduceOp::Sum)?.wait()?; // warm-up outside capture: 3 on both
        rt.synchronize(dev)?;
        let graph = CudaGraph::new(rt.clone(), g.allocators.clone(), dev)
            .map_err(|e| ferrocuda_dist::DistError::Reducer(e.to_string()))?;
        let capture = graph
            .capture(None, None, CaptureMode::ThreadLocal)
            .map_err(|e| ferrocuda_dist::DistError::Reducer(e.to_string()))?;
        pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
        capture
            .end()
            .map_err(|e| ferrocuda_dist::DistError::Reducer(e.to_string()))?;
        let mut seen = Vec::new();
        for _ in 0..3 {
            graph
                .replay(&rt.current_stream(dev)?)
                .map_err(|e| ferrocuda_dist::DistError::Reducer(e.to_string()))?;
            seen.push(b.to_host()?);
        }
        Ok(seen)
    })?;
    for seen in &got {
        // 3 after the warm-up; each replay doubles (both ranks hold the same value).
        assert_eq!(seen[0], vec![6.0; 512]);
        assert_eq!(seen[1], vec![12.0; 512]);
        assert_eq!(seen[2], vec![24.0; 512]);
    }
    Ok(())
}

/// A small MLP's parameter lengths: 784 → 256 → 64 → 10.
const MLP: [usize; 6] = [784 * 256, 256, 256 * 64, 64, 64 * 10, 10];

fn grad(rank: usize, param: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank + 1) * (param + 3) + i % 13) as f32 * 0.125)
        .collect()
}

#[test]
#[ignore = "needs two GPUs and libnccl: runs in the GPU bundle with MULTI_GPU=1"]
fn gpu2_bucketed_all_reduce_of_an_mlps_gradients_equals_their_sum() -> TestResult {
    let g = gpus(2, "")?;
    let groups = nccl_groups(&g, 2)?;
    let got = each_rank(&g, &groups, |r, pg, rt| {
        let dev = pg.device();
        let grads = MLP
            .iter()
            .enumerate()
            .map(|(p, &n)| DeviceBuffer::from_slice(rt, dev, &grad(r, p, n)))
            .collect::<Result<Vec<_>, _>>()?;
        let caps = BucketCaps {
            first_bytes: 64 << 10,
            bytes: 256 << 10,
        };
        let mut reducer = Reducer::new(
            rt.clone(),
            Arc::clone(&groups[r]),
            &MLP,
            caps,
            ReduceOp::Sum,
        )?;
        for p in (0..MLP.len()).rev() {
            reducer.grad_ready(p, &grads[p])?;
        }
        let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
        reducer.finish(&refs)?;
        let found = DeviceBuffer::from_slice(rt, dev, &[r as f32])?;
        reduce_found_inf(pg, &found)?;
        let values = grads
            .iter()
            .map(|b| b.to_host())
            .collect::<Result<Vec<_>, _>>()?;
        Ok((values, found.to_host()?))
    })?;
    for (values, found) in &got {
        for (p, &n) in MLP.iter().enumerate() {
            let sum: Vec<f32> = (0..n)
                .map(|i| grad(0, p, n)[i] + grad(1, p, n)[i])
                .collect();
            assert_eq!(values[p], sum, "parameter {p}");
        }
        assert_eq!(found, &vec![1.0]);
    }
    Ok(())
}
