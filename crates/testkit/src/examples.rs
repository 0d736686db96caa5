//! Running a package's examples from its integration tests, on the fake device.
use std::path::PathBuf;
use std::process::{Command, Output};

/// Example `name`'s binary: `cargo test` builds a package's examples beside its test
/// binaries' `deps` folder.
fn built(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join(name);
    path.exists().then_some(path)
}

/// Runs example `name` with `args` on the fake device (`FERROCUDA_BACKEND=fake`), with no
/// allocator configuration from the environment but `env`'s.
pub fn run_example(name: &str, env: &[(&str, &str)], args: &[&str]) -> Result<Output, String> {
    let exe = built(name).ok_or(format!(
        "example {name} not built: `cargo test` builds the examples (a `--test` filter does not; `cargo build --examples` then)"
    ))?;
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env("FERROCUDA_BACKEND", "fake")
        .env_remove("FERROCUDA_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().map_err(|e| e.to_string())
}
