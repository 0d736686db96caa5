//! A worker for torchrun: one process per GPU, each a ferrocuda rank. It makes its process
//! group from torchrun's variables (`ProcessGroup::from_dist_env`: the store torchrun's
//! agent made, NCCL on `LOCAL_RANK`'s GPU with its unique id shared through the store),
//! all-reduces `[rank + 1; 4]` and checks the sum. Under `FERROCUDA_BACKEND=fake` the ranks
//! are fake-device processes whose collectives move through the store: a run without GPUs.
//!
//! ```sh
//! cargo build --release --example torchrun_worker
//! torchrun --nproc_per_node=2 --no-python target/release/examples/torchrun_worker
//! FERROCUDA_BACKEND=fake torchrun --nproc_per_node=4 --no-python target/release/examples/torchrun_worker
//! ```
//! Run alone (no `RANK` in the environment), it is a job of one rank.
use ferrocuda::dist::{DistEnv, ProcessGroup, ReduceOp};
use ferrocuda::driver::FakeDriver;
use ferrocuda::stream::{DeviceBuffer, Runtime};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

fn main() -> ExitCode {
    match work() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("torchrun_worker: {e}");
            ExitCode::FAILURE
        }
    }
}

/// torchrun's variables, or those of a job of one rank where torchrun did not start us.
fn dist_env() -> Result<DistEnv, Box<dyn std::error::Error>> {
    if std::env::var_os("RANK").is_some() {
        return Ok(DistEnv::from_env()?);
    }
    println!("RANK is not set: a job of one rank (start the workers with torchrun for more)");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let port = port.to_string();
    Ok(DistEnv::from_vars(|k| match k {
        "RANK" | "LOCAL_RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("1".into()),
        "MASTER_ADDR" => Some("127.0.0.1".into()),
        "MASTER_PORT" => Some(port.clone()),
        _ => None,
    })?)
}

fn work() -> Result<(), Box<dyn std::error::Error>> {
    let env = dist_env()?;
    let gpu = ferrocuda::runtime();
    // One fake device per local rank, as a machine with that many GPUs would have.
    let rt = if gpu.driver().backend() == "cuda" && gpu.is_available() {
        gpu.clone()
    } else {
        let devices = env.local_world_size.unwrap_or(env.local_rank + 1);
        Runtime::new(Arc::new(FakeDriver::builder().devices(devices).build()))
    };
    let group = ProcessGroup::from_dist_env(rt.clone(), &env, Duration::from_secs(120))?;
    let (rank, size) = (group.rank(), group.size());
    let x = DeviceBuffer::from_slice(&rt, group.device(), &[rank as f32 + 1.0; 4])?;
    group.all_reduce(&x, ReduceOp::Sum)?.wait()?;
    let got = x.to_host()?;
    let want = (size * (size + 1) / 2) as f32;
    if got != [want; 4] {
        return Err(
            format!("rank {rank}: all_reduce gave {got:?}, expected {want} everywhere").into(),
        );
    }
    let place = if rt.driver().backend() == "cuda" {
        format!("the GPU (cuda:{})", group.device().0)
    } else {
        "the fake device, collectives through the store".into()
    };
    let store = if env.agent_store {
        "torchrun's agent store"
    } else {
        "rank 0's store"
    };
    println!(
        "rank {rank} of {size} on {place}: all_reduce ok ({want}), {store} at {}:{}",
        env.master_addr, env.master_port
    );
    Ok(())
}
