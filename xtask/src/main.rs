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
//!   generated and mutated traces (see [`fuzz`]); `ci` runs it with a fixed seed;
//! - `alloc-fuzz [--programs N] [--seed S]`: the allocator's structure-aware fuzz
//!   (`crates/alloc/tests/fuzz.rs`) in release, 100 000 programs unless told (CI runs 600
//!   in the ordinary test run);
//! - `thread-diff [--scripts N] [--seed S]`: the cross-thread differential test
//!   (`crates/alloc/tests/cross_thread_diff.rs`) in release, 100 000 scripts unless told
//!   (CI runs 10 000);
//! - `graph-fuzz [--programs N] [--seed S]`: the graph data-integrity fuzz
//!   (`tests/graph_fuzz.rs`) in release, 10 000 programs unless told (CI runs 200 in the
//!   ordinary test run);
//! - `loom`: the thread cache's slot protocol under `loom` (`--cfg loom`, its own target
//!   folder); `ci` runs it;
//! - `alloc-oracle [DIR]`: PyTorch's allocator results against ours, step by
//!   step (see [`oracle`]; DIR defaults to `tests/data/oracle`); any difference fails;
//!   `ci` runs it;
//! - `help` (or `-h`, `--help`): these tasks, briefly ([`USAGE`]).
#![forbid(unsafe_code)]

mod fuzz;
mod oracle;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

/// Test binaries that go into the GPU bundle.
const GPU_TESTS: &[&str] = &[
    "ferrocuda_driver",
    "conformance_cuda",
    "alloc_conformance",
    "graph_conformance",
    "availability",
    "graph_fuzz",
    "optim_conformance",
    "amp_conformance",
    "trees",
    "cudarc_interop",
    "cudarc_launch",
    "allocator_swap",
    "pinned_conformance",
    "allocator_async",
    "conformance_async",
    "nccl_gpu",
    "peer_cuda",
];
/// Test binaries that need two GPUs: bundled as `multi_*`, run by run.sh only with
/// `MULTI_GPU=1` (on fewer than two GPUs they fail, never skip).
const GPU_TESTS_MULTI: &[&str] = &["two_gpus"];
/// Shared libraries the bundled tests load from beside themselves (package, library name).
const GPU_LIBRARIES: &[(&str, &str)] =
    &[("ferrocuda-pluggable-fixture", "ferrocuda_pluggable_fixture")];
/// Bundled test binaries that run only some of their tests on the GPU (`--exact` names):
/// `graph_fuzz`'s fake-device run takes a minute and proves nothing about the GPU.
const GPU_TEST_ONLY: &[(&str, &str)] = &[
    (
        "graph_fuzz",
        "random_graph_programs_corrupt_nothing_on_the_gpu",
    ),
    (
        "ferrocuda_driver",
        "cuda::interop::tests::a_raw_stream_is_adopted_checked_and_never_destroyed",
    ),
];
/// Bench binaries that go into the GPU bundle.
const GPU_BENCHES: &[&str] = &[
    "launch",
    "alloc",
    "expandable",
    "graph",
    "autocast",
    "scaler",
    "step",
    "guards",
    "trees",
    "pinned",
    "torch_plugin",
];
/// Bench binaries that need two GPUs: bundled as `multibench_*`, run by run.sh only with
/// `MULTI_GPU=1` (on fewer than two GPUs they fail, never skip).
const GPU_BENCHES_MULTI: &[&str] = &["multi_gpu"];
/// Examples that go into the GPU bundle (each must succeed and say it ran on the GPU).
const GPU_EXAMPLES: &[&str] = &["tour", "snapshot", "decode"];
/// The PyTorch allocator library (crates/torch-plugin) and the script `run.sh` runs it with
/// against real PyTorch.
const TORCH_PLUGIN: &str = "ferrocuda-torch";
const TORCH_PLUGIN_LIBRARY: &str = "ferrocuda_torch";
const TORCH_PLUGIN_SCRIPT: &str = "xtask/torch/plugin_bench.py";
/// Traces of `tests/data` the bundle replays on the GPU beside PyTorch's allocator
/// (`replay.sh`): the four models of `shared/tools/torch_traces.py`, the shared recording
/// script (training with random shapes: GPT-2, ResNet-50; serving: BERT, a Llama decoder).
const REPLAY_TRACES: &[&str] = &["gpt2_train", "resnet50_train", "bert_serve", "llama_decode"];
/// The replay comparison's scripts, written into the bundle.
const REPLAY_SH: &str = include_str!("../gpu/replay.sh");
const REPLAY_COMPARE_PY: &str = include_str!("../gpu/replay_compare.py");

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
  alloc-oracle [DIR]
                  PyTorch's allocator results against ours, step by step
                  (DIR: tests/data/oracle)
  help            this text (also -h, --help)
";

fn main() -> ExitCode {
    let task = std::env::args().nth(1).unwrap_or_default();
    let result = match task.as_str() {
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        "ci" => ci(),
        "gpu-bundle" => gpu_bundle(),
        // The several-GPU bench fails on fewer than two GPUs: `MULTI_GPU=1 run.sh` runs it.
        "bench" => cargo(&["bench", "--workspace", "--exclude", "ferrocuda-dist"]),
        "doc" => doc(),
        "cli-fuzz" => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            fuzz::Options::parse(&args).and_then(|o| cli_fuzz(&o))
        }
        "loom" => loom(),
        "alloc-fuzz" | "thread-diff" | "graph-fuzz" => {
            let args: Vec<String> = std::env::args().skip(2).collect();
            let long = match task.as_str() {
                "alloc-fuzz" => &ALLOC_FUZZ,
                "thread-diff" => &THREAD_DIFF,
                _ => &GRAPH_FUZZ,
            };
            long.run(&args)
        }
        "alloc-oracle" => {
            let dir = std::env::args().nth(2);
            oracle::alloc_oracle(&dir.map_or_else(oracle_dir, PathBuf::from))
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

/// Tools the tests need beyond Rust, and which test needs each.
const TOOLS: &[(&str, &str)] = &[(
    "python3",
    "ferrocuda-types' snapshot::tests::python_reads_it_as_pytorch_does reads ferrocuda's \
     snapshot pickle with CPython's own unpickler (as do ferrocuda-cli's tests/replay.rs and \
     the root crate's tests/format_scenarios.rs), and ferrocuda-torch's tests/library.rs \
     loads the built PyTorch allocator library with ctypes",
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

fn ci() -> Result<(), String> {
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
    loom()?;
    cli_fuzz(&fuzz::Options::parse(&[])?)?;
    eprintln!("+ cargo xtask alloc-oracle {}", oracle_dir().display());
    oracle::alloc_oracle(&oracle_dir())?;
    doc()
}

/// `cargo doc`: rustdoc warnings (broken intra-doc links) fail it, and so do cargo's own
/// warnings, which `-D warnings` does not reach (an output file collision, where one
/// crate's page silently replaces another's).
fn doc() -> Result<(), String> {
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

/// A long run of one of the randomized tests in release: each `--name N` option of
/// `options` (flag, environment variable, default) sets that variable.
struct LongRun {
    task: &'static str,
    /// `cargo test` selects the test binary with these.
    select: &'static [&'static str],
    options: &'static [(&'static str, &'static str, &'static str)],
}

/// `alloc-fuzz [--programs N] [--seed S]`: `crates/alloc/tests/fuzz.rs`.
const ALLOC_FUZZ: LongRun = LongRun {
    task: "alloc-fuzz",
    select: &["-p", "ferrocuda-alloc", "--test", "fuzz"],
    options: &[
        ("--programs", "FERROCUDA_FUZZ_PROGRAMS", "100000"),
        ("--seed", "FERROCUDA_FUZZ_SEED", "20261123"),
    ],
};

/// `thread-diff [--scripts N] [--seed S]`: `crates/alloc/tests/cross_thread_diff.rs`.
const THREAD_DIFF: LongRun = LongRun {
    task: "thread-diff",
    select: &["-p", "ferrocuda-alloc", "--test", "cross_thread_diff"],
    options: &[
        ("--scripts", "FERROCUDA_DIFF_CASES", "100000"),
        ("--seed", "FERROCUDA_DIFF_SEED", "1592590336"),
    ],
};

/// `graph-fuzz [--programs N] [--seed S]`: the graph data-integrity fuzz
/// (`tests/graph_fuzz.rs`).
const GRAPH_FUZZ: LongRun = LongRun {
    task: "graph-fuzz",
    select: &["-p", "ferrocuda", "--test", "graph_fuzz"],
    options: &[
        ("--programs", "FERROCUDA_GRAPH_FUZZ_PROGRAMS", "10000"),
        ("--seed", "FERROCUDA_GRAPH_FUZZ_SEED", "20261205"),
    ],
};

impl LongRun {
    fn run(&self, args: &[String]) -> Result<(), String> {
        let mut values: Vec<(&str, String)> = self
            .options
            .iter()
            .map(|(_, var, default)| (*var, (*default).to_owned()))
            .collect();
        let usage = || {
            let flags: Vec<String> = self
                .options
                .iter()
                .map(|(f, _, _)| format!("[{f} N]"))
                .collect();
            format!("{} {}", self.task, flags.join(" "))
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let i = self
                .options
                .iter()
                .position(|(flag, _, _)| flag == a)
                .ok_or_else(|| format!("unknown option {a}: {}", usage()))?;
            let value = it.next().ok_or(format!("{a} needs a number"))?;
            value
                .parse::<u64>()
                .map_err(|e| format!("{a} {value}: {e}"))?;
            values[i].1 = value.clone();
        }
        let env: Vec<(&str, &str)> = values.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut cmd = vec!["test", "--release"];
        cmd.extend_from_slice(self.select);
        cmd.extend_from_slice(&["--", "--nocapture"]);
        cargo_with_env(&cmd, &env)
    }
}

/// The loom model of the thread cache (`crates/alloc/src/thread_cache.rs`, `loom_model`),
/// built with `--cfg loom` in `target/loom`; fails if no model ran.
fn loom() -> Result<(), String> {
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

/// Builds the `ferrocuda` command (debug: overflow checks on) and fuzzes it.
fn cli_fuzz(options: &fuzz::Options) -> Result<(), String> {
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
    let work = fuzz::work_dir(&root());
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    fuzz::fuzz(&exe, &real, &work, options)
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

fn gpu_bundle() -> Result<(), String> {
    let dir = root().join("gpu-bundle");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let groups = [
        (
            vec!["test", "--release", "--no-run", "--workspace"],
            GPU_TESTS,
            "test_",
        ),
        (
            vec!["test", "--release", "--no-run", "--workspace"],
            GPU_TESTS_MULTI,
            "multi_",
        ),
        (
            vec!["bench", "--no-run", "--workspace"],
            GPU_BENCHES,
            "bench_",
        ),
        (
            vec!["bench", "--no-run", "--workspace"],
            GPU_BENCHES_MULTI,
            "multibench_",
        ),
        (
            vec!["build", "--release", "--examples"],
            GPU_EXAMPLES,
            "example_",
        ),
        (
            vec![
                "build",
                "--release",
                "-p",
                "ferrocuda-cli",
                "--bin",
                "ferrocuda",
            ],
            &["ferrocuda"],
            "",
        ),
    ];
    for (args, names, prefix) in groups {
        for (name, exe) in built_executables(&args, names)? {
            copy_stripped(&exe, &dir.join(format!("{prefix}{name}")))?;
        }
    }
    // Beside the tests, where they look for them (the pluggable-allocator fixture).
    for (package, name) in GPU_LIBRARIES {
        let lib = built_library(package, name)?;
        let file = lib.file_name().ok_or("a library without a file name")?;
        copy_stripped(&lib, &dir.join(file))?;
    }
    bundle_torch_plugin(&dir)?;
    // PyTorch's figures come from the same run: take the anchor script along when the
    // shared folder beside the checkout has it.
    let anchor = root().join("../shared/tools/torch_anchor.py");
    match std::fs::copy(&anchor, dir.join("torch_anchor.py")) {
        Ok(_) => {}
        Err(e) => eprintln!(
            "note: {} not bundled ({e}); no PyTorch comparison",
            anchor.display()
        ),
    }
    // The pinned-memory anchor lives in this repository (PyTorch's side of benches/pinned.rs).
    std::fs::write(dir.join("torch_pinned.py"), TORCH_PINNED_PY).map_err(|e| e.to_string())?;
    // And the several-GPU one (PyTorch's side of crates/dist/benches/multi_gpu.rs).
    std::fs::write(dir.join("torch_dist.py"), TORCH_DIST_PY).map_err(|e| e.to_string())?;
    bundle_replay(&dir, &root().join("../shared/tools/torch_replay.py"))?;
    let script = dir.join("run.sh");
    std::fs::write(&script, run_sh()).map_err(|e| e.to_string())?;
    make_executable(&script)?;
    eprintln!(
        "bundle ready in {}: run gpu-bundle/run.sh on the GPU machine",
        dir.display()
    );
    pack_if_large(&dir)
}

/// The bundle's `run.sh`: [`RUN_SH`] with the tests of [`GPU_TEST_ONLY`] filled in.
fn run_sh() -> String {
    let only: String = GPU_TEST_ONLY
        .iter()
        .map(|(name, test)| format!("    test_{name}) echo \"--exact {test}\" ;;\n"))
        .collect();
    RUN_SH.replace("@TEST_ONLY@\n", &only)
}

/// Builds the PyTorch allocator library in release and copies it, stripped of line tables,
/// with its script into the bundle.
fn bundle_torch_plugin(dir: &Path) -> Result<(), String> {
    let lib = built_library(TORCH_PLUGIN, TORCH_PLUGIN_LIBRARY)?;
    let file = lib.file_name().ok_or("a library without a file name")?;
    copy_stripped(&lib, &dir.join(file))?;
    let script = root().join(TORCH_PLUGIN_SCRIPT);
    let name = script.file_name().ok_or("the plugin script has no name")?;
    std::fs::copy(&script, dir.join(name)).map_err(|e| format!("{}: {e}", script.display()))?;
    Ok(())
}

/// Copies a built file into the bundle, without its line tables (they make the bundle too
/// big to carry; symbols stay for backtraces).
fn copy_stripped(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::copy(from, to).map_err(|e| format!("{}: {e}", from.display()))?;
    let stripped = Command::new("strip").arg("--strip-debug").arg(to).status();
    if !stripped.is_ok_and(|s| s.success()) {
        eprintln!(
            "note: could not strip {}; the bundle stays larger",
            to.display()
        );
    }
    Ok(())
}

fn make_executable(path: &Path) -> Result<(), String> {
    let status = Command::new("chmod")
        .arg("+x")
        .arg(path)
        .status()
        .map_err(|e| e.to_string())?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("chmod +x {} failed", path.display()))
    }
}

/// What the replay comparison needs in the bundle: the traces of [`REPLAY_TRACES`] under
/// `traces/`, `replay.sh`, `replay_compare.py`, and a copy of PyTorch's replay `torch`
/// (`shared/tools/torch_replay.py`, beside the checkout: without it the bundle is not made).
fn bundle_replay(dir: &Path, torch: &Path) -> Result<(), String> {
    let traces = dir.join("traces");
    std::fs::create_dir_all(&traces).map_err(|e| e.to_string())?;
    for name in REPLAY_TRACES {
        let file = format!("{name}.pickle.xz");
        let from = root().join("tests/data").join(&file);
        std::fs::copy(&from, traces.join(&file)).map_err(|e| format!("{}: {e}", from.display()))?;
    }
    std::fs::copy(torch, dir.join("torch_replay.py")).map_err(|e| {
        format!(
            "{}: {e} (the replay comparison runs PyTorch's allocator through it)",
            torch.display()
        )
    })?;
    std::fs::write(dir.join("replay_compare.py"), REPLAY_COMPARE_PY).map_err(|e| e.to_string())?;
    let script = dir.join("replay.sh");
    std::fs::write(&script, REPLAY_SH).map_err(|e| e.to_string())?;
    make_executable(&script)
}

/// Past this size a bundle is also written as `gpu-bundle.tar.xz` (about 8x smaller), for
/// transports that limit what they carry (the device tool takes 64 MiB of working tree).
const PACK_ABOVE_BYTES: u64 = 48 << 20;

/// Writes `gpu-bundle.tar.xz` beside `dir` when the bundle is larger than
/// [`PACK_ABOVE_BYTES`] (removing a stale one otherwise).
fn pack_if_large(dir: &Path) -> Result<(), String> {
    let archive = root().join("gpu-bundle.tar.xz");
    let _ = std::fs::remove_file(&archive);
    let entries = std::fs::read_dir(dir).map_err(|e| e.to_string())?;
    let bytes: u64 = entries
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    if bytes <= PACK_ABOVE_BYTES {
        return Ok(());
    }
    let status = Command::new("tar")
        .arg("cJf")
        .arg(&archive)
        .arg("-C")
        .arg(root())
        .arg("gpu-bundle")
        .status()
        .map_err(|e| format!("tar: {e}"))?;
    if !status.success() {
        return Err("tar cJf gpu-bundle.tar.xz failed".into());
    }
    eprintln!(
        "the bundle is {} MiB: also packed as {} (unpack with `tar xJf gpu-bundle.tar.xz`)",
        bytes >> 20,
        archive.display()
    );
    Ok(())
}

/// PyTorch's pinned host allocator and host-to-device copies, measured beside
/// `benches/pinned.rs` (run by `run.sh`, compared with the criterion figures).
const TORCH_PINNED_PY: &str = include_str!("../anchors/torch_pinned.py");

/// PyTorch's `dist.all_reduce` (NCCL) bus bandwidth and `t.to("cuda:1")` bandwidth, measured
/// beside `crates/dist/benches/multi_gpu.rs` (run by `run.sh` with `MULTI_GPU=1`).
const TORCH_DIST_PY: &str = include_str!("../anchors/torch_dist.py");

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs the bundled tests and benches against the real CUDA driver. A skipped (ignored) test,
# a missing GPU, or a failed bench counts as a failure. Last line: "N passed, N failed".
# ONLY=<regex> runs just the binaries whose names match (and skips the PyTorch checks);
# ONLY=replay runs just the replay comparison (replay.sh: ferrocuda on the fake device and the
# GPU, and PyTorch's allocator, on the same traces).
# MULTI_GPU=1 also runs the multi_* tests and multibench_* benches, which need two GPUs (they
# fail on fewer), and torch_dist.py, PyTorch's side of multibench_multi_gpu, with a ratio table.
set -u -o pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export FERROCUDA_REQUIRE_GPU=1 CRITERION_HOME="$OUT/criterion"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
passed=0; failed=0
want() { [ -z "${ONLY:-}" ] || [[ "$1" =~ $ONLY ]]; }
# The tests of a binary to run, when not all of them (a test filtered out is no skip).
tests_of() {
  case "$1" in
@TEST_ONLY@
  esac
}
for t in test_* ${MULTI_GPU:+multi_*}; do
  want "$t" || continue
  echo "=== $t"
  # shellcheck disable=SC2046
  ./"$t" $(tests_of "$t") --include-ignored --test-threads=1 2>&1 | tee "$OUT/$t.log"
  rc=${PIPESTATUS[0]}
  line=$(grep -E '^test result:' "$OUT/$t.log" | tail -n 1)
  p=$(echo "$line" | sed -nE 's/.* ([0-9]+) passed.*/\1/p'); p=${p:-0}
  f=$(echo "$line" | sed -nE 's/.* ([0-9]+) failed.*/\1/p'); f=${f:-0}
  i=$(echo "$line" | sed -nE 's/.* ([0-9]+) ignored.*/\1/p'); i=${i:-0}
  if [ "$i" != 0 ]; then echo "$t: $i test(s) skipped: a skip is a failure here"; f=$((f + i)); fi
  if [ "$rc" != 0 ] && [ "$f" = 0 ]; then f=1; fi
  passed=$((passed + p)); failed=$((failed + f))
done
for e in example_*; do
  want "$e" || continue
  echo "=== $e"
  if ./"$e" 2>&1 | tee "$OUT/$e.log" && grep -q 'on the GPU' "$OUT/$e.log"; then
    passed=$((passed + 1))
  else
    echo "$e failed (or did not run on the GPU)"; failed=$((failed + 1))
  fi
done
for b in bench_* ${MULTI_GPU:+multibench_*}; do
  want "$b" || continue
  echo "=== $b"
  if ./"$b" --bench 2>&1 | tee "$OUT/$b.log"; then passed=$((passed + 1)); else echo "$b failed"; failed=$((failed + 1)); fi
done
if want replay; then
  echo "=== replay: ferrocuda on the fake device and on the GPU, PyTorch's allocator, same traces"
  if ./replay.sh "$OUT/replay" 2>&1 | tee "$OUT/replay.log"; then
    passed=$((passed + 1))
  else
    echo "replay comparison failed"; failed=$((failed + 1))
  fi
fi
if [ -f snapshot.pickle ] && [ -z "${ONLY:-}" ]; then
  echo "=== PyTorch's memory viewer on ferrocuda's snapshot"
  if python3 - snapshot.pickle <<'PY' 2>&1 | tee "$OUT/memory_viz.log"; then passed=$((passed + 1)); else echo "memory_viz check failed"; failed=$((failed + 1)); fi
import pickle, sys
from torch.cuda import _memory_viz as viz
s = pickle.load(open(sys.argv[1], 'rb'))
assert viz.segment_plot(s) and viz.trace_plot(s)
summary = viz.segsum(s)  # asserts allocated + free == reserved per segment
listing = viz.trace(s)
print(summary.splitlines()[-8])
print('memory_viz accepted it: %d segments, %d trace entries, %d lines of trace listing'
      % (len(s['segments']), len(s['device_traces'][0]), len(listing.splitlines())))
PY
  cp snapshot.pickle "$OUT/" 2>/dev/null
fi
# ferrocuda's allocator inside real PyTorch (libferrocuda_torch.so): the check with an empty
# configuration (PyTorch's behaviour) and the recommended one, then the five-way benchmark.
# ONLY=plugin runs just these; PLUGIN_BENCH_ARGS passes options to the benchmark.
plugin() {
  local name=$1; shift
  want "$name" || return 0
  echo "=== $name"
  if OUT="$OUT" PYTHONUNBUFFERED=1 "$@" 2>&1 | tee "$OUT/$name.log"; then passed=$((passed + 1)); else echo "$name failed"; failed=$((failed + 1)); fi
}
if [ -f plugin_bench.py ] && [ -f libferrocuda_torch.so ]; then
  plugin plugin_check env -u FERROCUDA_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF python3 plugin_bench.py check
  plugin plugin_check_recommended env -u PYTORCH_CUDA_ALLOC_CONF FERROCUDA_ALLOC_CONF=ferrocuda_recommended:True python3 plugin_bench.py check
  # shellcheck disable=SC2086
  plugin plugin_bench python3 plugin_bench.py bench ${PLUGIN_BENCH_ARGS:-}
fi
if [ -f torch_anchor.py ] && [ -z "${ONLY:-}" ]; then
  echo "=== torch_anchor.py (PyTorch, same machine, same run)"
  if PYTHONUNBUFFERED=1 python3 torch_anchor.py 2>&1 | tee "$OUT/torch_anchor.log"; then
    passed=$((passed + 1))
  else
    echo "torch_anchor.py failed"; failed=$((failed + 1))
  fi
fi
grep -h 'ratio' "$OUT"/bench_*.log 2>/dev/null
grep -h '^target ' "$OUT"/plugin_bench.log 2>/dev/null
if [ -f "$OUT/torch_anchor.json" ]; then
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
torch = json.load(open(os.path.join(out, "torch_anchor.json")))
def ours(name):
    p = os.path.join(out, "criterion", "alloc", name, "new", "estimates.json")
    return json.load(open(p))["median"]["point_estimate"] if os.path.exists(p) else None
rows = [("cached pair 512 B", "pair_512B", "torch_alloc_pair_ns_512", 60),
        ("cached pair 1 MiB", "pair_1MiB", "torch_alloc_pair_ns_1048576", 60),
        ("cached pair 100 MiB", "pair_100MiB", "torch_alloc_pair_ns_104857600", 60),
        ("pair 1 MiB, 8 threads", "pair_1MiB_8threads", "torch_alloc_pair_ns_1MiB_8threads", 150),
        ("churn, 1024 live", "churn_1024_live", "torch_alloc_mixed_ns", 60),
        ("pair 1 MiB, no thread cache", "pair_1MiB_locked", "torch_alloc_pair_ns_1048576", None),
        ("pair 1 MiB, expandable", "pair_1MiB_expandable", "torch_alloc_pair_ns_1048576", None),
        ("recommended: pair 1 MiB", "pair_1MiB_recommended", "torch_alloc_pair_ns_1048576", None),
        ("recommended: 8 threads", "pair_1MiB_8threads_recommended", "torch_alloc_pair_ns_1MiB_8threads", None),
        ("recommended: churn", "churn_1024_live_recommended", "torch_alloc_mixed_ns", None)]
print(f"{'allocator hot path':28} {'ferrocuda ns':>13} {'PyTorch ns':>11} {'ratio':>7} {'target ns':>10}")
for label, mine, theirs, target in rows:
    a, b = ours(mine), torch.get(theirs)
    if a is None or b is None:
        print(f"{label:28} missing"); continue
    print(f"{label:28} {a:13.1f} {b:11.1f} {a / b:7.3f} {target or '-':>10}")
PY
fi
if [ -f torch_pinned.py ] && [ -z "${ONLY:-}" ]; then
  echo "=== torch_pinned.py (PyTorch's pinned host allocator, same machine, same run)"
  if PYTHONUNBUFFERED=1 python3 torch_pinned.py 2>&1 | tee "$OUT/torch_pinned.log"; then
    passed=$((passed + 1))
  else
    echo "torch_pinned.py failed"; failed=$((failed + 1))
  fi
fi
if [ -f "$OUT/torch_pinned.json" ]; then
  python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
torch = json.load(open(os.path.join(out, "torch_pinned.json")))
def ours(group, name):
    p = os.path.join(out, "criterion", group, name, "new", "estimates.json")
    return json.load(open(p))["median"]["point_estimate"] if os.path.exists(p) else None
print(f"{'pinned host memory':28} {'ferrocuda':>13} {'PyTorch':>11} {'ratio':>7}")
for label, mine, theirs in [("alloc+free pair 4 KiB, ns", "pair_4KiB", "torch_pinned_pair_ns_4096"),
                            ("alloc+free pair 1 MiB, ns", "pair_1MiB", "torch_pinned_pair_ns_1048576"),
                            ("alloc+free pair 64 MiB, ns", "pair_64MiB", "torch_pinned_pair_ns_67108864"),
                            ("pair 1 MiB, 8 threads, ns", "pair_1MiB_8threads", "torch_pinned_pair_ns_1MiB_8threads"),
                            ("empty(pinned) 4 KiB, ns", "empty_pair_4KiB", "torch_pinned_empty_ns_4096"),
                            ("empty(pinned) 1 MiB, ns", "empty_pair_1MiB", "torch_pinned_empty_ns_1048576"),
                            ("empty(pinned) 64 MiB, ns", "empty_pair_64MiB", "torch_pinned_empty_ns_67108864")]:
    a, b = ours("pinned", mine), torch.get(theirs)
    print(f"{label:28} missing" if a is None or b is None else f"{label:28} {a:13.1f} {b:11.1f} {a / b:7.3f}")
for label, mine, theirs in [("H2D 64 MiB pinned, GB/s", "pinned_64MiB", "torch_h2d_pinned_GBps"),
                            ("H2D 64 MiB pageable, GB/s", "pageable_64MiB", "torch_h2d_pageable_GBps")]:
    ns, b = ours("h2d", mine), torch.get(theirs)
    if ns is None or b is None:
        print(f"{label:28} missing"); continue
    a = (64 << 20) / ns
    print(f"{label:28} {a:13.2f} {b:11.2f} {a / b:7.3f}")
PY
fi
if [ -n "${MULTI_GPU:-}" ] && [ -f torch_dist.py ] && want torch_dist; then
  echo "=== torch_dist.py (PyTorch's dist.all_reduce, NCCL, and t.to(\"cuda:1\"), same run)"
  if OUT="$OUT" PYTHONUNBUFFERED=1 python3 torch_dist.py 2>&1 | tee "$OUT/torch_dist.log"; then
    passed=$((passed + 1))
  else
    echo "torch_dist.py failed"; failed=$((failed + 1))
  fi
fi
if [ -n "${MULTI_GPU:-}" ] && [ -f "$OUT/torch_dist.json" ]; then
  python3 - "$OUT" <<'PY'
import json, os, re, sys
out = sys.argv[1]
torch = json.load(open(os.path.join(out, "torch_dist.json")))
log = os.path.join(out, "multibench_multi_gpu.log")
text = open(log).read() if os.path.exists(log) else ""
def ours(key):
    m = re.search(r"^" + key + r" ([0-9.]+)", text, re.M)
    return float(m.group(1)) if m else None
print(f"{'several GPUs, GB/s':28} {'ferrocuda':>10} {'PyTorch':>10} {'ratio':>7} {'target':>7}")
for label, mine, theirs, target in [
        ("all-reduce 256 MiB busbw", "ferrocuda_allreduce_busbw_GBps", "torch_allreduce_busbw_GBps", ">=0.98"),
        ("peer copy 256 MiB 0->1", "ferrocuda_peer_copy_GBps", "torch_peer_copy_GBps", "-")]:
    a, b = ours(mine), torch.get(theirs)
    print(f"{label:28} missing" if a is None or b is None else f"{label:28} {a:10.2f} {b:10.2f} {a / b:7.3f} {target:>7}")
PY
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
"#;

#[cfg(test)]
mod tests {
    use super::*;

    /// `run.sh` is valid bash and runs the plugin's check and benchmark.
    #[test]
    fn run_sh_parses_and_runs_the_plugin_steps() {
        let script = run_sh();
        let path = std::env::temp_dir().join(format!("ferrocuda-run-sh-{}", std::process::id()));
        std::fs::write(&path, &script).unwrap();
        let parsed = Command::new("bash").arg("-n").arg(&path).status().unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(parsed.success(), "bash -n refused run.sh");
        for step in [
            "plugin_bench.py check",
            "plugin_bench.py bench",
            "--exact cuda::interop::tests::",
            "${MULTI_GPU:+multibench_*}",
            "python3 torch_dist.py",
            "torch_allreduce_busbw_GBps",
        ] {
            assert!(script.contains(step), "run.sh lacks {step}");
        }
        assert!(!script.contains("@TEST_ONLY@"));
    }

    fn bash_accepts(name: &str, script: &str, dir: &Path) -> bool {
        let path = dir.join(name);
        std::fs::write(&path, script).is_ok()
            && Command::new("bash")
                .arg("-n")
                .arg(&path)
                .status()
                .is_ok_and(|s| s.success())
    }

    #[test]
    fn the_bundle_carries_the_replay_comparison() -> Result<(), String> {
        let dir = std::env::temp_dir().join(format!("xtask-bundle-replay-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let missing = bundle_replay(&dir, &dir.join("no/torch_replay.py"))
            .err()
            .unwrap_or_default();
        assert!(
            missing.contains("torch_replay.py") && missing.contains("PyTorch's allocator"),
            "{missing}"
        );
        let torch = dir.join("stand-in.py");
        std::fs::write(&torch, "print('torch')\n").map_err(|e| e.to_string())?;
        bundle_replay(&dir, &torch)?;
        for name in REPLAY_TRACES {
            assert!(
                dir.join(format!("traces/{name}.pickle.xz")).is_file(),
                "{name}"
            );
        }
        for file in ["torch_replay.py", "replay.sh", "replay_compare.py"] {
            assert!(dir.join(file).is_file(), "{file}");
        }
        // run.sh runs the step (ONLY=replay runs just it), and both scripts parse.
        assert!(RUN_SH.contains("if want replay; then") && RUN_SH.contains("./replay.sh"));
        assert!(bash_accepts("run.sh", &run_sh(), &dir));
        assert!(bash_accepts("replay.sh", REPLAY_SH, &dir));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
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
            "alloc-oracle",
            "help",
        ] {
            assert!(
                USAGE.lines().any(|l| l.trim_start().starts_with(task)),
                "{task}"
            );
        }
    }

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
