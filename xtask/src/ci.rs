//! `cargo xtask ci`: what CI runs (`.ci/run`): checks the tools the tests need, then format,
//! clippy with `-D warnings`, every test, the loom model, the CLI fuzz with a fixed seed, the
//! PyTorch oracle and the docs with no warning.

use crate::{cargo, cli_fuzz, doc, loom, oracle, oracle_dir};
use std::process::{Command, Stdio};

/// Tools the tests need beyond Rust, and which test needs each.
const TOOLS: &[(&str, &str)] = &[(
    "python3",
    "ferrocuda-types' snapshot::tests::python_reads_it_as_pytorch_does reads ferrocuda's \
     snapshot pickle with CPython's own unpickler (as do ferrocuda-cli's cli_scenarios and \
     ferrocuda-alloc's alloc_scenarios, in their replay and formats modules), and \
     ferrocuda-torch's torch_plugin_scenarios (its library module) loads the built PyTorch \
     allocator library with ctypes",
)];

/// Checks up front that every tool of [`TOOLS`] runs (`runs` tries one), so a missing one
/// is a clear message rather than a failing (or skipped) test later.
fn require_tools(runs: impl Fn(&str) -> bool) -> Result<(), String> {
    match TOOLS.iter().find(|(tool, _)| !runs(tool)) {
        None => Ok(()),
        Some((tool, why)) => Err(format!(
            "{tool} is needed and was not found: {why}; install it (apt-get install {tool})"
        )),
    }
}

pub(crate) fn ci() -> Result<(), String> {
    require_tools(|tool| {
        Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })?;
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    cargo(&["test", "--workspace"])?;
    loom::loom()?;
    cli_fuzz::cli_fuzz(&cli_fuzz::Options::parse(&[])?)?;
    eprintln!("+ cargo xtask alloc-oracle {}", oracle_dir().display());
    oracle::alloc_oracle(&oracle_dir())?;
    doc::doc()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tool_is_named_with_the_test_that_needs_it() {
        assert_eq!(require_tools(|_| true), Ok(()));
        let err = require_tools(|t| t != "python3").err().unwrap_or_default();
        assert!(
            err.contains("python3 is needed") && err.contains("python_reads_it_as_pytorch_does"),
            "{err}"
        );
    }
}
