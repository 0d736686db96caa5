//! `cargo xtask loom`: the thread cache's slot protocol under `loom` (`--cfg loom`, built in
//! its own target folder, `target/loom`).

use crate::root;
use std::process::{Command, Stdio};

/// The loom model of the thread cache (`crates/alloc/src/thread_cache.rs`, `loom_model`),
/// built with `--cfg loom` in `target/loom`; fails if no model ran.
pub(crate) fn loom() -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let args = ["test", "-p", "ferrocuda-alloc", "--lib", "loom_model"];
    eprintln!("+ RUSTFLAGS=\"--cfg loom\" cargo {}", args.join(" "));
    let out = Command::new(cargo)
        .args(args)
        .env("RUSTFLAGS", "--cfg loom")
        .env("CARGO_TARGET_DIR", root().join("target").join("loom"))
        .current_dir(root())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    let log = String::from_utf8_lossy(&out.stdout);
    eprint!("{log}");
    if !out.status.success() {
        return Err("the loom model failed".into());
    }
    let ran: usize = log
        .lines()
        .filter_map(|l| l.strip_prefix("test result: ok. "))
        .filter_map(|l| l.split(' ').next()?.parse::<usize>().ok())
        .sum();
    if ran == 0 {
        return Err("no loom model ran (was the test renamed?)".into());
    }
    Ok(())
}
