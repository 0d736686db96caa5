//! PyTorch's own figures for a recording, shown beside a replay's so that "equals PyTorch"
//! can be read off the table: the recording's `memory_stats` (when the snapshot file stores
//! `torch.cuda.memory_stats()` under that key), a sidecar `pytorch-figures.json` beside the
//! trace (rows of `model`, `conf` and the figures, as in the workspace's `tests/data`), or
//! else what the snapshot's own history and segments imply.
use crate::recording::Recording;
use ferrocuda_types::AllocatorConfig;
use std::collections::BTreeMap;
use std::path::Path;

/// PyTorch's figures for one configuration (each as PyTorch reported it, when it did).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PytorchFigures {
    /// `requested_bytes.all.peak`.
    pub peak_requested: Option<u64>,
    /// `allocated_bytes.all.peak`.
    pub peak_allocated: Option<u64>,
    /// `reserved_bytes.all.peak`.
    pub peak_reserved: Option<u64>,
    /// `num_device_alloc`.
    pub num_device_alloc: Option<u64>,
    /// `num_device_free`.
    pub num_device_free: Option<u64>,
}

/// PyTorch's figures for the configurations it ran, and where they came from.
#[derive(Clone, Debug, Default)]
pub struct Reference {
    /// Where the figures came from (for the note under the table).
    pub source: String,
    rows: Vec<(AllocatorConfig, PytorchFigures)>,
}

impl Reference {
    /// PyTorch's figures for `config`, if it ran that configuration (compared as parsed,
    /// so `""`, `default` and an equivalent spelling match).
    pub fn figures(&self, config: &AllocatorConfig) -> Option<&PytorchFigures> {
        self.rows.iter().find(|(c, _)| c == config).map(|(_, f)| f)
    }
}

fn from_stats(stats: &BTreeMap<String, i64>) -> PytorchFigures {
    let get = |k: &str| stats.get(k).and_then(|&v| u64::try_from(v).ok());
    PytorchFigures {
        peak_requested: get("requested_bytes.all.peak"),
        peak_allocated: get("allocated_bytes.all.peak"),
        peak_reserved: get("reserved_bytes.all.peak"),
        num_device_alloc: get("num_device_alloc"),
        num_device_free: get("num_device_free"),
    }
}

/// The recording's own statistics (device 0, under the configuration the snapshot's
/// `allocator_settings` names).
pub fn from_recording(recording: &Recording) -> Option<Reference> {
    let stats = recording.memory_stats.as_ref()?;
    let config = AllocatorConfig::parse(&recording.allocator_settings.conf).ok()?;
    Some(Reference {
        source: "the recording's memory_stats".into(),
        rows: vec![(config, from_stats(stats))],
    })
}

/// The rows of a sidecar JSON file for `model`; `None` when the file is absent, has no such
/// rows, or is not such a file (a sidecar is optional; a bad one is ignored, with a note).
pub fn from_sidecar(file: &Path, model: &str) -> Result<Option<Reference>, String> {
    let Ok(text) = std::fs::read_to_string(file) else {
        return Ok(None);
    };
    let all: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    let Some(rows) = all.as_array() else {
        return Err(format!("{}: not an array of rows", file.display()));
    };
    let u = |row: &serde_json::Value, k: &str| row.get(k).and_then(serde_json::Value::as_u64);
    let rows: Vec<_> = rows
        .iter()
        .filter(|r| r.get("model").and_then(|m| m.as_str()) == Some(model))
        .filter_map(|r| {
            let conf = r.get("conf")?.as_str()?;
            let conf = if conf == "default" { "" } else { conf };
            let figures = PytorchFigures {
                peak_requested: u(r, "peak_requested"),
                peak_allocated: u(r, "peak_allocated"),
                peak_reserved: u(r, "peak_reserved"),
                num_device_alloc: u(r, "num_device_alloc"),
                num_device_free: u(r, "num_device_free"),
            };
            Some((AllocatorConfig::parse(conf).ok()?, figures))
        })
        .collect();
    Ok((!rows.is_empty()).then(|| Reference {
        source: format!("{} (model {model})", file.display()),
        rows,
    }))
}

/// PyTorch's figures for the trace at `trace`: `sidecar` if given, else the recording's
/// own statistics, else `pytorch-figures.json` beside the trace (rows for the trace's
/// file name up to its first dot).
pub fn find(
    trace: &Path,
    recording: &Recording,
    sidecar: Option<&Path>,
) -> Result<Option<Reference>, String> {
    let model = trace
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.split('.').next())
        .unwrap_or_default();
    if let Some(file) = sidecar {
        return match from_sidecar(file, model)? {
            Some(r) => Ok(Some(r)),
            None => Err(format!(
                "--pytorch-figures {}: no rows for model {model:?}",
                file.display()
            )),
        };
    }
    if let Some(r) = from_recording(recording) {
        return Ok(Some(r));
    }
    let beside = trace.with_file_name("pytorch-figures.json");
    // A malformed file that was not asked for is not fatal.
    Ok(from_sidecar(&beside, model)
        .ok()
        .flatten()
        .or_else(|| from_snapshot(recording)))
}

/// What the snapshot itself says of device 0, when it carries no `memory_stats`: the peaks
/// of requested and reserved bytes its history implies (lifted to its segments at the end,
/// so a history that starts mid-run still gives a lower bound) and the device allocations
/// and frees it recorded, under the configuration its `allocator_settings` names.
pub fn from_snapshot(recording: &Recording) -> Option<Reference> {
    if recording.traces.first().is_none_or(Vec::is_empty) {
        return None;
    }
    let config = AllocatorConfig::parse(&recording.allocator_settings.conf).ok()?;
    let stats = crate::report::stats_from_recording(recording, 0);
    let count = |v: i64| u64::try_from(v).ok();
    Some(Reference {
        source: "the snapshot's own history and segments (it has no memory_stats): peaks \
                 its history implies, allocated bytes unknown"
            .into(),
        rows: vec![(
            config,
            PytorchFigures {
                peak_requested: count(stats.requested_bytes.all.peak),
                peak_allocated: None,
                peak_reserved: count(stats.reserved_bytes.all.peak),
                num_device_alloc: count(stats.num_device_alloc),
                num_device_free: count(stats.num_device_free),
            },
        )],
    })
}
