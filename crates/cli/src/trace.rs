//! Reading PyTorch memory snapshots (`torch.cuda.memory._snapshot()` pickled, optionally
//! `.xz` or `.gz` compressed) down to the allocation events a replay needs.
use ferrocuda_types::Snapshot;
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

/// Reads a snapshot file (pickle, optionally `.xz` or `.gz` compressed): PyTorch's
/// `_dump_snapshot` output or ferrocuda's.
pub fn read_snapshot(path: &Path) -> Result<Snapshot, TraceError> {
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
    Snapshot::from_pickle(&raw).map_err(|e| bad(format!("not a pickled snapshot dict ({e})")))
}

/// The device traces of a snapshot file: one event list per device.
pub fn read_device_traces(path: &Path) -> Result<Vec<Vec<Event>>, TraceError> {
    let snapshot = read_snapshot(path)?;
    Ok(snapshot
        .device_traces
        .iter()
        .map(|trace| {
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
        })
        .collect())
}
