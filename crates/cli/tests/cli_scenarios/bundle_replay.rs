//! The GPU bundle's replay comparison (`xtask/gpu/replay.sh` and `replay_compare.py`), run
//! here without a GPU: `--device cuda` is served by the fake device and PyTorch's
//! `torch_replay.py` by a stand-in that reports this command's figures in its format. The
//! step must pass when the memory figures agree and fail loudly when one differs, so that
//! a mistake in the scripts is found before the bundle reaches the GPU.
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const EXE: &str = env!("CARGO_BIN_EXE_ferrocuda");

/// `ferrocuda` with `--device cuda` replaced by `--device fake` and the output relabelled
/// `cuda`; with SKEW=cuda, the GPU runs report one device allocation more (then they differ
/// from PyTorch's and from the fake device's), with SKEW=fake the fake device's runs do
/// (then the GPU agrees with PyTorch and only the fake device differs), with
/// SKEW=placement the GPU runs do not say where their segments went (then the fake device
/// cannot place them there).
const FAKE_GPU: &str = r#"#!/usr/bin/env bash
args=(); cuda=0
for a in "$@"; do if [ "$a" = cuda ]; then cuda=1; a=fake; fi; args+=("$a"); done
out=$("$REAL_FERROCUDA" "${args[@]}") || exit $?
if [ "$cuda" = 1 ]; then
  out=${out//\"backend\": \"fake\"/\"backend\": \"cuda\"}
  if [ "${SKEW:-}" = cuda ]; then out=${out//\"num_device_alloc\": /\"num_device_alloc\": 1}; fi
  if [ "${SKEW:-}" = placement ]; then out=${out//\"segment_addresses\"/\"segment_addresses_hidden\"}; fi
elif [ "${SKEW:-}" = fake ]; then
  out=${out//\"num_device_alloc\": /\"num_device_alloc\": 1}
fi
printf '%s\n' "$out"
"#;

/// `torch_replay.py TRACE --repeat 1 --json OUT`, answered from `ferrocuda replay` on the
/// fake device under the same PYTORCH_CUDA_ALLOC_CONF, in PyTorch's keys.
const FAKE_TORCH: &str = r#"import json, os, subprocess, sys
trace, out = sys.argv[1], sys.argv[sys.argv.index("--json") + 1]
assert sys.argv[sys.argv.index("--repeat") + 1] == "1"
ours = json.loads(subprocess.run([os.environ["REAL_FERROCUDA"], "replay", trace, "--json"],
                                 check=True, capture_output=True).stdout)[0]
fig = {k: ours[k] for k in ["peak_requested", "peak_reserved", "peak_allocated",
                            "num_device_alloc", "num_device_free"]}
fig.update(trace=os.path.basename(trace), conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           events=ours["timed_events"], seconds=1e-3, ns_per_event=2.0 * ours["ns_per_event"])
json.dump(fig, open(out, "w"))
print(json.dumps(fig))
"#;

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../xtask/gpu")
}

/// A bundle folder with the two scripts, the stand-ins and one small trace with two
/// streams and enough segments to count.
fn bundle(dir: &Path) -> TestResult {
    std::fs::create_dir_all(dir.join("traces"))?;
    for f in ["replay.sh", "replay_compare.py"] {
        std::fs::copy(scripts().join(f), dir.join(f))?;
    }
    std::fs::write(dir.join("fake_gpu.sh"), FAKE_GPU)?;
    std::fs::write(dir.join("fake_torch.py"), FAKE_TORCH)?;
    let mib = 1u64 << 20;
    let mut events = Vec::new();
    for i in 0..40u64 {
        let (addr, size) = (0x7f00_0000_0000 + (i << 28), (1 + i % 7) * 3 * mib);
        let stream = if i % 2 == 0 { 0 } else { 0x5a00 };
        let e = |action: &str| json!({"action": action, "addr": addr, "size": size, "stream": stream, "time_us": i});
        events.push(e("alloc"));
        if i % 3 != 0 {
            events.push(e("free_completed"));
        }
    }
    let snapshot = json!({"segments": [], "device_traces": [events]});
    // A pickle named .pickle.xz: the command tells the format from the first bytes.
    let bytes = serde_pickle::to_vec(&snapshot, serde_pickle::SerOptions::new())?;
    std::fs::write(dir.join("traces/small.pickle.xz"), bytes)?;
    Ok(())
}

fn run_step(dir: &Path, skew: Option<&str>) -> Result<Output, std::io::Error> {
    let mut cmd = Command::new("bash");
    cmd.arg(dir.join("replay.sh"))
        .arg(dir.join("out"))
        .env("REAL_FERROCUDA", EXE)
        .env("FERROCUDA", dir.join("fake_gpu.sh"))
        .env("TORCH_REPLAY", dir.join("fake_torch.py"))
        .env("REPLAY_RUNS", "2")
        // The step must not be swayed by a configuration in the caller's environment.
        .env("FERROCUDA_ALLOC_CONF", "max_split_size_mb:100");
    if let Some(side) = skew {
        cmd.env("SKEW", side);
    }
    cmd.output()
}

#[test]
fn the_bundles_replay_step_passes_on_equal_figures_and_fails_on_a_difference() -> TestResult {
    let dir = std::env::temp_dir().join(format!("ferrocuda-bundle-replay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    bundle(&dir)?;
    Command::new("chmod")
        .arg("+x")
        .arg(dir.join("fake_gpu.sh"))
        .status()?;

    let out = run_step(&dir, None)?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{text}\n{err}");
    assert!(
        text.contains("ours cuda ns/ev") && text.contains("replay comparison passed: 2 traces"),
        "{text}"
    );
    // One row per configuration; the stand-in is twice as slow, so the ratio is 0.5 or
    // near it and the default configuration's target is shown.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("out/summary.json"))?)?;
    let rows = summary["rows"].as_array().ok_or("rows")?;
    assert_eq!(rows.len(), 2, "{summary}");
    assert_eq!(rows[0]["conf"], "default");
    assert_eq!(rows[0]["target"], 0.5);
    assert_eq!(rows[1]["conf"], "expandable");
    for row in rows {
        assert_eq!(row["runs"], json!([2, 2]), "{row}");
        assert!(row["events"].as_u64() > Some(60), "{row}");
        assert!(row["ratio"].as_f64().is_some_and(|r| r > 0.0), "{row}");
        // PyTorch's figures (no OOM count among them) are shown beside ours.
        let theirs = row["pytorch"].as_object().ok_or("pytorch")?;
        assert_eq!(theirs.len(), 4, "{row}");
        for (key, value) in theirs {
            assert_eq!(&row["ours"][key], value, "{key}: {row}");
        }
    }
    assert!(dir.join("out/small.expandable.cuda.2.json").exists());
    // The fake device's runs took the GPU runs' segment addresses, every one of them.
    let fake: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        dir.join("out/small.default.fake.2.json"),
    )?)?;
    let used = &fake[0]["addresses"];
    assert!(used["recorded"].as_u64() > Some(3), "{fake}");
    assert_eq!(used["used"], used["recorded"], "{fake}");
    assert_eq!(used["fresh"], 0, "{fake}");

    // Ours on the GPU differs from PyTorch's on the GPU: a failure in both configurations.
    let out = run_step(&dir, Some("cuda"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("MISMATCH small default: num_device_alloc PyTorch")
            && text.contains("MISMATCH small expandable: num_device_alloc PyTorch")
            && text.contains("replay comparison FAILED"),
        "{text}"
    );
    // Only the fake device differs: a failure in both configurations (it had the GPU's
    // segment addresses, so placement cannot explain it).
    let out = run_step(&dir, Some("fake"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("MISMATCH small default: num_device_alloc fake")
            && text.contains("MISMATCH small expandable: num_device_alloc fake")
            && !text.contains("num_device_alloc PyTorch"),
        "{text}"
    );
    // The GPU runs do not say where their segments went: the fake device's placement is
    // not the driver's, a failure where the configuration makes segments with malloc.
    let out = run_step(&dir, Some("placement"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("MISMATCH small default: fake run 1 placed segments")
            && !text.contains("MISMATCH small expandable"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
