//! Reading a large snapshot: a two-million-event history (about 96 MB of pickle, written by
//! CPython's `pickle` as PyTorch's `_dump_snapshot` writes it) read, replayed, summarised and
//! plotted, with the peak resident memory of each (target: at most 400 MiB; the reader that
//! decoded into a tree of generic values took about 1.75 GB), and the time to read it.
//!
//! The peak is the process's `VmHWM`, reset before each step (`/proc/self/clear_refs`,
//! value 5), so each figure is what that step needed on top of what the process already
//! held. Needs `python3` (to write the snapshot) and Linux's `/proc`.
use criterion::Criterion;
use ferrocuda_cli::replay::replay;
use ferrocuda_cli::report::{plot_html, summary};
use ferrocuda_cli::trace::{events, read_recording};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Events of the history.
const EVENTS: usize = 2_000_000;
/// The target, MiB.
const TARGET_MIB: f64 = 400.0;

/// A history of allocations and frees of a few sizes, up to 2 000 live at once; every event
/// has PyTorch's keys (`compile_context` and `user_metadata` included) and no frames, as
/// `_record_memory_history(context=None)` records.
const WRITE: &str = r#"
import lzma, pickle, random, sys
n, out = int(sys.argv[1]), sys.argv[2]
rng = random.Random(1)
live, events, t, next_addr = [], [], 1795234311472016, 1 << 40
def event(action, addr, size):
    events.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
                   "compile_context": "N/A", "user_metadata": ""})
while len(events) < n:
    if live and (len(live) > 2000 or rng.random() < 0.5):
        a, s = live.pop(rng.randrange(len(live)))
        event("free_requested", a, s)
        event("free_completed", a, s)
    else:
        s = rng.choice([512, 4096, 1 << 20, 3 << 20, 12 << 20])
        live.append((next_addr, s))
        event("alloc", next_addr, s)
        next_addr += 1 << 25
    t += 1
snapshot = {"segments": [], "device_traces": [events[:n]],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}
with lzma.open(out, "wb", preset=1) as f:
    pickle.dump(snapshot, f, protocol=4)
"#;

fn write_snapshot() -> Result<PathBuf, String> {
    let path = std::env::temp_dir().join(format!("ferrocuda-2m-{}.pickle.xz", std::process::id()));
    let status = std::process::Command::new("python3")
        .args(["-c", WRITE, &EVENTS.to_string(), &path.to_string_lossy()])
        .status()
        .map_err(|e| format!("python3 is needed to write the snapshot: {e}"))?;
    if !status.success() {
        return Err(format!("writing the snapshot failed ({status})"));
    }
    Ok(path)
}

fn high_water_mib() -> Result<f64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .ok_or("no VmHWM in /proc/self/status")?;
    Ok(kib / 1024.0)
}

/// Peak resident memory while `step` runs, MiB.
fn peak_of(step: impl FnOnce() -> Result<(), String>) -> Result<f64, String> {
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| format!("clear_refs: {e}"))?;
    step()?;
    high_water_mib()
}

fn measure(path: &Path) -> Result<Vec<(&'static str, f64)>, String> {
    let read = || read_recording(path).map_err(|e| e.to_string());
    Ok(vec![
        (
            "replay",
            peak_of(|| {
                let recording = read()?;
                let trace = events(&recording.traces[0]);
                drop(recording);
                replay(&trace, "", 80 << 30, |_| {})
                    .map(drop)
                    .map_err(|e| e.to_string())
            })?,
        ),
        ("summary", peak_of(|| read().map(|r| drop(summary(&r))))?),
        (
            "plot",
            peak_of(|| read().map(|r| drop(plot_html(&r, "2M events"))))?,
        ),
    ])
}

fn main() -> ExitCode {
    let path = match write_snapshot() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("snapshot_memory: {e}");
            return ExitCode::FAILURE;
        }
    };
    let figures = measure(&path);
    let mut c = Criterion::default().configure_from_args().sample_size(10);
    c.bench_function("read a 2M-event snapshot", |b| {
        b.iter(|| read_recording(&path).map(|r| r.traces[0].len()))
    });
    c.final_summary();
    let _ = std::fs::remove_file(&path);
    match figures {
        Ok(rows) => {
            let mut met = true;
            for (step, mib) in rows {
                println!(
                    "peak RSS of {step} on {EVENTS} events: {mib:.1} MiB (target <= {TARGET_MIB} MiB)"
                );
                met &= mib <= TARGET_MIB;
            }
            if met {
                ExitCode::SUCCESS
            } else {
                eprintln!("snapshot_memory: a peak is above the target");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("snapshot_memory: {e}");
            ExitCode::FAILURE
        }
    }
}
