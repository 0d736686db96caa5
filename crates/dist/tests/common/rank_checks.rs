//! What one rank runs and checks in the several-GPU tests, whether the ranks are threads
//! (`dist_multigpu.rs`) or processes torchrun started (`torchrun_multigpu.rs`): every
//! collective against a reference, an all-reduce captured in a graph and replayed, and the
//! bucketed all-reduce of an MLP's gradients with `found_inf` reduced across ranks. Each
//! computes every rank's inputs itself, so it checks its own results alone.
use super::Res;
use ferrocuda_alloc::DeviceAllocators;
use ferrocuda_dist::{BucketCaps, DistError, ProcessGroup, ReduceOp, Reducer, reduce_found_inf};
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::{DeviceBuffer, Runtime};
use std::sync::Arc;

fn check<T: PartialEq + std::fmt::Debug>(what: &str, got: &T, want: &T) -> Res<()> {
    if got == want {
        return Ok(());
    }
    let (got, want) = (format!("{got:?}"), format!("{want:?}"));
    let cut = |s: &str| s.chars().take(120).collect::<String>();
    Err(DistError::Mismatched(format!(
        "{what}: got {}…, want {}…",
        cut(&got),
        cut(&want)
    )))
}

fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 1000 + i) as f32 * 0.5).collect()
}

/// All-reduce, broadcast from the last rank, all-gather, reduce-scatter and a send from
/// rank 0 to rank 1 (the others keep theirs), each against the reference.
pub(crate) fn every_collective(r: usize, pg: &ProcessGroup, rt: &Arc<Runtime>) -> Res<()> {
    let (dev, size, n) = (pg.device(), pg.size(), 4099);
    let sum: Vec<f32> = (0..n)
        .map(|i| (0..size).map(|q| input(q, n)[i]).sum())
        .collect();
    let b = DeviceBuffer::from_slice(rt, dev, &input(r, n))?;
    pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
    check("all_reduce", &b.to_host()?, &sum)?;
    let b = DeviceBuffer::from_slice(rt, dev, &input(r, n))?;
    pg.broadcast(&b, size - 1)?.wait()?;
    check("broadcast", &b.to_host()?, &input(size - 1, n))?;
    let gathered = DeviceBuffer::<f32>::filled(rt, dev, size * n, 0.0)?;
    pg.all_gather(&gathered, &DeviceBuffer::from_slice(rt, dev, &input(r, n))?)?
        .wait()?;
    let all: Vec<f32> = (0..size).flat_map(|q| input(q, n)).collect();
    check("all_gather", &gathered.to_host()?, &all)?;
    let big: Vec<f32> = (0..size).flat_map(|_| input(r, n)).collect();
    let scattered = DeviceBuffer::<f32>::filled(rt, dev, n, 0.0)?;
    let big = DeviceBuffer::from_slice(rt, dev, &big)?;
    pg.reduce_scatter(&scattered, &big, ReduceOp::Sum)?.wait()?;
    check("reduce_scatter", &scattered.to_host()?, &sum)?;
    let p2p = DeviceBuffer::from_slice(rt, dev, &input(r, n))?;
    match r {
        0 => pg.send(&p2p, 1)?.wait()?,
        1 => pg.recv(&p2p, 0)?.wait()?,
        _ => {}
    }
    let want = if r == 1 { input(0, n) } else { input(r, n) };
    check("send/recv", &p2p.to_host()?, &want)
}

/// An all-reduce captured into a CUDA graph after one eager warm-up, replayed three times:
/// every rank holds the same value after the warm-up, and each replay multiplies it by
/// the group's size.
pub(crate) fn captured_all_reduce(
    r: usize,
    pg: &ProcessGroup,
    rt: &Arc<Runtime>,
    allocators: &Arc<DeviceAllocators>,
) -> Res<()> {
    let (dev, size) = (pg.device(), pg.size());
    let graph_error = |e: ferrocuda_graph::GraphError| DistError::Reducer(e.to_string());
    let b = DeviceBuffer::from_slice(rt, dev, &[1.0f32 + r as f32; 512])?;
    pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
    rt.synchronize(dev)?;
    let graph = CudaGraph::new(rt.clone(), allocators.clone(), dev).map_err(graph_error)?;
    let capture = graph
        .capture(None, None, CaptureMode::ThreadLocal)
        .map_err(graph_error)?;
    pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
    capture.end().map_err(graph_error)?;
    let mut value = (size * (size + 1) / 2) as f32;
    for replay in 0..3 {
        graph
            .replay(&rt.current_stream(dev)?)
            .map_err(graph_error)?;
        value *= size as f32;
        check(
            &format!("replay {replay}"),
            &b.to_host()?,
            &vec![value; 512],
        )?;
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

/// The MLP's gradients all-reduced in buckets as they become ready (last layer first), equal
/// to their sum, and `found_inf` (1 on the last rank only) reduced to 1 on every rank.
pub(crate) fn bucketed_mlp(r: usize, pg: &Arc<ProcessGroup>, rt: &Arc<Runtime>) -> Res<()> {
    let (dev, size) = (pg.device(), pg.size());
    let grads = MLP
        .iter()
        .enumerate()
        .map(|(p, &n)| DeviceBuffer::from_slice(rt, dev, &grad(r, p, n)))
        .collect::<Result<Vec<_>, _>>()?;
    let caps = BucketCaps {
        first_bytes: 64 << 10,
        bytes: 256 << 10,
    };
    let mut reducer = Reducer::new(rt.clone(), Arc::clone(pg), &MLP, caps, ReduceOp::Sum)?;
    for p in (0..MLP.len()).rev() {
        reducer.grad_ready(p, &grads[p])?;
    }
    let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
    reducer.finish(&refs)?;
    let found = DeviceBuffer::from_slice(rt, dev, &[f32::from(r + 1 == size)])?;
    reduce_found_inf(pg, &found)?;
    for (p, &n) in MLP.iter().enumerate() {
        let sum: Vec<f32> = (0..n)
            .map(|i| (0..size).map(|q| grad(q, p, n)[i]).sum())
            .collect();
        check(&format!("parameter {p}"), &grads[p].to_host()?, &sum)?;
    }
    check("found_inf", &found.to_host()?, &vec![1.0])
}
