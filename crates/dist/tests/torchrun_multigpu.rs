//! One process per GPU on two GPUs (the GPU bundle's `multi_torchrun_multigpu`, run with
//! `MULTI_GPU=1`): torchrun starting two ferrocuda workers that run every collective, a
//! captured all-reduce and the bucketed all-reduce of an MLP's gradients; a job of one
//! PyTorch rank and one ferrocuda rank all-reducing the same buffers (either holding rank
//! 0); and a rank killed in the middle of a collective, which the other rank's watchdog
//! turns into a typed error within its timeout.
//!
//! With `FERROCUDA_MULTIGPU_WORKER=bench` under torchrun, a worker times the all-reduce of
//! 256 MiB of fp32 (the bundle's `torchrun_allreduce.py` sets it against PyTorch's
//! `dist.all_reduce` under torchrun; a measurement, not a scenario).
//!
//! No harness: the binary runs the scenarios and is itself the ferrocuda worker (with
//! `FERROCUDA_MULTIGPU_WORKER` set to the worker's role). Without `--include-ignored` (or
//! `--ignored`) it reports every scenario ignored, as the other two-GPU tests are in CI;
//! with it, on fewer than two GPUs, every scenario fails.
#![forbid(unsafe_code)]
mod common;
use common::{gpus, rank_checks};
use ferrocuda_dist::{DistEnv, ProcessGroup, ReduceOp};
use ferrocuda_stream::DeviceBuffer;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Outcome = Result<(), String>;
/// A scenario this process runs, by name.
type Scenario = (&'static str, fn() -> Outcome);
const ROLE: &str = "FERROCUDA_MULTIGPU_WORKER";
/// The group timeout of the killed-rank scenario's watchdog.
const WATCHDOG: Duration = Duration::from_secs(5);

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
    let scenarios: [Scenario; 4] = [
        (
            "torchrun_starts_two_ferrocuda_workers",
            torchrun_two_workers,
        ),
        ("a_pytorch_rank_0_and_a_ferrocuda_rank_1_all_reduce", || {
            mixed(0)
        }),
        ("a_ferrocuda_rank_0_and_a_pytorch_rank_1_all_reduce", || {
            mixed(1)
        }),
        (
            "a_rank_killed_mid_collective_is_a_typed_error_on_the_other",
            killed_rank,
        ),
    ];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let run = args
        .iter()
        .any(|a| a == "--include-ignored" || a == "--ignored");
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let (mut passed, mut failed, mut ignored) = (0, 0, 0);
    for (name, scenario) in scenarios {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        if !run {
            println!("test {name} ... ignored, needs two GPUs and PyTorch (MULTI_GPU=1)");
            ignored += 1;
            continue;
        }
        match scenario() {
            Ok(()) => {
                println!("test {name} ... ok");
                passed += 1;
            }
            Err(e) => {
                println!("test {name} ... FAILED\n{e}");
                failed += 1;
            }
        }
    }
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    println!(
        "test result: {verdict}. {passed} passed; {failed} failed; {ignored} ignored; 0 measured; 0 filtered out"
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

// ---- the scenarios (this process) ------------------------------------------------------

fn free_port() -> Result<String, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr()
        .map_err(|e| e.to_string())?
        .port()
        .to_string())
}

/// This binary as the worker of `role`.
fn me(role: &str) -> Result<Command, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = Command::new(exe);
    c.env(ROLE, role).env("NCCL_NVLS_ENABLE", "0");
    Ok(c)
}

/// Rank `rank` of 2 as `env://` and our `DistEnv::from_env` read it (no torchrun agent).
fn rank_env(c: &mut Command, rank: usize, port: &str) {
    c.env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .env("NCCL_NVLS_ENABLE", "0")
        .env_remove("TORCHELASTIC_USE_AGENT_STORE");
}

fn output_of(child: Child, deadline: Duration) -> Result<(bool, String), String> {
    let start = Instant::now();
    let mut child = child;
    loop {
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            return Err(format!("did not finish within {deadline:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), text))
}

fn torchrun_two_workers() -> Outcome {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let child = Command::new("python3")
        .args([
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--no-python",
        ])
        .arg(exe)
        .env(ROLE, "collectives")
        .env("NCCL_NVLS_ENABLE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let (ok, text) = output_of(child, Duration::from_secs(300))?;
    for r in 0..2 {
        if !text.contains(&format!("rank {r} of 2 ok")) {
            return Err(format!("rank {r} did not finish:\n{text}"));
        }
    }
    if !ok {
        return Err(format!("torchrun failed:\n{text}"));
    }
    println!(
        "{}",
        text.lines()
            .filter(|l| l.contains(" ok"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    Ok(())
}

/// PyTorch's rank: `init_process_group("nccl")` over `env://` (eager, with `device_id`),
/// then the same two all-reduces as the ferrocuda rank.
const TORCH_RANK: &str = r#"
import os, torch, torch.distributed as dist
r = int(os.environ["RANK"]); dev = torch.device(f"cuda:{r}"); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
t = torch.full((1024,), float(r + 1), device=dev)
dist.all_reduce(t)
u = torch.full((256,), float(10 * (r + 1)), device=dev)
dist.all_reduce(u, op=dist.ReduceOp.MAX)
torch.cuda.synchronize()
assert bool((t == 3.0).all()), t
assert bool((u == 20.0).all()), u
print(f"torch rank {r} ok", flush=True)
dist.destroy_process_group()
"#;

fn mixed(torch_rank: usize) -> Outcome {
    let port = free_port()?;
    let ours = 1 - torch_rank;
    let mut py = Command::new("python3");
    py.arg("-c").arg(TORCH_RANK);
    rank_env(&mut py, torch_rank, &port);
    let mut rust = me("mixed")?;
    rank_env(&mut rust, ours, &port);
    // One communicator needs one NCCL: PyTorch's wheel's, found first.
    let nccl = torch_nccl_first()?;
    rust.env("LD_LIBRARY_PATH", nccl.ld_library_path());
    // Ours first when it holds the store (rank 0), PyTorch's first otherwise.
    let spawn = |c: &mut Command| {
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())
    };
    let (py, mut rust) = if ours == 0 {
        let rust = spawn(&mut rust)?;
        (spawn(&mut py)?, rust)
    } else {
        let py = spawn(&mut py)?;
        (py, spawn(&mut rust)?)
    };
    let (py_ok, py_text) = output_of(py, Duration::from_secs(180))?;
    // The ferrocuda rank holding the store waits until PyTorch's rank is done with it.
    drop(rust.stdin.take());
    let (rust_ok, rust_text) = output_of(rust, Duration::from_secs(60))?;
    let torch_line = format!("torch rank {torch_rank} ok");
    let ours_line = format!("ferrocuda rank {ours} ok");
    if !(py_ok && rust_ok && py_text.contains(&torch_line) && rust_text.contains(&ours_line)) {
        return Err(format!(
            "PyTorch rank:\n{py_text}\nferrocuda rank:\n{rust_text}"
        ));
    }
    println!("{torch_line}; {ours_line}");
    Ok(())
}

/// A folder whose `libnccl.so` is PyTorch's own libnccl (NCCL refuses a communicator whose
/// ranks run different versions, and ferrocuda opens `libnccl.so` by that name first):
/// what docs/multi_gpu.md tells a user of a mixed job to make.
struct TorchNccl(std::path::PathBuf);

impl TorchNccl {
    fn ld_library_path(&self) -> String {
        match std::env::var("LD_LIBRARY_PATH") {
            Ok(rest) if !rest.is_empty() => format!("{}:{rest}", self.0.display()),
            _ => self.0.display().to_string(),
        }
    }
}

impl Drop for TorchNccl {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn torch_nccl_first() -> Result<TorchNccl, String> {
    let script = "import nvidia.nccl, os; \
                  print(os.path.join(nvidia.nccl.__path__[0], 'lib', 'libnccl.so.2'))";
    let out = Command::new("python3")
        .args(["-c", script])
        .output()
        .map_err(|e| e.to_string())?;
    let lib = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || lib.is_empty() {
        return Err(format!(
            "PyTorch's NCCL: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let dir = std::env::temp_dir().join(format!("torch_nccl_{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).map_err(|e| e.to_string())?;
    Ok(TorchNccl(dir))
}

fn killed_rank() -> Outcome {
    let port = free_port()?;
    let mut ranks = Vec::new();
    for r in 0..2 {
        let mut c = me("killed")?;
        rank_env(&mut c, r, &port);
        let child = c
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| e.to_string())?;
        ranks.push(child);
    }
    let mut lines = Vec::new();
    for child in &mut ranks {
        let out = child.stdout.take().ok_or("a worker's stdout")?;
        lines.push(BufReader::new(out).lines());
    }
    let wait_for = |lines: &mut std::io::Lines<BufReader<std::process::ChildStdout>>,
                    what: &str| {
        for line in lines.by_ref() {
            let line = line.map_err(|e| e.to_string())?;
            if line.contains(what) {
                return Ok(line);
            }
        }
        Err(format!("the worker ended before saying {what:?}"))
    };
    wait_for(&mut lines[1], "in a collective")?;
    wait_for(&mut lines[0], "ready")?;
    ranks[1].kill().map_err(|e| e.to_string())?;
    let _ = ranks[1].wait();
    let mut stdin = ranks[0].stdin.take().ok_or("rank 0's stdin")?;
    writeln!(stdin, "go").map_err(|e| e.to_string())?;
    let verdict = wait_for(&mut lines[0], "rank 0:")?;
    let (ok, rest) = output_of(ranks.swap_remove(0), Duration::from_secs(60))?;
    if !ok || !verdict.contains("typed error") {
        return Err(format!("{verdict}\n{rest}"));
    }
    println!("{verdict}");
    Ok(())
}

// ---- the workers (processes this binary starts) ----------------------------------------

fn worker(role: &str) -> Result<(), Box<dyn std::error::Error>> {
    let g = gpus(2, "")?;
    let env = DistEnv::from_env()?;
    g.rt.set_device(env.device())?;
    let timeout = Duration::from_secs(120);
    match role {
        "collectives" => {
            let pg = Arc::new(ProcessGroup::from_dist_env(g.rt.clone(), &env, timeout)?);
            let r = pg.rank();
            rank_checks::every_collective(r, &pg, &g.rt)?;
            rank_checks::captured_all_reduce(r, &pg, &g.rt, &g.allocators)?;
            rank_checks::bucketed_mlp(r, &pg, &g.rt)?;
            println!(
                "rank {r} of {} ok: every collective, a captured all-reduce replayed, the MLP's buckets",
                pg.size()
            );
        }
        "mixed" => {
            let pg = ProcessGroup::join_pytorch(g.rt.clone(), &env, timeout)?;
            let (r, dev) = (pg.rank(), pg.device());
            let t = DeviceBuffer::<f32>::filled(&g.rt, dev, 1024, (r + 1) as f32)?;
            pg.all_reduce(&t, ReduceOp::Sum)?.synchronize()?;
            let u = DeviceBuffer::<f32>::filled(&g.rt, dev, 256, (10 * (r + 1)) as f32)?;
            pg.all_reduce(&u, ReduceOp::Max)?.synchronize()?;
            if t.to_host()? != vec![3.0; 1024] || u.to_host()? != vec![20.0; 256] {
                return Err("the all-reduces with PyTorch's rank differ".into());
            }
            println!("ferrocuda rank {r} ok");
            // The communicator goes now (PyTorch's ranks destroy theirs too), the store
            // (served here when this is rank 0) once the parent says PyTorch's rank is done.
            let store = pg.store();
            drop(pg);
            let _ = std::io::stdin().read_line(&mut String::new());
            drop(store);
        }
        "killed" => killed_worker(&g, &env)?,
        "bench" => bench_worker(&g, &env)?,
        other => return Err(format!("unknown role {other}").into()),
    }
    Ok(())
}

/// Rank 1 enters an all-reduce and waits there to be killed; rank 0, told to go, enters
/// the same all-reduce without its peer and must get a typed error from its watchdog.
fn killed_worker(g: &common::Gpus, env: &DistEnv) -> Result<(), Box<dyn std::error::Error>> {
    let pg = ProcessGroup::from_dist_env(g.rt.clone(), env, Duration::from_secs(120))?
        .with_timeout(WATCHDOG)?;
    let (r, dev) = (pg.rank(), pg.device());
    let warm = DeviceBuffer::<f32>::filled(&g.rt, dev, 1024, 1.0)?;
    pg.all_reduce(&warm, ReduceOp::Sum)?.synchronize()?;
    let big = DeviceBuffer::<f32>::filled(&g.rt, dev, 16 << 20, 1.0)?;
    if r == 1 {
        let _work = pg.all_reduce(&big, ReduceOp::Sum)?;
        println!("rank 1 in a collective");
        std::io::stdout().flush()?;
        std::thread::sleep(Duration::from_secs(600));
        return Err("rank 1 was not killed".into());
    }
    println!("rank 0 ready");
    std::io::stdout().flush()?;
    std::io::stdin().read_line(&mut String::new())?;
    let start = Instant::now();
    let result = pg
        .all_reduce(&big, ReduceOp::Sum)
        .and_then(|work| work.synchronize());
    let after = start.elapsed();
    match result {
        Err(e) if after < WATCHDOG * 4 => {
            println!(
                "rank 0: typed error after {:.2} s: {e}",
                after.as_secs_f64()
            );
            Ok(())
        }
        Err(e) => Err(format!("rank 0: the error came after {after:?}: {e}").into()),
        Ok(()) => Err("rank 0: the all-reduce completed without its peer".into()),
    }
}

/// The all-reduce of 256 MiB fp32, 5 warm-ups then 50 calls each followed by a host wait
/// for the device, as PyTorch's side does (`dist.all_reduce` makes the current stream wait,
/// then `torch.cuda.synchronize()`); rank 0 prints NCCL's bus bandwidth (bytes × 2(n−1)/n
/// over the median call).
fn bench_worker(g: &common::Gpus, env: &DistEnv) -> Result<(), Box<dyn std::error::Error>> {
    const BYTES: usize = 256 << 20;
    let pg = if std::env::var_os("FERROCUDA_BENCH_BLOCKING_COMM").is_some() {
        blocking_group(g, env)?
    } else {
        ProcessGroup::from_dist_env(g.rt.clone(), env, Duration::from_secs(120))?
    };
    let dev = pg.device();
    let t = DeviceBuffer::<f32>::filled(&g.rt, dev, BYTES / 4, 1.0)?;
    let call = || -> Result<(), Box<dyn std::error::Error>> {
        pg.all_reduce(&t, ReduceOp::Sum)?.wait()?;
        g.rt.synchronize(dev)?;
        Ok(())
    };
    for _ in 0..5 {
        call()?;
    }
    let mut times: Vec<f64> = (0..50)
        .map(|_| {
            let start = Instant::now();
            call()?;
            Ok(start.elapsed().as_secs_f64())
        })
        .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    times.sort_by(f64::total_cmp);
    let n = pg.size() as f64;
    let busbw = BYTES as f64 * 2.0 * (n - 1.0) / n / times[times.len() / 2] / 1e9;
    if pg.rank() == 0 {
        println!("ferrocuda_torchrun_allreduce_busbw_GBps {busbw:.2}");
    }
    Ok(())
}

/// A group whose communicator is made blocking (`ncclCommInitRank`, as PyTorch's default
/// `TORCH_NCCL_USE_COMM_NONBLOCKING=0`) without a watchdog: the bench's comparison point for
/// the fail-fast group `from_dist_env` makes (`FERROCUDA_BENCH_BLOCKING_COMM=1`).
fn blocking_group(
    g: &common::Gpus,
    env: &DistEnv,
) -> Result<ProcessGroup, Box<dyn std::error::Error>> {
    use ferrocuda_driver::nccl::{NcclComm, UniqueId};
    let store = ferrocuda_dist::rendezvous(env, Duration::from_secs(120))?;
    let id = if env.rank == 0 {
        let id = UniqueId::new()?;
        store.set("bench/nccl_id", &id.0)?;
        id
    } else {
        let bytes = store.get("bench/nccl_id")?;
        UniqueId(bytes.as_slice().try_into()?)
    };
    let comm = NcclComm::init_rank(&g.driver, env.device(), env.world_size, &id, env.rank)?;
    Ok(ProcessGroup::new(g.rt.clone(), Box::new(comm))?)
}
