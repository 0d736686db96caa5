//! Collectives, process groups and the bucketed reducer on the fake device with 2–4
//! devices, one thread per rank: every collective against a reference, PyTorch's stream
//! protocol (the communication stream after the current one, `Work::wait` a stream wait,
//! buffers in flight not reused), DDP's bucket assignment and launch order, overlap with
//! the backward pass, and `found_inf` reduced without a host synchronisation.
use ferrocuda_alloc::DeviceAllocators;
use ferrocuda_dist::{
    BucketCaps, DistError, FakeGroup, ProcessGroup, ReduceOp, Reducer, assign_buckets,
    reduce_found_inf,
};
use ferrocuda_driver::{Call, Completion, FakeDriver};
use ferrocuda_stream::{DeviceBuffer, KernelCache, Runtime};
use ferrocuda_types::{AllocatorConfig, DeviceIndex};
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;
type Res<T> = Result<T, DistError>;

struct World {
    fake: Arc<FakeDriver>,
    rt: Arc<Runtime>,
    groups: Vec<Arc<ProcessGroup>>,
}

fn world(n: usize) -> Res<World> {
    let fake = Arc::new(FakeDriver::builder().devices(n).build());
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    DeviceAllocators::new(fake.clone(), AllocatorConfig::default(), true).install(&rt);
    let devices: Vec<DeviceIndex> = (0..n as u16).map(DeviceIndex).collect();
    let groups = FakeGroup::new(fake.clone(), &devices)?
        .into_iter()
        .map(|r| ProcessGroup::new(rt.clone(), Box::new(r)).map(Arc::new))
        .collect::<Res<Vec<_>>>()?;
    Ok(World { fake, rt, groups })
}

/// Runs `f` on every rank, one thread each with its device current; results by rank.
fn each_rank<T: Send>(
    w: &World,
    f: impl Fn(usize, &ProcessGroup, &Arc<Runtime>) -> Res<T> + Sync,
) -> Res<Vec<T>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = w
            .groups
            .iter()
            .enumerate()
            .map(|(r, g)| {
                let (f, rt) = (&f, &w.rt);
                s.spawn(move || {
                    rt.set_device(g.device())?;
                    f(r, g, rt)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(DistError::Reducer("a rank panicked".into())))
            })
            .collect()
    })
}

fn input(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (rank * 10 + i) as f32 - 3.0).collect()
}

#[test]
fn every_collective_matches_a_reference_on_2_3_and_4_ranks() -> TestResult {
    for size in 2..=4 {
        let w = world(size)?;
        let n = 6;
        let inputs: Vec<Vec<f32>> = (0..size).map(|r| input(r, n)).collect();
        let col = |i: usize| inputs.iter().map(move |v| v[i]);
        let sum: Vec<f32> = (0..n).map(|i| col(i).sum()).collect();
        let max: Vec<f32> = (0..n).map(|i| col(i).fold(f32::MIN, f32::max)).collect();
        let avg: Vec<f32> = sum.iter().map(|s| s / size as f32).collect();
        for (op, want) in [
            (ReduceOp::Sum, &sum),
            (ReduceOp::Max, &max),
            (ReduceOp::Avg, &avg),
        ] {
            let got = each_rank(&w, |r, g, rt| {
                let b = DeviceBuffer::from_slice(rt, g.device(), &input(r, n))?;
                g.all_reduce(&b, op)?.wait()?;
                Ok(b.to_host()?)
            })?;
            assert!(got.iter().all(|g| g == want), "{op:?} on {size}: {got:?}");
        }
        let got = each_rank(&w, |r, g, rt| {
            let b = DeviceBuffer::from_slice(rt, g.device(), &input(r, n))?;
            g.broadcast(&b, 1)?.wait()?;
            Ok(b.to_host()?)
        })?;
        assert!(got.iter().all(|g| *g == inputs[1]));
        let got = each_rank(&w, |r, g, rt| {
            let input = DeviceBuffer::from_slice(rt, g.device(), &input(r, n))?;
            let out = DeviceBuffer::<f32>::filled(rt, g.device(), n * size, 0.0)?;
            g.all_gather(&out, &input)?.wait()?;
            Ok(out.to_host()?)
        })?;
        assert!(got.iter().all(|g| *g == inputs.concat()));
        let got = each_rank(&w, |r, g, rt| {
            let big: Vec<f32> = (0..size).flat_map(|_| input(r, n)).collect();
            let input = DeviceBuffer::from_slice(rt, g.device(), &big)?;
            let out = DeviceBuffer::<f32>::filled(rt, g.device(), n, 0.0)?;
            g.reduce_scatter(&out, &input, ReduceOp::Sum)?.wait()?;
            Ok(out.to_host()?)
        })?;
        assert!(got.iter().all(|g| *g == sum), "reduce_scatter on {size}");
        let got = each_rank(&w, |r, g, rt| {
            let b = DeviceBuffer::from_slice(rt, g.device(), &[r as i64 + 1, 7])?;
            g.all_reduce(&b, ReduceOp::Product)?.wait()?;
            Ok(b.to_host()?)
        })?;
        let fact: i64 = (1..=size as i64).product();
        assert!(got.iter().all(|g| *g == vec![fact, 7i64.pow(size as u32)]));
    }
    Ok(())
}

#[test]
fn bad_calls_are_typed_errors() -> TestResult {
    let w = world(2)?;
    let errs = each_rank(&w, |r, g, rt| {
        let b = DeviceBuffer::<f32>::filled(rt, g.device(), 4 + r, 0.0)?;
        Ok(g.all_reduce(&b, ReduceOp::Sum).err())
    })?;
    assert!(
        errs.iter()
            .all(|e| matches!(e, Some(DistError::Mismatched(_)))),
        "{errs:?}"
    );
    let g = &w.groups[0];
    let other = DeviceBuffer::<f32>::filled(&w.rt, DeviceIndex(1), 4, 0.0)?;
    assert!(matches!(
        g.all_reduce(&other, ReduceOp::Sum),
        Err(DistError::DeviceMismatch { .. })
    ));
    let small = DeviceBuffer::<f32>::filled(&w.rt, DeviceIndex(0), 4, 0.0)?;
    assert!(matches!(
        g.all_gather(&small, &small),
        Err(DistError::LengthMismatch { .. })
    ));
    assert!(matches!(
        g.broadcast(&small, 2),
        Err(DistError::InvalidRank { rank: 2, size: 2 })
    ));
    assert!(matches!(
        g.send(&small, 1),
        Err(DistError::Unsupported("send"))
    ));
    assert!(matches!(
        g.send(&small, 0),
        Err(DistError::InvalidRank { .. })
    ));
    Ok(())
}
