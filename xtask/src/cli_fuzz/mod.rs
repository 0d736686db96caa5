//! `cargo xtask cli-fuzz [--cases N] [--seed S] [--long]`: the `ferrocuda` command against
//! generated and mutated snapshots, allocator configurations, capacities and environments.
//!
//! Each case writes one input file and runs the built binary once (`replay`, `summary` or
//! `plot`), with its output in files. A case fails when the command panics (exit 101), is
//! killed by a signal (abort, stack overflow), runs past 10 s (killed), exits with another
//! code than 0 or 1, or fails without exactly one `ferrocuda: ...` line on stderr. The debug
//! binary is used, so arithmetic overflow panics too. Cases derive from the seed and their
//! index alone: `--seed S --case N` runs one again, and failed inputs are kept under
//! `target/cli-fuzz/failures/`.
//!
//! The inputs are made in [`inputs`].

mod inputs;

use crate::{built_executables, root};
use inputs::{Rng, capacity, conf, input};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Cases of the fixed-seed run in `cargo xtask ci`.
pub(crate) const CI_CASES: u64 = 3000;
/// Cases of `--long`.
pub(crate) const LONG_CASES: u64 = 100_000;
/// The seed of the CI run.
pub(crate) const CI_SEED: u64 = 11;
const HANG: Duration = Duration::from_secs(10);

/// One command line, its environment, and whether stdout goes to `/dev/full`.
struct Invocation {
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    full: bool,
    kind: &'static str,
}

fn invocation(r: &mut Rng, file: &Path, dir: &Path) -> Invocation {
    let path = file.display().to_string();
    let kind = *r.pick(&["replay", "replay", "replay", "summary", "plot"]);
    let mut args = vec![kind.to_owned(), path];
    match kind {
        "replay" => {
            for _ in 0..r.below(4) {
                args.push(format!("--conf={}", conf(r)));
            }
            if r.chance(70) {
                args.push(format!("--capacity={}", capacity(r)));
            }
            if r.chance(30) {
                args.push("--json".into());
            }
            if r.chance(30) {
                args.push("--addresses=recorded".into());
            }
            // Without a GPU: refused in one line (with a fake-device option or without).
            if r.chance(5) {
                args.push("--device=cuda".into());
            }
        }
        "plot" => {
            args.push("-o".into());
            let out = if r.chance(5) {
                "/nonexistent/dir/x.html".into()
            } else {
                dir.join("page.html").display().to_string()
            };
            args.push(out);
        }
        _ => {}
    }
    let mut env = Vec::new();
    if r.chance(15) {
        let var = *r.pick(&[
            "FERROCUDA_ALLOC_CONF",
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_ALLOC_CONF",
        ]);
        env.push((var, conf(r)));
    }
    Invocation {
        args,
        env,
        full: r.chance(3),
        kind,
    }
}

/// What went wrong with one case, if anything.
/// `Ok(Ok(succeeded))` for a case that behaved, `Ok(Err(why))` for one that did not.
fn run_case(exe: &Path, dir: &Path, inv: &Invocation) -> Result<Result<bool, String>, String> {
    let out_path = dir.join("stdout");
    let err_path = dir.join("stderr");
    let stdout = if inv.full {
        std::fs::OpenOptions::new().write(true).open("/dev/full")
    } else {
        std::fs::File::create(&out_path)
    }
    .map_err(|e| e.to_string())?;
    let stderr = std::fs::File::create(&err_path).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.args(&inv.args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .env_remove("FERROCUDA_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .env("RUST_BACKTRACE", "0");
    for (k, v) in &inv.env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|e| format!("{}: {e}", exe.display()))?;
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(Err(format!("hang: killed after {} s", HANG.as_secs())));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    let first = err.lines().next().unwrap_or_default().to_owned();
    Ok(match status.code() {
        None => Err(format!("killed by a signal ({status}): {first}")),
        Some(101) => Err(format!("panic: {}", err.trim())),
        Some(0) if err.lines().any(|l| !l.starts_with("ferrocuda: ")) => {
            Err(format!("succeeded with unexpected stderr: {}", err.trim()))
        }
        Some(0) => Ok(true),
        Some(1) if err.lines().count() != 1 || !first.starts_with("ferrocuda: ") => Err(format!(
            "failure not one `ferrocuda: ` line: {}",
            err.trim()
        )),
        Some(1) => {
            refusal(&first);
            Ok(false)
        }
        Some(code) => Err(format!("exit code {code}: {}", err.trim())),
    })
}

static REFUSALS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Notes a refusal's kind: its message without the file name, numbers and quoted parts.
fn refusal(line: &str) {
    let text = line
        .replace("input.pickle", "")
        .replace(|c: char| c.is_ascii_digit(), "");
    let kind: String = text
        .split(['"', '\'', '`', '('])
        .next()
        .unwrap_or_default()
        .chars()
        .filter(|c| !c.is_ascii_digit())
        .take(90)
        .collect();
    if let Ok(mut r) = REFUSALS.lock() {
        r.push(kind);
    }
}

/// The most common kinds of refusal, most common first.
fn refusal_kinds() -> Vec<(usize, String)> {
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    if let Ok(r) = REFUSALS.lock() {
        for k in r.iter() {
            *counts.entry(k.clone()).or_default() += 1;
        }
    }
    let mut v: Vec<(usize, String)> = counts.into_iter().map(|(k, n)| (n, k)).collect();
    v.sort_by(|a, b| b.cmp(a));
    v
}

/// Options of `cargo xtask cli-fuzz`.
#[derive(Debug)]
pub(crate) struct Options {
    /// Number of cases.
    pub(crate) cases: u64,
    /// The seed.
    pub(crate) seed: u64,
    /// Run just this case.
    pub(crate) only: Option<u64>,
}

impl Options {
    /// From the arguments after `cli-fuzz`.
    pub(crate) fn parse(args: &[String]) -> Result<Options, String> {
        let mut o = Options {
            cases: CI_CASES,
            seed: CI_SEED,
            only: None,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut number = |name: &str| {
                it.next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or(format!("{name} needs a whole number"))
            };
            match a.as_str() {
                "--cases" => o.cases = number("--cases")?,
                "--seed" => o.seed = number("--seed")?,
                "--case" => o.only = Some(number("--case")?),
                "--long" => o.cases = LONG_CASES,
                _ => {
                    return Err(format!(
                        "unknown option {a}: cli-fuzz [--cases N] [--seed S] [--long] [--case N]"
                    ));
                }
            }
        }
        Ok(o)
    }
}

/// Runs the fuzz with `exe` (the built `ferrocuda`), `real` a real trace's bytes to cut from.
pub(crate) fn fuzz(exe: &Path, real: &[u8], work: &Path, o: &Options) -> Result<(), String> {
    let cases: Vec<u64> = match o.only {
        Some(c) => vec![c],
        None => (0..o.cases).collect(),
    };
    let failures_dir = work.join("failures");
    let start = Instant::now();
    let workers = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8);
    let results = std::sync::Mutex::new((Vec::<String>::new(), [[0u64; 2]; 3], 0u64));
    std::thread::scope(|scope| {
        for w in 0..workers {
            let (cases, results, failures_dir) = (&cases, &results, &failures_dir);
            scope.spawn(move || {
                let dir = work.join(format!("worker-{w}"));
                let _ = std::fs::create_dir_all(&dir);
                for &case in cases.iter().skip(w).step_by(workers) {
                    let mut r = Rng::new(o.seed, case);
                    let file = dir.join("input.pickle");
                    let outcome = input(&mut r, real)
                        .and_then(|b| std::fs::write(&file, b).map_err(|e| e.to_string()))
                        .and_then(|()| {
                            let inv = invocation(&mut r, &file, &dir);
                            run_case(exe, &dir, &inv).map(|f| (f, inv))
                        });
                    let Ok(mut guard) = results.lock() else {
                        return;
                    };
                    let (failures, ok, done) = &mut *guard;
                    *done += 1;
                    match outcome {
                        Ok((Ok(succeeded), inv)) => {
                            let kind = match inv.kind {
                                "replay" => 0,
                                "summary" => 1,
                                _ => 2,
                            };
                            ok[kind][usize::from(succeeded)] += 1;
                        }
                        Ok((Err(why), inv)) => {
                            let _ = std::fs::create_dir_all(failures_dir);
                            let kept = failures_dir.join(format!("case-{case}.pickle"));
                            let _ = std::fs::copy(&file, &kept);
                            failures.push(format!(
                                "case {case} (--seed {} --case {case}): ferrocuda {} {}: {why}",
                                o.seed,
                                inv.args.join(" "),
                                inv.env
                                    .iter()
                                    .map(|(k, v)| format!("{k}={v:?}"))
                                    .collect::<Vec<_>>()
                                    .join(" ")
                            ));
                        }
                        Err(e) => failures.push(format!("case {case}: harness error: {e}")),
                    }
                    if *done % 1000 == 0 {
                        eprintln!("cli-fuzz: {done} cases, {} failures", failures.len());
                    }
                }
            });
        }
    });
    let (failures, ok, done) = results.into_inner().map_err(|_| "a worker panicked")?;
    for f in &failures {
        eprintln!("{f}");
    }
    let kinds = ["replay", "summary", "plot"]
        .iter()
        .zip(ok)
        .map(|(k, [failed, succeeded])| format!("{k} {succeeded} ran, {failed} refused"))
        .collect::<Vec<_>>()
        .join("; ");
    eprintln!(
        "cli-fuzz: {done} cases (seed {}) in {:.1} s on {workers} workers: {} failures \
         (panics, aborts, hangs over {} s, refusals not one line); {kinds}",
        o.seed,
        start.elapsed().as_secs_f64(),
        failures.len(),
        HANG.as_secs(),
    );
    for (n, kind) in refusal_kinds().iter().take(12) {
        eprintln!("  {n:6} refused: {kind}");
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} failing cases (inputs kept in {})",
            failures.len(),
            failures_dir.display()
        ))
    }
}

/// Where the fuzz keeps its files.
pub(crate) fn work_dir(root: &Path) -> PathBuf {
    root.join("target").join("cli-fuzz")
}

/// Builds the `ferrocuda` command (debug: overflow checks on) and fuzzes it.
pub(crate) fn cli_fuzz(options: &Options) -> Result<(), String> {
    let built = built_executables(
        &["build", "-p", "ferrocuda-cli", "--bin", "ferrocuda"],
        &["ferrocuda"],
    )?;
    let exe = built
        .first()
        .map(|(_, e)| e.clone())
        .ok_or("no ferrocuda binary")?;
    let trace = root().join("tests/data/resnet50_train.pickle.xz");
    let xz = std::fs::read(&trace).map_err(|e| format!("{}: {e}", trace.display()))?;
    let mut real = Vec::new();
    lzma_rs::xz_decompress(&mut xz.as_slice(), &mut real).map_err(|e| e.to_string())?;
    let work = work_dir(&root());
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    fuzz(&exe, &real, &work, options)
}
