//! Reports from a snapshot: PyTorch's `memory_summary` table, and a self-contained HTML
//! page with the memory timeline.
use ferrocuda_types::{DeviceStats, PoolKind, Snapshot, Stat, format_size};
use std::fmt::Write;

fn pool(segment_type: &str) -> PoolKind {
    if segment_type == "small" {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// Running totals of requested and reserved bytes over a device's trace: `(requested,
/// reserved)` after each event, relative to the start of the trace.
fn timeline(snapshot: &Snapshot, device: usize) -> Vec<(u64, i64, i64)> {
    let (mut requested, mut reserved) = (0i64, 0i64);
    let trace = snapshot
        .device_traces
        .get(device)
        .map_or(&[][..], Vec::as_slice);
    trace
        .iter()
        .map(|e| {
            // Sizes are at most 2^50 (checked on reading); sums saturate.
            let size = i64::try_from(e.size).unwrap_or(i64::MAX);
            match e.action.as_str() {
                "alloc" => requested = requested.saturating_add(size),
                "free_completed" => requested = requested.saturating_sub(size),
                "segment_alloc" | "segment_map" => reserved = reserved.saturating_add(size),
                "segment_free" | "segment_unmap" => reserved = reserved.saturating_sub(size),
                _ => {}
            }
            (e.time_us, requested, reserved)
        })
        .collect()
}

/// The statistics a snapshot allows for `device`: current values from its segments; peaks
/// of requested and reserved bytes from the trace (a trace that starts mid-run is taken
/// relative to the end state); other peaks equal the current value.
pub fn stats_from_snapshot(snapshot: &Snapshot, device: u16) -> DeviceStats {
    let mut s = DeviceStats {
        max_split_size: snapshot.allocator_settings.max_split_size,
        ..DeviceStats::default()
    };
    for seg in snapshot.segments.iter().filter(|g| g.device == device) {
        let kind = pool(&seg.segment_type);
        if !seg.is_expandable {
            s.segment.increase(kind, 1);
        }
        s.reserved_bytes.increase(kind, seg.total_size as i64);
        for b in &seg.blocks {
            let size = b.size as i64;
            if b.state == "active_allocated" {
                s.allocation.increase(kind, 1);
                s.allocated_bytes.increase(kind, size);
            }
            if b.state.starts_with("active_") {
                s.active.increase(kind, 1);
                s.active_bytes.increase(kind, size);
                s.requested_bytes.increase(kind, b.requested_size as i64);
            } else if seg.blocks.len() > 1 && !seg.is_expandable {
                s.inactive_split.increase(kind, 1);
                s.inactive_split_bytes.increase(kind, size);
            }
        }
    }
    let line = timeline(snapshot, usize::from(device));
    if let Some(&(_, end_requested, end_reserved)) = line.last() {
        let lift = |stat: &mut Stat, end: i64, max: i64| {
            stat.peak = stat
                .peak
                .max(stat.current.saturating_add(max.saturating_sub(end)))
        };
        let max_requested = line.iter().map(|p| p.1).max().unwrap_or(0);
        let max_reserved = line.iter().map(|p| p.2).max().unwrap_or(0);
        lift(&mut s.requested_bytes.all, end_requested, max_requested);
        lift(&mut s.reserved_bytes.all, end_reserved, max_reserved);
        let trace = snapshot
            .device_traces
            .get(usize::from(device))
            .map_or(&[][..], Vec::as_slice);
        let total = |action: &str| {
            trace
                .iter()
                .filter(|e| e.action == action)
                .map(|e| i64::try_from(e.size).unwrap_or(i64::MAX))
                .fold(0i64, i64::saturating_add)
        };
        s.requested_bytes.all.allocated = total("alloc");
        s.requested_bytes.all.freed = total("free_completed");
        s.num_device_alloc = trace
            .iter()
            .filter(|e| e.action == "segment_alloc" || e.action == "segment_map")
            .count() as i64;
        s.num_device_free = trace
            .iter()
            .filter(|e| e.action == "segment_free" || e.action == "segment_unmap")
            .count() as i64;
        s.num_ooms = trace.iter().filter(|e| e.action == "oom").count() as i64;
    }
    s
}

/// Devices a snapshot has anything for.
pub fn devices(snapshot: &Snapshot) -> Vec<u16> {
    let mut d: Vec<u16> = snapshot.segments.iter().map(|s| s.device).collect();
    d.extend(
        snapshot
            .device_traces
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .map(|(i, _)| i as u16),
    );
    d.sort_unstable();
    d.dedup();
    d
}

/// What each figure of the table is, printed under it: a snapshot holds the state at one
/// moment and a history of requests and segments, not PyTorch's running statistics.
pub const SUMMARY_NOTES: &str = "\
How these figures were derived from the snapshot (it holds the state at one moment and a \
history, not PyTorch's running statistics):
- Cur Usage: the snapshot's segments and blocks when it was taken.
- Peak Usage of Requested memory and GPU reserved memory (all pools): from the trace of \
requests and segments, so a peak may lie above every other row's.
- other Peak Usage figures are the current values (the trace does not record them): \
Allocated memory may show a peak below Requested memory's.
- Tot Alloc / Tot Freed of Requested memory (all pools): sums of the trace's alloc and \
free_completed events; of the other rows: the current values and 0.
- from large pool / from small pool: from the segments alone, so pool rows need not add up \
to the all-pools row above them where that row comes from the trace.
";

/// `memory_summary` for every device of a snapshot, each followed by [`SUMMARY_NOTES`]; a
/// snapshot with no segments and no history says so.
pub fn summary(snapshot: &Snapshot) -> String {
    let devices = devices(snapshot);
    if devices.is_empty() {
        return "The snapshot has no segments and no history: nothing to summarize.\n".into();
    }
    devices
        .into_iter()
        .map(|d| stats_from_snapshot(snapshot, d).summary(d, false) + SUMMARY_NOTES)
        .collect::<Vec<_>>()
        .join("\n")
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A self-contained HTML page (inline SVG, no scripts, no links): requested and reserved
/// bytes over the trace of each device, and the largest blocks of the snapshot.
pub fn plot_html(snapshot: &Snapshot, title: &str) -> String {
    let mut html = format!(
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{t}</title><style>\
         body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}td.l{{text-align:left}}\
         </style></head><body><h1>{t}</h1>",
        t = escape(title)
    );
    let (w, h) = (900.0f64, 300.0f64);
    for device in devices(snapshot) {
        let line = timeline(snapshot, usize::from(device));
        let stats = stats_from_snapshot(snapshot, device);
        let _ = write!(html, "<h2>cuda:{device}</h2>");
        if line.is_empty() {
            html += "<p>No history in this snapshot (record it with record_memory_history).</p>";
        } else {
            // Shift so that the end of the trace matches the snapshot's current state.
            let (_, end_req, end_res) = line[line.len() - 1];
            let req0 = stats.requested_bytes.all.current.saturating_sub(end_req);
            let res0 = stats.reserved_bytes.all.current.saturating_sub(end_res);
            let top = line
                .iter()
                .map(|p| p.1.saturating_add(req0).max(p.2.saturating_add(res0)))
                .max()
                .unwrap_or(1)
                .max(1) as f64;
            let (t0, t1) = (
                line[0].0 as f64,
                line[line.len() - 1].0.max(line[0].0 + 1) as f64,
            );
            let x = |t: u64| (t as f64 - t0) / (t1 - t0) * w;
            let y = |v: i64| h - (v as f64 / top) * h;
            let points = |pick: &dyn Fn(&(u64, i64, i64)) -> i64| {
                line.iter()
                    .map(|p| format!("{:.1},{:.1}", x(p.0), y(pick(p))))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let _ = write!(
                html,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{hh}\" viewBox=\"0 -10 {w} {hh}\">\
                 <rect x=\"0\" y=\"0\" width=\"{w}\" height=\"{h}\" fill=\"#fafafa\" stroke=\"#999\"/>\
                 <polyline fill=\"none\" stroke=\"#c33\" stroke-width=\"1.5\" points=\"{res}\"/>\
                 <polyline fill=\"none\" stroke=\"#36c\" stroke-width=\"1.5\" points=\"{req}\"/>\
                 <text x=\"4\" y=\"12\" font-size=\"12\">peak {top}</text>\
                 <text x=\"4\" y=\"{ly}\" font-size=\"12\" fill=\"#c33\">reserved</text>\
                 <text x=\"80\" y=\"{ly}\" font-size=\"12\" fill=\"#36c\">requested</text>\
                 <text x=\"{tx}\" y=\"{ly}\" font-size=\"12\" text-anchor=\"end\">{secs:.3} s, {n} events</text></svg>",
                hh = h + 30.0,
                res = points(&|p| p.2.saturating_add(res0)),
                req = points(&|p| p.1.saturating_add(req0)),
                top = escape(&format_size(top as u64)),
                ly = h + 16.0,
                tx = w - 4.0,
                secs = (t1 - t0) / 1e6,
                n = line.len(),
            );
        }
        let mut blocks: Vec<_> = snapshot
            .segments
            .iter()
            .filter(|s| s.device == device)
            .flat_map(|s| s.blocks.iter().map(move |b| (s, b)))
            .filter(|(_, b)| b.state.starts_with("active_"))
            .collect();
        blocks.sort_by_key(|(_, b)| std::cmp::Reverse(b.size));
        html += "<h3>Largest live blocks</h3><table><tr><th>address</th><th>size</th><th>requested</th><th>state</th><th>stream</th><th>allocated at</th></tr>";
        for (seg, b) in blocks.iter().take(20) {
            let at = b.frames.first().map_or(String::from("—"), |f| {
                format!("{}:{} {}", f.filename, f.line, f.name)
            });
            let _ = write!(
                html,
                "<tr><td>{:#x}</td><td>{}</td><td>{}</td><td class=\"l\">{}</td><td>{}</td><td class=\"l\">{}</td></tr>",
                b.address,
                escape(&format_size(b.size)),
                escape(&format_size(b.requested_size)),
                escape(&b.state),
                seg.stream,
                escape(&at)
            );
        }
        html += "</table>";
    }
    html += "</body></html>\n";
    html
}
