//! `ferrocuda plan` end to end: PyTorch's own warm-up snapshots (nine batch sizes recorded
//! on an H200) planned against the pools PyTorch's captures reserved; warm-ups of eight
//! batch sizes recorded as snapshots here, planned by the command, against the same program
//! captured for real into one shared pool on the fake device; and its refusals.
// Test code: a failed setup should stop the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use ferrocuda_alloc::history::HistoryOptions;
use ferrocuda_alloc::{Caching, CachingAllocator, Route};
use ferrocuda_driver::{Driver, FakeDriver};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, PoolId, StreamFlags};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

const EXE: &str = env!("CARGO_BIN_EXE_ferrocuda");
const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;
const BATCHES: [u64; 8] = [64, 48, 32, 24, 16, 8, 4, 1];

/// One decode step's requests for `batch` on `a`: temporaries freed, an output left live.
fn step(a: &CachingAllocator, stream: ferrocuda_types::StreamHandle, batch: u64) -> DevicePtr {
    let hidden = a.allocate(batch * 16 * 1024, stream).unwrap();
    let wide = a.allocate(batch * 64 * 1024, stream).unwrap();
    a.free(hidden.ptr).unwrap();
    let scratch = a.allocate(batch * 256 * 1024 + 4096, stream).unwrap();
    a.free(wide.ptr).unwrap();
    let out = a.allocate(batch * 16 * 1024, stream).unwrap();
    a.free(scratch.ptr).unwrap();
    out.ptr
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrocuda-plan-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes one snapshot per batch size's warm-up; returns their paths.
fn record_warm_ups(a: &CachingAllocator, fake: &FakeDriver, dir: &std::path::Path) -> Vec<String> {
    let side = fake.stream_create(D0, StreamFlags::default()).unwrap();
    BATCHES
        .iter()
        .map(|&batch| {
            a.record_memory_history(HistoryOptions::parse(Some("all"), None, 100_000).unwrap());
            let out = step(a, side, batch);
            let path = dir.join(format!("warmup_{batch}.pickle"));
            std::fs::write(&path, a.device_snapshot().to_pickle().unwrap()).unwrap();
            a.record_memory_history(HistoryOptions::default());
            a.free(out).unwrap();
            path.display().to_string()
        })
        .collect()
}

/// The captures for real, one pool: its reserved bytes after each.
fn capture_all(a: &CachingAllocator, fake: &FakeDriver, free_outputs: bool) -> Vec<u64> {
    let stream = fake.stream_create(D0, StreamFlags::default()).unwrap();
    let pool = PoolId::for_capture();
    BATCHES
        .iter()
        .map(|&batch| {
            a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))
                .unwrap();
            let out = step(a, stream, batch);
            a.end_allocate_to_pool(pool).unwrap();
            if free_outputs {
                a.free(out).unwrap();
            }
            a.pool_reserved_bytes(pool)
        })
        .collect()
}

fn planned(files: &[String], extra: &[&str]) -> Vec<u64> {
    let out = Command::new(EXE)
        .arg("plan")
        .args(files)
        .args(extra)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    rows[0]["reserved_after"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// PyTorch's warm-up snapshots (`tests/data/plan/`, recorded by `xtask/anchors/torch_plan.py`)
/// planned in four capture orders and output policies: each plan equals the bytes PyTorch's
/// shared pool reserved after every capture in the same recording run.
#[test]
fn plan_from_pytorchs_warm_ups_equals_pytorchs_pools() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/plan");
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("pytorch_pools.json")).unwrap())
            .unwrap();
    let batches: Vec<u64> = recorded["batches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    let runs = recorded["pool_bytes_after_each_capture"]
        .as_object()
        .unwrap();
    assert_eq!(runs.len(), 4);
    for (run, pools) in runs {
        let mut order = batches.clone();
        if run.starts_with("smallest_first") {
            order.reverse();
        }
        let files: Vec<String> = order
            .iter()
            .map(|b| {
                data.join(format!("warmup_{b}.pickle.xz"))
                    .display()
                    .to_string()
            })
            .collect();
        let mut extra = vec!["--conf", ""];
        if run.ends_with("free_outputs") {
            extra.push("--free-outputs");
        }
        let pytorch: Vec<u64> = pools
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(planned(&files, &extra), pytorch, "{run}");
    }
}

/// The command's plan from eight warm-up snapshots equals the shared pool after every
/// capture, outputs kept or freed, under the default configuration and another.
#[test]
fn plan_from_warm_up_snapshots_equals_the_captures() {
    for conf in ["", "max_split_size_mb:20,roundup_power2_divisions:4"] {
        for free_outputs in [false, true] {
            let fake = Arc::new(FakeDriver::builder().backing(false).build());
            let config = AllocatorConfig::parse(conf).unwrap();
            let a = CachingAllocator::new(fake.clone(), D0, config, Caching::On).unwrap();
            let _busy = a.allocate(30 * MIB, ferrocuda_types::StreamHandle::legacy(D0));
            let dir = temp_dir(&format!("{}-{free_outputs}", conf.len()));
            let files = record_warm_ups(&a, &fake, &dir);
            let real = capture_all(&a, &fake, free_outputs);
            let mut extra = vec!["--conf", conf];
            if free_outputs {
                extra.push("--free-outputs");
            }
            assert_eq!(
                planned(&files, &extra),
                real,
                "conf {conf:?}, free outputs {free_outputs}"
            );
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

/// A table by default; a snapshot without history is refused with a line that says how to
/// record one; a missing file is named.
#[test]
fn plan_prints_a_table_and_refuses_what_it_cannot_plan() {
    let fake = Arc::new(FakeDriver::builder().backing(false).build());
    let a =
        CachingAllocator::new(fake.clone(), D0, AllocatorConfig::default(), Caching::On).unwrap();
    let dir = temp_dir("table");
    let files = record_warm_ups(&a, &fake, &dir);
    let out = Command::new(EXE)
        .arg("plan")
        .args(&files[..2])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("pool reserved") && text.contains("pool: "),
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.contains("warmup_")).count(),
        2,
        "{text}"
    );

    let bare = dir.join("no_history.pickle");
    std::fs::write(&bare, a.device_snapshot().to_pickle().unwrap()).unwrap();
    let out = Command::new(EXE).arg("plan").arg(&bare).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.contains("no allocation history") && err.contains("_record_memory_history"),
        "{err}"
    );

    let out = Command::new(EXE)
        .arg("plan")
        .arg(dir.join("missing.pickle"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.pickle"));
    std::fs::remove_dir_all(&dir).unwrap();
}
