//! NCCL on one GPU (the GPU bundle's `test_dist_gpu`): a one-rank communicator made both ways,
//! every collective of one rank on ferrocuda buffers and streams, a collective captured
//! into a CUDA graph and replayed, and the bucketed reducer. Ignored without a GPU; the
//! bundle runs it with `--include-ignored`, where a missing GPU or libnccl fails it.
#![forbid(unsafe_code)]
mod common;
use common::{TestResult, each_rank, gpus, nccl_groups};
use ferrocuda_dist::{BucketCaps, ProcessGroup, ReduceOp, Reducer, reduce_found_inf};
use ferrocuda_driver::nccl::{self, NcclComm};
use ferrocuda_graph::{CaptureMode, CudaGraph};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;

const D0: DeviceIndex = DeviceIndex(0);

#[test]
#[ignore = "needs a GPU and libnccl: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_one_rank_collectives_on_ferrocuda_buffers() -> TestResult {
    let g = gpus(1, "")?;
    assert!(nccl::version()? >= 21000);
    let groups = nccl_groups(&g, 1)?;
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let out = each_rank(&g, &groups, |_, pg, rt| {
        let b = DeviceBuffer::from_slice(rt, D0, &values)?;
        pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
        pg.broadcast(&b, 0)?.wait()?;
        let gathered = DeviceBuffer::<f32>::filled(rt, D0, 1000, 0.0)?;
        pg.all_gather(&gathered, &b)?.wait()?;
        let scattered = DeviceBuffer::<f32>::filled(rt, D0, 1000, 0.0)?;
        pg.reduce_scatter(&scattered, &gathered, ReduceOp::Max)?
            .wait()?;
        Ok(scattered.to_host()?)
    })?;
    assert_eq!(out[0], values);

    // ncclCommInitAll's communicator, on a stream of ours.
    let comm = NcclComm::init_all(&g.driver, &[D0])?
        .pop()
        .ok_or("no communicator")?;
    assert_eq!((comm.rank(), comm.size(), comm.device()), (0, 1, D0));
    let pg = ProcessGroup::new(g.rt.clone(), Box::new(comm))?;
    let b = DeviceBuffer::from_slice(&g.rt, D0, &[3i64, -4])?;
    pg.all_reduce(&b, ReduceOp::Min)?.wait()?;
    assert_eq!(b.to_host()?, vec![3, -4]);
    Ok(())
}

#[test]
#[ignore = "needs a GPU and libnccl: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_one_rank_all_reduce_captured_into_a_graph_replays() -> TestResult {
    let g = gpus(1, "")?;
    let pg = nccl_groups(&g, 1)?.pop().ok_or("no group")?;
    let b = DeviceBuffer::from_slice(&g.rt, D0, &[1.0f32; 256])?;
    // Warm up outside capture (NCCL sets up its buffers at the first call).
    pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
    g.rt.synchronize(D0)?;
    let graph = CudaGraph::new(g.rt.clone(), g.allocators.clone(), D0)?;
    {
        let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?;
        pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
        b.fill(2.0)?;
        pg.all_reduce(&b, ReduceOp::Sum)?.wait()?;
        capture.end()?;
    }
    // One rank, in place: NCCL enqueues nothing for the collective, so the fill's memset is
    // what the graph holds; the collectives' capture must still succeed and replay.
    assert!(graph.node_count()? >= 1);
    b.fill(0.0)?;
    let stream = g.rt.current_stream(D0)?;
    graph.replay(&stream)?;
    assert_eq!(b.to_host()?, vec![2.0; 256]);
    Ok(())
}

#[test]
#[ignore = "needs a GPU and libnccl: runs in the GPU bundle (cargo xtask gpu-bundle)"]
fn gpu_one_rank_bucketed_reducer_and_found_inf() -> TestResult {
    let g = gpus(1, "")?;
    let pg = nccl_groups(&g, 1)?.pop().ok_or("no group")?;
    let lens = [4096, 64, 512, 8];
    let grads = lens
        .iter()
        .enumerate()
        .map(|(p, &n)| DeviceBuffer::<f32>::filled(&g.rt, D0, n, p as f32 + 0.5))
        .collect::<Result<Vec<_>, _>>()?;
    let caps = BucketCaps {
        first_bytes: 1024,
        bytes: 4096,
    };
    let mut reducer = Reducer::new(g.rt.clone(), Arc::clone(&pg), &lens, caps, ReduceOp::Sum)?;
    for p in (0..lens.len()).rev() {
        reducer.grad_ready(p, &grads[p])?;
    }
    let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
    reducer.finish(&refs)?;
    for (p, gr) in grads.iter().enumerate() {
        assert_eq!(gr.to_host()?, vec![p as f32 + 0.5; lens[p]]);
    }
    let found = DeviceBuffer::from_slice(&g.rt, D0, &[1.0f32])?;
    reduce_found_inf(&pg, &found)?;
    assert_eq!(found.to_host()?, vec![1.0]);
    Ok(())
}
