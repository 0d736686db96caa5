use super::*;

// Collectives give the mathematically right results (4 ranks, random data).
#[test]
fn a08_collectives_match_reference_four_ranks() {
    let e = env(4, Completion::Eager, &[], "");
    let n = 37usize;
    let world = 4usize;
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        assert_eq!(pg.rank(), rank);
        assert_eq!(pg.size(), world);
        let mut results: Vec<(String, Vec<f32>)> = Vec::new();
        for (salt, op) in [
            (1, ReduceOp::Sum),
            (2, ReduceOp::Avg),
            (3, ReduceOp::Max),
            (4, ReduceOp::Min),
            (5, ReduceOp::Product),
        ] {
            let b = DeviceBuffer::from_slice(rt, dev, &data(rank, salt, n)).unwrap();
            pg.all_reduce(&b, op).unwrap().wait().unwrap();
            results.push((format!("{op:?}"), b.to_host().unwrap()));
        }
        let b = DeviceBuffer::from_slice(rt, dev, &data(rank, 6, n)).unwrap();
        pg.broadcast(&b, 2).unwrap().wait().unwrap();
        results.push(("broadcast".into(), b.to_host().unwrap()));
        let input = DeviceBuffer::from_slice(rt, dev, &data(rank, 7, n * world)).unwrap();
        let output = DeviceBuffer::<f32>::filled(rt, dev, n, 0.0).unwrap();
        pg.reduce_scatter(&output, &input, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap();
        results.push(("reduce_scatter".into(), output.to_host().unwrap()));
        let input = DeviceBuffer::from_slice(rt, dev, &data(rank, 8, n)).unwrap();
        let output = DeviceBuffer::<f32>::filled(rt, dev, n * world, 0.0).unwrap();
        pg.all_gather(&output, &input).unwrap().wait().unwrap();
        results.push(("all_gather".into(), output.to_host().unwrap()));
        // i64 sum.
        let iv: Vec<i64> = (0..n as i64).map(|i| i * (rank as i64 + 1) - 3).collect();
        let ib = DeviceBuffer::from_slice(rt, dev, &iv).unwrap();
        pg.all_reduce(&ib, ReduceOp::Sum).unwrap().wait().unwrap();
        let got: Vec<f32> = ib.to_host().unwrap().iter().map(|&x| x as f32).collect();
        results.push(("i64 sum".into(), got));
        results
    });
    let inputs = |salt, len| (0..world).map(|r| data(r, salt, len)).collect::<Vec<_>>();
    let fold = |salt: u64, len: usize, f: &dyn Fn(f32, f32) -> f32| -> Vec<f32> {
        let ins = inputs(salt, len);
        (0..len)
            .map(|i| ins[1..].iter().fold(ins[0][i], |a, v| f(a, v[i])))
            .collect()
    };
    let sum = fold(1, n, &|a, b| a + b);
    let avg: Vec<f32> = fold(2, n, &|a, b| a + b)
        .iter()
        .map(|s| s / world as f32)
        .collect();
    let max = fold(3, n, &f32::max);
    let min = fold(4, n, &f32::min);
    let prod = fold(5, n, &|a, b| a * b);
    let bcast = data(2, 6, n);
    let rs_all = fold(7, n * world, &|a, b| a + b);
    let ag: Vec<f32> = inputs(8, n).concat();
    let isum: Vec<f32> = (0..n as i64)
        .map(|i| (1..=world as i64).map(|r| i * r - 3).sum::<i64>() as f32)
        .collect();
    for (rank, res) in out.iter().enumerate() {
        let want = [
            sum.clone(),
            avg.clone(),
            max.clone(),
            min.clone(),
            prod.clone(),
            bcast.clone(),
            rs_all[rank * n..(rank + 1) * n].to_vec(),
            ag.clone(),
            isum.clone(),
        ];
        for ((name, got), want) in res.iter().zip(want.iter()) {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                    "rank {rank} {name}[{i}]: got {g}, want {w}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Send and receive: a ring over 4 ranks, in both directions.
#[test]
fn a09_send_recv_ring() {
    let e = env(4, Completion::Eager, &[], "");
    let n = 65usize;
    let world = 4usize;
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let next = (rank + 1) % world;
        let prev = (rank + world - 1) % world;
        let mine = DeviceBuffer::from_slice(rt, dev, &data(rank, 11, n)).unwrap();
        let got = DeviceBuffer::<f32>::filled(rt, dev, n, 0.0).unwrap();
        // Even ranks send first, odd receive first: no cycle of blocking sends.
        if rank % 2 == 0 {
            pg.send(&mine, next).unwrap();
            pg.recv(&got, prev).unwrap().wait().unwrap();
        } else {
            pg.recv(&got, prev).unwrap().wait().unwrap();
            pg.send(&mine, next).unwrap();
        }
        let fwd = got.to_host().unwrap();
        // The other way.
        let got2 = DeviceBuffer::<f32>::filled(rt, dev, n, 0.0).unwrap();
        if rank % 2 == 0 {
            pg.send(&mine, prev).unwrap();
            pg.recv(&got2, next).unwrap().wait().unwrap();
        } else {
            pg.recv(&got2, next).unwrap().wait().unwrap();
            pg.send(&mine, prev).unwrap();
        }
        // Send to self, or to no rank: typed.
        let selfsend = pg.send(&mine, rank).err();
        let outside = pg.recv(&got, world).err();
        (fwd, got2.to_host().unwrap(), selfsend, outside)
    });
    for (rank, (fwd, bwd, selfsend, outside)) in out.into_iter().enumerate() {
        assert_eq!(
            fwd,
            data((rank + world - 1) % world, 11, n),
            "rank {rank} from prev"
        );
        assert_eq!(
            bwd,
            data((rank + 1) % world, 11, n),
            "rank {rank} from next"
        );
        assert_eq!(selfsend, Some(DistError::InvalidRank { rank, size: world }));
        assert_eq!(
            outside,
            Some(DistError::InvalidRank {
                rank: world,
                size: world
            })
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Mismatched calls are typed errors on every rank, and the group still works afterwards.
#[test]
fn a10_mismatched_collectives_are_typed_errors() {
    let e = env(3, Completion::Eager, &[], "");
    let world = 3usize;
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let mut errs = Vec::new();
        // Counts disagree.
        let b = DeviceBuffer::<f32>::filled(rt, dev, 4 + usize::from(rank == 1), 1.0).unwrap();
        errs.push(pg.all_reduce(&b, ReduceOp::Sum).err());
        // Roots disagree.
        let b = DeviceBuffer::<f32>::filled(rt, dev, 4, 1.0).unwrap();
        errs.push(pg.broadcast(&b, rank % 2).err());
        // Operations disagree.
        let op = if rank == 2 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        errs.push(pg.all_reduce(&b, op).err());
        // Types disagree: i32 on rank 0, f32 elsewhere.
        if rank == 0 {
            let bi = DeviceBuffer::<i32>::filled(rt, dev, 4, 1).unwrap();
            errs.push(pg.all_reduce(&bi, ReduceOp::Sum).err());
        } else {
            errs.push(pg.all_reduce(&b, ReduceOp::Sum).err());
        }
        // Kinds disagree.
        if rank == 0 {
            errs.push(pg.broadcast(&b, 0).err());
        } else {
            errs.push(pg.all_reduce(&b, ReduceOp::Sum).err());
        }
        // Local errors (no rendezvous): root out of range, wrong device, wrong lengths.
        let local = vec![
            pg.broadcast(&b, world).err(),
            pg.all_reduce(
                &DeviceBuffer::<f32>::filled(rt, DeviceIndex(((rank + 1) % world) as u16), 4, 0.0)
                    .unwrap(),
                ReduceOp::Sum,
            )
            .err(),
            pg.reduce_scatter(&b, &b, ReduceOp::Sum).err(),
            pg.all_gather(&b, &b).err(),
        ];
        // Still works.
        let ok = DeviceBuffer::<f32>::filled(rt, dev, 4, (rank + 1) as f32).unwrap();
        pg.all_reduce(&ok, ReduceOp::Sum).unwrap().wait().unwrap();
        (errs, local, ok.to_host().unwrap())
    });
    for (rank, (errs, local, ok)) in out.into_iter().enumerate() {
        for (i, err) in errs.iter().enumerate() {
            assert!(
                matches!(err, Some(DistError::Mismatched(_))),
                "rank {rank} mismatch #{i}: {err:?}"
            );
        }
        assert_eq!(
            local[0],
            Some(DistError::InvalidRank {
                rank: world,
                size: world
            })
        );
        assert!(
            matches!(local[1], Some(DistError::DeviceMismatch { .. })),
            "{:?}",
            local[1]
        );
        assert!(
            matches!(local[2], Some(DistError::LengthMismatch { .. })),
            "{:?}",
            local[2]
        );
        assert!(
            matches!(local[3], Some(DistError::LengthMismatch { .. })),
            "{:?}",
            local[3]
        );
        assert_eq!(ok, vec![6.0; 4], "rank {rank} after errors");
    }
}

// ---------------------------------------------------------------------------------------------
// A rank that drops out: the others must not hang forever.
#[test]
fn a11_rank_dropping_out_does_not_hang_forever() {
    let e = env(2, Completion::Eager, &[], "");
    let fake = e.fake.clone();
    let rt = e.rt.clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut ranks = FakeGroup::ranks(fake, &[D0, D1]).unwrap();
        let r1 = ranks.pop().unwrap();
        let r0 = ranks.pop().unwrap();
        // Rank 1 leaves: its process group is made and dropped without a call.
        let gone = std::thread::spawn({
            let rt = rt.clone();
            move || drop(ProcessGroup::new(rt, Box::new(r1)).unwrap())
        });
        gone.join().unwrap();
        let pg = ProcessGroup::new(rt.clone(), Box::new(r0)).unwrap();
        let b = DeviceBuffer::<f32>::filled(&rt, D0, 8, 1.0).unwrap();
        let r = pg.all_reduce(&b, ReduceOp::Sum).map(drop);
        let _ = tx.send(format!("{r:?}"));
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(r) => assert!(
            r.starts_with("Err"),
            "the survivor's all_reduce returned {r}"
        ),
        Err(_) => panic!(
            "rank 0's all_reduce still blocked 10 s after rank 1 dropped its process group \
             (no timeout, no error)"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Reducer: reverse-order buckets, launched when full and in order, averaged results.
#[test]
fn a12_reducer_buckets_and_average() {
    let e = env(3, Completion::Eager, &[], "");
    let world = 3usize;
    let lens = [3usize, 5, 2, 4, 6];
    let caps = BucketCaps {
        first_bytes: 16,
        bytes: 24,
    };
    assert_eq!(
        ferrocuda_dist::assign_buckets(&lens, caps),
        vec![vec![4], vec![3, 2], vec![1, 0]]
    );
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let mut red = Reducer::new(rt.clone(), pg.clone(), &lens, caps, ReduceOp::Avg).unwrap();
        assert_eq!(red.buckets(), vec![vec![4], vec![3, 2], vec![1, 0]]);
        let mut per_iter = Vec::new();
        for iter in 0..2u64 {
            let grads: Vec<DeviceBuffer<f32>> = lens
                .iter()
                .enumerate()
                .map(|(p, &l)| {
                    DeviceBuffer::from_slice(rt, dev, &data(rank, 100 * iter + p as u64, l))
                        .unwrap()
                })
                .collect();
            let mut launched_after = Vec::new();
            // Rank 0: reverse order (as autograd); others: forward order.
            let order: Vec<usize> = if rank == 0 {
                (0..5).rev().collect()
            } else {
                (0..5).collect()
            };
            for &p in &order {
                red.grad_ready(p, &grads[p]).unwrap();
                launched_after.push(red.launched().to_vec());
            }
            let double = red.grad_ready(order[0], &grads[order[0]]).err();
            let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
            red.finish(&refs).unwrap();
            let vals: Vec<Vec<f32>> = grads.iter().map(|g| g.to_host().unwrap()).collect();
            per_iter.push((launched_after, double, vals));
        }
        // finish before every gradient: DDP's error.
        let g = DeviceBuffer::<f32>::filled(rt, dev, 6, 0.0).unwrap();
        let early_grads: Vec<DeviceBuffer<f32>> = lens
            .iter()
            .map(|&l| DeviceBuffer::filled(rt, dev, l, 0.0).unwrap())
            .collect();
        let refs: Vec<&DeviceBuffer<f32>> = early_grads.iter().collect();
        let _ = g;
        let early = red.finish(&refs).err();
        (per_iter, early)
    });
    for (rank, (per_iter, early)) in out.into_iter().enumerate() {
        assert!(
            matches!(early, Some(DistError::Reducer(_))),
            "rank {rank}: {early:?}"
        );
        for (iter, (launched_after, double, vals)) in per_iter.into_iter().enumerate() {
            if rank == 0 {
                assert_eq!(
                    launched_after,
                    vec![vec![0], vec![0], vec![0, 1], vec![0, 1], vec![0, 1, 2]],
                    "rank 0 iter {iter}: buckets launched as they fill"
                );
            } else {
                assert_eq!(
                    launched_after,
                    vec![vec![], vec![], vec![], vec![], vec![0, 1, 2]],
                    "rank {rank} iter {iter}: launched only in order"
                );
            }
            assert!(matches!(double, Some(DistError::Reducer(_))), "{double:?}");
            for (p, &l) in lens.iter().enumerate() {
                let want: Vec<f32> = (0..l)
                    .map(|i| {
                        (0..world)
                            .map(|r| data(r, 100 * iter as u64 + p as u64, l)[i])
                            .sum::<f32>()
                            / world as f32
                    })
                    .collect();
                for (i, (g, w)) in vals[p].iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() < 1e-4,
                        "rank {rank} iter {iter} param {p}[{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// found_inf reduced across ranks with max: any rank's inf reaches all; Sum reducer too.
#[test]
fn a13_found_inf_and_sum_reducer() {
    let e = env(4, Completion::Manual, &[], "");
    let world = 4usize;
    let out = run_ranks(&e, world, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let fi =
            DeviceBuffer::<f32>::from_slice(rt, dev, &[if rank == 2 { 1.0 } else { 0.0 }]).unwrap();
        reduce_found_inf(&pg, &fi).unwrap();
        let seen = fi.to_host().unwrap()[0];
        let none = DeviceBuffer::<f32>::from_slice(rt, dev, &[0.0]).unwrap();
        reduce_found_inf(&pg, &none).unwrap();
        let seen_none = none.to_host().unwrap()[0];
        // A Sum reducer with one bucket per parameter (caps of 1 byte).
        let lens = [7usize, 1, 9];
        let caps = BucketCaps {
            first_bytes: 1,
            bytes: 1,
        };
        let mut red = Reducer::new(rt.clone(), pg.clone(), &lens, caps, ReduceOp::Sum).unwrap();
        let grads: Vec<DeviceBuffer<f32>> = lens
            .iter()
            .enumerate()
            .map(|(p, &l)| {
                DeviceBuffer::from_slice(rt, dev, &data(rank, 50 + p as u64, l)).unwrap()
            })
            .collect();
        for p in (0..3).rev() {
            red.grad_ready(p, &grads[p]).unwrap();
        }
        let refs: Vec<&DeviceBuffer<f32>> = grads.iter().collect();
        red.finish(&refs).unwrap();
        let vals: Vec<Vec<f32>> = grads.iter().map(|g| g.to_host().unwrap()).collect();
        (seen, seen_none, vals)
    });
    for (rank, (seen, seen_none, vals)) in out.into_iter().enumerate() {
        assert_eq!(seen, 1.0, "rank {rank} did not see rank 2's inf");
        assert_eq!(seen_none, 0.0, "rank {rank}");
        for (p, &l) in [7usize, 1, 9].iter().enumerate() {
            let want: Vec<f32> = (0..l)
                .map(|i| (0..world).map(|r| data(r, 50 + p as u64, l)[i]).sum())
                .collect();
            assert_eq!(vals[p], want, "rank {rank} param {p}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Collectives in manual completion: ordered after every rank's pending work; the current
//     stream waits only through Work::wait.
#[test]
fn a14_collective_stream_order_manual_completion() {
    let e = env(2, Completion::Manual, &[], "");
    let fake = e.fake.clone();
    let out = run_ranks(&e, 2, 60, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        // A side stream as current stream: the comm stream must wait for it.
        let side = rt.stream_from_pool(dev, true).unwrap();
        let _g = rt.stream_guard(&side).unwrap();
        let b = DeviceBuffer::<f32>::uninit(rt, dev, 16).unwrap();
        b.fill((rank + 1) as f32 * 10.0).unwrap(); // pending
        let w = pg.all_reduce(&b, ReduceOp::Sum).unwrap();
        let done_early = w.is_completed().unwrap();
        w.wait().unwrap();
        let v = b.to_host().unwrap();
        let _ = &fake;
        (done_early, v)
    });
    for (rank, (done_early, v)) in out.into_iter().enumerate() {
        assert!(
            !done_early,
            "rank {rank}: collective completed before pending inputs ran"
        );
        assert_eq!(v, vec![30.0; 16], "rank {rank}");
    }
}

// ---------------------------------------------------------------------------------------------
// A small exchange ordered as the fake group needs it (its send is a host rendezvous
//     with the receiver, documented on `ProcessGroup::send`): rank 0 sends then receives,
//     rank 1 receives then sends.
#[test]
fn a15_ordered_send_recv_exchange() {
    let e = env(2, Completion::Eager, &[], "");
    let out = run_ranks(&e, 2, 10, move |rank, pg, rt| {
        let dev = DeviceIndex(rank as u16);
        let mine = DeviceBuffer::<f32>::filled(rt, dev, 4, rank as f32 + 1.0).unwrap();
        let got = DeviceBuffer::<f32>::filled(rt, dev, 4, 0.0).unwrap();
        let other = 1 - rank;
        if rank == 0 {
            pg.send(&mine, other).unwrap().wait().unwrap();
            pg.recv(&got, other).unwrap().wait().unwrap();
        } else {
            pg.recv(&got, other).unwrap().wait().unwrap();
            pg.send(&mine, other).unwrap().wait().unwrap();
        }
        got.to_host().unwrap()
    });
    assert_eq!(out[0], vec![2.0; 4]);
    assert_eq!(out[1], vec![1.0; 4]);
}

// ---------------------------------------------------------------------------------------------
// Reducer given a gradient on another device than its group.
#[test]
fn a16_reducer_refuses_gradient_on_another_device() {
    let e = env(2, Completion::Eager, &[], "");
    let rt = &e.rt;
    let rank = FakeGroup::ranks(e.fake.clone(), &[D0])
        .unwrap()
        .pop()
        .unwrap();
    let pg = Arc::new(ProcessGroup::new(rt.clone(), Box::new(rank)).unwrap());
    let mut red = Reducer::new(
        rt.clone(),
        pg.clone(),
        &[4],
        BucketCaps::default(),
        ReduceOp::Sum,
    )
    .unwrap();
    let wrong = DeviceBuffer::<f32>::from_slice(rt, D1, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let r = red.grad_ready(0, &wrong);
    assert!(
        matches!(r, Err(DistError::DeviceMismatch { .. })),
        "grad_ready with a gradient on cuda:1 for a group on cuda:0 returned {r:?}"
    );
    // And finish writing results into a buffer of another device.
    let mut red = Reducer::new(rt.clone(), pg, &[4], BucketCaps::default(), ReduceOp::Sum).unwrap();
    let right = DeviceBuffer::<f32>::from_slice(rt, D0, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    red.grad_ready(0, &right).unwrap();
    let r = red.finish(&[&wrong]);
    assert!(
        matches!(r, Err(DistError::DeviceMismatch { .. })),
        "finish into a gradient on cuda:1 for a group on cuda:0 returned {r:?}"
    );
}
