//! `cargo xtask doc`: `cargo doc --workspace --no-deps`, failing on any rustdoc or cargo
//! warning.

use crate::root;
use std::process::{Command, Stdio};

/// `cargo doc`: rustdoc warnings (broken intra-doc links) fail it, and so do cargo's own
/// warnings, which `-D warnings` does not reach (an output file collision, where one
/// crate's page silently replaces another's).
pub(crate) fn doc() -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("+ RUSTDOCFLAGS=-D warnings cargo doc --workspace --no-deps");
    let out = Command::new(cargo)
        .args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings")
        .current_dir(root())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| e.to_string())?;
    let log = String::from_utf8_lossy(&out.stderr);
    eprint!("{log}");
    if !out.status.success() {
        return Err("cargo doc failed".into());
    }
    match log.lines().find(|l| l.starts_with("warning")) {
        Some(w) => Err(format!("cargo doc warned: {w}")),
        None => Ok(()),
    }
}
