//! `ferrocuda plan`: the bytes a CUDA graph capture's private pool will reserve, from
//! snapshots of its warm-ups, before capturing (PyTorch's allocator and ferrocuda's take
//! the same segments for the same requests, so the plan holds for either).
//!
//! Each snapshot is one capture's warm-up, recorded with
//! `torch.cuda.memory._record_memory_history(enabled="all")` switched on just before it and
//! the snapshot taken right after; several are captures sharing one pool, in capture
//! order. The requests are the trace's `alloc` and `free_requested` events
//! ([`CaptureRequests::from_trace`]); the plan replays them through the allocator
//! ([`plan_pool`]).
use crate::recording::{Recording, TraceAction};
use ferrocuda_alloc::{AfterCapture, CaptureRequests, PoolPlan, plan_pool};
use ferrocuda_types::{AllocatorConfig, TraceEntry};

/// The requests of a warm-up's snapshot: its one device trace with history.
pub fn requests_of(recording: &Recording) -> Result<CaptureRequests, String> {
    let mut traces = recording.traces.iter().filter(|t| !t.is_empty());
    let (Some(trace), None) = (traces.next(), traces.next()) else {
        return Err(if recording.traces.iter().all(Vec::is_empty) {
            "no allocation history (record the warm-up with \
             torch.cuda.memory._record_memory_history(enabled=\"all\"))"
                .into()
        } else {
            "history on more than one device: a capture runs on one".into()
        });
    };
    let entries: Vec<TraceEntry> = trace
        .iter()
        .filter_map(|e| {
            let action = match e.action {
                TraceAction::Alloc => "alloc",
                TraceAction::FreeRequested => "free_requested",
                TraceAction::FreeCompleted => "free_completed",
                _ => return None,
            };
            Some(TraceEntry {
                action: action.into(),
                addr: e.addr,
                size: e.size,
                stream: e.stream,
                time_us: e.time_us,
                device_free: None,
                compile_context: String::new(),
                user_metadata: String::new(),
                frames: None,
            })
        })
        .collect();
    Ok(CaptureRequests::from_trace(&entries))
}

/// The plan of `captures` (one per warm-up, in capture order) under `config`.
pub fn plan(
    config: &AllocatorConfig,
    captures: &[CaptureRequests],
    free_outputs: bool,
) -> Result<PoolPlan, String> {
    let after = if free_outputs {
        AfterCapture::FreeOutputs
    } else {
        AfterCapture::KeepOutputs
    };
    plan_pool(config, captures, after).map_err(|e| e.to_string())
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// The plan as a table: per capture its file, the pool's bytes after it and what it added;
/// then the pool's segments and peak.
pub fn plan_table(label: &str, files: &[String], plan: &PoolPlan) -> String {
    let width = files.iter().map(String::len).max().unwrap_or(0).max(7);
    let mut out = format!(
        "conf {label}\n{:>7}  {:<width$}  {:>14}  {:>12}\n",
        "capture", "warm-up", "pool reserved", "added"
    );
    let mut before = 0;
    for (i, (file, after)) in files.iter().zip(&plan.reserved_after).enumerate() {
        out += &format!(
            "{:>7}  {:<width$}  {:>14}  {:>12}\n",
            i + 1,
            file,
            mib(*after),
            mib(after.saturating_sub(before))
        );
        before = *after;
    }
    out += &format!(
        "pool: {} ({} bytes) in {} segments; peak allocated {}\n",
        mib(plan.reserved_bytes),
        plan.reserved_bytes,
        plan.segments.len(),
        mib(plan.peak_allocated_bytes)
    );
    out
}

/// The plan as JSON: the configuration's label, bytes after each capture, the pool's bytes,
/// its segments and peak.
pub fn plan_json(label: &str, plan: &PoolPlan) -> serde_json::Value {
    serde_json::json!({
        "conf": label,
        "reserved_after": plan.reserved_after,
        "reserved_bytes": plan.reserved_bytes,
        "segments": plan.segments,
        "peak_allocated_bytes": plan.peak_allocated_bytes,
    })
}
