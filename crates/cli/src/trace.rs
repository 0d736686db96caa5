//! Reading PyTorch memory snapshots (`torch.cuda.memory._snapshot()` pickled, optionally
//! `.xz` or `.gz` compressed) down to the allocation events a replay needs.
use ferrocuda_types::{
    AllocatorSettings, ExternalAnnotation, Snapshot, SnapshotSegment, TraceEntry,
};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// What a trace event does, as far as a replay cares.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A block of `size` requested bytes was handed out at `addr`.
    Alloc,
    /// The block at `addr` became reusable.
    FreeCompleted,
    /// Anything else (`free_requested`, PyTorch's own `segment_*`, `snapshot`, `oom`).
    Other,
}

/// One event of a device trace.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// What happened.
    pub action: Action,
    /// The block's address in the recording process.
    pub addr: u64,
    /// Bytes (requested bytes for `alloc`).
    pub size: u64,
    /// The stream, as the recording process numbered it (0 is the default stream).
    pub stream: u64,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a (compressed) pickle.
    #[error("{path} is not a PyTorch memory snapshot: {why}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
}

fn decompress(path: &Path, bytes: Vec<u8>) -> Result<Vec<u8>, String> {
    if bytes.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        let mut out = Vec::new();
        lzma_rs::xz_decompress(&mut bytes.as_slice(), &mut out)
            .map_err(|e| format!("bad xz data: {e}"))?;
        return Ok(out);
    }
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(bytes.as_slice())
            .read_to_end(&mut out)
            .map_err(|e| format!("bad gzip data: {e}"))?;
        return Ok(out);
    }
    let _ = path;
    Ok(bytes)
}

/// Sizes above this are refused (no device has a pebibyte), so sums of a snapshot's sizes
/// fit in the statistics' signed 64-bit counters.
pub const MAX_SIZE: u64 = 1 << 50;

/// A snapshot file as read: the snapshot, and PyTorch's own statistics when the recording
/// stored them beside it.
#[derive(Clone, Debug, PartialEq)]
pub struct Recording {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// `torch.cuda.memory_stats()` of the recording process (device 0), when the file has
    /// it under the key `memory_stats`.
    pub memory_stats: Option<BTreeMap<String, i64>>,
    /// Whether the file has `device_traces` (a snapshot taken without history has not).
    pub has_history: bool,
}

/// The keys of a snapshot dict ferrocuda reads; a file must have at least one of
/// `device_traces` and `segments`.
#[derive(Deserialize)]
#[serde(expecting = "a dict with the keys device_traces and segments")]
struct Envelope {
    segments: Option<Vec<SnapshotSegment>>,
    device_traces: Option<Vec<Vec<TraceEntry>>>,
    #[serde(default)]
    allocator_settings: AllocatorSettings,
    #[serde(default)]
    external_annotations: Vec<ExternalAnnotation>,
    #[serde(default)]
    memory_stats: Option<BTreeMap<String, i64>>,
}

/// Where in the snapshot a decoding error happened, in words: `event 3 of device 0
/// (device_traces[0][3]), field size`.
fn locate(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let index = |s: Option<&&Segment>| match s {
        Some(Segment::Seq { index }) => Some(*index),
        _ => None,
    };
    let field = |from: usize| {
        let rest: Vec<String> = segments[from.min(segments.len())..]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if rest.is_empty() {
            String::new()
        } else {
            format!(", field {}", rest.join("").trim_start_matches('.'))
        }
    };
    match segments.first() {
        Some(Segment::Map { key }) if key == "device_traces" => {
            match (index(segments.get(1)), index(segments.get(2))) {
                (Some(d), Some(e)) => format!("event {e} of device {d} ({path}){}", field(3)),
                _ => path.to_string(),
            }
        }
        Some(Segment::Map { key }) if key == "segments" => match index(segments.get(1)) {
            Some(i) => format!("segment {i} ({path}){}", field(2)),
            None => path.to_string(),
        },
        _ if segments.is_empty() => "the top level".into(),
        _ => path.to_string(),
    }
}

fn decode(raw: &[u8]) -> Result<Recording, String> {
    match crate::pickle::check_shape(raw).map_err(|e| e.to_string())? {
        crate::pickle::Top::Dict => {}
        crate::pickle::Top::Container => return Err("a pickled list or tuple, not a dict".into()),
        crate::pickle::Top::Scalar => return Err("a pickled scalar, not a dict".into()),
    }
    let options = serde_pickle::DeOptions::new().replace_unresolved_globals();
    let mut de = serde_pickle::Deserializer::new(raw, options);
    let envelope: Envelope = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let inner = e.inner().to_string();
        let why = if inner.contains("integer too large") {
            "an integer of 2^63 or more (pickle integers are read as signed 64-bit; \
             no address or size reaches 2^63)"
                .to_owned()
        } else {
            inner
        };
        format!("{}: {why}", locate(e.path()))
    })?;
    if envelope.segments.is_none() && envelope.device_traces.is_none() {
        return Err("a dict without device_traces and segments (the keys of \
                    torch.cuda.memory._snapshot())"
            .into());
    }
    let has_history = envelope.device_traces.is_some();
    let recording = Recording {
        snapshot: Snapshot {
            segments: envelope.segments.unwrap_or_default(),
            device_traces: envelope.device_traces.unwrap_or_default(),
            allocator_settings: envelope.allocator_settings,
            external_annotations: envelope.external_annotations,
        },
        memory_stats: envelope.memory_stats,
        has_history,
    };
    check_sizes(&recording.snapshot)?;
    Ok(recording)
}

/// Refuses sizes no device has, and segment totals that would overflow a statistic.
fn check_sizes(s: &Snapshot) -> Result<(), String> {
    let too_big = |what: String, v: u64| {
        Err(format!(
            "{what}: {v} bytes is more than any device has (at most 2^50)"
        ))
    };
    for (d, trace) in s.device_traces.iter().enumerate() {
        for (i, e) in trace.iter().enumerate() {
            if e.size > MAX_SIZE {
                return too_big(
                    format!("event {i} of device {d} (device_traces[{d}][{i}]), field size"),
                    e.size,
                );
            }
        }
    }
    let mut totals: BTreeMap<u16, u64> = BTreeMap::new();
    for (i, seg) in s.segments.iter().enumerate() {
        let sizes = [
            seg.total_size,
            seg.allocated_size,
            seg.active_size,
            seg.requested_size,
        ];
        let blocks = seg.blocks.iter().flat_map(|b| [b.size, b.requested_size]);
        if let Some(v) = sizes.into_iter().chain(blocks).find(|&v| v > MAX_SIZE) {
            return too_big(format!("segment {i} (segments[{i}])"), v);
        }
        let block_sum = seg
            .blocks
            .iter()
            .map(|b| b.size)
            .fold(0u64, u64::saturating_add);
        let total = totals.entry(seg.device).or_default();
        *total = total
            .saturating_add(seg.total_size)
            .saturating_add(block_sum);
        if *total > 1 << 60 {
            return Err(format!(
                "segments of device {}: more than 2^60 bytes in all",
                seg.device
            ));
        }
    }
    Ok(())
}

/// Reads a snapshot file (pickle, optionally `.xz` or `.gz` compressed): PyTorch's
/// `_dump_snapshot` output or ferrocuda's, with PyTorch's statistics if it carries them.
pub fn read_recording(path: &Path) -> Result<Recording, TraceError> {
    let name = path.display().to_string();
    let bad = |why: String| TraceError::Format {
        path: name.clone(),
        why,
    };
    let bytes = std::fs::read(path).map_err(|source| TraceError::Io {
        path: name.clone(),
        source,
    })?;
    let raw = decompress(path, bytes).map_err(&bad)?;
    decode(&raw).map_err(bad)
}

/// Reads a snapshot file (see [`read_recording`]).
pub fn read_snapshot(path: &Path) -> Result<Snapshot, TraceError> {
    Ok(read_recording(path)?.snapshot)
}

/// The events of one device trace, as a replay sees them.
pub fn events(trace: &[TraceEntry]) -> Vec<Event> {
    trace
        .iter()
        .map(|e| Event {
            action: match e.action.as_str() {
                "alloc" => Action::Alloc,
                "free_completed" => Action::FreeCompleted,
                _ => Action::Other,
            },
            addr: e.addr,
            size: e.size,
            stream: e.stream,
        })
        .collect()
}

/// The addresses of a device trace's `segment_alloc` events (the recording's `cudaMalloc`s),
/// in order: what `replay --addresses recorded` hands out.
pub fn segment_addresses(trace: &[TraceEntry]) -> Vec<u64> {
    trace
        .iter()
        .filter(|e| e.action == "segment_alloc")
        .map(|e| e.addr)
        .collect()
}

/// The device traces of a snapshot file: one event list per device.
pub fn read_device_traces(path: &Path) -> Result<Vec<Vec<Event>>, TraceError> {
    let snapshot = read_snapshot(path)?;
    Ok(snapshot.device_traces.iter().map(|t| events(t)).collect())
}
