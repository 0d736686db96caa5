//! One process per GPU, started by torchrun: the environment it sets ([`DistEnv`]), the
//! store the ranks meet through (torchrun's agent store, or one rank 0 runs, as
//! `torch.distributed`'s `env://` rendezvous does), and a process group made from them
//! ([`ProcessGroup::from_env`]): NCCL on the GPU, with its unique id shared through the
//! store; the store itself on the fake device ([`StoreRank`]).
use crate::store::{StoreError, TcpStore};
use crate::store_group::StoreRank;
use crate::{DistError, ProcessGroup, Result};
use ferrocuda_driver::nccl::{NcclComm, UniqueId};
use ferrocuda_stream::Runtime;
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;
use std::time::Duration;

/// What torchrun tells a worker (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_USE_AGENT_STORE`,
/// `TORCHELASTIC_RESTART_COUNT`), and PyTorch's `TORCH_NCCL_USE_COMM_NONBLOCKING`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// This process's rank in the job.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// Its rank on this machine: the GPU it uses.
    pub local_rank: usize,
    /// Processes on this machine, if said.
    pub local_world_size: Option<usize>,
    /// The store's host.
    pub master_addr: String,
    /// The store's port.
    pub master_port: u16,
    /// torchrun's agent runs the store (`TORCHELASTIC_USE_AGENT_STORE=True`): every rank
    /// connects to it; otherwise rank 0 runs it.
    pub agent_store: bool,
    /// How many times torchrun restarted the workers (0 if unset): a new attempt's keys do
    /// not meet an old one's.
    pub restart_count: u64,
    /// `TORCH_NCCL_USE_COMM_NONBLOCKING=1`: NCCL communicators made non-blocking, as
    /// PyTorch then makes them (off by default, as in PyTorch).
    pub nonblocking_comm: bool,
}

fn env_error(var: &'static str, message: String) -> DistError {
    DistError::Env { var, message }
}

fn number<T: std::str::FromStr>(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<T>> {
    match get(var) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| env_error(var, format!("{var}={v:?} is not a number in range"))),
    }
}

fn required<T: std::str::FromStr>(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<T> {
    number(get, var)?.ok_or_else(|| {
        env_error(
            var,
            format!("{var} is not set: start the workers with torchrun, which sets it"),
        )
    })
}

impl DistEnv {
    /// From the process's environment.
    pub fn from_env() -> Result<DistEnv> {
        DistEnv::from_vars(|k| std::env::var(k).ok())
    }

    /// From variables `get` returns (for tests and launchers of one's own). Missing or
    /// malformed variables, a rank outside the world, a local rank outside the machine are
    /// [`DistError::Env`] / [`DistError::InvalidRank`].
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
        let rank = required(&get, "RANK")?;
        let world_size: usize = required(&get, "WORLD_SIZE")?;
        if world_size == 0 {
            return Err(env_error(
                "WORLD_SIZE",
                "WORLD_SIZE=0: a job has at least one rank".into(),
            ));
        }
        if rank >= world_size {
            return Err(DistError::InvalidRank {
                rank,
                size: world_size,
            });
        }
        let local_rank = number(&get, "LOCAL_RANK")?.unwrap_or(0);
        let local_world_size = number(&get, "LOCAL_WORLD_SIZE")?;
        if let Some(n) = local_world_size.filter(|&n| local_rank >= n) {
            return Err(env_error(
                "LOCAL_RANK",
                format!("LOCAL_RANK={local_rank} but LOCAL_WORLD_SIZE={n}"),
            ));
        }
        let master_addr = get("MASTER_ADDR").ok_or_else(|| {
            env_error(
                "MASTER_ADDR",
                "MASTER_ADDR is not set: start the workers with torchrun, which sets it".into(),
            )
        })?;
        Ok(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port: required(&get, "MASTER_PORT")?,
            agent_store: get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True"),
            restart_count: number(&get, "TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0),
            nonblocking_comm: get("TORCH_NCCL_USE_COMM_NONBLOCKING")
                .is_some_and(|v| matches!(v.trim(), "1" | "true" | "True" | "TRUE" | "y" | "yes")),
        })
    }

    /// The GPU of this rank (`LOCAL_RANK`).
    pub fn device(&self) -> DeviceIndex {
        DeviceIndex(self.local_rank.min(usize::from(u16::MAX)) as u16)
    }

    /// This attempt's keys in the store begin with it.
    fn prefix(&self) -> String {
        format!("ferrocuda/attempt_{}", self.restart_count)
    }
}

/// The job's store, counted into as PyTorch's `TCPStore` does (`init/`): torchrun's
/// agent store, or (without one) rank 0 serves it on `MASTER_PORT` as `env://` does.
fn job_store(env: &DistEnv, timeout: Duration) -> Result<TcpStore> {
    let store = if env.rank == 0 && !env.agent_store {
        TcpStore::serve(env.master_port, None, timeout)?
    } else {
        TcpStore::connect(&env.master_addr, env.master_port, timeout)?
    };
    store.count_in()?;
    Ok(store)
}

/// How much longer than the others rank 0 waits at the rendezvous when its process holds
/// the store.
const HOST_GRACE: Duration = Duration::from_secs(1);

/// Connects to the job's store (torchrun's agent store, or rank 0's, which rank 0 starts on
/// `MASTER_PORT`), counts this rank in as PyTorch's `TCPStore` does (`init/`), then meets
/// every other rank within `timeout` (rank 0, holding the store, a second longer). A rank number taken twice is
/// [`DistError::DuplicateRank`] (for the second process to claim it); ranks that do not
/// arrive in time are [`DistError::RanksMissing`], naming them.
pub fn rendezvous(env: &DistEnv, timeout: Duration) -> Result<Arc<TcpStore>> {
    let hosts = env.rank == 0 && !env.agent_store;
    let store = job_store(env, timeout)?;
    // The store lives in rank 0's process: it waits a little longer than the others, so
    // that they can name the missing ranks before a failed rendezvous takes the store away.
    let wait = if hosts { timeout + HOST_GRACE } else { timeout };
    let prefix = env.prefix();
    if store.add(&format!("{prefix}/rank/{}", env.rank), 1)? > 1 {
        return Err(DistError::DuplicateRank { rank: env.rank });
    }
    let keys: Vec<String> = (0..env.world_size)
        .map(|r| format!("{prefix}/rank/{r}"))
        .collect();
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();
    match store.wait(&names, Some(wait)) {
        Ok(()) => Ok(Arc::new(store)),
        Err(StoreError::Timeout { .. }) => {
            let mut missing = Vec::new();
            for (r, k) in names.iter().enumerate() {
                if !store.check(&[k])? {
                    missing.push(r);
                }
            }
            Err(DistError::RanksMissing {
                missing,
                world_size: env.world_size,
                after: wait,
            })
        }
        Err(e) => Err(e.into()),
    }
}

impl ProcessGroup {
    /// The process group of a worker torchrun started ([`DistEnv::from_env`],
    /// [`rendezvous`]): on the GPU, NCCL on `LOCAL_RANK`'s device, with rank 0's unique id
    /// shared through the store; on the fake device, a [`StoreRank`]. `timeout` is
    /// `init_process_group`'s: it bounds the rendezvous (every rank has arrived before NCCL
    /// is asked for anything), every store operation and every collective (the group's
    /// watchdog, [`ProcessGroup::with_timeout`]). The communicator is made as PyTorch makes
    /// it: blocking by default; with `TORCH_NCCL_USE_COMM_NONBLOCKING=1`
    /// ([`DistEnv::nonblocking_comm`]) non-blocking, its creation bounded by `timeout` too
    /// (a rank that dies between the rendezvous and NCCL's creation is then an error, not a
    /// hang), at a price: on two H200s its all-reduce of 256 MiB ran at 265 GB/s against a
    /// blocking communicator's 289 GB/s (docs/multi_gpu.md).
    pub fn from_env(runtime: Arc<Runtime>, timeout: Duration) -> Result<ProcessGroup> {
        ProcessGroup::from_dist_env(runtime, &DistEnv::from_env()?, timeout)
    }

    /// [`ProcessGroup::from_env`] for a [`DistEnv`] given.
    pub fn from_dist_env(
        runtime: Arc<Runtime>,
        env: &DistEnv,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        let device = env.device();
        runtime.check_device(device)?;
        let store = rendezvous(env, timeout)?;
        let prefix = env.prefix();
        let comm: Box<dyn crate::Collective> = match runtime.driver().clone().into_cuda() {
            Some(cuda) => {
                let id = share_unique_id(&store, env.rank, &format!("{prefix}/nccl_id"))?;
                Box::new(nccl_rank(&cuda, env, &id, env.nonblocking_comm, timeout)?)
            }
            None => Box::new(StoreRank::new(
                runtime.driver().clone(),
                store.clone(),
                env.rank,
                env.world_size,
                device,
                &format!("{prefix}/group"),
            )?),
        };
        ProcessGroup::for_job(runtime, comm, store, timeout)
    }
}

impl ProcessGroup {
    /// A rank of a job whose other ranks may be PyTorch processes
    /// (`init_process_group("nccl")` under torchrun or `env://`): NCCL on `LOCAL_RANK`'s
    /// GPU, its unique id exchanged under the key where PyTorch's rank 0 puts it and its
    /// other ranks read it ([`pytorch_unique_id_key`]). PyTorch ranks claim no rank in the
    /// store, so this meets them at NCCL's creation only (non-blocking, bounded by
    /// `timeout`, as every collective is by the watchdog): a duplicate or missing rank is
    /// a timeout here, not [`DistError::DuplicateRank`] or [`DistError::RanksMissing`].
    /// PyTorch creates its communicator at its first collective (or at
    /// `init_process_group` when given `device_id`); that call must come within `timeout`.
    /// The communicator is made non-blocking whatever [`DistEnv::nonblocking_comm`] says
    /// (nothing else bounds the wait for PyTorch's ranks), which costs some speed
    /// ([`ProcessGroup::from_dist_env`]). Every rank must load the same libnccl (NCCL
    /// refuses ranks of different versions; docs/multi_gpu.md shows how to point ferrocuda
    /// at PyTorch's). On the fake device there is no NCCL to share: an error.
    pub fn join_pytorch(
        runtime: Arc<Runtime>,
        env: &DistEnv,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        let device = env.device();
        runtime.check_device(device)?;
        let cuda = runtime.driver().clone().into_cuda().ok_or(DistError::Env {
            var: "FERROCUDA_BACKEND",
            message: "PyTorch ranks share NCCL communicators: the fake device has none".into(),
        })?;
        let store = job_store(env, timeout)?;
        let id = share_unique_id(&store, env.rank, &pytorch_unique_id_key(env))?;
        let comm = nccl_rank(&cuda, env, &id, true, timeout)?;
        // The store lives as long as the group: PyTorch ranks may still be using it.
        ProcessGroup::for_job(runtime, Box::new(comm), Arc::new(store), timeout)
    }
}

/// This rank's communicator on `env`'s device: non-blocking (its creation bounded by
/// `timeout`) or blocking, as PyTorch's `TORCH_NCCL_USE_COMM_NONBLOCKING` chooses.
fn nccl_rank(
    cuda: &Arc<ferrocuda_driver::CudaDriver>,
    env: &DistEnv,
    id: &UniqueId,
    nonblocking: bool,
    timeout: Duration,
) -> Result<NcclComm> {
    let (dev, size, rank) = (env.device(), env.world_size, env.rank);
    Ok(if nonblocking {
        NcclComm::init_rank_nonblocking(cuda, dev, size, id, rank, timeout)?
    } else {
        NcclComm::init_rank(cuda, dev, size, id, rank)?
    })
}

/// Where PyTorch's default process group keeps its first NCCL communicator's unique id:
/// `init_process_group` wraps the rendezvous store in `PrefixStore("default_pg")`, then
/// the group's name (`"0/"`) and the device (`"cuda/"`), and ProcessGroupNCCL names the
/// id by its communicator counter (`"0"`) (`torch/distributed/distributed_c10d.py`,
/// `ProcessGroupNCCL::broadcastUniqueNCCLID`); under torchrun's agent store the
/// rendezvous store is itself `PrefixStore("/worker/attempt_<restart>")`
/// (`torch/distributed/rendezvous.py`). A `PrefixStore` joins with `/`.
pub fn pytorch_unique_id_key(env: &DistEnv) -> String {
    let key = "default_pg/0//cuda//0";
    if env.agent_store {
        format!("/worker/attempt_{}/{key}", env.restart_count)
    } else {
        key.to_owned()
    }
}

/// Rank 0 makes NCCL's unique id and publishes it under `key`; the others read it (a rank
/// 0 that could not make one publishes nothing usable, and the others fail at once).
fn share_unique_id(store: &TcpStore, rank: usize, key: &str) -> Result<UniqueId> {
    if rank == 0 {
        return match UniqueId::new() {
            Ok(id) => {
                store.set(key, &id.0)?;
                Ok(id)
            }
            Err(e) => {
                store.set(key, b"")?;
                Err(e.into())
            }
        };
    }
    let bytes = store.get(key)?;
    let id: [u8; 128] = bytes.as_slice().try_into().map_err(|_| DistError::Env {
        var: "RANK",
        message: "rank 0 could not make NCCL's unique id".into(),
    })?;
    Ok(UniqueId(id))
}
