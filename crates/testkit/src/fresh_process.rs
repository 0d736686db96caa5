//! The `main` of a harness-less test whose scenarios each need a fresh process (a
//! configuration read once per process, a once-per-process swap, a fork): run with the
//! scenario variable set, it runs that one scenario; run without it, it runs itself once per
//! selected scenario (and backend) with the variable set, and prints libtest's lines
//! (`test NAME ... ok`, `test result: ...`), which the GPU bundle parses.
//!
//! Such a test sets `harness = false` on its `[[test]]` entry and ends its `main` with
//! [`Runner::main`].
use std::fmt::Display;
use std::process::{Command, ExitCode};

/// What a scenario gives: its failure is a message.
pub type Outcome = Result<(), Box<dyn std::error::Error>>;

/// `Ok` if `ok`, else the failure `what`.
pub fn ensure(ok: bool, what: impl Display) -> Outcome {
    if ok {
        Ok(())
    } else {
        Err(what.to_string().into())
    }
}

/// One scenario: its name, the environment its process gets, and its body.
#[derive(Debug)]
pub struct Scenario {
    pub name: &'static str,
    /// Set in the scenario's process, after `Runner::cleared` is removed.
    pub env: &'static [(&'static str, &'static str)],
    pub run: fn() -> Outcome,
}

/// What the tests that use this differ in.
#[derive(Debug)]
pub struct Runner {
    /// The variable naming the scenario a process runs.
    pub variable: &'static str,
    /// Variables a scenario's process starts without, unless the scenario sets them.
    pub cleared: &'static [&'static str],
    /// Run each scenario once per backend (`FERROCUDA_BACKEND` = `fake`, `cuda`; the names
    /// prefixed `fake::`, `cuda::`), the cuda one only when `FERROCUDA_REQUIRE_GPU=1` and
    /// reported as ignored otherwise. Without it, each scenario runs once, under its own name,
    /// in the environment it inherits, and the result line has no ignored count.
    pub per_backend: bool,
}

impl Runner {
    /// The test's `main`. Arguments that do not start with `-` select scenarios by substring.
    pub fn main(&self, scenarios: &[Scenario]) -> ExitCode {
        if let Ok(name) = std::env::var(self.variable) {
            return run_one(scenarios, &name);
        }
        let gpu = std::env::var("FERROCUDA_REQUIRE_GPU").is_ok_and(|v| v == "1");
        let filters: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .collect();
        let backends: &[Option<&str>] = if self.per_backend {
            &[Some("fake"), Some("cuda")]
        } else {
            &[None]
        };
        let (mut passed, mut failed, mut ignored) = (0, 0, 0);
        for s in scenarios
            .iter()
            .filter(|s| filters.is_empty() || filters.iter().any(|f| s.name.contains(f.as_str())))
        {
            for &backend in backends {
                let name = match backend {
                    Some(backend) => format!("{backend}::{}", s.name),
                    None => s.name.to_string(),
                };
                if backend == Some("cuda") && !gpu {
                    println!("test {name} ... ignored, needs a GPU: runs in the GPU bundle");
                    ignored += 1;
                    continue;
                }
                match self.run_in_own_process(s, backend) {
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
        }
        let verdict = if failed == 0 { "ok" } else { "FAILED" };
        let ignored = if self.per_backend {
            format!("; {ignored} ignored")
        } else {
            String::new()
        };
        println!("\ntest result: {verdict}. {passed} passed; {failed} failed{ignored}");
        if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    fn run_in_own_process(&self, s: &Scenario, backend: Option<&str>) -> Result<(), String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut command = Command::new(exe);
        for var in self.cleared {
            command.env_remove(var);
        }
        command.envs(s.env.iter().copied());
        if let Some(backend) = backend {
            command.env("FERROCUDA_BACKEND", backend);
        }
        let out = command
            .env(self.variable, s.name)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }
}

/// In a scenario's own process: runs the named one.
fn run_one(scenarios: &[Scenario], name: &str) -> ExitCode {
    match scenarios.iter().find(|s| s.name == name).map(|s| (s.run)()) {
        Some(Ok(())) => ExitCode::SUCCESS,
        Some(Err(e)) => {
            eprintln!("{name}: {e}");
            ExitCode::FAILURE
        }
        None => {
            eprintln!("no scenario {name}");
            ExitCode::FAILURE
        }
    }
}
