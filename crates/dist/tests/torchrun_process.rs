//! Ranks in separate processes, as torchrun starts them, on the fake device (CI has no GPU):
//! this binary runs the scenarios and re-runs itself as each worker, with torchrun's
//! variables set. Workers meet through the store (rank 0's, or an agent store the parent
//! runs, as torchrun's agent does), make a process group with `ProcessGroup::from_env`
//! and run every collective through it, checking the results. Bad runs end in typed errors
//! within the timeout: a rank given twice, a rank that never arrives, a peer that dies
//! before a collective.
#![forbid(unsafe_code)]
use ferrocuda_dist::{DistError, ProcessGroup, ReduceOp, StoreError, TcpStoreServer};
use ferrocuda_driver::FakeDriver;
use ferrocuda_stream::{DeviceBuffer, Runtime};
use std::net::TcpListener;
use std::process::{Command, ExitCode, Output};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A scenario the parent runs.
type Scenario = fn() -> Result<(), String>;

/// Set in a worker: what it should do and what outcome it expects.
const ROLE: &str = "FERROCUDA_TEST_WORKER";

fn main() -> ExitCode {
    if let Ok(role) = std::env::var(ROLE) {
        return match worker(&role) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                println!("worker failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let scenarios: [(&str, Scenario); 5] = [
        (
            "four ranks meet at rank 0's store and agree on every collective",
            four_ranks,
        ),
        (
            "ranks meet at an agent store, as under torchrun",
            agent_store,
        ),
        (
            "a rank given twice is an error, and the others time out naming the missing",
            duplicate_rank,
        ),
        (
            "a rank that never arrives is named within the timeout",
            missing_rank,
        ),
        (
            "a peer gone before a collective makes it a timeout, not a hang",
            dead_peer,
        ),
    ];
    let mut failed = 0;
    for (name, run) in scenarios {
        match run() {
            Ok(()) => println!("test {name} ... ok"),
            Err(e) => {
                failed += 1;
                println!("test {name} ... FAILED\n{e}");
            }
        }
    }
    println!(
        "\ntest result: {}. {} passed; {failed} failed",
        if failed == 0 { "ok" } else { "FAILED" },
        scenarios.len() - failed
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A port nobody listens on now.
fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// Starts worker `rank` of `world` (role `role`), with torchrun's variables.
fn spawn(
    role: &str,
    rank: usize,
    world: usize,
    port: u16,
    agent: bool,
) -> Result<std::process::Child, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = Command::new(exe);
    c.env(ROLE, role)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("TORCHELASTIC_RESTART_COUNT", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if agent {
        c.env("TORCHELASTIC_USE_AGENT_STORE", "True");
    }
    c.spawn().map_err(|e| e.to_string())
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs workers (role per rank) and returns their outputs, by rank.
fn run(
    roles: &[(&str, usize)],
    world: usize,
    port: u16,
    agent: bool,
) -> Result<Vec<Output>, String> {
    let children: Vec<_> = roles
        .iter()
        .map(|&(role, rank)| spawn(role, rank, world, port, agent))
        .collect::<Result<_, _>>()?;
    children
        .into_iter()
        .map(|c| c.wait_with_output().map_err(|e| e.to_string()))
        .collect()
}

fn all_succeed(outs: &[Output]) -> Result<(), String> {
    for (i, o) in outs.iter().enumerate() {
        if !o.status.success() {
            return Err(format!("worker {i} failed:\n{}", text(o)));
        }
    }
    Ok(())
}

fn four_ranks() -> Result<(), String> {
    let roles: Vec<_> = (0..4).map(|r| ("collectives", r)).collect();
    all_succeed(&run(&roles, 4, free_port()?, false)?)
}

fn agent_store() -> Result<(), String> {
    let agent = TcpStoreServer::bind(0).map_err(|e| e.to_string())?;
    let roles: Vec<_> = (0..3).map(|r| ("collectives", r)).collect();
    all_succeed(&run(&roles, 3, agent.port(), true)?)?;
    // torchrun's workers count themselves in (`init/`), as PyTorch's do.
    let store =
        ferrocuda_dist::TcpStore::connect("127.0.0.1", agent.port(), Duration::from_secs(5))
            .map_err(|e| e.to_string())?;
    let joined = store.workers_joined().map_err(|e| e.to_string())?;
    if joined != 3 {
        return Err(format!("init/ counts {joined} workers, expected 3"));
    }
    Ok(())
}

/// Runs workers expected to fail in a typed way (each checks its own error and succeeds),
/// each within the timeout: all of them done in 20 s, though the rendezvous waits 3.
fn run_failing(roles: &[(&str, usize)], world: usize) -> Result<Vec<Output>, String> {
    let t0 = Instant::now();
    let outs = run(roles, world, free_port()?, false)?;
    all_succeed(&outs)?;
    if t0.elapsed() > Duration::from_secs(20) {
        return Err(format!("took {:?}", t0.elapsed()));
    }
    Ok(outs)
}

fn duplicate_rank() -> Result<(), String> {
    let role = "expect-duplicate-or-missing";
    let outs = run_failing(&[(role, 0), (role, 1), (role, 1)], 3)?;
    let said: String = outs.iter().map(text).collect();
    if !said.contains("rank 1 is taken") {
        return Err(format!("no worker reported the duplicate rank:\n{said}"));
    }
    Ok(())
}

fn missing_rank() -> Result<(), String> {
    run_failing(&[("expect-missing-2", 0), ("expect-missing-2", 1)], 3).map(drop)
}

fn dead_peer() -> Result<(), String> {
    let roles = [
        ("expect-collective-timeout", 0),
        ("leave-after-rendezvous", 1),
    ];
    run_failing(&roles, 2).map(drop)
}

/// A worker: the group from the environment on a fake device with `LOCAL_WORLD_SIZE`
/// devices, then what `role` says.
fn worker(role: &str) -> Result<(), String> {
    let devices: usize = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let rt = Runtime::new(Arc::new(FakeDriver::builder().devices(devices).build()));
    let short = Duration::from_secs(3);
    let timeout = if role == "collectives" {
        Duration::from_secs(30)
    } else {
        short
    };
    let group = ProcessGroup::from_env(rt.clone(), timeout);
    match role {
        "collectives" => collectives(&rt, &group.map_err(|e| e.to_string())?),
        "expect-duplicate-or-missing" => match group {
            Err(e @ DistError::DuplicateRank { rank: 1 }) => {
                println!("{e}");
                Ok(())
            }
            Err(DistError::RanksMissing { missing, .. }) if missing == [2] => Ok(()),
            other => Err(format!(
                "expected a duplicate or a missing rank, got {other:?}"
            )),
        },
        "expect-missing-2" => match group {
            Err(e @ DistError::RanksMissing { .. })
                if e.to_string().starts_with("ranks [2] of 3 did not join") =>
            {
                Ok(())
            }
            other => Err(format!("expected rank 2 missing, got {other:?}")),
        },
        "leave-after-rendezvous" => group.map(drop).map_err(|e| e.to_string()),
        "expect-collective-timeout" => {
            let group = group.map_err(|e| e.to_string())?;
            let b = DeviceBuffer::from_slice(&rt, group.device(), &[1.0f32; 8])
                .map_err(|e| e.to_string())?;
            match group.all_reduce(&b, ReduceOp::Sum) {
                Err(DistError::Store(StoreError::Timeout { .. })) => Ok(()),
                other => Err(format!("expected a store timeout, got {other:?}")),
            }
        }
        other => Err(format!("unknown role {other}")),
    }
}

/// Every collective, checked against what NCCL defines, with values that tell ranks apart.
fn collectives(rt: &Arc<Runtime>, g: &ProcessGroup) -> Result<(), String> {
    let e = |e: DistError| e.to_string();
    let (r, n) = (g.rank(), g.size());
    let dev = g.device();
    let buf = |v: &[f32]| DeviceBuffer::from_slice(rt, dev, v).map_err(|e| e.to_string());
    let host = |b: &DeviceBuffer<f32>| b.to_host().map_err(|e| e.to_string());
    let x = buf(&[r as f32 + 1.0, 10.0 * r as f32])?;
    g.all_reduce(&x, ReduceOp::Sum)
        .map_err(e)?
        .wait()
        .map_err(e)?;
    let sum_ranks: f32 = (0..n).map(|i| i as f32).sum();
    expect(
        host(&x)?,
        vec![sum_ranks + n as f32, 10.0 * sum_ranks],
        "all_reduce sum",
    )?;
    let m = buf(&[r as f32])?;
    g.all_reduce(&m, ReduceOp::Max)
        .map_err(e)?
        .wait()
        .map_err(e)?;
    expect(host(&m)?, vec![(n - 1) as f32], "all_reduce max")?;
    let b = buf(&[r as f32 * 3.0; 4])?;
    g.broadcast(&b, n - 1).map_err(e)?.wait().map_err(e)?;
    expect(host(&b)?, vec![(n - 1) as f32 * 3.0; 4], "broadcast")?;
    let mine = buf(&[r as f32, -(r as f32)])?;
    let all = buf(&vec![0.0; 2 * n])?;
    g.all_gather(&all, &mine).map_err(e)?.wait().map_err(e)?;
    let want: Vec<f32> = (0..n).flat_map(|i| [i as f32, -(i as f32)]).collect();
    expect(host(&all)?, want, "all_gather")?;
    let input = buf(&(0..n).map(|i| (i * 100 + r) as f32).collect::<Vec<_>>())?;
    let out = buf(&[0.0])?;
    g.reduce_scatter(&out, &input, ReduceOp::Sum)
        .map_err(e)?
        .wait()
        .map_err(e)?;
    let want = (0..n).map(|i| (r * 100 + i) as f32).sum::<f32>();
    expect(host(&out)?, vec![want], "reduce_scatter")?;
    // A ring of sends: each rank sends its rank to the next, receives from the previous.
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let send = buf(&[r as f32 + 0.5])?;
    let recv = buf(&[0.0])?;
    if r % 2 == 0 {
        g.send(&send, next).map_err(e)?.wait().map_err(e)?;
        g.recv(&recv, prev).map_err(e)?.wait().map_err(e)?;
    } else {
        g.recv(&recv, prev).map_err(e)?.wait().map_err(e)?;
        g.send(&send, next).map_err(e)?.wait().map_err(e)?;
    }
    expect(host(&recv)?, vec![prev as f32 + 0.5], "send/recv ring")?;
    Ok(())
}

fn expect(got: Vec<f32>, want: Vec<f32>, what: &str) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: {got:?}, expected {want:?}"))
    }
}
