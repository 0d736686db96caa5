//! Real PyTorch snapshots (`tests/data/snapshots/`, recorded with PyTorch 2.11's default
//! history settings: stacks included, frames shared by reference through the pickle's memo)
//! read as CPython reads them, and through every command; and the ways users compress them.
use ferrocuda_cli::recording::{StackId, TraceAction};
use ferrocuda_cli::trace::read_recording;
use serde_json::{Value as Json, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The shared recordings (with `facts.json`), then this project's own
/// (`xtask/torch/record_snapshots.py` on an H200: ResNet-18 with default history, GPT-2 with
/// `max_entries=2000`, a CUDA graph beside a `MemPool` with `context="all",
/// stacks="python"`).
const SNAPSHOTS: [&str; 8] = [
    "transformer_train_default",
    "transformer_train_context_all",
    "transformer_train_python_stacks",
    "transformer_graph_capture",
    "transformer_serve_random",
    "resnet18_train",
    "gpt2_train_max_entries",
    "mlp_graph_mempool",
];

fn snapshot(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data/snapshots")
        .join(format!("{name}.pickle.xz"))
}

fn scratch(test: &str) -> Result<PathBuf, std::io::Error> {
    let dir =
        std::env::temp_dir().join(format!("ferrocuda-snapshots-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn ferrocuda(args: &[&str]) -> Result<Output, std::io::Error> {
    Command::new(env!("CARGO_BIN_EXE_ferrocuda"))
        .args(args)
        .output()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// What CPython's `pickle.load` gives for a snapshot, reduced to what the reader keeps:
/// per event (action, address, size, stream, time, frame count, innermost frame), per
/// segment (device, address, size, pool, block count, frames of its first block).
const PYTHON_VIEW: &str = r#"
import json, lzma, pickle, sys
d = pickle.load(lzma.open(sys.argv[1]))
def frames(x):
    f = x.get("frames")
    return [-1, ""] if f is None else [len(f), f[0]["name"] if f else ""]
out = {
    "events": [[[e["action"], e.get("addr", e.get("device_free", 0)), e["size"], e["stream"],
                 e["time_us"]] + frames(e) for e in t] for t in d["device_traces"]],
    "segments": [[s["device"], s["address"], s["total_size"], list(s["segment_pool_id"]),
                  len(s["blocks"])] + frames(s["blocks"][0]) for s in d["segments"]],
    "conf": d["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"],
    "stacks": len({id(x["frames"]) for x in [e for t in d["device_traces"] for e in t]
                   + d["segments"] + [b for s in d["segments"] for b in s["blocks"]]
                   if "frames" in x}),
}
json.dump(out, sys.stdout)
"#;

#[test]
fn every_shared_snapshot_reads_as_cpython_reads_it() -> TestResult {
    let facts: Json = serde_json::from_str(&std::fs::read_to_string(
        snapshot("x").with_file_name("facts.json"),
    )?)?;
    for name in SNAPSHOTS {
        let path = snapshot(name);
        let out = Command::new("python3")
            .args(["-c", PYTHON_VIEW, &path.to_string_lossy()])
            .output()
            .map_err(|e| format!("python3 is needed for this test: {e}"))?;
        assert!(out.status.success(), "{}", text(&out.stderr));
        let python: Json = serde_json::from_slice(&out.stdout)?;
        let r = read_recording(&path)?;
        let frames = |stack: StackId| -> Json {
            let mut all = r.stacks.frames(stack);
            match (stack == StackId::NONE, all.next()) {
                (true, _) => json!([-1, ""]),
                (false, None) => json!([0, ""]),
                (false, Some(first)) => {
                    json!([1 + all.count(), r.stacks.text(first.name)])
                }
            }
        };
        let names = [
            (TraceAction::Alloc, "alloc"),
            (TraceAction::FreeRequested, "free_requested"),
            (TraceAction::FreeCompleted, "free_completed"),
            (TraceAction::SegmentAlloc, "segment_alloc"),
            (TraceAction::SegmentFree, "segment_free"),
            (TraceAction::SegmentMap, "segment_map"),
            (TraceAction::SegmentUnmap, "segment_unmap"),
            (TraceAction::Snapshot, "snapshot"),
            (TraceAction::Oom, "oom"),
        ];
        let events: Vec<Vec<Json>> = r
            .traces
            .iter()
            .map(|t| {
                t.iter()
                    .map(|e| {
                        let action = names.iter().find(|n| n.0 == e.action).map_or("?", |n| n.1);
                        let mut row = json!([action, e.addr, e.size, e.stream, e.time_us]);
                        if let (Some(row), Json::Array(f)) = (row.as_array_mut(), frames(e.stack)) {
                            row.extend(f);
                        }
                        row
                    })
                    .collect()
            })
            .collect();
        assert_eq!(json!(events), python["events"], "{name}: events");
        let segments: Vec<Json> = r
            .segments
            .iter()
            .map(|s| {
                let mut row = json!([
                    s.device,
                    s.address,
                    s.total_size,
                    [s.pool.0, s.pool.1],
                    s.blocks.len()
                ]);
                if let (Some(row), Json::Array(f)) = (
                    row.as_array_mut(),
                    frames(s.blocks.first().map_or(StackId::NONE, |b| b.stack)),
                ) {
                    row.extend(f);
                }
                row
            })
            .collect();
        assert_eq!(json!(segments), python["segments"], "{name}: segments");
        assert_eq!(r.allocator_settings.conf, python["conf"], "{name}");
        // The facts recorded beside the files, and the sharing they describe: a stack
        // referred to again is read once.
        // One stack per distinct list object, as Python sees them: nothing copied.
        assert_eq!(json!(r.stacks.len()), python["stacks"], "{name}");
        let Some(fact) = facts.get(name) else {
            continue;
        };
        assert_eq!(json!(r.traces[0].len()), fact["trace_entries"], "{name}");
        assert_eq!(json!(r.segments.len()), fact["segments"], "{name}");
        let with_frames = r.traces[0]
            .iter()
            .filter(|e| r.stacks.frames(e.stack).next().is_some())
            .count();
        assert_eq!(json!(with_frames), fact["entries_with_frames"], "{name}");
        assert!(
            fact["frame_lists_shared_by_identity"].as_u64() > Some(0),
            "{name}"
        );
    }
    Ok(())
}

#[test]
fn replay_summary_and_plot_work_on_every_shared_snapshot() -> TestResult {
    let dir = scratch("commands")?;
    for name in SNAPSHOTS {
        let path = snapshot(name);
        let p = path.to_string_lossy();
        let out = ferrocuda(&[
            "replay",
            &p,
            "--conf",
            "",
            "--conf",
            "expandable_segments:True",
        ])?;
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        assert!(text(&out.stdout).contains("peak reserved"), "{name}");
        let out = ferrocuda(&["summary", &p])?;
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        let summary = text(&out.stdout);
        for section in ["Largest live blocks", "Allocation sites by live bytes"] {
            assert!(
                summary.contains(section),
                "{name}: {section} missing: {summary}"
            );
        }
        // Sites are the user's Python lines where Python stacks were recorded.
        assert!(summary.contains(".py:"), "{name}: {summary}");
        if name == "transformer_graph_capture" || name == "transformer_serve_random" {
            assert!(summary.contains("private (1, 0)"), "{name}: {summary}");
        }
        if name == "mlp_graph_mempool" {
            assert!(
                summary.contains("private (0, 1)") && summary.contains("private (1, 0)"),
                "{name}: {summary}"
            );
        }
        // The user's own lines, not PyTorch's library files, where Python stacks exist.
        if name == "resnet18_train" {
            assert!(
                summary.contains("record_snapshots.py:70"),
                "{name}: {summary}"
            );
        }
        let page = dir.join(format!("{name}.html"));
        let out = ferrocuda(&["plot", &p, "-o", &page.to_string_lossy()])?;
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        let html = std::fs::read_to_string(&page)?;
        assert!(html.contains("<svg"), "{name}");
        // A block's stack on hover: a title of several frames.
        assert!(
            html.contains("<tr title=\"") && html.contains(".py:"),
            "{name}: no stacks on hover"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn what_users_compress_reads_the_same() -> TestResult {
    use std::io::{Read, Write};
    let dir = scratch("compress")?;
    let path = snapshot("transformer_train_default");
    let mut raw = Vec::new();
    liblzma::read::XzDecoder::new(std::fs::File::open(&path)?).read_to_end(&mut raw)?;
    let reference = read_recording(&path)?;
    let plain = dir.join("plain.pickle");
    std::fs::write(&plain, &raw)?;
    // gzip with two members, as `cat a.gz b.gz` makes (Python's gzip reads on across them).
    let half = raw.len() / 2;
    let mut gz = Vec::new();
    for part in [&raw[..half], &raw[half..]] {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(part)?;
        gz.extend(enc.finish()?);
    }
    let gz_path = dir.join("two-members.pickle.gz");
    std::fs::write(&gz_path, &gz)?;
    // xz as two concatenated streams, with stream padding between them.
    let mut xz = Vec::new();
    for part in [&raw[..half], &raw[half..]] {
        let mut enc = liblzma::write::XzEncoder::new(Vec::new(), 6);
        enc.write_all(part)?;
        xz.extend(enc.finish()?);
        xz.extend([0u8; 4]);
    }
    let xz_path = dir.join("two-streams.pickle.xz");
    std::fs::write(&xz_path, &xz)?;
    for file in [&plain, &gz_path, &xz_path] {
        let r = read_recording(file)?;
        assert_eq!(r.traces, reference.traces, "{}", file.display());
        assert_eq!(r.segments, reference.segments, "{}", file.display());
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// A snapshot dict whose history has `n` events, each with a one-frame stack whose file
/// name is the same 1 MiB string (memo reference `BINGET 1`), each stack a new list.
fn shared_string_bomb(n: usize) -> Vec<u8> {
    let mut b = vec![0x80, 4, b'}', b'('];
    let key = |b: &mut Vec<u8>, k: &str| {
        b.push(0x8c);
        b.push(k.len() as u8);
        b.extend(k.as_bytes());
    };
    key(&mut b, "segments");
    b.push(b']');
    key(&mut b, "device_traces");
    b.extend([b']', b']', b'(']);
    for i in 0..n {
        b.extend([b'}', b'(']);
        for (k, v) in [
            ("action", None),
            ("addr", Some(4096 * i as u32)),
            ("size", Some(512)),
            ("stream", Some(0)),
            ("time_us", Some(i as u32)),
        ] {
            key(&mut b, k);
            match v {
                None => key(&mut b, "alloc"),
                Some(v) => {
                    b.push(b'J');
                    b.extend(v.to_le_bytes());
                }
            }
        }
        key(&mut b, "frames");
        b.extend([b']', b'}', b'(']);
        key(&mut b, "name");
        key(&mut b, "f");
        key(&mut b, "filename");
        if i == 0 {
            b.push(b'X');
            b.extend((1u32 << 20).to_le_bytes());
            b.extend(std::iter::repeat_n(b'a', 1 << 20));
            b.extend([b'q', 1]);
        } else {
            b.extend([b'h', 1]);
        }
        key(&mut b, "line");
        b.extend([b'K', 1, b'u', b'a', b'u']);
    }
    b.extend([b'e', b'a', b'u', b'.']);
    b
}

#[test]
fn fifty_thousand_frames_naming_one_string_keep_it_once() -> TestResult {
    let dir = scratch("shared-string")?;
    let path = dir.join("shared.pickle");
    std::fs::write(&path, shared_string_bomb(50_000))?;
    let r = read_recording(&path)?;
    assert_eq!(r.traces[0].len(), 50_000);
    // One frame, kept once; every event's stack names it.
    let first = r.traces[0][0].stack;
    let frame = r.stacks.frames(first).next().copied();
    assert!(
        r.traces[0]
            .iter()
            .all(|e| r.stacks.frames(e.stack).next().copied() == frame)
    );
    // Every command runs on it under a 1 GB address-space limit, and its output shows
    // the name shortened, not 50 000 MiB of it.
    for args in [vec!["summary"], vec!["replay"]] {
        let p = path.to_string_lossy();
        let line = format!(
            "ulimit -v 1000000; exec {} {} {p}",
            env!("CARGO_BIN_EXE_ferrocuda"),
            args.join(" ")
        );
        let out = Command::new("sh").args(["-c", &line]).output()?;
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        assert!(
            out.stdout.len() < 1 << 20,
            "{args:?}: {} bytes",
            out.stdout.len()
        );
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

fn assert_one_line_failure(out: &Output, wanted: &[&str]) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    for w in wanted {
        assert!(err.contains(w), "{w:?} not in {err}");
    }
}

#[test]
fn bombs_devices_and_directories_end_with_one_line_under_a_3_gb_limit() -> TestResult {
    let hostile = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/hostile");
    let limited = |args: &str| -> Result<Output, std::io::Error> {
        let line = format!(
            "ulimit -v 3000000; exec {} {args}",
            env!("CARGO_BIN_EXE_ferrocuda")
        );
        Command::new("sh").args(["-c", &line]).output()
    };
    // 3 GiB of harmless opcodes (under 1 MiB of xz): the decompressed-bytes cap.
    let bytes = hostile
        .join("bytes_3g.pickle.xz")
        .to_string_lossy()
        .into_owned();
    assert_one_line_failure(
        &limited(&format!("summary {bytes}"))?,
        &["more than 1073741824 bytes of pickle", "--max-bytes"],
    );
    // 3 GiB of pushes: the values cap, long before the bytes one.
    let values = hostile
        .join("values_3g.pickle.xz")
        .to_string_lossy()
        .into_owned();
    assert_one_line_failure(
        &limited(&format!("replay {values}"))?,
        &["values", "--max-bytes"],
    );
    // Another limit is taken.
    assert_one_line_failure(
        &limited(&format!("--max-bytes 64M summary {bytes}"))?,
        &["more than 67108864 bytes of pickle"],
    );
    assert_one_line_failure(
        &limited("plot /dev/zero -o /dev/null")?,
        &["/dev/zero", "not a regular file"],
    );
    let dir = std::env::temp_dir().to_string_lossy().into_owned();
    assert_one_line_failure(
        &limited(&format!("summary {dir}"))?,
        &["not a regular file"],
    );
    assert_one_line_failure(
        &limited("--max-bytes 12X summary x")?,
        &["--max-bytes", "unit"],
    );
    Ok(())
}

/// The snapshot `oom_forensics:<path>` writes at an out-of-memory error: `ferrocuda
/// summary` and `replay` read it, and its history holds the `oom` entry.
#[test]
fn the_oom_forensics_snapshot_reads_in_every_command() -> TestResult {
    use ferrocuda_alloc::{AllocError, Caching, CachingAllocator};
    use ferrocuda_driver::FakeDriver;
    use ferrocuda_types::{AllocatorConfig, DeviceIndex, StreamHandle};
    use std::sync::Arc;
    let path = scratch("oom-forensics")?.join("oom.pickle");
    let path_text = path.to_string_lossy().into_owned();
    let fake = Arc::new(FakeDriver::builder().capacity(64 << 20).build());
    let config = AllocatorConfig::parse(&format!("oom_forensics:{path_text}"))?;
    let a = CachingAllocator::new(fake, DeviceIndex(0), config, Caching::On)?;
    a.record_memory_history(ferrocuda_alloc::history::HistoryOptions::parse(
        Some("all"),
        Some("all"),
        1000,
    )?);
    let stream = StreamHandle::legacy(DeviceIndex(0));
    let live = a.allocate(40 << 20, stream)?;
    let err = a.allocate(40 << 20, stream).err();
    assert!(matches!(err, Some(AllocError::OutOfMemory(_))), "{err:?}");
    let summary = ferrocuda(&["summary", &path_text])?;
    assert!(summary.status.success(), "{}", text(&summary.stderr));
    assert!(!summary.stdout.is_empty());
    let replay = ferrocuda(&["replay", &path_text, "--conf", ""])?;
    assert!(replay.status.success(), "{}", text(&replay.stderr));
    let recording = read_recording(&path)?;
    assert!(
        recording
            .traces
            .iter()
            .flatten()
            .any(|e| e.action == TraceAction::Oom),
        "the oom entry"
    );
    a.free(live.ptr)?;
    Ok(())
}
