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
use serde_json::{Value, json};
use std::io::Write;
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

/// splitmix64: a small, well-known generator; cases must replay from (seed, index) alone.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, case: u64) -> Rng {
        let mut r = Rng(seed ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next();
        r
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

const ACTIONS: &[&str] = &[
    "alloc",
    "alloc",
    "alloc",
    "free_requested",
    "free_completed",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
    "something_else",
];

/// A size: mostly what programs ask for, sometimes more than the device has, and (in one
/// value of 2000) beyond what any device has or beyond 2^63.
fn size(r: &mut Rng) -> u64 {
    match r.below(2000) {
        0 => *r.pick(&[1 << 50, (1 << 50) + 1, i64::MAX as u64, 1 << 63, u64::MAX]),
        1..=100 => 0,
        101..=200 => r.below(1 << 40) + (80 << 30),
        201..=1200 => r.below(1 << 20),
        _ => r.below(1 << 32),
    }
}

fn event(r: &mut Rng, addrs: &[u64]) -> Value {
    let stream = if r.chance(90) {
        r.below(4)
    } else {
        r.next() >> 1
    };
    json!({
        "action": r.pick(ACTIONS),
        "addr": r.pick(addrs),
        "size": size(r),
        "stream": stream,
        "time_us": r.below(1 << 40),
        "compile_context": "N/A",
        "frames": match r.below(10) {
            // A few stacks shared by many events (as PyTorch's are): the memo writer below
            // writes each once and refers back to it.
            0..=3 => json!([{"filename": "x.py", "line": 3, "name": "f"},
                            {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"}]),
            4 => json!([{"filename": "y.py", "line": r.below(3), "name": "g"}]),
            5 => json!([]),
            _ => Value::Null,
        },
    })
}

fn segment(r: &mut Rng, device: u64) -> Value {
    let blocks: Vec<Value> = (0..r.below(4))
        .map(|i| {
            json!({"address": i << 20, "size": size(r), "requested_size": size(r),
                   "state": r.pick(&["active_allocated", "active_pending_free", "inactive"])})
        })
        .collect();
    json!({
        "device": device, "address": r.below(1 << 47), "total_size": size(r),
        "allocated_size": size(r), "active_size": 0, "requested_size": 0, "stream": r.below(3),
        "segment_type": r.pick(&["small", "large", "odd"]), "segment_pool_id": [0, 0],
        "is_expandable": r.chance(30), "blocks": blocks,
    })
}

/// A snapshot-shaped value: mostly valid, with a few fields of the wrong type or missing.
fn snapshot(r: &mut Rng) -> Value {
    let devices = *r.pick(&[1u64, 1, 1, 2, 3]);
    let addrs: Vec<u64> = (0..1 + r.below(40)).map(|_| r.below(1 << 47)).collect();
    let traces: Vec<Value> = (0..devices)
        .map(|_| Value::Array((0..r.below(120)).map(|_| event(r, &addrs)).collect()))
        .collect();
    let segments: Vec<Value> = (0..r.below(6))
        .map(|_| {
            let device = r.below(devices);
            segment(r, device)
        })
        .collect();
    let mut s = json!({"segments": segments, "device_traces": traces});
    if r.chance(20) {
        s["memory_stats"] = json!({"requested_bytes.all.peak": size(r), "reserved_bytes.all.peak": size(r),
                                   "allocated_bytes.all.peak": size(r), "num_device_alloc": r.below(9)});
    }
    if r.chance(20) {
        s["allocator_settings"] = json!({"PYTORCH_CUDA_ALLOC_CONF": conf(r)});
    }
    if r.chance(25) {
        for _ in 0..1 + r.below(2) {
            corrupt_value(r, &mut s);
        }
    }
    s
}

/// Replaces or removes one field somewhere in the value.
fn corrupt_value(r: &mut Rng, s: &mut Value) {
    let replacement = r
        .pick(&[
            json!("text"),
            json!(-1),
            json!(1.5),
            Value::Null,
            json!([1, 2]),
            json!({"a": 1}),
            json!(u64::MAX),
        ])
        .clone();
    let top = *r.pick(&[
        "segments",
        "device_traces",
        "memory_stats",
        "allocator_settings",
    ]);
    if r.chance(20) {
        if let Some(m) = s.as_object_mut() {
            m.remove(top);
        }
        return;
    }
    let mut at = &mut s[top];
    while let Some(len) = at.as_array().map(Vec::len).filter(|&n| n > 0) {
        let i = r.below(len as u64) as usize;
        at = &mut at[i];
    }
    let field = *r.pick(&[
        "action",
        "addr",
        "size",
        "stream",
        "device",
        "total_size",
        "blocks",
    ]);
    match at.as_object_mut() {
        Some(m) if r.chance(30) => drop(m.remove(field)),
        Some(m) => drop(m.insert(field.into(), replacement)),
        None => *at = replacement,
    }
}

fn conf(r: &mut Rng) -> String {
    const VALID: &[&str] = &[
        "expandable_segments:True",
        "max_split_size_mb:100",
        "garbage_collection_threshold:0.5",
        "roundup_power2_divisions:[64:8,>:1]",
        "large_segment_size_mb:12",
        "expandable_segments_reclaim:True",
        "cross_stream_reuse:True",
        "thread_cache:False",
    ];
    if r.chance(85) {
        return match r.below(4) {
            0 => "default".into(),
            1 => String::new(),
            _ => (0..1 + r.below(2))
                .map(|_| *r.pick(VALID))
                .collect::<Vec<_>>()
                .join(","),
        };
    }
    const PARTS: &[&str] = &[
        "expandable_segments:True",
        "expandable_segments:False",
        "max_split_size_mb:100",
        "max_split_size_mb:20",
        "max_split_size_mb:2",
        "garbage_collection_threshold:0.5",
        "garbage_collection_threshold:1.5",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[64:8,>:1]",
        "roundup_power2_divisions:[64:8,>:1",
        "large_segment_size_mb:12",
        "expandable_segments_reclaim:True",
        "cross_stream_reuse:True",
        "thread_cache:False",
        "per_process_memory_fraction:0.5",
        "per_process_memory_fraction:0.0",
        "backend:cudaMallocAsync",
        "bogus:1",
        "max_split_size_mb:99999999999999999999999",
        "default",
        "",
        ":",
        ",",
        "\u{00e9}:\u{1F600}",
    ];
    let n = 1 + r.below(3);
    let mut s = (0..n).map(|_| *r.pick(PARTS)).collect::<Vec<_>>().join(",");
    if r.chance(10) && !s.is_empty() {
        let cut = r.below(s.len() as u64) as usize;
        s = s.chars().take(cut).collect();
    }
    s
}

fn capacity(r: &mut Rng) -> String {
    if r.chance(85) {
        return r
            .pick(&["80", "80G", "1G", "512M", "2M", "4T", "64M"])
            .to_string();
    }
    r.pick(&[
        "0",
        "17179869184",
        "17179869189",
        "18446744073709551616",
        "-1",
        "1.5G",
        "80X",
        "",
        "1K",
        "5T",
        " 8G",
    ])
    .to_string()
}

/// A pickle (protocol 4) of `v` as CPython's pickler writes objects that are shared: each
/// equal string, list or dict is written once, memoized, and referred back to (`BINGET`,
/// `LONG_BINGET`) wherever it occurs again, as PyTorch's snapshots share their stacks. A
/// `null` field is left out of its dict.
fn memo_pickle(v: &Value) -> Vec<u8> {
    struct Writer {
        out: Vec<u8>,
        seen: std::collections::HashMap<String, u32>,
    }
    impl Writer {
        fn shared(&mut self, key: String) -> bool {
            match self.seen.get(&key) {
                Some(&id) if id < 256 => self.out.extend([b'h', id as u8]),
                Some(&id) => {
                    self.out.push(b'j');
                    self.out.extend(id.to_le_bytes());
                }
                None => return false,
            }
            true
        }
        fn memoize(&mut self, key: String) {
            let id = self.seen.len() as u32;
            self.seen.insert(key, id);
            self.out.push(0x94);
        }
        fn write(&mut self, v: &Value) {
            match v {
                Value::Null => self.out.push(b'N'),
                Value::Bool(b) => self.out.push(if *b { 0x88 } else { 0x89 }),
                Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                    (Some(i), _, _) => {
                        self.out.extend([0x8a, 8]);
                        self.out.extend(i.to_le_bytes());
                    }
                    (None, Some(u), _) => {
                        self.out.extend([0x8a, 9]);
                        self.out.extend(u.to_le_bytes());
                        self.out.push(0);
                    }
                    (_, _, f) => {
                        self.out.push(b'G');
                        self.out.extend(f.unwrap_or(0.0).to_be_bytes());
                    }
                },
                Value::String(s) => {
                    if !self.shared(format!("s{s}")) {
                        self.out.push(b'X');
                        self.out.extend((s.len() as u32).to_le_bytes());
                        self.out.extend(s.as_bytes());
                        self.memoize(format!("s{s}"));
                    }
                }
                Value::Array(items) => {
                    let key = format!("a{v}");
                    if !self.shared(key.clone()) {
                        self.out.push(b']');
                        self.memoize(key);
                        self.out.push(b'(');
                        items.iter().for_each(|i| self.write(i));
                        self.out.push(b'e');
                    }
                }
                Value::Object(map) => {
                    let key = format!("o{v}");
                    if !self.shared(key.clone()) {
                        self.out.push(b'}');
                        self.memoize(key);
                        self.out.push(b'(');
                        for (k, v) in map.iter().filter(|(_, v)| !v.is_null()) {
                            self.write(&Value::String(k.clone()));
                            self.write(v);
                        }
                        self.out.push(b'u');
                    }
                }
            }
        }
    }
    let mut w = Writer {
        out: vec![0x80, 4],
        seen: Default::default(),
    };
    w.write(v);
    w.out.push(b'.');
    w.out
}

/// The bytes of one input file: a pickled snapshot, perhaps mutated or compressed, or
/// something that is not one at all.
fn input(r: &mut Rng, real: &[u8]) -> Result<Vec<u8>, String> {
    let mut bytes = match r.below(20) {
        0 => Vec::new(),
        1 => (0..r.below(4096)).map(|_| r.next() as u8).collect(),
        2 => real[..r.below(real.len() as u64) as usize].to_vec(),
        3 => {
            // Nesting: a list (or dict values) deeper than any snapshot.
            let n = *r.pick(&[50usize, 99, 100, 101, 5000, 300_000]);
            let mut b = vec![0x80, 2];
            b.extend(std::iter::repeat_n(b']', n));
            b.extend(std::iter::repeat_n(b'a', n - 1));
            b.push(b'.');
            b
        }
        4 => {
            serde_pickle::to_vec(&json!({"a": 1}), Default::default()).map_err(|e| e.to_string())?
        }
        5 => {
            // A container that holds itself, under a key the reader walks.
            let key = *r.pick(&["device_traces", "segments", "frames"]);
            let mut b = vec![0x80, 4, b'}', 0x94, b'X'];
            b.extend((key.len() as u32).to_le_bytes());
            b.extend(key.as_bytes());
            b.extend([b']', 0x94, b'h', *r.pick(&[0u8, 1]), b'a', b's', b'.']);
            b
        }
        6..=11 => memo_pickle(&snapshot(r)),
        _ => serde_pickle::to_vec(&snapshot(r), serde_pickle::SerOptions::new())
            .map_err(|e| e.to_string())?,
    };
    if r.chance(12) && !bytes.is_empty() {
        for _ in 0..1 + r.below(8) {
            let i = r.below(bytes.len() as u64) as usize;
            match r.below(3) {
                0 => bytes[i] = r.next() as u8,
                1 => bytes.truncate(i.max(1)),
                _ => bytes.insert(i, r.next() as u8),
            }
        }
    }
    match r.below(10) {
        0 => {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(&bytes).map_err(|e| e.to_string())?;
            bytes = gz.finish().map_err(|e| e.to_string())?;
        }
        1 => {
            let mut xz = Vec::new();
            lzma_rs::xz_compress(&mut bytes.as_slice(), &mut xz).map_err(|e| e.to_string())?;
            bytes = xz;
        }
        _ => {}
    }
    if r.chance(5) && bytes.len() > 8 {
        let i = 6 + r.below(bytes.len() as u64 - 6) as usize;
        bytes[i] ^= 0x55;
    }
    Ok(bytes)
}

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
