//! Output formats against PyTorch's (written by an independent audit): (memory_stats keys, memory_summary text, the
//! out-of-memory message, snapshot values). Each test says what PyTorch does and where.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use ferrocuda_alloc::history::HistoryOptions;
use ferrocuda_alloc::{AllocError, Caching, DeviceAllocators};
use ferrocuda_driver::{FakeDriver, fake::Completion};
use ferrocuda_stream::{DeviceBuffer, KernelCache, Module, Runtime};
use ferrocuda_testkit::{KERNELS, register_fake_kernels};
use ferrocuda_types::{
    AllocatorConfig, DeviceIndex, DeviceStats, KernelArg, LaunchConfig, Snapshot, StreamHandle,
    TraceEntry,
};
use std::collections::BTreeMap;
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;
const D0: DeviceIndex = DeviceIndex(0);
const MIB: u64 = 1 << 20;

const HINT: &str = " If reserved but unallocated memory is large try setting \
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation \
for Memory Management  \
(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";

struct Setup {
    fake: Arc<FakeDriver>,
    rt: Arc<Runtime>,
    allocators: Arc<DeviceAllocators>,
}

fn setup_with(capacity: u64, completion: Completion, conf: &str) -> Setup {
    let fake = Arc::new(
        FakeDriver::builder()
            .capacity(capacity)
            .completion(completion)
            .build(),
    );
    register_fake_kernels(&fake);
    let rt = Runtime::with_kernel_cache(fake.clone(), KernelCache::at(None));
    let config = AllocatorConfig::parse(conf).unwrap();
    let allocators = DeviceAllocators::new(fake.clone(), config, Caching::On);
    allocators.install(&rt);
    Setup {
        fake,
        rt,
        allocators,
    }
}

fn setup(capacity: u64) -> Setup {
    setup_with(capacity, Completion::Eager, "")
}

fn default_stream(s: &Setup) -> StreamHandle {
    s.rt.current_stream(D0).unwrap().handle()
}

fn oom_text(r: Result<ferrocuda_alloc::Allocation, AllocError>) -> String {
    match r {
        Err(e @ AllocError::OutOfMemory(_)) => e.to_string(),
        other => panic!("expected an out-of-memory error, got {other:?}"),
    }
}

/// Runs `script` in the workspace root, where its relative paths (`tests/data/...`) are.
fn python(script: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("python3")
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn tmp(name: &str) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("zz-audit-{}-{n}-{name}", std::process::id()))
}

// ---------------------------------------------------------------------------------------
// (1) memory_stats: key set and order
// ---------------------------------------------------------------------------------------

/// `tests/data/oracle-min/min-merge-split`: PyTorch 2.11's own `dict(torch.cuda.memory_stats())`
/// after alloc 2 MiB, alloc 2 MiB, free the second. Same program here; the flat dictionary
/// must have the same keys in the same (sorted) order and the same values.
#[test]
fn stats_keys_and_values_equal_pytorch_2_11_recording() -> TestResult {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/oracle-min/min-merge-split.result.json"
    ))?;
    let rec: serde_json::Value = serde_json::from_str(&text)?;
    let step = rec["steps"][3].as_object().expect("the stats step");
    // serde_json without preserve_order sorts keys; PyTorch's memory_stats sorts them too.
    let want_keys: Vec<&String> = step.keys().collect();

    let s = setup(80 << 30);
    let a = s.allocators.device(D0)?;
    let st = default_stream(&s);
    let _p0 = a.allocate(2 * MIB, st)?;
    let p1 = a.allocate(2 * MIB, st)?;
    a.free(p1.ptr)?;
    let got = a.stats().to_map();
    let got_keys: Vec<&String> = got.keys().collect();

    let extra: Vec<_> = got_keys
        .iter()
        .filter(|k| !step.contains_key(**k))
        .collect();
    let missing: Vec<_> = want_keys
        .iter()
        .filter(|k| !got.contains_key(**k))
        .collect();
    let differing: Vec<_> = step
        .iter()
        .filter(|(k, v)| got.get(*k).map(|g| v.as_i64() != Some(*g)).unwrap_or(false))
        .map(|(k, v)| format!("{k}: pytorch {v} ferrocuda {}", got[k]))
        .collect();
    assert!(differing.is_empty(), "values differ: {differing:?}");
    // `num_oom_rejections` is PyTorch 2.15's (throw_on_cudamalloc_oom), newer than the
    // 2.11 recording.
    assert!(
        extra == [&&"num_oom_rejections".to_string()] && missing.is_empty(),
        "PyTorch 2.11 has {} keys, ferrocuda {}; extra {extra:?}, missing {missing:?}",
        want_keys.len(),
        got_keys.len()
    );
    let shared: Vec<&String> = got_keys
        .iter()
        .copied()
        .filter(|k| k.as_str() != "num_oom_rejections")
        .collect();
    assert_eq!(shared, want_keys, "same order");
    Ok(())
}

/// Python sorts `(key, value)` tuples by key (str comparison, code point order); the map's
/// order must be that order.
#[test]
fn stats_order_is_python_sorted_order() -> TestResult {
    let s = setup(80 << 30);
    let got = s.allocators.device(D0)?.stats().to_map();
    let keys: Vec<String> = got.keys().cloned().collect();
    let json = serde_json::to_string(&keys)?;
    let out = python(
        "import json,sys\nk=json.loads(sys.argv[1])\nprint(k==sorted(k))",
        &[&json],
    );
    assert_eq!(out.trim(), "True");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// (2) memory_summary: PyTorch's formatter (torch/cuda/memory.py memory_summary) run by
//     Python on the library's own memory_stats, compared line by line.
// ---------------------------------------------------------------------------------------

const PY_SUMMARY: &str = r#"
import json, sys
stats = json.load(open(sys.argv[1]))
device = int(sys.argv[2]); abbreviated = sys.argv[3] == "1"
def _format_size(sz, pref_sz):
    prefixes = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_sz < 768 * 1024:
            break
        prefix = new_prefix
        sz //= 1024
        pref_sz /= 1024
    return f"{sz:6d} {prefix}"
def _format_count(cnt, pref_cnt):
    prefixes = [" ", "K", "M"]
    prefix = prefixes[0]
    for new_prefix in prefixes[1:]:
        if pref_cnt < 750 * 1000:
            break
        prefix = new_prefix
        cnt //= 1000
        pref_cnt /= 1000
    return f"{cnt:7d} {prefix} "
metrics_to_display = [
    ("allocated_bytes", "Allocated memory", _format_size),
    ("active_bytes", "Active memory", _format_size),
    ("requested_bytes", "Requested memory", _format_size),
    ("reserved_bytes", "GPU reserved memory", _format_size),
    ("inactive_split_bytes", "Non-releasable memory", _format_size),
    ("allocation", "Allocations", _format_count),
    ("active", "Active allocs", _format_count),
    ("segment", "GPU reserved segments", _format_count),
    ("inactive_split", "Non-releasable allocs", _format_count),
]
lines = []
lines.append("=" * 75)
lines.append(" {_:16} PyTorch CUDA memory summary, device ID {device:<17d} ")
lines.append("-" * 75)
lines.append("  {_:9} CUDA OOMs: {num_ooms:<12d} | {_:6} cudaMalloc retries: {num_alloc_retries:<8d}  ")
lines.append("=" * 75)
lines.append("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ")
for metric_key, metric_name, formatter in metrics_to_display:
    lines.append("-" * 75)
    submetrics = [("all", metric_name)]
    if not abbreviated:
        submetrics.append(("large_pool", "      from large pool"))
        submetrics.append(("small_pool", "      from small pool"))
    current_prefval = None
    for submetric_key, submetric_name in submetrics:
        prefix = metric_key + "." + submetric_key + "."
        current = stats[prefix + "current"]
        peak = stats[prefix + "peak"]
        allocated = stats[prefix + "allocated"]
        freed = stats[prefix + "freed"]
        if current_prefval is None:
            current_prefval = current
            peak_prefval = peak
            allocated_prefval = allocated
            freed_prefval = freed
        lines.append(
            f" {submetric_name:<21} | {formatter(current, current_prefval)} | {formatter(peak, peak_prefval)} | "
            f"{formatter(allocated, allocated_prefval)} | {formatter(freed, freed_prefval)} ",
        )
for metric_key, metric_name, formatter in [
    ("oversize_allocations", "Oversize allocations", _format_count),
    ("oversize_segments", "Oversize GPU segments", _format_count),
]:
    lines.append("-" * 75)
    prefix = metric_key + "."
    current = stats[prefix + "current"]
    peak = stats[prefix + "peak"]
    allocated = stats[prefix + "allocated"]
    freed = stats[prefix + "freed"]
    lines.append(
        f" {metric_name:<21} | {formatter(current, current)} | {formatter(peak, peak)} | "
        f"{formatter(allocated, allocated)} | {formatter(freed, freed)} ",
    )
lines.append("=" * 75)
fmt_dict = {"_": "", "device": device}
for k, v in stats.items():
    fmt_dict[k.replace(".", "-")] = v
sys.stdout.write("|" + "|\n|".join(lines).format(**fmt_dict) + "|\n")
"#;

fn pytorch_summary(stats: &BTreeMap<String, i64>, device: u16, abbreviated: bool) -> String {
    let path = tmp(&format!("stats-{device}-{abbreviated}.json"));
    std::fs::write(&path, serde_json::to_string(stats).unwrap()).unwrap();
    let out = python(
        PY_SUMMARY,
        &[
            path.to_str().unwrap(),
            &device.to_string(),
            if abbreviated { "1" } else { "0" },
        ],
    );
    let _ = std::fs::remove_file(&path);
    out
}

fn assert_same_lines(ours: &str, theirs: &str) {
    let (a, b): (Vec<&str>, Vec<&str>) = (ours.split('\n').collect(), theirs.split('\n').collect());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x, y, "line {i} differs\nours:\n{ours}\npytorch:\n{theirs}");
    }
    assert_eq!(
        a.len(),
        b.len(),
        "line count\nours:\n{ours}\npytorch:\n{theirs}"
    );
    assert_eq!(ours, theirs);
}

/// A small known program: small and large allocations, a free, a failed request.
#[test]
fn summary_of_small_program_equals_pytorch_formatter() -> TestResult {
    let s = setup(256 * MIB);
    let a = s.allocators.device(D0)?;
    let st = default_stream(&s);
    let x = a.allocate(1000, st)?;
    let _y = a.allocate(3 * MIB, st)?;
    let _z = a.allocate(50 * MIB + 7, st)?;
    a.free(x.ptr)?;
    let _ = a.allocate(1 << 30, st);
    let stats = a.stats();
    let map = stats.to_map();
    for abbreviated in [false, true] {
        let ours = stats.summary(0, abbreviated);
        assert_same_lines(&ours, &pytorch_summary(&map, 0, abbreviated));
    }
    assert!(stats.summary(0, false).contains("CUDA OOMs: 1 "));
    Ok(())
}

/// Values at and around every unit threshold of `_format_size` / `_format_count`, sub-rows
/// larger than their `all` row's unit would suggest, device IDs of several widths.
#[test]
fn summary_thresholds_equal_pytorch_formatter() -> TestResult {
    let byte_values: [i64; 8] = [
        0,
        786_431,
        786_432,
        805_306_367,
        805_306_368,
        1_234_567_890_123,
        824_633_720_832 * 1024,
        3 << 60,
    ];
    let count_values: [i64; 7] = [
        0,
        749_999,
        750_000,
        749_999_999,
        750_000_000,
        9_999_999_999,
        1,
    ];
    for (round, device) in [(0usize, 0u16), (1, 7), (2, 12345)] {
        let mut s = DeviceStats {
            max_split_size: -1,
            num_ooms: 123_456_789_012,
            num_alloc_retries: 42,
            ..DeviceStats::default()
        };
        let pick = |vals: &[i64], i: usize| vals[(i + round) % vals.len()];
        let mut i = 0;
        for arr in [
            &mut s.allocated_bytes,
            &mut s.active_bytes,
            &mut s.requested_bytes,
            &mut s.reserved_bytes,
            &mut s.inactive_split_bytes,
        ] {
            for stat in [&mut arr.all, &mut arr.large_pool, &mut arr.small_pool] {
                stat.current = pick(&byte_values, i);
                stat.peak = pick(&byte_values, i + 1);
                stat.allocated = pick(&byte_values, i + 2);
                stat.freed = pick(&byte_values, i + 3);
                i += 1;
            }
        }
        for arr in [
            &mut s.allocation,
            &mut s.active,
            &mut s.segment,
            &mut s.inactive_split,
        ] {
            for stat in [&mut arr.all, &mut arr.large_pool, &mut arr.small_pool] {
                stat.current = pick(&count_values, i);
                stat.peak = pick(&count_values, i + 1);
                stat.allocated = pick(&count_values, i + 2);
                stat.freed = pick(&count_values, i + 3);
                i += 1;
            }
        }
        s.oversize_allocations.current = 750_000;
        s.oversize_allocations.peak = 999_999_999;
        s.oversize_segments.allocated = 749_999;
        let map = s.to_map();
        for abbreviated in [false, true] {
            assert_same_lines(
                &s.summary(device, abbreviated),
                &pytorch_summary(&map, device, abbreviated),
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// (3) The out-of-memory message (c10/cuda/CUDACachingAllocator.cpp,
//     DeviceCachingAllocator::malloc, TORCH_CHECK_WITH(OutOfMemoryError, ...)).
// ---------------------------------------------------------------------------------------

/// Default configuration, no fraction, no private pools, no NVML (so `proc_info` is empty):
/// PyTorch's text is exactly these pieces, the hint included.
#[test]
fn oom_message_equals_pytorch_text() -> TestResult {
    let s = setup(64 * MIB);
    let a = s.allocators.device(D0)?;
    let st = default_stream(&s);
    let _kept = a.allocate(1000, st)?;
    let got = oom_text(a.allocate(100 * MIB, st));
    let want = format!(
        "CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of \
         64.00 MiB of which 62.00 MiB is free. Of the allocated memory 1024 bytes is allocated \
         by PyTorch, and 2.00 MiB is reserved by PyTorch but unallocated.{HINT}"
    );
    assert_eq!(got, want);
    Ok(())
}

/// `Tried to allocate` is `alloc_size` (get_allocation_size: 2 MiB for small, 20 MiB for
/// 1–10 MiB), not the request; with a fraction, `"<allowed> allowed; "` comes before "Of the".
#[test]
fn oom_message_alloc_size_and_allowed() -> TestResult {
    let s = setup(64 * MIB);
    let a = s.allocators.device(D0)?;
    a.set_memory_fraction(0.5)?;
    let st = default_stream(&s);
    let _big = a.allocate(30 * MIB, st)?; // 30 MiB segment; 32 MiB allowed
    let got = oom_text(a.allocate(5 * MIB, st));
    let want = format!(
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of \
         64.00 MiB of which 34.00 MiB is free. 32.00 MiB allowed; Of the allocated memory \
         30.00 MiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but \
         unallocated.{HINT}"
    );
    assert_eq!(got, want);
    // A small request needs a 2 MiB segment: with the 32 MiB allowed taken (the 30 MiB
    // segment and a full 2 MiB small one), refused.
    let _one = a.allocate(MIB, st)?;
    let _two = a.allocate(MIB, st)?;
    let got = oom_text(a.allocate(1000, st));
    assert!(
        got.starts_with("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total"),
        "{got}"
    );
    Ok(())
}

/// Cached free blocks of a private pool still in use (a graph's) are `allocated_in_private_
/// pools`: PyTorch adds them to the allocated figure, takes them off the unallocated one and
/// says "with X allocated in private pools (e.g., CUDA Graphs), ".
#[test]
fn oom_message_private_pool_piece() -> TestResult {
    use ferrocuda_alloc::Route;
    use ferrocuda_types::PoolId;
    let s = setup(64 * MIB);
    let a = s.allocators.device(D0)?;
    let st = default_stream(&s);
    let pool = PoolId(1, 0);
    a.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let x = a.allocate(30 * MIB, st)?;
    a.free(x.ptr)?;
    a.end_allocate_to_pool(pool)?;
    let got = oom_text(a.allocate(100 * MIB, st));
    let want = format!(
        "CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of \
         64.00 MiB of which 34.00 MiB is free. Of the allocated memory 30.00 MiB is allocated \
         by PyTorch, with 30.00 MiB allocated in private pools (e.g., CUDA Graphs), and 0 bytes \
         is reserved by PyTorch but unallocated.{HINT}"
    );
    assert_eq!(got, want);
    Ok(())
}

#[test]
fn oom_message_one_exabyte() -> TestResult {
    let s = setup(64 * MIB);
    let a = s.allocators.device(D0)?;
    let got = oom_text(a.allocate(1 << 60, default_stream(&s)));
    assert_eq!(
        got,
        "CUDA out of memory. Tried to allocate more than 1EB memory."
    );
    Ok(())
}

/// The `oom` trace entry: `device_free` in `addr`'s place, `size` = params.size() (the
/// rounded request, not alloc_size), num_ooms counted.
#[test]
fn oom_trace_entry_values() -> TestResult {
    let s = setup(64 * MIB);
    let a = s.allocators.device(D0)?;
    a.record_memory_history(HistoryOptions::parse(Some("all"), None, usize::MAX)?);
    let st = default_stream(&s);
    let _big = a.allocate(60 * MIB, st)?;
    let _ = oom_text(a.allocate(5 * MIB + 1, st));
    let snap = s.allocators.snapshot()?;
    let oom: Vec<&TraceEntry> = snap.device_traces[0]
        .iter()
        .filter(|e| e.action == "oom")
        .collect();
    assert_eq!(oom.len(), 1);
    assert_eq!(oom[0].device_free, Some(4 * MIB));
    assert_eq!(oom[0].addr, 0);
    assert_eq!(a.stats().num_ooms, 1);
    assert_eq!(oom[0].size, 5 * MIB + 512, "round_size of the request");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// (4) Snapshot values
// ---------------------------------------------------------------------------------------

/// A never-allocated split remainder has requested_size 0 in PyTorch (new Block constructor),
/// allocated blocks their request.
#[test]
fn snapshot_block_values_and_types() -> TestResult {
    let s = setup(80 << 30);
    let a = s.allocators.device(D0)?;
    let st = default_stream(&s);
    let side = s.rt.new_stream(D0, 0)?;
    let small = a.allocate(1000, st)?;
    let large = a.allocate(3 * MIB, side.handle())?;
    let snap = s.allocators.snapshot()?;
    assert_eq!(snap.segments.len(), 2);
    for seg in &snap.segments {
        if seg.address == small.ptr.0 {
            assert_eq!(
                (seg.segment_type.as_str(), seg.total_size, seg.stream),
                ("small", 2 * MIB, 0)
            );
            assert_eq!(seg.blocks[0].state, "active_allocated");
            assert_eq!(seg.blocks[0].requested_size, 1000);
            assert_eq!(
                (seg.blocks[1].state.as_str(), seg.blocks[1].requested_size),
                ("inactive", 0)
            );
            assert_eq!(
                (seg.allocated_size, seg.active_size, seg.requested_size),
                (1024, 1024, 1000)
            );
        } else {
            assert_eq!(seg.address, large.ptr.0);
            assert_eq!(
                (seg.segment_type.as_str(), seg.total_size, seg.stream),
                ("large", 20 * MIB, side.handle().raw)
            );
            assert_eq!(seg.segment_pool_id, (0, 0));
            assert!(!seg.is_expandable);
        }
        let mut addr = seg.address;
        for b in &seg.blocks {
            assert_eq!(b.address, addr);
            addr += b.size;
        }
    }
    Ok(())
}

/// `active_pending_free`: freed after record_stream while the side stream is still busy.
#[test]
fn snapshot_state_pending_free() -> TestResult {
    let s = setup_with(80 << 30, Completion::Manual, "");
    let m = Module::from_cuda_source(&s.rt, D0, "k", KERNELS)?;
    let side = s.rt.new_stream(D0, 0)?;
    let x = DeviceBuffer::<f32>::uninit(&s.rt, D0, 256)?;
    side.wait_stream(&s.rt.current_stream(D0)?)?;
    side.launch(
        &m.function("add_one_f32")?,
        &LaunchConfig::for_elements(256, 256),
        &[x.arg(), KernelArg::value(&256u32)],
    )?;
    x.record_stream(&side)?;
    drop(x);
    let snap = s.allocators.snapshot()?;
    let states: Vec<&str> = snap.segments[0]
        .blocks
        .iter()
        .map(|b| b.state.as_str())
        .collect();
    assert_eq!(states, ["active_pending_free", "inactive"]);
    assert_eq!(snap.segments[0].active_size, 1024);
    assert_eq!(snap.segments[0].allocated_size, 0);
    s.fake.advance_all();
    Ok(())
}

/// `NativeCachingAllocator::snapshot` copies `da->trace()` BEFORE `da->snapshot()` records
/// its SNAPSHOT entry, so a snapshot never contains its own `snapshot` event (the 2.11
/// recordings in tests/data, each taken with history on, have none); the next one does.
#[test]
fn snapshot_does_not_contain_its_own_snapshot_entry() -> TestResult {
    let s = setup(80 << 30);
    let a = s.allocators.device(D0)?;
    a.record_memory_history(HistoryOptions::parse(Some("all"), None, usize::MAX)?);
    let st = default_stream(&s);
    let _x = a.allocate(1000, st)?;
    let first = s.allocators.snapshot()?;
    let actions: Vec<&str> = first.device_traces[0]
        .iter()
        .map(|e| e.action.as_str())
        .collect();
    assert_eq!(
        actions,
        ["segment_alloc", "alloc"],
        "first snapshot's trace"
    );
    let second = s.allocators.snapshot()?;
    let actions: Vec<&str> = second.device_traces[0]
        .iter()
        .map(|e| e.action.as_str())
        .collect();
    assert_eq!(actions, ["segment_alloc", "alloc", "snapshot"]);
    Ok(())
}

/// `time_us`: microseconds since the epoch, non-decreasing.
#[test]
fn trace_time_us_units() -> TestResult {
    let s = setup(80 << 30);
    let a = s.allocators.device(D0)?;
    a.record_memory_history(HistoryOptions::parse(Some("all"), None, usize::MAX)?);
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
    };
    let before = now();
    let x = a.allocate(1000, default_stream(&s))?;
    a.free(x.ptr)?;
    let after = now();
    let snap = s.allocators.snapshot()?;
    let t: Vec<u64> = snap.device_traces[0]
        .iter()
        .filter(|e| e.action != "snapshot")
        .map(|e| e.time_us)
        .collect();
    assert!(!t.is_empty());
    assert!(
        t.iter().all(|&x| x >= before && x <= after),
        "{t:?} {before} {after}"
    );
    assert!(t.windows(2).all(|w| w[0] <= w[1]));
    // Entries without a recorded context have no `frames` key (tests/data recordings, made
    // with context=None, have none).
    assert!(snap.device_traces[0].iter().all(|e| e.frames.is_none()));
    Ok(())
}

#[inline(never)]
fn frames_probe_alloc(a: &ferrocuda_alloc::CachingAllocator, bytes: u64, st: StreamHandle) -> u64 {
    std::hint::black_box(a.allocate(bytes, st).unwrap().ptr.0)
}

#[inline(never)]
fn frames_probe_free(a: &ferrocuda_alloc::CachingAllocator, ptr: u64) {
    a.free(std::hint::black_box(ferrocuda_types::DevicePtr(ptr)))
        .unwrap();
}

fn has_frame(frames: &[ferrocuda_types::Frame], name: &str) -> bool {
    frames.iter().any(|f| f.name.contains(name))
}

fn entry<'a>(snap: &'a Snapshot, action: &str) -> &'a TraceEntry {
    snap.device_traces[0]
        .iter()
        .find(|e| e.action == action)
        .unwrap_or_else(|| panic!("no {action} entry"))
}

/// context="state": PyTorch keeps the stack of each live block AND of each segment
/// (`context_when_segment_allocated`, reported as the segment's `frames`); trace entries get
/// none (record_trace drops contexts below ALLOC).
#[test]
fn frames_with_context_state() -> TestResult {
    let s = setup(80 << 30);
    let a = s.allocators.device(D0)?;
    a.record_memory_history(HistoryOptions::parse(
        Some("all"),
        Some("state"),
        usize::MAX,
    )?);
    let _p = frames_probe_alloc(a, 1000, default_stream(&s));
    let snap = s.allocators.snapshot()?;
    let seg = &snap.segments[0];
    assert!(
        has_frame(&seg.blocks[0].frames, "frames_probe_alloc"),
        "block frames"
    );
    assert!(seg.blocks[1].frames.is_empty());
    assert!(snap.device_traces[0].iter().all(|e| e.frames.is_none()));
    assert!(
        has_frame(&seg.frames, "frames_probe_alloc"),
        "segment frames: PyTorch reports context_when_segment_allocated, got {:?}",
        seg.frames
    );
    Ok(())
}

/// context="alloc": record_trace keeps the context given (record_context_ >= ALLOC), and
/// free() passes `context ? context : block->context_when_allocated` to FREE_REQUESTED and
/// free_block passes the same to FREE_COMPLETED: with no free-time stack (context below ALL)
/// both carry the allocation stack. SEGMENT_ALLOC gets the malloc context; SEGMENT_FREE
/// `context ? context : context_when_segment_allocated`.
#[test]
fn frames_with_context_alloc() -> TestResult {
    let s = setup(80 << 30);
    let a = s.allocators.device(D0)?;
    a.record_memory_history(HistoryOptions::parse(
        Some("all"),
        Some("alloc"),
        usize::MAX,
    )?);
    let p = frames_probe_alloc(a, 1000, default_stream(&s));
    frames_probe_free(a, p);
    a.empty_cache();
    let snap = s.allocators.snapshot()?;
    let mut problems = Vec::new();
    for action in [
        "segment_alloc",
        "alloc",
        "free_requested",
        "free_completed",
        "segment_free",
    ] {
        let e = entry(&snap, action);
        match &e.frames {
            Some(f) if has_frame(f, "frames_probe_alloc") => {}
            other => problems.push(format!(
                "{action}: frames {:?}",
                other.as_ref().map(|f| f.len())
            )),
        }
    }
    assert!(problems.is_empty(), "{problems:?}");
    Ok(())
}

/// context="all": the free-time stack goes to FREE_REQUESTED and, through
/// free_block(block, context), to FREE_COMPLETED.
#[test]
fn frames_with_context_all() -> TestResult {
    let s = setup(80 << 30);
    let a = s.allocators.device(D0)?;
    a.record_memory_history(HistoryOptions::parse(Some("all"), Some("all"), usize::MAX)?);
    let p = frames_probe_alloc(a, 1000, default_stream(&s));
    frames_probe_free(a, p);
    let snap = s.allocators.snapshot()?;
    let fr = entry(&snap, "free_requested")
        .frames
        .clone()
        .unwrap_or_default();
    assert!(has_frame(&fr, "frames_probe_free"), "free_requested");
    let fc = entry(&snap, "free_completed")
        .frames
        .clone()
        .unwrap_or_default();
    assert!(
        has_frame(&fc, "frames_probe_free"),
        "free_completed should carry the free-time stack; has alloc stack: {}",
        has_frame(&fc, "frames_probe_alloc")
    );
    Ok(())
}

/// The dumped pickle: key order and Python types per the 2.11 recordings.
#[test]
fn pickle_keys_and_types_match_recording() -> TestResult {
    let s = setup(80 << 30);
    let a = s.allocators.device(D0)?;
    a.record_memory_history(HistoryOptions::parse(Some("all"), None, usize::MAX)?);
    let st = default_stream(&s);
    let x = a.allocate(1000, st)?;
    let _y = a.allocate(3 * MIB, st)?;
    a.free(x.ptr)?;
    let path = tmp("snap.pickle");
    std::fs::write(&path, s.allocators.snapshot()?.to_pickle()?)?;
    let script = r#"
import pickle, lzma, sys
ours = pickle.load(open(sys.argv[1], 'rb'))
ref = pickle.load(lzma.open('tests/data/gpt2_train.pickle.xz'))
def shape(x):
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}, list(x.keys())
    if isinstance(x, list):
        return [shape(x[0])] if x else []
    return type(x).__name__
out = []
out.append(('top', list(ours.keys()) == list(ref.keys()), list(ours.keys())))
out.append(('segment', shape(ours['segments'][0]) == shape(ref['segments'][0])))
b = ours['segments'][0]['blocks'][0]; rb = ref['segments'][0]['blocks'][0]
out.append(('block', list(b.keys()) == list(rb.keys()), [type(v).__name__ for v in b.values()] == [type(v).__name__ for v in rb.values()]))
e = ours['device_traces'][0][0]; re_ = ref['device_traces'][0][0]
out.append(('trace', list(e.keys()) == list(re_.keys()), [type(v).__name__ for v in e.values()] == [type(v).__name__ for v in re_.values()]))
out.append(('settings', list(ours['allocator_settings'].keys()) == list(ref['allocator_settings'].keys()),
            ours['allocator_settings'] == ref['allocator_settings']))
out.append(('annotations', ours['external_annotations']))
ok = all(all(v for v in o[1:] if isinstance(v, bool)) for o in out)
print('OK' if ok else out)
"#;
    let out = python(script, &[path.to_str().unwrap()]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(out.trim(), "OK");
    Ok(())
}
