//! Project tasks, run as `cargo xtask <task>`:
//! - `ci`: the tools CI needs (python3), format check, clippy with `-D warnings`, every
//!   test, the CLI fuzz with a fixed seed, the docs with no warning (what `.ci/run` runs);
//! - `doc`: the docs, failing on any rustdoc or cargo warning;
//! - `gpu-bundle`: builds release test and bench binaries into `gpu-bundle/` (git-ignored)
//!   with a `run.sh` that runs them against the real driver, fails on any skip, and ends with
//!   `N passed, N failed`; with them the PyTorch allocator library (`libferrocuda_torch.so`)
//!   and `xtask/torch/plugin_bench.py`, which `run.sh` runs against real PyTorch, and the
//!   `ferrocuda` command, four traces and `replay.sh`, which replays them on the fake device,
//!   on the GPU and through PyTorch's allocator and fails if the fake and the real device's
//!   memory figures differ (`MULTI_GPU=1 run.sh` also runs the two-GPU `multi_*` tests, the
//!   `multibench_*` benches and `torch_dist.py`, PyTorch's side of them);
//! - `bench`: the criterion benches (they need a GPU; without one they say they skipped), all
//!   but the two-GPU one (`cargo bench -p ferrocuda-dist`);
//! - `cli-fuzz [--cases N] [--seed S] [--long] [--case N]`: the `ferrocuda` command against
//!   generated and mutated traces (see [`cli_fuzz`]); `ci` runs it with a fixed seed;
//! - `alloc-fuzz [--programs N] [--seed S]`: the allocator's structure-aware fuzz
//!   (`crates/alloc/tests/alloc_fuzz.rs`) in release, 100 000 programs unless told (CI runs
//!   600 in the ordinary test run);
//! - `thread-diff [--scripts N] [--seed S]`: the cross-thread differential test
//!   (`crates/alloc/tests/alloc_diff.rs`) in release, 100 000 scripts unless told
//!   (CI runs 10 000);
//! - `graph-fuzz [--programs N] [--seed S]`: the graph data-integrity fuzz
//!   (`crates/graph/tests/graph_fuzz.rs`) in release, 10 000 programs unless told (CI runs
//!   200 in the ordinary test run);
//! - `loom`: the thread cache's slot protocol under `loom` (`--cfg loom`, its own target
//!   folder); `ci` runs it;
//! - `alloc-oracle [DIR]`: PyTorch's allocator results against ours, step by
//!   step (see [`oracle`]; DIR defaults to `tests/data/oracle`); any difference fails;
//!   `ci` runs it;
//! - `help` (or `-h`, `--help`): these tasks, briefly ([`USAGE`]).
//!
//! One module a task: [`ci`], [`doc`], [`gpu_bundle`] (the scripts it writes into the
//! bundle are files under `xtask/gpu/`), [`bench`](mod@bench), [`cli_fuzz`], [`long_run`]
//! (`alloc-fuzz`, `thread-diff`, `graph-fuzz`), [`loom`] and [`oracle`] (`alloc-oracle`);
//! this file parses the task and keeps what they share (running cargo, reading its output).
#![forbid(unsafe_code)]

mod bench;
mod churn_profile;
mod ci;
mod cli_fuzz;
mod doc;
mod gpu_bundle;
mod house;
mod long_run;
mod loom;
mod oracle;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

/// What `cargo xtask --help` prints (and a task it does not know, on stderr).
const USAGE: &str = "\
usage: cargo xtask <task> [options]

tasks:
  ci              what CI runs (.ci/run): checks python3 is there, cargo fmt --check,
                  clippy -D warnings, every test, the loom model, the CLI fuzz (3000 cases,
                  seed 11), the PyTorch oracle, the docs with no warning
  doc             cargo doc --workspace, failing on any rustdoc or cargo warning
  gpu-bundle      release tests, benches, examples, the ferrocuda command, four traces and
                  run.sh in gpu-bundle/, to copy to a GPU machine; needs
                  ../shared/tools/torch_replay.py beside the checkout
  bench           the criterion benches (they need a GPU; without one they say they skipped)
  cli-fuzz [--cases N] [--seed S] [--long] [--case N]
                  the ferrocuda command against generated and mutated traces
  alloc-fuzz [--programs N] [--seed S]
                  the allocator's fuzz in release (100 000 programs unless told)
  thread-diff [--scripts N] [--seed S]
                  the cross-thread differential test in release (100 000 scripts unless told)
  graph-fuzz [--programs N] [--seed S]
                  the graph data-integrity fuzz in release (10 000 programs unless told)
  loom            the thread cache's slot protocol under loom (built in target/loom)
  churn-profile   the allocator's mixed churn, and 8 slots of 1 MiB, on the fake device
                  under callgrind: instructions per operation, default and recommended
                  configuration (needs valgrind)
  alloc-oracle [DIR]
                  PyTorch's allocator results against ours, step by step
                  (DIR: tests/data/oracle)
  help            this text (also -h, --help)
";

/// Whether `args` (what follows the task) asks for help: then no task runs.
fn asks_for_help(args: &[String]) -> bool {
    args.iter().any(|a| a == "-h" || a == "--help")
}

/// Runs a task that takes no arguments, refusing any (a stray argument must not start a
/// long run the user did not mean).
fn without_arguments(args: &[String], task: fn() -> Result<(), String>) -> Result<(), String> {
    match args.first() {
        Some(a) => Err(format!("takes no arguments (got `{a}`)\n{USAGE}")),
        None => task(),
    }
}

fn main() -> ExitCode {
    let task = std::env::args().nth(1).unwrap_or_default();
    let rest: Vec<String> = std::env::args().skip(2).collect();
    if asks_for_help(&rest) {
        print!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let result = match task.as_str() {
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        "ci" => without_arguments(&rest, ci::ci),
        "gpu-bundle" => without_arguments(&rest, gpu_bundle::gpu_bundle),
        "bench" => without_arguments(&rest, bench::bench),
        "doc" => without_arguments(&rest, doc::doc),
        "cli-fuzz" => cli_fuzz::Options::parse(&rest).and_then(|o| cli_fuzz::cli_fuzz(&o)),
        "loom" => without_arguments(&rest, loom::loom),
        "churn-profile" => without_arguments(&rest, churn_profile::churn_profile),
        "alloc-fuzz" | "thread-diff" | "graph-fuzz" => {
            let long = match task.as_str() {
                "alloc-fuzz" => &long_run::ALLOC_FUZZ,
                "thread-diff" => &long_run::THREAD_DIFF,
                _ => &long_run::GRAPH_FUZZ,
            };
            long.run(&rest)
        }
        "alloc-oracle" => {
            let dir = rest.first().map_or_else(oracle_dir, PathBuf::from);
            oracle::alloc_oracle(&dir)
        }
        "" => {
            eprint!("xtask: no task given\n{USAGE}");
            return ExitCode::FAILURE;
        }
        _ => Err(format!("unknown task\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask {task}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The committed oracle files.
fn oracle_dir() -> PathBuf {
    root().join("tests/data/oracle")
}

fn cargo(args: &[&str]) -> Result<(), String> {
    cargo_with_env(args, &[("FERROCUDA_XTASK", "1")])
}

fn cargo_with_env(args: &[&str], env: &[(&str, &str)]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    eprintln!("+ {}cargo {}", shown.concat(), args.join(" "));
    let status = Command::new(cargo)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root())
        .status()
        .map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("cargo {} failed ({status})", args.join(" ")))
    }
}

/// Builds `args` and returns cargo's JSON messages.
fn cargo_messages(args: &[&str]) -> Result<Vec<serde_json::Value>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("+ cargo {} --message-format=json", args.join(" "));
    let out = Command::new(cargo)
        .args(args)
        .arg("--message-format=json")
        .current_dir(root())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("cargo {} failed", args.join(" ")));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect())
}

/// Builds the cdylib `name` of `package` in release and returns the shared library.
fn built_library(package: &str, name: &str) -> Result<PathBuf, String> {
    let messages = cargo_messages(&["build", "--release", "-p", package, "--lib"])?;
    let suffix = std::env::consts::DLL_SUFFIX;
    messages
        .iter()
        .filter(|m| m["target"]["name"].as_str() == Some(name))
        .filter_map(|m| m["filenames"].as_array())
        .flatten()
        .filter_map(|f| f.as_str())
        .find(|f| f.ends_with(suffix))
        .map(PathBuf::from)
        .ok_or_else(|| format!("no shared library was built for {name}"))
}

/// One target of a workspace package, as `cargo metadata` lists it.
#[cfg(test)]
struct Target {
    package: String,
    kind: String,
    name: String,
}

/// Every target of the workspace's packages, one entry per kind (for the tests that check
/// the names this tool gives cargo).
#[cfg(test)]
fn workspace_targets() -> Result<Vec<Target>, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    let mut targets = Vec::new();
    for package in metadata["packages"].as_array().into_iter().flatten() {
        for target in package["targets"].as_array().into_iter().flatten() {
            for kind in target["kind"].as_array().into_iter().flatten() {
                targets.push(Target {
                    package: package["name"].as_str().unwrap_or_default().to_owned(),
                    kind: kind.as_str().unwrap_or_default().to_owned(),
                    name: target["name"].as_str().unwrap_or_default().to_owned(),
                });
            }
        }
    }
    Ok(targets)
}

/// Builds `args` with JSON messages and returns the executables of the named targets.
fn built_executables(args: &[&str], names: &[&str]) -> Result<Vec<(String, PathBuf)>, String> {
    let mut found = Vec::new();
    for msg in cargo_messages(args)? {
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        if let (Some(exe), true) = (msg["executable"].as_str(), names.contains(&name)) {
            found.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    for n in names {
        if !found.iter().any(|(f, _)| f == n) {
            return Err(format!("no executable was built for {n}"));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo xtask ci --help` prints help instead of running CI; a stray argument to a task
    /// that takes none is refused before anything runs.
    #[test]
    fn help_after_a_task_and_stray_arguments_run_nothing() {
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert!(asks_for_help(&args(&["--help"])));
        assert!(asks_for_help(&args(&["--seed", "3", "-h"])));
        assert!(!asks_for_help(&args(&["--seed", "3"])));
        let never = || -> Result<(), String> { panic!("the task ran") };
        let refused = without_arguments(&args(&["--verbose"]), never);
        assert!(refused.is_err_and(|e| e.contains("takes no arguments (got `--verbose`)")));
        assert_eq!(without_arguments(&[], || Ok(())), Ok(()));
    }

    /// `cargo xtask --help` names every task `main` runs.
    #[test]
    fn the_usage_names_every_task() {
        for task in [
            "ci",
            "doc",
            "gpu-bundle",
            "bench",
            "cli-fuzz",
            "alloc-fuzz",
            "thread-diff",
            "graph-fuzz",
            "loom",
            "churn-profile",
            "alloc-oracle",
            "help",
        ] {
            assert!(
                USAGE.lines().any(|l| l.trim_start().starts_with(task)),
                "{task}"
            );
        }
    }
}
