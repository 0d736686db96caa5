//! `cargo xtask gpu-bundle`: builds release test and bench binaries, examples, the PyTorch
//! allocator library, the `ferrocuda` command and four traces into `gpu-bundle/`
//! (git-ignored), with `run.sh` (`xtask/gpu/run.sh`) that runs them against the real driver
//! on a GPU machine and `replay.sh` (`xtask/gpu/replay.sh`), the replay comparison.

use crate::{built_executables, built_library, root};
use std::path::Path;
use std::process::Command;

/// Test binaries that go into the GPU bundle.
const GPU_TESTS: &[&str] = &[
    "ferrocuda_driver",
    "cuda_conformance",
    "alloc_conformance",
    "graph_conformance",
    "availability_scenarios",
    "graph_fuzz",
    "optim_conformance",
    "amp_conformance",
    "trees_conformance",
    "cudarc_scenarios",
    "cudarc_gpu",
    "pluggable_process",
    "pinned_conformance",
    "async_process",
    "async_conformance",
    "dist_gpu",
    "dist_failfast_gpu",
    "store_torch",
    "peer_gpu",
    "blas_conformance",
    "blas_graphs",
    "fft_conformance",
];
/// Test binaries that need two GPUs: bundled as `multi_*`, run by run.sh only with
/// `MULTI_GPU=1` (on fewer than two GPUs they fail, never skip).
const GPU_TESTS_MULTI: &[&str] = &["dist_multigpu", "torchrun_multigpu"];
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
    "gemm",
    "fft",
    "sleep",
];
/// Bench binaries that need two GPUs: bundled as `multibench_*`, run by run.sh only with
/// `MULTI_GPU=1` (on fewer than two GPUs they fail, never skip).
const GPU_BENCHES_MULTI: &[&str] = &["multi_gpu"];
/// Examples that go into the GPU bundle (each must succeed and say it ran on the GPU).
const GPU_EXAMPLES: &[&str] = &["tour", "snapshot", "decode", "torchrun_worker", "ipc_peer"];
/// The PyTorch allocator library (crates/torch-plugin) and the scripts `run.sh` runs it with
/// against real PyTorch.
const TORCH_PLUGIN: &str = "ferrocuda-torch";
const TORCH_PLUGIN_LIBRARY: &str = "ferrocuda_torch";
const TORCH_PLUGIN_SCRIPT: &str = "xtask/torch/plugin_bench.py";
/// The plug-in's sleep-and-wake script (it imports the first).
const TORCH_PLUGIN_SLEEP_SCRIPT: &str = "xtask/torch/plugin_sleep.py";
/// Traces of `tests/data` the bundle replays on the GPU beside PyTorch's allocator
/// (`replay.sh`): the four models of `shared/tools/torch_traces.py`, the shared recording
/// script (training with random shapes: GPT-2, ResNet-50; serving: BERT, a Llama decoder).
const REPLAY_TRACES: &[&str] = &["gpt2_train", "resnet50_train", "bert_serve", "llama_decode"];
/// The replay comparison's scripts, written into the bundle.
const REPLAY_SH: &str = include_str!("../gpu/replay.sh");
const REPLAY_COMPARE_PY: &str = include_str!("../gpu/replay_compare.py");

pub(crate) fn gpu_bundle() -> Result<(), String> {
    // Checked before the long build: without PyTorch's replay script no bundle is made.
    let torch_replay = root().join("../shared/tools/torch_replay.py");
    if !torch_replay.is_file() {
        return Err(format!(
            "{} not found: the bundle's replay comparison runs PyTorch's allocator through \
             it (the shared tools folder beside the checkout)",
            torch_replay.display()
        ));
    }
    let dir = root().join("gpu-bundle");
    let _ = std::fs::remove_dir_all(&dir);
    // A packed bundle of an earlier run must not pass for this one.
    let _ = std::fs::remove_file(root().join("gpu-bundle.tar.xz"));
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
    // And its pageable copies alone, alternated with ours round by round by `run.sh`'s
    // paired steps, which `paired_summary.py` sums up (`torch_pinned.py` times its copies
    // with `torch_copies.py`'s `rate`).
    std::fs::write(dir.join("torch_copies.py"), TORCH_COPIES_PY).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("paired_summary.py"), PAIRED_SUMMARY_PY).map_err(|e| e.to_string())?;
    // Issue 30's table in rounds: PyTorch's side of a round (from the anchors above) and the
    // table's summary.
    std::fs::write(dir.join("torch_table.py"), TORCH_TABLE_PY).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("issue_table.py"), ISSUE_TABLE_PY).map_err(|e| e.to_string())?;
    // And cuBLAS's and cuFFT's (PyTorch's side of crates/mathlib/benches).
    std::fs::write(dir.join("torch_mathlib.py"), TORCH_MATHLIB_PY).map_err(|e| e.to_string())?;
    // And the graph-memory planner's (PyTorch's capture pools against `ferrocuda plan`).
    std::fs::write(dir.join("torch_plan.py"), TORCH_PLAN_PY).map_err(|e| e.to_string())?;
    // And the several-GPU one (PyTorch's side of crates/dist/benches/multi_gpu.rs).
    std::fs::write(dir.join("torch_dist.py"), TORCH_DIST_PY).map_err(|e| e.to_string())?;
    // And the all-reduce under torchrun, both sides (multi_torchrun_multigpu's bench role).
    std::fs::write(dir.join("torchrun_allreduce.py"), TORCHRUN_ALLREDUCE_PY)
        .map_err(|e| e.to_string())?;
    // And CUDA IPC's (PyTorch on either side of examples/ipc_peer.rs).
    std::fs::write(dir.join("ipc_torch.py"), TORCH_IPC_PY).map_err(|e| e.to_string())?;
    bundle_replay(&dir, &torch_replay)?;
    let script = dir.join("run.sh");
    std::fs::write(&script, run_sh()).map_err(|e| e.to_string())?;
    make_executable(&script)?;
    let sanitize = dir.join("sanitize.sh");
    std::fs::write(&sanitize, SANITIZE_SH).map_err(|e| e.to_string())?;
    make_executable(&sanitize)?;
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
    RUN_SH.replace(TEST_ONLY_LINE, &only)
}

/// Builds the PyTorch allocator library in release and copies it, stripped of line tables,
/// with its script into the bundle.
fn bundle_torch_plugin(dir: &Path) -> Result<(), String> {
    let lib = built_library(TORCH_PLUGIN, TORCH_PLUGIN_LIBRARY)?;
    let file = lib.file_name().ok_or("a library without a file name")?;
    copy_stripped(&lib, &dir.join(file))?;
    for script in [TORCH_PLUGIN_SCRIPT, TORCH_PLUGIN_SLEEP_SCRIPT] {
        let script = root().join(script);
        let name = script.file_name().ok_or("a plugin script has no name")?;
        std::fs::copy(&script, dir.join(name)).map_err(|e| format!("{}: {e}", script.display()))?;
    }
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
/// PyTorch's 64 MiB pageable copies, one round (`run.sh`'s paired copies).
const TORCH_COPIES_PY: &str = include_str!("../anchors/torch_copies.py");
/// PyTorch's side of one round of `run.sh`'s `issue_table` step.
const TORCH_TABLE_PY: &str = include_str!("../anchors/torch_table.py");
const TORCH_MATHLIB_PY: &str = include_str!("../anchors/torch_mathlib.py");
/// PyTorch's CUDA graph pools against `ferrocuda plan` (run by `run.sh` as `torch_plan`).
const TORCH_PLAN_PY: &str = include_str!("../anchors/torch_plan.py");
const TORCH_IPC_PY: &str = include_str!("../torch/ipc_torch.py");
const TORCHRUN_ALLREDUCE_PY: &str = include_str!("../anchors/torchrun_allreduce.py");

/// PyTorch's `dist.all_reduce` (NCCL) bus bandwidth and `t.to("cuda:1")` bandwidth, measured
/// beside `crates/dist/benches/multi_gpu.rs` (run by `run.sh` with `MULTI_GPU=1`).
const TORCH_DIST_PY: &str = include_str!("../anchors/torch_dist.py");

/// The bundle's `run.sh` (`xtask/gpu/run.sh`), before [`run_sh`] fills in the tests of
/// [`GPU_TEST_ONLY`] at [`TEST_ONLY_LINE`].
const RUN_SH: &str = include_str!("../gpu/run.sh");
/// The summary of `run.sh`'s paired steps (`xtask/gpu/paired_summary.py`).
const PAIRED_SUMMARY_PY: &str = include_str!("../gpu/paired_summary.py");
/// Issue 30's table from `run.sh`'s `issue_table` rounds (`xtask/gpu/issue_table.py`).
const ISSUE_TABLE_PY: &str = include_str!("../gpu/issue_table.py");
/// compute-sanitizer over the conformance binaries (`xtask/gpu/sanitize.sh`), run by `run.sh`.
const SANITIZE_SH: &str = include_str!("../gpu/sanitize.sh");
/// The line of [`RUN_SH`] that [`run_sh`] replaces with a `case` arm for each test of
/// [`GPU_TEST_ONLY`] (a comment, so that the file alone is valid bash).
const TEST_ONLY_LINE: &str =
    "    # @TEST_ONLY@: gpu-bundle fills in the arms of GPU_TEST_ONLY (xtask/src/gpu_bundle.rs)\n";

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

    /// `xtask/gpu/run.sh` holds the line [`run_sh`] fills in exactly once, and parses as it is
    /// (so that it can be read and checked as a file).
    #[test]
    fn run_sh_file_has_one_test_only_line_and_parses_alone() {
        assert_eq!(RUN_SH.matches(TEST_ONLY_LINE).count(), 1);
        let dir = std::env::temp_dir().join(format!("xtask-run-sh-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(bash_accepts("run.sh", RUN_SH, &dir));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `sanitize.sh` parses, and every binary it runs is one the bundle carries.
    #[test]
    fn the_sanitizer_step_runs_bundled_binaries() {
        let dir = std::env::temp_dir().join(format!("xtask-sanitize-sh-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(bash_accepts("sanitize.sh", SANITIZE_SH, &dir));
        let _ = std::fs::remove_dir_all(&dir);
        let named: Vec<&str> = (SANITIZE_SH.split(|c: char| !c.is_alphanumeric() && c != '_'))
            .filter(|w| w.starts_with("test_"))
            .collect();
        assert!(named.len() >= 8, "{named:?}");
        for name in named {
            let bundled = name.strip_prefix("test_").unwrap();
            assert!(
                GPU_TESTS.contains(&bundled),
                "sanitize.sh runs {name}, not bundled"
            );
        }
        assert!(RUN_SH.contains("./sanitize.sh"), "run.sh runs the step");
    }

    /// Every binary the bundle names is a target of the workspace: a renamed test would
    /// otherwise be found missing only when the bundle is built.
    #[test]
    fn the_bundle_names_targets_that_exist() -> Result<(), String> {
        let targets = crate::workspace_targets()?;
        let has = |kinds: &[&str], name: &str| {
            targets
                .iter()
                .any(|t| t.name == name && kinds.contains(&t.kind.as_str()))
        };
        let tests = GPU_TESTS.iter().chain(GPU_TESTS_MULTI);
        for name in tests.chain(GPU_TEST_ONLY.iter().map(|(name, _)| name)) {
            assert!(has(&["test", "lib"], name), "no test binary {name}");
        }
        for name in GPU_BENCHES.iter().chain(GPU_BENCHES_MULTI) {
            assert!(has(&["bench"], name), "no bench {name}");
        }
        for name in GPU_EXAMPLES {
            assert!(has(&["example"], name), "no example {name}");
        }
        Ok(())
    }

    /// Every bench of the workspace goes into the bundle unless it measures only the host
    /// (named here, with why): a new bench left out of [`GPU_BENCHES`] would otherwise never
    /// run on a GPU.
    #[test]
    fn every_device_bench_is_bundled() -> Result<(), String> {
        const HOST_ONLY: &[(&str, &str)] = &[
            (
                "many_streams",
                "the command's reader and replay on the fake device",
            ),
            (
                "snapshot_memory",
                "the command's peak memory reading a snapshot",
            ),
        ];
        let targets = crate::workspace_targets()?;
        for t in targets.iter().filter(|t| t.kind == "bench") {
            let name = t.name.as_str();
            let bundled = GPU_BENCHES
                .iter()
                .chain(GPU_BENCHES_MULTI)
                .any(|b| *b == name);
            let host_only = HOST_ONLY.iter().any(|(b, _)| *b == name);
            assert!(
                bundled || host_only,
                "bench {name} is neither in GPU_BENCHES nor named host-only"
            );
        }
        Ok(())
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
}
