//! Several GPUs (issue 16's speed part; the GPU bundle's `bench_multi_gpu`, run only with
//! `MULTI_GPU=1`): the all-reduce of 256 MiB fp32 over every visible GPU (one thread per
//! device, communicators from `ncclCommInitAll`, each call followed by a wait for its
//! stream), reported as NCCL's bus bandwidth `bytes * 2(n-1)/n / time` (criterion's
//! throughput and a `busbw` line); and a copy of 256 MiB from device 0 to device 1 with peer
//! access enabled (`DeviceBuffer::copy_from`, then both devices synchronised), in GB/s.
//! PyTorch's side is `xtask/anchors/torch_dist.py`. With fewer than two GPUs it FAILS
//! (exit 1), never skips: it runs only when asked.
#[path = "../tests/common/mod.rs"]
mod common;
use common::{Gpus, Res, each_rank, gpus};
use criterion::{Criterion, Throughput};
use ferrocuda_dist::{ProcessGroup, ReduceOp};
use ferrocuda_driver::nccl::NcclComm;
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_types::DeviceIndex;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 256 MiB of fp32.
const BYTES: usize = 256 << 20;
const LEN: usize = BYTES / 4;
const D0: DeviceIndex = DeviceIndex(0);
const D1: DeviceIndex = DeviceIndex(1);

/// Says why the bench cannot go on and exits nonzero (a bench asked for must not skip).
fn fail(why: impl std::fmt::Display) -> ! {
    eprintln!("bench multi_gpu FAILED: {why}");
    std::process::exit(1)
}

/// One process group per visible device, from `ncclCommInitAll`.
fn groups(g: &Gpus) -> Res<Vec<Arc<ProcessGroup>>> {
    let devices: Vec<DeviceIndex> = (0..g.rt.device_count())
        .map(|d| DeviceIndex(d as u16))
        .collect();
    NcclComm::init_all(&g.driver, &devices)?
        .into_iter()
        .map(|comm| Ok(Arc::new(ProcessGroup::new(g.rt.clone(), Box::new(comm))?)))
        .collect()
}

/// The median of `samples` (seconds per call), or `None` when there are none.
fn median(samples: &mut [f64]) -> Option<f64> {
    samples.sort_by(f64::total_cmp);
    samples.get(samples.len() / 2).copied()
}

fn all_reduce(c: &mut Criterion, g: &Gpus) -> Res<()> {
    let groups = groups(g)?;
    let n = groups.len();
    let bufs = each_rank(g, &groups, |_, pg, rt| {
        DeviceBuffer::<f32>::filled(rt, pg.device(), LEN, 1.0)
            .map_err(ferrocuda_dist::DistError::from)
    })?;
    let bus_bytes = (BYTES * 2 * (n - 1) / n) as u64;
    let per_call = Mutex::new(Vec::new());
    let mut group = c.benchmark_group("multi_gpu");
    group.throughput(Throughput::BytesDecimal(bus_bytes));
    group.sample_size(20);
    group.bench_function(format!("all_reduce_256MiB_f32_{n}gpus"), |b| {
        b.iter_custom(|iters| {
            // Each rank times its own calls; the slowest rank's time is the collective's.
            let times = each_rank(g, &groups, |r, pg, _| {
                let start = Instant::now();
                for _ in 0..iters {
                    pg.all_reduce(&bufs[r], ReduceOp::Sum)?.synchronize()?;
                }
                Ok(start.elapsed())
            })
            .unwrap_or_else(|e| fail(format!("all-reduce: {e}")));
            let slowest = times.into_iter().max().unwrap_or(Duration::ZERO);
            per_call
                .lock()
                .push(slowest.as_secs_f64() / iters.max(1) as f64);
            slowest
        })
    });
    group.finish();
    let secs = median(&mut per_call.lock())
        .unwrap_or_else(|| fail("the all-reduce bench took no samples"));
    println!(
        "ferrocuda_allreduce_busbw_GBps {:.2} (256 MiB fp32, {n} GPUs, median {:.1} us per call)",
        bus_bytes as f64 / secs / 1e9,
        secs * 1e6
    );
    Ok(())
}

fn peer_copy(c: &mut Criterion, g: &Gpus) -> Res<()> {
    let peer = g.rt.get_p2p_access(D0, D1)? && g.rt.get_p2p_access(D1, D0)?;
    println!("peer access between devices 0 and 1: {peer}");
    let src = DeviceBuffer::<f32>::filled(&g.rt, D0, LEN, 1.0)?;
    let dst = DeviceBuffer::<f32>::filled(&g.rt, D1, LEN, 0.0)?;
    let per_call = Mutex::new(Vec::new());
    let mut group = c.benchmark_group("multi_gpu");
    group.throughput(Throughput::BytesDecimal(BYTES as u64));
    group.sample_size(20);
    group.bench_function("peer_copy_256MiB_0_to_1", |b| {
        b.iter_custom(|iters| {
            let run = || -> Res<Duration> {
                g.rt.synchronize(D0)?;
                g.rt.synchronize(D1)?;
                let start = Instant::now();
                for _ in 0..iters {
                    dst.copy_from(&src)?;
                    g.rt.synchronize(D0)?;
                    g.rt.synchronize(D1)?;
                }
                Ok(start.elapsed())
            };
            let took = run().unwrap_or_else(|e| fail(format!("peer copy: {e}")));
            per_call
                .lock()
                .push(took.as_secs_f64() / iters.max(1) as f64);
            took
        })
    });
    group.finish();
    let secs =
        median(&mut per_call.lock()).unwrap_or_else(|| fail("the peer copy bench took no samples"));
    println!(
        "ferrocuda_peer_copy_GBps {:.2} (256 MiB, device 0 to 1, peer access {peer})",
        BYTES as f64 / secs / 1e9
    );
    Ok(())
}

fn main() {
    let g = gpus(2, "").unwrap_or_else(|e| fail(e));
    let mut c = Criterion::default().configure_from_args();
    if let Err(e) = all_reduce(&mut c, &g) {
        fail(format!("all-reduce: {e}"));
    }
    if let Err(e) = peer_copy(&mut c, &g) {
        fail(format!("peer copy: {e}"));
    }
    c.final_summary();
}
