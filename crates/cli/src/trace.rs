//! Reading PyTorch memory snapshots (`torch.cuda.memory._snapshot()` pickled, optionally
//! `.xz` or `.gz` compressed) into a [`Recording`], and the allocation events a replay
//! needs from it.
use crate::input::{InputError, Limits};
use crate::recording::{Recording, TraceAction, TraceEvent};
use std::path::Path;

pub use crate::recording::MAX_SIZE;

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
    /// The file could not be opened or read.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The file is not a (compressed) pickle of a snapshot.
    #[error("{path} is not a PyTorch memory snapshot: {why}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
}

/// Reads a snapshot file (pickle, optionally `.xz` or `.gz` compressed): PyTorch's
/// `_dump_snapshot` output or ferrocuda's, with PyTorch's statistics if it carries them,
/// within the default [`Limits`].
pub fn read_recording(path: &Path) -> Result<Recording, TraceError> {
    read_recording_within(path, &Limits::DEFAULT)
}

/// Reads a snapshot file within `limits`.
pub fn read_recording_within(path: &Path, limits: &Limits) -> Result<Recording, TraceError> {
    let bad = |why: String| TraceError::Format {
        path: path.display().to_string(),
        why,
    };
    let input = crate::input::open(path, limits)?;
    let read = crate::unpickle::unpickle(std::io::BufReader::new(input), limits)
        .map_err(|e| bad(e.to_string()))?;
    crate::recording::from_heap(read.heap, read.top).map_err(bad)
}

/// The events of one device trace, as a replay sees them.
pub fn events(trace: &[TraceEvent]) -> Vec<Event> {
    trace
        .iter()
        .map(|e| Event {
            action: match e.action {
                TraceAction::Alloc => Action::Alloc,
                TraceAction::FreeCompleted => Action::FreeCompleted,
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
pub fn segment_addresses(trace: &[TraceEvent]) -> Vec<u64> {
    trace
        .iter()
        .filter(|e| e.action == TraceAction::SegmentAlloc)
        .map(|e| e.addr)
        .collect()
}

/// The device traces of a snapshot file: one event list per device.
pub fn read_device_traces(path: &Path) -> Result<Vec<Vec<Event>>, TraceError> {
    let recording = read_recording(path)?;
    Ok(recording.traces.iter().map(|t| events(t)).collect())
}
