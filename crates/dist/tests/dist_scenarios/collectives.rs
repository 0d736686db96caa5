//! Collectives, process groups and the bucketed reducer on the fake device with 2–4
//! devices, one thread per rank: every collective against a reference, PyTorch's stream
//! protocol (the communication stream after the current one, `Work::wait` a stream wait,
//! buffers in flight not reused), DDP's bucket assignment and launch order, overlap with
//! the backward pass, and `found_inf` reduced without a host synchronisation.
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_dist::{
    BucketCaps, DistError, FakeGroup, FakeRank, ProcessGroup, ReduceOp, Reducer, assign_buckets,
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
    ranks: Vec<FakeRank>,
    groups: Vec<Arc<ProcessGroup>>,
}

fn world(n: usize) -> Res<World> {
    let fake = Arc::new(FakeDriver::builder().devices(n).build());
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    DeviceAllocators::new(fake.clone(), AllocatorConfig::default(), Caching::On).install(&rt);
    let devices: Vec<DeviceIndex> = (0..n as u16).map(DeviceIndex).collect();
    let ranks = FakeGroup::ranks(fake.clone(), &devices)?;
    let groups = ranks
        .iter()
        .map(|r| ProcessGroup::new(rt.clone(), Box::new(r.clone())).map(Arc::new))
        .collect::<Res<Vec<_>>>()?;
    Ok(World {
        fake,
        rt,
        ranks,
        groups,
    })
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
    let bytes = DeviceBuffer::<u8>::filled(&w.rt, DeviceIndex(0), 4, 0)?;
    assert!(matches!(
        g.all_reduce(&bytes, ReduceOp::Sum),
        Err(DistError::UnsupportedType(ferrocuda_types::DType::U8))
    ));
    assert!(matches!(
        g.send(&small, 0),
        Err(DistError::InvalidRank { .. })
    ));
    Ok(())
}

#[test]
fn send_and_recv_pair_up_in_stream_order() -> TestResult {
    let w = world(3)?;
    let got = each_rank(&w, |r, g, rt| {
        let b = DeviceBuffer::from_slice(rt, g.device(), &input(r, 5))?;
        // A ring: each rank sends to the next and receives from the previous.
        let (next, prev) = ((r + 1) % 3, (r + 2) % 3);
        let out = DeviceBuffer::<f32>::filled(rt, g.device(), 5, 0.0)?;
        if r == 0 {
            g.send(&b, next)?.wait()?;
            g.recv(&out, prev)?.wait()?;
        } else {
            g.recv(&out, prev)?.wait()?;
            g.send(&b, next)?.wait()?;
        }
        Ok(out.to_host()?)
    })?;
    for (r, got) in got.iter().enumerate() {
        assert_eq!(
            got,
            &input((r + 2) % 3, 5),
            "rank {r} got its predecessor's data"
        );
    }
    Ok(())
}

#[test]
fn the_collective_runs_after_the_current_stream_and_work_wait_is_a_stream_wait() -> TestResult {
    let w = world(2)?;
    let bufs = each_rank(&w, |r, g, rt| {
        Ok(DeviceBuffer::from_slice(rt, g.device(), &input(r, 3))?)
    })?;
    w.fake.set_completion(Completion::Manual);
    let before = w.fake.calls(Call::StreamSynchronize) + w.fake.calls(Call::EventSynchronize);
    let markers = each_rank(&w, |r, g, rt| {
        let b = &bufs[r];
        b.fill(1.0)?; // pending on the current stream: the collective must come after it
        let work = g.all_reduce(b, ReduceOp::Sum)?;
        work.wait()?;
        let marker = DeviceBuffer::<f32>::uninit(rt, g.device(), 1)?;
        marker.fill(5.0)?; // after the wait: runs only once the collective has
        Ok((marker, work.is_completed()?))
    })?;
    assert!(markers.iter().all(|(_, done)| !done), "nothing has run yet");
    assert_eq!(
        w.fake.calls(Call::StreamSynchronize) + w.fake.calls(Call::EventSynchronize),
        before,
        "no host synchronisation"
    );
    // The group's own stream waits for every rank's input: alone, it runs nothing.
    let group_stream = w.ranks[0].group_stream();
    assert_eq!(w.fake.advance(group_stream, None)?, 0);
    assert_eq!(w.ranks[0].completed(), 0);
    let current0 = w.rt.current_stream(DeviceIndex(0))?;
    assert!(w.fake.pending(current0.handle())? > 0);
    w.fake.advance_all();
    w.fake.set_completion(Completion::Eager);
    for (r, b) in bufs.iter().enumerate() {
        assert_eq!(b.to_host()?, vec![2.0; 3], "rank {r}: the fills came first");
        assert_eq!(markers[r].0.to_host()?, vec![5.0]);
    }
    assert_eq!(w.ranks[0].completed(), 1);
    Ok(())
}

#[test]
fn a_buffer_dropped_while_its_collective_is_in_flight_is_not_reused() -> TestResult {
    let w = world(2)?;
    w.fake.set_completion(Completion::Manual);
    let reused = each_rank(&w, |r, g, rt| {
        let b = DeviceBuffer::from_slice(rt, g.device(), &input(r, 1024))?;
        let ptr = b.ptr();
        let work = g.all_reduce(&b, ReduceOp::Sum)?;
        drop(b);
        let again = DeviceBuffer::<f32>::uninit(rt, g.device(), 1024)?;
        let reused = again.ptr() == ptr;
        drop(work);
        Ok(reused)
    })?;
    assert_eq!(
        reused,
        vec![false, false],
        "record_stream held the memory for the comm stream"
    );
    w.fake.set_completion(Completion::Eager);
    w.fake.advance_all();
    Ok(())
}

/// A small MLP's parameters: (weight, bias) per layer, 32 → 16 → 8 → 4.
const MLP: [usize; 6] = [32 * 16, 16, 16 * 8, 8, 8 * 4, 4];

fn grad(rank: usize, param: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank + 1) * (param + 2) + i % 7) as f32 * 0.25)
        .collect()
}

#[test]
fn buckets_are_filled_in_reverse_order_with_ddps_caps() {
    let caps = BucketCaps {
        first_bytes: 200,
        bytes: 600,
    };
    // Reverse: 4 (16 B), 32*4 (128 B), 8 (32 B) → 176 B < 200, then 16*8 (512 B) closes at
    // 688 B; 16 (64 B), 32*16 (2048 B) closes the next.
    assert_eq!(
        assign_buckets(&MLP, caps),
        vec![vec![5, 4, 3, 2], vec![1, 0]]
    );
    assert_eq!(
        assign_buckets(&MLP, BucketCaps::default()),
        vec![vec![5, 4, 3, 2, 1, 0]]
    );
    assert_eq!(
        assign_buckets(
            &MLP,
            BucketCaps {
                first_bytes: 16,
                bytes: 16
            }
        ),
        vec![vec![5], vec![4], vec![3], vec![2], vec![1], vec![0]]
    );
}

#[test]
fn the_bucketed_all_reduce_of_an_mlps_gradients_is_their_sum() -> TestResult {
    for size in [2, 3, 4] {
        let w = world(size)?;
        let caps = BucketCaps {
            first_bytes: 200,
            bytes: 600,
        };
        let got = each_rank(&w, |r, g, rt| {
            let grads = MLP
                .iter()
                .enumerate()
                .map(|(p, &n)| DeviceBuffer::from_slice(rt, g.device(), &grad(r, p, n)))
                .collect::<Result<Vec<_>, _>>()?;
            let group = Arc::clone(&w.groups[r]);
            let mut reducer = Reducer::new(rt.clone(), group, &MLP, caps, ReduceOp::Sum)?;
            let mut launched_after = Vec::new();
            for iteration in 0..2 {
                for p in (0..MLP.len()).rev() {
                    reducer.grad_ready(p, &grads[p])?;
                    if iteration == 0 {
                        launched_after.push(reducer.launched().to_vec());
                    }
                }
                let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
                reducer.finish(&refs)?;
                if iteration == 0 {
                    // Second iteration reduces the already-reduced gradients again.
                    continue;
                }
            }
            let values = grads
                .iter()
                .map(|b| b.to_host())
                .collect::<Result<Vec<_>, _>>()?;
            Ok((values, launched_after))
        })?;
        let ranks = size as f32;
        for (values, launched) in &got {
            for (p, &n) in MLP.iter().enumerate() {
                let sum: Vec<f32> = (0..n)
                    .map(|i| (0..size).map(|r| grad(r, p, n)[i]).sum::<f32>() * ranks)
                    .collect();
                assert_eq!(values[p], sum, "parameter {p} on {size} ranks");
            }
            assert_eq!(
                launched,
                &vec![vec![], vec![], vec![], vec![0], vec![0], vec![0, 1]],
                "each bucket launched as soon as it was full"
            );
        }
    }
    Ok(())
}

#[test]
fn buckets_overlap_the_backward_pass_and_finish_waits_on_the_stream() -> TestResult {
    let w = world(2)?;
    let caps = BucketCaps {
        first_bytes: 200,
        bytes: 600,
    };
    w.fake.set_completion(Completion::Manual);
    let states = each_rank(&w, |r, g, rt| {
        let grads = MLP
            .iter()
            .enumerate()
            .map(|(p, &n)| DeviceBuffer::<f32>::filled(rt, g.device(), n, (r + p) as f32))
            .collect::<Result<Vec<_>, _>>()?;
        let group = Arc::clone(&w.groups[r]);
        let mut reducer = Reducer::new(rt.clone(), group, &MLP, caps, ReduceOp::Sum)?;
        for p in [5, 4, 3, 2] {
            reducer.grad_ready(p, &grads[p])?;
        }
        assert_eq!(reducer.launched(), &[0]);
        Ok((grads, reducer))
    })?;
    // Bucket 0 is in flight; the rest of the backward pass (compute stream) runs on
    // without waiting for it.
    let current = w.rt.current_stream(DeviceIndex(0))?.handle();
    let comm = w.groups[0].stream().handle();
    w.fake.advance(current, None)?;
    assert_eq!(
        w.fake.pending(current)?,
        0,
        "the compute stream never waits for the comm stream"
    );
    assert!(w.fake.pending(comm)? > 0, "the collective is still pending");
    w.fake.set_completion(Completion::Eager);
    w.fake.advance_all();
    let sums = std::thread::scope(|s| {
        let handles: Vec<_> = states
            .into_iter()
            .enumerate()
            .map(|(r, (grads, mut reducer))| {
                let rt = &w.rt;
                s.spawn(move || -> Res<Vec<Vec<f32>>> {
                    rt.set_device(DeviceIndex(r as u16))?;
                    for p in [1, 0] {
                        reducer.grad_ready(p, &grads[p])?;
                    }
                    let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
                    reducer.finish(&refs)?;
                    Ok(grads
                        .iter()
                        .map(|g| g.to_host())
                        .collect::<Result<_, _>>()?)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(DistError::Reducer("panicked".into())))
            })
            .collect::<Res<Vec<_>>>()
    })?;
    for s in &sums {
        for (p, &n) in MLP.iter().enumerate() {
            assert_eq!(s[p], vec![(2 * p + 1) as f32; n]);
        }
    }
    Ok(())
}

#[test]
fn finish_before_every_gradient_is_ready_and_a_double_mark_are_errors() -> TestResult {
    let w = world(2)?;
    let rt = &w.rt;
    let g = DeviceBuffer::<f32>::filled(rt, DeviceIndex(0), 4, 1.0)?;
    let mut reducer = Reducer::new(
        rt.clone(),
        w.groups[0].clone(),
        &[4, 4],
        BucketCaps::default(),
        ReduceOp::Sum,
    )?;
    reducer.grad_ready(1, &g)?;
    assert!(
        matches!(reducer.grad_ready(1, &g), Err(DistError::Reducer(m)) if m.contains("only once"))
    );
    assert!(
        matches!(reducer.finish(&[&g, &g]), Err(DistError::Reducer(m)) if m.contains("prior iteration"))
    );
    assert!(matches!(
        reducer.grad_ready(7, &g),
        Err(DistError::Reducer(_))
    ));
    let short = DeviceBuffer::<f32>::filled(rt, DeviceIndex(0), 3, 1.0)?;
    assert!(matches!(
        reducer.grad_ready(0, &short),
        Err(DistError::LengthMismatch { .. })
    ));
    Ok(())
}

#[test]
fn found_inf_is_reduced_across_ranks_without_a_host_sync() -> TestResult {
    let w = world(3)?;
    let flags = each_rank(&w, |r, g, rt| {
        Ok(DeviceBuffer::from_slice(
            rt,
            g.device(),
            &[if r == 1 { 1.0f32 } else { 0.0 }],
        )?)
    })?;
    let syncs = |f: &FakeDriver| {
        [
            Call::StreamSynchronize,
            Call::EventSynchronize,
            Call::DeviceSynchronize,
            Call::MemcpyDtoH,
        ]
        .iter()
        .map(|&c| f.calls(c))
        .sum::<u64>()
    };
    let before = syncs(&w.fake);
    each_rank(&w, |r, g, _| reduce_found_inf(g, &flags[r]))?;
    assert_eq!(syncs(&w.fake), before, "no host synchronisation");
    for f in &flags {
        assert_eq!(f.to_host()?, vec![1.0]);
    }
    Ok(())
}
