//! What the GPU tests of this crate share (`dist_gpu.rs`, `dist_multigpu.rs`, and the bench
//! `benches/multi_gpu.rs`): a runtime with the caching allocators over the real driver, and
//! one thread per rank.
#![allow(dead_code)] // each test binary uses part of it
pub(crate) mod rank_checks;
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_dist::{DistError, ProcessGroup};
use ferrocuda_driver::CudaDriver;
use ferrocuda_driver::nccl::{NcclComm, UniqueId};
use ferrocuda_stream::Runtime;
use ferrocuda_types::{AllocatorConfig, DeviceIndex};
use std::sync::Arc;

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;
pub(crate) type Res<T> = Result<T, DistError>;

pub(crate) struct Gpus {
    pub(crate) driver: Arc<CudaDriver>,
    pub(crate) rt: Arc<Runtime>,
    pub(crate) allocators: Arc<DeviceAllocators>,
}

/// The real driver with at least `n` devices, or why not (a failure: these tests run only
/// where the GPUs are).
pub(crate) fn gpus(n: usize, config: &str) -> Result<Gpus, Box<dyn std::error::Error>> {
    let driver = Arc::new(CudaDriver::new());
    if let Some(reason) = driver.unavailable_reason() {
        return Err(format!("no usable CUDA device ({reason}): this test needs {n} GPU(s)").into());
    }
    let rt = Runtime::new(driver.clone());
    if rt.device_count() < n {
        return Err(format!("{} GPU(s) here: this test needs {n}", rt.device_count()).into());
    }
    let allocators =
        DeviceAllocators::new(driver.clone(), AllocatorConfig::parse(config)?, Caching::On);
    allocators.install(&rt);
    Ok(Gpus {
        driver,
        rt,
        allocators,
    })
}

/// One NCCL rank per device of the first `n`, made with `ncclCommInitRank` and a shared
/// unique id, one thread each (as across processes).
pub(crate) fn nccl_groups(g: &Gpus, n: usize) -> Res<Vec<Arc<ProcessGroup>>> {
    let id = UniqueId::new()?;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (driver, rt) = (&g.driver, &g.rt);
                s.spawn(move || -> Res<Arc<ProcessGroup>> {
                    let dev = DeviceIndex(r as u16);
                    let comm = NcclComm::init_rank(driver, dev, n, &id, r)?;
                    Ok(Arc::new(ProcessGroup::new(rt.clone(), Box::new(comm))?))
                })
            })
            .collect();
        handles.into_iter().map(join).collect()
    })
}

/// Runs `f` on every rank, one thread each with its device current; results by rank.
pub(crate) fn each_rank<T: Send>(
    g: &Gpus,
    groups: &[Arc<ProcessGroup>],
    f: impl Fn(usize, &ProcessGroup, &Arc<Runtime>) -> Res<T> + Sync,
) -> Res<Vec<T>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .iter()
            .enumerate()
            .map(|(r, pg)| {
                let (f, rt) = (&f, &g.rt);
                s.spawn(move || {
                    rt.set_device(pg.device())?;
                    f(r, pg, rt)
                })
            })
            .collect();
        handles.into_iter().map(join).collect()
    })
}

fn join<T>(h: std::thread::ScopedJoinHandle<'_, Res<T>>) -> Res<T> {
    h.join()
        .unwrap_or_else(|_| Err(DistError::Reducer("a rank's thread panicked".into())))
}
