//! The `ferrocuda` command under hostile input (issue 11): every bad input ends the command
//! with a one-line message and exit code 1; nothing panics, aborts or hangs, and nothing
//! silently replays something other than what was asked for.
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const EXE: &str = env!("CARGO_BIN_EXE_ferrocuda");

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/data")
        .join(name)
}

/// A scratch directory for one test.
fn scratch(test: &str) -> Result<PathBuf, std::io::Error> {
    let dir = std::env::temp_dir().join(format!("ferrocuda-hostile-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn write_pickle(path: &Path, value: &serde_json::Value) -> TestResult {
    let bytes = serde_pickle::to_vec(value, serde_pickle::SerOptions::new())?;
    std::fs::write(path, bytes)?;
    Ok(())
}

/// Runs `command` to its end, killing it after 60 s (a hang fails the test, not the run).
fn output(command: &mut Command) -> Result<Output, std::io::Error> {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let pid = child.id().to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(out) => out,
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid]).status();
            Err(std::io::Error::other("hung: killed after 60 s"))
        }
    }
}

/// Runs the command with no allocator configuration in the environment.
fn ferrocuda(args: &[&str]) -> Result<Output, std::io::Error> {
    output(
        Command::new(EXE)
            .args(args)
            .env_remove("FERROCUDA_ALLOC_CONF")
            .env_remove("PYTORCH_CUDA_ALLOC_CONF")
            .env_remove("PYTORCH_ALLOC_CONF"),
    )
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A failure as the command must report one: exit code 1, one line on stderr that starts
/// with `ferrocuda: ` and contains every piece of `wanted`.
fn assert_one_line_failure(out: &Output, wanted: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("ferrocuda: "), "{err}");
    for w in wanted {
        assert!(err.contains(w), "{w:?} not in {err}");
    }
}

fn event(action: &str, addr: u64, size: u64) -> serde_json::Value {
    json!({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 1})
}

fn snapshot(device_traces: serde_json::Value) -> serde_json::Value {
    json!({"segments": [], "device_traces": device_traces})
}

/// Nothing in the reader recurses: depth costs what the containers cost, and a memo
/// reference is a reference, never expanded.
#[test]
fn deep_nesting_and_doubling_memo_references_read_without_recursion_or_expansion() -> TestResult {
    let dir = scratch("deep")?;
    let path = dir.join("deep.pickle");
    // 300 000 empty lists, each appended into the one below: a list nested 300 000 deep.
    let n = 300_000;
    let mut deep = vec![0x80, 2];
    deep.extend(std::iter::repeat_n(b']', n));
    deep.extend(std::iter::repeat_n(b'a', n - 1));
    std::fs::write(&path, [&deep[..], b"."].concat())?;
    for command in ["replay", "summary"] {
        let out = ferrocuda(&[command, &path.to_string_lossy()])?;
        assert_one_line_failure(&out, &["a pickled list", "not a dict"]);
    }
    // A memo reference doubled at every level: a small file, 2^60 values if expanded.
    let mut bomb = vec![0x80, 2, b']', b'q', 0];
    for level in 1..=60u8 {
        bomb.extend([
            b']',
            b'(',
            b'h',
            level - 1,
            b'h',
            level - 1,
            b'e',
            b'q',
            level,
        ]);
    }
    bomb.extend([b'}', b'(']);
    let key = |b: &mut Vec<u8>, k: &str| {
        b.push(b'X');
        b.extend((k.len() as u32).to_le_bytes());
        b.extend(k.as_bytes());
    };
    for k in ["segments", "device_traces", "junk", "deep"] {
        key(&mut bomb, k);
        match k {
            "junk" => bomb.extend([b'h', 60]),
            "deep" => bomb.extend(&deep[2..]),
            _ => bomb.push(b']'),
        }
    }
    bomb.extend([b'u', b'.']);
    let path = dir.join("bomb.pickle");
    std::fs::write(&path, &bomb)?;
    let out = ferrocuda(&["summary", &path.to_string_lossy()])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("nothing to summarize"),
        "{}",
        stdout(&out)
    );
    // The doubling structure where the reader looks: a type error, found at once.
    let mut misplaced = bomb.clone();
    let at = misplaced
        .windows(15)
        .position(|w| w.ends_with(b"device_traces"))
        .map_or(0, |i| i + 15);
    misplaced.splice(at..at + 1, [b'h', 60]);
    std::fs::write(&path, &misplaced)?;
    let out = ferrocuda(&["replay", &path.to_string_lossy()])?;
    assert_one_line_failure(
        &out,
        &["event 0 of device 0", "expected a dict, found a list"],
    );
    // A list that holds itself where the reader looks: named as such.
    let mut recursive = vec![0x80, 2, b'}', b'('];
    key(&mut recursive, "device_traces");
    recursive.extend([b']', b'q', 1, b'h', 1, b'a', b'u', b'.']);
    std::fs::write(&path, &recursive)?;
    let out = ferrocuda(&["replay", &path.to_string_lossy()])?;
    assert_one_line_failure(&out, &["recursive structure"]);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn output_errors_end_the_command_with_a_message_and_a_broken_pipe_ends_quietly() -> TestResult {
    let trace = data("resnet50_train.pickle.xz");
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full")?;
    let out = Command::new(EXE)
        .arg("summary")
        .arg(&trace)
        .stdout(Stdio::from(full))
        .output()?;
    assert_one_line_failure(&out, &["cannot write", "stdout"]);
    assert!(!stderr(&out).contains("panicked"));

    // A reader that goes away before the command writes (decompressing takes a while).
    let mut child = Command::new(EXE)
        .arg("summary")
        .arg(&trace)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    drop(child.stdout.take());
    let out = child.wait_with_output()?;
    assert_eq!(stderr(&out), "", "a broken pipe ends quietly");
    assert_eq!(out.status.code(), Some(0));
    Ok(())
}

#[test]
fn capacity_is_range_checked_and_takes_units() -> TestResult {
    let trace = data("resnet50_train.pickle.xz");
    let t = trace.to_string_lossy();
    for bad in [
        "17179869189",
        "17179869184",
        "0",
        "80X",
        "-1",
        "1.5G",
        "",
        "1K",
    ] {
        let out = ferrocuda(&["replay", &t, &format!("--capacity={bad}")])?;
        assert_one_line_failure(&out, &["--capacity"]);
    }
    for (good, ooms) in [
        ("80G", false),
        ("80", false),
        ("81920M", false),
        ("512M", true),
    ] {
        let out = ferrocuda(&["replay", &t, "--capacity", good, "--json"])?;
        assert!(out.status.success(), "{good}: {}", stderr(&out));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(
            json[0]["num_ooms"].as_u64().map(|n| n > 0),
            Some(ooms),
            "{good}"
        );
    }
    Ok(())
}

#[test]
fn a_dict_that_is_not_a_snapshot_is_an_error_naming_what_is_missing() -> TestResult {
    let dir = scratch("notsnap")?;
    let path = dir.join("a.pickle");
    write_pickle(&path, &json!({"a": 1}))?;
    let p = path.to_string_lossy();
    for command in ["replay", "summary"] {
        let out = ferrocuda(&[command, &p])?;
        assert_one_line_failure(&out, &["device_traces", "segments"]);
    }
    let out = ferrocuda(&["plot", &p, "-o", &dir.join("x.html").to_string_lossy()])?;
    assert_one_line_failure(&out, &["device_traces", "segments"]);
    write_pickle(&path, &json!([1, 2]))?;
    let out = ferrocuda(&["summary", &p])?;
    assert_one_line_failure(&out, &["dict"]);
    // Segments without history: summary works, replay says there is nothing to replay.
    write_pickle(&path, &json!({"segments": []}))?;
    let out = ferrocuda(&["replay", &p])?;
    assert_one_line_failure(&out, &["no allocation history", "device_traces"]);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn devices_are_replayed_separately() -> TestResult {
    let dir = scratch("devices")?;
    let path = dir.join("two.pickle");
    let gib50 = 50u64 << 30;
    let dev = |addr| {
        json!([
            event("alloc", addr, gib50),
            event("free_completed", addr, gib50)
        ])
    };
    write_pickle(&path, &snapshot(json!([dev(1 << 40), dev(2 << 40)])))?;
    let p = path.to_string_lossy();
    let out = ferrocuda(&["replay", &p, "--json"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let rows = json.as_array().ok_or("an array")?;
    assert_eq!(rows.len(), 2, "{json}");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row["device"], i, "{json}");
        assert_eq!(row["num_ooms"], 0, "{json}");
        assert_eq!(row["peak_requested"], gib50, "{json}");
    }
    let out = ferrocuda(&["replay", &p])?;
    let text = stdout(&out);
    assert!(text.contains("cuda:0") && text.contains("cuda:1"), "{text}");
    assert!(
        stderr(&out).contains("each device separately"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn replay_takes_the_configuration_from_the_environment() -> TestResult {
    let trace = data("resnet50_train.pickle.xz");
    for var in ["FERROCUDA_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"] {
        let out = Command::new(EXE)
            .arg("replay")
            .arg(&trace)
            .env_remove("FERROCUDA_ALLOC_CONF")
            .env_remove("PYTORCH_ALLOC_CONF")
            .env(var, "expandable_segments:True")
            .output()?;
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            stdout(&out).contains("expandable_segments:True") && stdout(&out).contains("1.0103"),
            "{}",
            stdout(&out)
        );
        assert!(
            stderr(&out).contains(&format!("{var}=expandable_segments:True")),
            "{}",
            stderr(&out)
        );
    }
    let out = Command::new(EXE)
        .arg("replay")
        .arg(&trace)
        .env("FERROCUDA_ALLOC_CONF", "max_split_size_mb:2")
        .output()?;
    assert_one_line_failure(
        &out,
        &[
            "FERROCUDA_ALLOC_CONF",
            "invalid allocator config at character 18",
        ],
    );
    assert!(!stderr(&out).contains("ConfigError"), "Display, not Debug");
    // --conf wins over the environment, and says so.
    let out = Command::new(EXE)
        .arg("replay")
        .arg(&trace)
        .args(["--conf", "default"])
        .env("FERROCUDA_ALLOC_CONF", "bogus:1")
        .output()?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("1.3563"), "{}", stdout(&out));
    Ok(())
}

#[test]
fn conf_default_is_accepted_and_every_conf_is_parsed_before_anything_is_read() -> TestResult {
    let trace = data("resnet50_train.pickle.xz");
    let t = trace.to_string_lossy();
    let out = ferrocuda(&["replay", &t, "--conf", "default", "--json"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json[0]["conf"], "default");
    // The bad second --conf is reported before the (missing) trace is even opened.
    let out = ferrocuda(&[
        "replay",
        "/nonexistent.pickle",
        "--conf",
        "",
        "--conf",
        "bogus:1",
    ])?;
    assert_one_line_failure(&out, &["--conf \"bogus:1\"", "Unrecognized key 'bogus'"]);
    Ok(())
}

#[test]
fn decoding_errors_name_the_event_and_the_field() -> TestResult {
    let dir = scratch("decode")?;
    let path = dir.join("bad.pickle");
    let p = path.to_string_lossy();
    let good = event("alloc", 4096, 512);
    let bad = json!({"action": "alloc", "addr": 8192, "size": "512", "stream": 0, "time_us": 1});
    write_pickle(&path, &snapshot(json!([[good.clone(), bad]])))?;
    let out = ferrocuda(&["replay", &p])?;
    assert_one_line_failure(&out, &["event 1 of device 0", "size"]);
    // 2^63 does not fit the signed integers pickle readers use: say so.
    let huge =
        json!({"action": "alloc", "addr": 1u64 << 63, "size": 512, "stream": 0, "time_us": 1});
    write_pickle(&path, &snapshot(json!([[good, huge]])))?;
    let out = ferrocuda(&["replay", &p])?;
    assert_one_line_failure(&out, &["event 1 of device 0", "addr", "2^63"]);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn the_table_shows_pytorchs_figures_beside_ours() -> TestResult {
    // The sidecar tests/data/pytorch-figures.json holds PyTorch's figures for this trace.
    let trace = data("resnet50_train.pickle.xz");
    let out = ferrocuda(&[
        "replay",
        &trace.to_string_lossy(),
        "--conf",
        "default",
        "--conf",
        "expandable_segments:True",
        "--conf",
        "max_split_size_mb:100",
    ])?;
    let text = stdout(&out);
    assert!(out.status.success(), "{}", stderr(&out));
    let row = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_default()
            .to_owned()
    };
    let reserved = row("  PyTorch peak reserved");
    assert!(reserved.matches("= ours").count() == 2, "{text}");
    assert!(
        reserved.contains("n/a"),
        "no figures for max_split_size_mb: {text}"
    );
    assert!(
        row("  PyTorch peak allocated").matches("= ours").count() == 2,
        "{text}"
    );
    // GPT-2's default peak allocated is 217 KiB above PyTorch's (README): shown as such.
    let out = ferrocuda(&["replay", &data("gpt2_train.pickle.xz").to_string_lossy()])?;
    let text = stdout(&out);
    assert!(
        text.lines()
            .any(|l| l.starts_with("  PyTorch peak allocated") && l.contains("ours +217.00 KiB")),
        "{text}"
    );

    // The recording's own memory_stats, when a snapshot carries them.
    let dir = scratch("stats")?;
    let path = dir.join("withstats.pickle");
    let mut s = snapshot(json!([[
        event("alloc", 4096, 1000),
        event("free_completed", 4096, 1000)
    ]]));
    s["memory_stats"] = json!({
        "requested_bytes.all.peak": 1000, "allocated_bytes.all.peak": 1024,
        "reserved_bytes.all.peak": 2 << 20, "num_device_alloc": 1, "num_device_free": 0
    });
    write_pickle(&path, &s)?;
    let out = ferrocuda(&["replay", &path.to_string_lossy()])?;
    let text = stdout(&out);
    assert!(out.status.success(), "{}", stderr(&out));
    for name in ["requested", "allocated", "reserved"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("  PyTorch peak {name}")) && l.contains("= ours")),
            "{text}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

#[test]
fn summary_says_where_each_figure_comes_from() -> TestResult {
    let out = ferrocuda(&[
        "summary",
        &data("resnet50_train.pickle.xz").to_string_lossy(),
    ])?;
    let text = stdout(&out);
    assert!(out.status.success());
    for note in [
        "Peak Usage of Requested memory and GPU reserved memory (all pools): from the trace",
        "other Peak Usage figures are the current values",
        "pool rows need not add up",
    ] {
        assert!(text.contains(note), "{note:?} missing: {text}");
    }
    Ok(())
}

#[test]
fn recorded_addresses_are_checked_and_used_per_device() -> TestResult {
    let dir = scratch("addresses")?;
    let path = dir.join("addresses.pickle");
    let mib = 1u64 << 20;
    let dev = |segment: u64| {
        json!([
            event("segment_alloc", segment, 20 * mib),
            event("alloc", segment, 4 * mib),
            event("free_completed", segment, 4 * mib)
        ])
    };
    write_pickle(
        &path,
        &snapshot(json!([dev(0x7f00_0000_0000), dev(0x7e00_0000_0000)])),
    )?;
    let p = path.to_string_lossy();
    let out = ferrocuda(&["replay", &p, "--json", "--addresses", "recorded"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    for row in json.as_array().ok_or("an array")? {
        let used = &row["addresses"];
        assert_eq!(
            (&used["recorded"], &used["used"]),
            (&json!(1), &json!(1)),
            "{json}"
        );
    }
    let out = ferrocuda(&["replay", &p])?;
    assert!(
        !stdout(&out).contains("planned addresses"),
        "{}",
        stdout(&out)
    );
    // An address no cudaMalloc returns is refused with the culprit.
    write_pickle(&path, &snapshot(json!([dev(0x7f00_0000_0100)])))?;
    let out = ferrocuda(&["replay", &p, "--addresses", "recorded"])?;
    assert_one_line_failure(&out, &["--addresses recorded", "0x7f0000000100", "512"]);
    // Argument errors are one line and exit code 1 too (clap's own code would be 2).
    let out = ferrocuda(&["replay", &p, "--addresses", "somewhere"])?;
    assert_one_line_failure(&out, &["somewhere", "--addresses", "--help"]);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// `--addresses-from` takes the segment addresses another replay's driver gave (its `--json`
/// rows carry them): a replay handed its own addresses gives its own figures with every
/// segment where it was, one handed the trace's addresses gives `--addresses recorded`'s
/// figures, and a file that cannot serve is one line naming it.
#[test]
fn addresses_from_another_replay_place_segments_where_it_did() -> TestResult {
    let dir = scratch("addresses-from")?;
    let trace = data("bert_serve.pickle.xz");
    let t = trace.to_string_lossy();
    let rows = |out: &Output| -> Result<Vec<serde_json::Value>, Box<dyn std::error::Error>> {
        assert!(out.status.success(), "{}", stderr(out));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok(json.as_array().ok_or("an array")?.clone())
    };
    let memory = |row: &serde_json::Value| {
        [
            "peak_allocated",
            "peak_reserved",
            "num_device_alloc",
            "num_device_free",
        ]
        .map(|k| row[k].clone())
    };
    let confs = ["--conf", "default", "--conf", "expandable_segments:True"];
    let mut args = vec!["replay", &t, "--json"];
    args.extend_from_slice(&confs);
    let first = rows(&ferrocuda(&args)?)?;
    assert!(
        first[0]["segment_addresses"]
            .as_array()
            .is_some_and(|a| a.len() > 30)
    );
    assert!(
        first[1].get("segment_addresses").is_none(),
        "expandable segments map pages"
    );
    let given = dir.join("given.json");
    std::fs::write(&given, serde_json::to_vec(&first)?)?;
    let g = given.to_string_lossy().into_owned();
    args.extend_from_slice(&["--addresses-from", &g]);
    let again = rows(&ferrocuda(&args)?)?;
    for (a, b) in first.iter().zip(&again) {
        assert_eq!(memory(a), memory(b), "{b}");
        assert_eq!(a["segment_addresses"], b["segment_addresses"]);
        let n = a["segment_addresses"].as_array().map_or(0, Vec::len);
        assert_eq!(
            b["addresses"],
            json!({"recorded": n, "used": n, "fresh": 0})
        );
    }
    // The trace's own addresses through the file: what --addresses recorded gives.
    let recorded = rows(&ferrocuda(&[
        "replay",
        &t,
        "--json",
        "--addresses",
        "recorded",
    ])?)?;
    let addresses = ferrocuda_cli::trace::segment_addresses(
        &ferrocuda_cli::trace::read_recording(&trace)?.traces[0],
    );
    let file = json!([{"device": 0, "conf": "default", "segment_addresses": addresses}]);
    std::fs::write(&given, serde_json::to_vec(&file)?)?;
    let through_file = rows(&ferrocuda(&[
        "replay",
        &t,
        "--json",
        "--addresses-from",
        &g,
    ])?)?;
    assert_eq!(memory(&recorded[0]), memory(&through_file[0]));
    assert_ne!(
        memory(&first[0]),
        memory(&recorded[0]),
        "bert_serve's default figures follow segment placement (tests/data/README.md)"
    );
    // Files that cannot serve.
    let missing = dir.join("missing.json");
    let m = missing.to_string_lossy();
    let out = ferrocuda(&["replay", &t, "--addresses-from", &m])?;
    assert_one_line_failure(&out, &["--addresses-from", "missing.json"]);
    std::fs::write(&given, b"{\"device\": 0}")?;
    let out = ferrocuda(&["replay", &t, "--addresses-from", &g])?;
    assert_one_line_failure(&out, &["--addresses-from", "not the --json output"]);
    std::fs::write(&given, serde_json::to_vec(&file)?)?;
    let out = ferrocuda(&[
        "replay",
        &t,
        "--conf",
        "expandable_segments:True",
        "--addresses-from",
        &g,
    ])?;
    assert_one_line_failure(
        &out,
        &["no row for device 0 under configuration \"expandable_segments:True\""],
    );
    let unaligned = json!([{"device": 0, "conf": "default", "segment_addresses": [4096, 100]}]);
    std::fs::write(&given, serde_json::to_vec(&unaligned)?)?;
    let out = ferrocuda(&["replay", &t, "--addresses-from", &g])?;
    assert_one_line_failure(&out, &["--addresses-from", "not a multiple of 512"]);
    let out = ferrocuda(&[
        "replay",
        &t,
        "--addresses",
        "recorded",
        "--addresses-from",
        &g,
    ])?;
    assert_one_line_failure(&out, &["--addresses-from", "cannot be used with"]);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// `--capacity` and `--addresses` belong to the fake device: with `--device cuda` they are
/// refused, before the driver is initialised or the trace is read.
#[test]
fn the_fake_devices_options_are_refused_with_device_cuda() -> TestResult {
    let missing = "/nonexistent/trace.pickle";
    for (flags, named) in [
        (&["--capacity", "80G"][..], "--capacity"),
        (&["--capacity=1.5G"][..], "--capacity"),
        (&["--addresses", "recorded"][..], "--addresses"),
        (&["--addresses", "fresh"][..], "--addresses"),
        (&["--addresses-from", "gpu.json"][..], "--addresses-from"),
    ] {
        let mut args = vec!["replay", missing, "--device", "cuda"];
        args.extend_from_slice(flags);
        let out = ferrocuda(&args)?;
        assert_one_line_failure(&out, &[named, "fake device only"]);
    }
    let out = ferrocuda(&["replay", missing, "--device", "gpu"])?;
    assert_one_line_failure(&out, &["'gpu'", "--device", "possible values: fake, cuda"]);
    // What is missing is named; no subcommand at all says which there are.
    assert_one_line_failure(&ferrocuda(&["replay"])?, &["required", "<TRACE>"]);
    assert_one_line_failure(&ferrocuda(&["plot", missing])?, &["required", "--output"]);
    assert_one_line_failure(&ferrocuda(&[])?, &["replay, summary, plan or plot"]);
    // The fake device is the default, and `--device fake` takes its options.
    let trace = data("resnet50_train.pickle.xz");
    let t = trace.to_string_lossy();
    let out = ferrocuda(&[
        "replay",
        &t,
        "--device",
        "fake",
        "--capacity",
        "4G",
        "--json",
    ])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(json[0]["backend"], "fake", "{json}");
    assert!(json[0]["num_ooms"].as_u64() > Some(0), "{json}");
    Ok(())
}

/// `--device cuda` without a GPU is a one-line error saying CUDA is unavailable, given
/// before the trace is read. With a GPU it replays there, and the figures of the expandable
/// configuration (which do not depend on where the driver puts segments) are the fake
/// device's.
#[test]
fn device_cuda_replays_on_the_gpu_or_says_cuda_is_unavailable() -> TestResult {
    let cuda = ferrocuda_driver::CudaDriver::new();
    if let Some(reason) = cuda.unavailable_reason() {
        eprintln!("no GPU here ({reason}): checking the error");
        let out = ferrocuda(&["replay", "/nonexistent/trace.pickle", "--device", "cuda"])?;
        assert_one_line_failure(&out, &["--device cuda", "CUDA is unavailable", reason.name]);
        return Ok(());
    }
    let trace = data("resnet50_train.pickle.xz");
    let t = trace.to_string_lossy();
    let conf = ["--conf", "expandable_segments:True", "--json"];
    let run = |device: &str| -> Result<serde_json::Value, Box<dyn std::error::Error>> {
        let mut args = vec!["replay", &*t, "--device", device];
        args.extend_from_slice(&conf);
        let out = ferrocuda(&args)?;
        assert!(out.status.success(), "{}", stderr(&out));
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    let (real, fake) = (run("cuda")?, run("fake")?);
    assert_eq!(real[0]["backend"], "cuda");
    for key in [
        "peak_requested",
        "peak_allocated",
        "peak_reserved",
        "num_device_alloc",
        "num_device_free",
        "num_ooms",
        "timed_events",
    ] {
        assert_eq!(real[0][key], fake[0][key], "{key}");
    }
    Ok(())
}
