//! Reading PyTorch memory snapshots (`torch.cuda.memory._snapshot()` pickled, optionally
//! `.xz` or `.gz` compressed) down to the allocation events a replay needs.
use serde_pickle::{HashableValue, Value};
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

fn key<'a>(
    dict: &'a std::collections::BTreeMap<HashableValue, Value>,
    name: &str,
) -> Option<&'a Value> {
    dict.get(&HashableValue::String(name.to_owned()))
}

fn int(v: Option<&Value>) -> Option<u64> {
    match v? {
        Value::I64(i) => u64::try_from(*i).ok(),
        Value::Int(b) => u64::try_from(b.clone()).ok(),
        _ => None,
    }
}

/// The device traces of a snapshot file: one event list per device.
pub fn read_device_traces(path: &Path) -> Result<Vec<Vec<Event>>, TraceError> {
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
    let value = serde_pickle::value_from_slice(
        &raw,
        serde_pickle::DeOptions::new().replace_unresolved_globals(),
    )
    .map_err(|e| bad(format!("not a pickle ({e})")))?;
    let Value::Dict(top) = value else {
        return Err(bad("the pickle is not a dict".into()));
    };
    let Some(Value::List(devices)) = key(&top, "device_traces") else {
        return Err(bad(
            "no 'device_traces' list (record with torch.cuda.memory._record_memory_history)".into(),
        ));
    };
    devices
        .iter()
        .enumerate()
        .map(|(d, trace)| {
            let Value::List(events) = trace else {
                return Err(bad(format!("device_traces[{d}] is not a list")));
            };
            events
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let Value::Dict(e) = e else {
                        return Err(bad(format!("device_traces[{d}][{i}] is not a dict")));
                    };
                    let action = match key(e, "action") {
                        Some(Value::String(a)) if a == "alloc" => Action::Alloc,
                        Some(Value::String(a)) if a == "free_completed" => Action::FreeCompleted,
                        Some(Value::String(_)) => Action::Other,
                        _ => return Err(bad(format!("device_traces[{d}][{i}] has no 'action'"))),
                    };
                    let field = |f: &str| {
                        int(key(e, f)).ok_or_else(|| {
                            bad(format!("device_traces[{d}][{i}] has no integer '{f}'"))
                        })
                    };
                    Ok(Event {
                        action,
                        addr: field("addr")?,
                        size: field("size")?,
                        stream: field("stream")?,
                    })
                })
                .collect()
        })
        .collect()
}
