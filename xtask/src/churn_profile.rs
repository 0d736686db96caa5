//! `cargo xtask churn-profile`: instructions per operation of the allocator's mixed churn
//! (`crates/alloc/examples/churn.rs`) and of its 8 slots of 1 MiB (the stand-in for the
//! 8-thread pairs' locked path) on the fake device, counted by valgrind's callgrind, for
//! PyTorch's default configuration and ferrocuda's recommended set. Instruction counts
//! do not move with the host's load, where times on a shared machine do: this is how a
//! hot-path change is judged before it is timed on the GPU machine.
//!
//! Each configuration runs twice, with one and with three timed rounds after the same
//! warm-up; the difference of the two totals over the operations between them is the
//! steady churn's cost, start-up and warm-up cancelled out. Callgrind's output files stay in
//! `target/churn-profile/` for `callgrind_annotate`.

use crate::{cargo_messages, root};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Steps per round: callgrind runs the churn about 50 times slower than the machine.
const STEPS: u64 = 500_000;
const CONFIGURATIONS: [&str; 2] = ["", "ferrocuda_recommended:True"];
/// The example's shapes: the anchor's mixed churn, and 8 slots of 1 MiB (one thread's
/// stand-in for the locked operations of the bench's 8-thread pairs).
const SHAPES: [&str; 2] = ["mixed", "pairs"];

/// Builds the churn example in release and returns its executable.
fn churn_example() -> Result<PathBuf, String> {
    let messages = cargo_messages(&[
        "build",
        "--release",
        "-p",
        "ferrocuda-alloc",
        "--example",
        "churn",
    ])?;
    messages
        .iter()
        .filter(|m| m["target"]["name"].as_str() == Some("churn"))
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| "cargo built no churn example".to_string())
}

/// The total instructions callgrind counted for one run of `churn` of `shape` with `rounds`
/// rounds.
fn instructions(
    churn: &Path,
    (shape, conf): (&str, &str),
    rounds: u64,
    out: &Path,
) -> Result<u64, String> {
    let output = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(churn)
        .args([conf, &STEPS.to_string(), &rounds.to_string(), shape])
        .env("FERROCUDA_BACKEND", "fake")
        .output()
        .map_err(|e| format!("valgrind could not start ({e}): churn-profile needs valgrind"))?;
    let log = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!("callgrind failed ({}):\n{log}", output.status));
    }
    let refs = log
        .lines()
        .find_map(|l| {
            l.split_once("I   refs:")
                .map(|(_, n)| n.trim().replace(',', ""))
        })
        .ok_or_else(|| format!("callgrind printed no instruction count:\n{log}"))?;
    refs.parse()
        .map_err(|e| format!("callgrind's count `{refs}`: {e}"))
}

pub(crate) fn churn_profile() -> Result<(), String> {
    let churn = churn_example()?;
    let dir = root().join("target/churn-profile");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let runs = SHAPES
        .iter()
        .flat_map(|shape| CONFIGURATIONS.iter().map(move |conf| (*shape, *conf)));
    for (i, run) in runs.enumerate() {
        let one = instructions(&churn, run, 1, &dir.join(format!("callgrind.{i}.1")))?;
        let three = instructions(&churn, run, 3, &dir.join(format!("callgrind.{i}.3")))?;
        let per_op = three.saturating_sub(one) as f64 / (2 * STEPS) as f64;
        let (shape, conf) = run;
        println!(
            "churn ({shape}), configuration \"{conf}\": {per_op:.1} instructions per operation"
        );
    }
    println!(
        "callgrind's files: {} (callgrind_annotate --auto=yes FILE)",
        dir.display()
    );
    Ok(())
}
