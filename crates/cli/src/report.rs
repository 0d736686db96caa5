//! Reports from a snapshot: PyTorch's `memory_summary` table, what holds the memory (the
//! largest live blocks and the allocation sites by bytes, from the recorded stacks), and a
//! self-contained HTML page with the memory timeline.
use crate::recording::{Recording, Segment, StackId, TraceAction};
use crate::sites::{Site, Sites};
use ferrocuda_types::{DeviceStats, PoolKind, Stat, format_size};
use std::fmt::Write;

fn pool(seg: &Segment) -> PoolKind {
    if seg.small {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// Running totals of requested and reserved bytes over a device's trace: `(time,
/// requested, reserved)` after each event, relative to the start of the trace.
fn timeline(recording: &Recording, device: usize) -> Vec<(u64, i64, i64)> {
    let (mut requested, mut reserved) = (0i64, 0i64);
    let trace = recording.traces.get(device).map_or(&[][..], Vec::as_slice);
    trace
        .iter()
        .map(|e| {
            // Sizes are at most 2^50 (checked on reading); sums saturate.
            let size = i64::try_from(e.size).unwrap_or(i64::MAX);
            match e.action {
                TraceAction::Alloc => requested = requested.saturating_add(size),
                TraceAction::FreeCompleted => requested = requested.saturating_sub(size),
                TraceAction::SegmentAlloc | TraceAction::SegmentMap => {
                    reserved = reserved.saturating_add(size)
                }
                TraceAction::SegmentFree | TraceAction::SegmentUnmap => {
                    reserved = reserved.saturating_sub(size)
                }
                _ => {}
            }
            (e.time_us, requested, reserved)
        })
        .collect()
}

/// The statistics a snapshot allows for `device`: current values from its segments; peaks
/// of requested and reserved bytes from the trace (a trace that starts mid-run is taken
/// relative to the end state); other peaks equal the current value.
pub fn stats_from_recording(recording: &Recording, device: u16) -> DeviceStats {
    let mut s = DeviceStats {
        max_split_size: recording.allocator_settings.max_split_size,
        ..DeviceStats::default()
    };
    for seg in recording.segments.iter().filter(|g| g.device == device) {
        let kind = pool(seg);
        if !seg.is_expandable {
            s.segment.increase(kind, 1);
        }
        s.reserved_bytes.increase(kind, seg.total_size as i64);
        for b in &seg.blocks {
            let size = b.size as i64;
            if b.state == crate::recording::BlockState::ActiveAllocated {
                s.allocation.increase(kind, 1);
                s.allocated_bytes.increase(kind, size);
            }
            if b.state.is_active() {
                s.active.increase(kind, 1);
                s.active_bytes.increase(kind, size);
                s.requested_bytes.increase(kind, b.requested_size as i64);
            } else if seg.blocks.len() > 1 && !seg.is_expandable {
                s.inactive_split.increase(kind, 1);
                s.inactive_split_bytes.increase(kind, size);
            }
        }
    }
    let line = timeline(recording, usize::from(device));
    let Some(&(_, end_requested, end_reserved)) = line.last() else {
        return s;
    };
    let lift = |stat: &mut Stat, end: i64, max: i64| {
        stat.peak = stat
            .peak
            .max(stat.current.saturating_add(max.saturating_sub(end)))
    };
    let max_requested = line.iter().map(|p| p.1).max().unwrap_or(0);
    let max_reserved = line.iter().map(|p| p.2).max().unwrap_or(0);
    lift(&mut s.requested_bytes.all, end_requested, max_requested);
    lift(&mut s.reserved_bytes.all, end_reserved, max_reserved);
    let trace = &recording.traces[usize::from(device)];
    let total = |action: TraceAction| {
        trace
            .iter()
            .filter(|e| e.action == action)
            .map(|e| i64::try_from(e.size).unwrap_or(i64::MAX))
            .fold(0i64, i64::saturating_add)
    };
    let count = |actions: &[TraceAction]| {
        trace.iter().filter(|e| actions.contains(&e.action)).count() as i64
    };
    s.requested_bytes.all.allocated = total(TraceAction::Alloc);
    s.requested_bytes.all.freed = total(TraceAction::FreeCompleted);
    s.num_device_alloc = count(&[TraceAction::SegmentAlloc, TraceAction::SegmentMap]);
    s.num_device_free = count(&[TraceAction::SegmentFree, TraceAction::SegmentUnmap]);
    s.num_ooms = count(&[TraceAction::Oom]);
    s
}

/// Devices a snapshot has anything for.
pub fn devices(recording: &Recording) -> Vec<u16> {
    let mut d: Vec<u16> = recording.segments.iter().map(|s| s.device).collect();
    d.extend(
        recording
            .traces
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .filter_map(|(i, _)| u16::try_from(i).ok()),
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

/// How many rows the "what holds the memory" tables show.
pub const TOP_ROWS: usize = 10;

/// The pool a segment belongs to, in words.
fn pool_name(seg: &Segment) -> String {
    match seg.pool {
        (0, 0) => "default".into(),
        (a, b) => format!("private ({a}, {b})"),
    }
}

/// `memory_summary` for every device of a snapshot, each followed by [`SUMMARY_NOTES`] and
/// what holds its memory; a snapshot with no segments and no history says so.
pub fn summary(recording: &Recording) -> String {
    let devices = devices(recording);
    if devices.is_empty() {
        return "The snapshot has no segments and no history: nothing to summarize.\n".into();
    }
    let sites = Sites::new(recording);
    devices
        .into_iter()
        .map(|d| {
            stats_from_recording(recording, d).summary(d, false)
                + SUMMARY_NOTES
                + &holders_text(recording, &sites, d)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A live block with where it came from.
struct Live<'a> {
    seg: &'a Segment,
    address: u64,
    size: u64,
    requested: u64,
    state: &'static str,
    stack: StackId,
}

fn live_blocks<'a>(recording: &'a Recording, sites: &Sites, device: u16) -> Vec<Live<'a>> {
    let mut blocks: Vec<Live> = recording
        .segments
        .iter()
        .filter(|s| s.device == device)
        .flat_map(|seg| {
            seg.blocks
                .iter()
                .filter(|b| b.state.is_active())
                .map(move |b| (seg, b))
        })
        .map(|(seg, b)| Live {
            seg,
            address: b.address,
            size: b.size,
            requested: b.requested_size,
            state: b.state.name(),
            stack: sites.stack_of_block(device, b.address, b.stack),
        })
        .collect();
    blocks.sort_by_key(|b| (std::cmp::Reverse(b.size), b.address));
    blocks
}

/// Live bytes per allocation site, largest first: `(site, bytes, blocks)`.
fn by_site(blocks: &[Live], sites: &Sites) -> Vec<(Site, u64, usize)> {
    let mut totals: Vec<(Site, u64, usize)> = Vec::new();
    for b in blocks {
        let site = sites.site(b.stack);
        match totals.iter_mut().find(|(s, _, _)| *s == site) {
            Some(row) => {
                row.1 += b.size;
                row.2 += 1;
            }
            None => totals.push((site, b.size, 1)),
        }
    }
    totals.sort_by_key(|&(_, bytes, _)| std::cmp::Reverse(bytes));
    totals
}

/// "What holds my memory": the largest live blocks and the allocation sites by live
/// bytes, for one device.
fn holders_text(recording: &Recording, sites: &Sites, device: u16) -> String {
    let blocks = live_blocks(recording, sites, device);
    let mut out = String::new();
    if blocks.is_empty() {
        return out;
    }
    let live: u64 = blocks.iter().map(|b| b.size).sum();
    let _ = writeln!(
        out,
        "\nWhat holds the memory of cuda:{device}: {} in {} live blocks",
        format_size(live),
        blocks.len()
    );
    let _ = writeln!(out, "\nLargest live blocks:");
    let _ = writeln!(
        out,
        "{:>12} {:>12}  {:<19} {:<16} allocated at",
        "size", "requested", "state", "pool"
    );
    for b in blocks.iter().take(TOP_ROWS) {
        let _ = writeln!(
            out,
            "{:>12} {:>12}  {:<19} {:<16} {}",
            format_size(b.size),
            format_size(b.requested),
            b.state,
            pool_name(b.seg),
            sites.describe(sites.site(b.stack))
        );
    }
    let _ = writeln!(out, "\nAllocation sites by live bytes:");
    let _ = writeln!(out, "{:>12} {:>7} {:>7}  site", "bytes", "share", "blocks");
    for (site, bytes, n) in by_site(&blocks, sites).iter().take(TOP_ROWS) {
        let _ = writeln!(
            out,
            "{:>12} {:>6.1}% {:>7}  {}",
            format_size(*bytes),
            100.0 * *bytes as f64 / live.max(1) as f64,
            n,
            sites.describe(*site)
        );
    }
    let private: Vec<String> = recording
        .segments
        .iter()
        .filter(|s| s.device == device && s.pool != (0, 0))
        .map(pool_name)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !private.is_empty() {
        let _ = writeln!(
            out,
            "\nPrivate pools (CUDA graph captures or MemPools): {}",
            private.join(", ")
        );
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The memory timeline of one device as inline SVG, shifted so that its end matches the
/// snapshot's current state.
fn timeline_svg(line: &[(u64, i64, i64)], stats: &DeviceStats) -> String {
    let (w, h) = (900.0f64, 300.0f64);
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
    format!(
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
    )
}

/// A self-contained HTML page (inline SVG, no scripts, no links): requested and reserved
/// bytes over the trace of each device, the largest live blocks with their stacks on hover,
/// and the allocation sites by live bytes.
pub fn plot_html(recording: &Recording, title: &str) -> String {
    let mut html = format!(
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{t}</title><style>\
         body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}td.l{{text-align:left}}\
         tr[title]:hover{{background:#eef}}</style></head><body><h1>{t}</h1>",
        t = escape(title)
    );
    let sites = Sites::new(recording);
    for device in devices(recording) {
        let line = timeline(recording, usize::from(device));
        let stats = stats_from_recording(recording, device);
        let _ = write!(html, "<h2>cuda:{device}</h2>");
        if line.is_empty() {
            html += "<p>No history in this snapshot (record it with record_memory_history).</p>";
        } else {
            html += &timeline_svg(&line, &stats);
        }
        let blocks = live_blocks(recording, &sites, device);
        html += "<h3>Largest live blocks</h3><p>Hover over a row for the stack that \
                 allocated the block.</p><table><tr><th>address</th><th>size</th>\
                 <th>requested</th><th>state</th><th>pool</th><th>stream</th>\
                 <th>allocated at</th></tr>";
        for b in blocks.iter().take(2 * TOP_ROWS) {
            let _ = write!(
                html,
                "<tr title=\"{}\"><td>{:#x}</td><td>{}</td><td>{}</td><td class=\"l\">{}</td>\
                 <td class=\"l\">{}</td><td>{}</td><td class=\"l\">{}</td></tr>",
                escape(&sites.stack_text(b.stack)),
                b.address,
                escape(&format_size(b.size)),
                escape(&format_size(b.requested)),
                b.state,
                escape(&pool_name(b.seg)),
                b.seg.stream,
                escape(&sites.describe(sites.site(b.stack)))
            );
        }
        html += "</table><h3>Allocation sites by live bytes</h3><table><tr><th>bytes</th>\
                 <th>blocks</th><th class=\"l\">site</th></tr>";
        for (site, bytes, n) in by_site(&blocks, &sites).iter().take(TOP_ROWS) {
            let _ = write!(
                html,
                "<tr title=\"{}\"><td>{}</td><td>{n}</td><td class=\"l\">{}</td></tr>",
                escape(&sites.stack_text(site.example)),
                escape(&format_size(*bytes)),
                escape(&sites.describe(*site))
            );
        }
        html += "</table>";
    }
    html += "</body></html>\n";
    html
}
