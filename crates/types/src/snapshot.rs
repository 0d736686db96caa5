//! Memory snapshots with PyTorch's structure (allocator spec §7.2): the dictionary
//! `torch.cuda.memory._snapshot()` returns and `torch.cuda._memory_viz` reads. Field names
//! are PyTorch's; serialized with serde they become the same Python dicts and lists.
use serde::{Deserialize, Serialize};

/// One source location of an allocation or free.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    /// Source file.
    pub filename: String,
    /// Line in it.
    pub line: u32,
    /// Function name.
    pub name: String,
}

/// A block of a segment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotBlock {
    /// Address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for (allocated blocks; 0 otherwise).
    pub requested_size: u64,
    /// `active_allocated`, `active_pending_free` or `inactive`.
    pub state: String,
    /// Where it was allocated, when history recorded it.
    #[serde(default)]
    pub frames: Vec<Frame>,
}

/// A segment: a device allocation, or one contiguous mapped run of an expandable segment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotSegment {
    /// Device index.
    pub device: u16,
    /// Address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes of active blocks (allocated or waiting for events).
    pub active_size: u64,
    /// Requested bytes of active blocks.
    pub requested_size: u64,
    /// The stream (its raw handle).
    pub stream: u64,
    /// `small` or `large`.
    pub segment_type: String,
    /// The owning pool, `(0, 0)` for the default pools.
    pub segment_pool_id: (u64, u64),
    /// Part of an expandable segment.
    pub is_expandable: bool,
    /// Its physical pages are released: a segment of a sleepable pool that sleeps
    /// (ferrocuda's own key, written only when true, so snapshots of everything else are
    /// PyTorch's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub asleep: bool,
    /// Where the segment was allocated.
    #[serde(default)]
    pub frames: Vec<Frame>,
    /// Its blocks, by address.
    pub blocks: Vec<SnapshotBlock>,
}

/// One event of the history (`device_traces`). Written with PyTorch's keys in its order
/// (`CUDACachingAllocator.cpp`, `_memory_snapshot`): an `oom` entry has `device_free` where
/// the others have `addr`, and `frames` only where a context was recorded.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct TraceEntry {
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`,
    /// `segment_map`, `segment_unmap`, `snapshot` or `oom`.
    pub action: String,
    /// Address (for `oom`: 0, and not written).
    #[serde(default)]
    pub addr: u64,
    /// Bytes (requested bytes for `alloc` and frees; the rounded request for `oom`).
    pub size: u64,
    /// The stream (its raw handle).
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// Free device bytes (only on `oom` entries).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub device_free: Option<u64>,
    /// Always `"N/A"` (no compiler here).
    #[serde(default)]
    pub compile_context: String,
    /// User metadata (empty).
    #[serde(default)]
    pub user_metadata: String,
    /// Where it happened: `Some` when a context was recorded (then written, even empty).
    #[serde(default)]
    pub frames: Option<Vec<Frame>>,
}

impl Serialize for TraceEntry {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let oom = self.action == "oom";
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("action", &self.action)?;
        if oom {
            map.serialize_entry("device_free", &self.device_free.unwrap_or_default())?;
        } else {
            map.serialize_entry("addr", &self.addr)?;
        }
        map.serialize_entry("size", &self.size)?;
        map.serialize_entry("stream", &self.stream)?;
        map.serialize_entry("time_us", &self.time_us)?;
        map.serialize_entry("compile_context", &self.compile_context)?;
        map.serialize_entry("user_metadata", &self.user_metadata)?;
        if let Some(frames) = &self.frames {
            map.serialize_entry("frames", frames)?;
        }
        map.end()
    }
}

/// The key of a `roundup_power2_divisions` entry: an interval's lower bound in MiB,
/// written as a string (`"1"`, `"2"`, …) and ordered by number, as PyTorch writes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IntervalMib(pub u64);

impl Serialize for IntervalMib {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0.to_string())
    }
}

impl<'de> Deserialize<'de> for IntervalMib {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse()
            .map(IntervalMib)
            .map_err(|_| serde::de::Error::custom(format!("'{text}' is not a MiB bound")))
    }
}

/// `allocator_settings` of a snapshot, with PyTorch 2.11's keys in its order
/// (`CUDACachingAllocator.cpp`, `snapshot`; the recordings in `tests/data` have them).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AllocatorSettings {
    /// The settings string last parsed (`last_allocator_settings`): empty for the
    /// defaults.
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF")]
    pub conf: String,
    /// Bytes, or -1 when unlimited.
    pub max_split_size: i64,
    /// 0 when off.
    pub garbage_collection_threshold: f64,
    /// Whether expandable segments are on.
    pub expandable_segments: bool,
    /// `pinned_num_register_threads`.
    pub pinned_num_register_threads: u64,
    /// `release_lock_on_cudamalloc`.
    pub release_lock_on_cudamalloc: bool,
    /// `pinned_use_cuda_host_register`.
    pub pinned_use_cuda_host_register: bool,
    /// `graph_capture_record_stream_reuse`.
    pub graph_capture_record_stream_reuse: bool,
    /// Divisions per interval, keyed by the interval's lower bound in MiB (`"1"`, `"2"`, …).
    pub roundup_power2_divisions: std::collections::BTreeMap<IntervalMib, u64>,
}

/// A whole snapshot: what `torch.cuda.memory._snapshot()` returns.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Segments of every device, by address.
    #[serde(default)]
    pub segments: Vec<SnapshotSegment>,
    /// History per device index.
    #[serde(default)]
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// Settings in force.
    #[serde(default)]
    pub allocator_settings: AllocatorSettings,
    /// Record-function markers (PyTorch's; ferrocuda records none).
    #[serde(default)]
    pub external_annotations: Vec<ExternalAnnotation>,
}

/// A record-function marker of a PyTorch snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExternalAnnotation {
    /// The scope's name.
    pub name: String,
    /// `START` or `END`.
    pub stage: String,
    /// Device index.
    pub device: u16,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
}

impl Snapshot {
    /// The snapshot as a Python pickle, as `torch.cuda.memory._dump_snapshot` writes it:
    /// PyTorch's viewer (`torch.cuda._memory_viz`, pytorch.org/memory_viz) reads it.
    pub fn to_pickle(&self) -> Result<Vec<u8>, String> {
        serde_pickle::to_vec(self, serde_pickle::SerOptions::new()).map_err(|e| e.to_string())
    }

    /// Reads a pickled snapshot as [`Snapshot::to_pickle`] writes it (fields PyTorch adds
    /// are ignored). A snapshot PyTorch wrote shares its stack frames through the pickle's
    /// memo, which this decoder refuses; the `ferrocuda` command's reader
    /// (`ferrocuda_cli::trace::read_recording`) reads those.
    pub fn from_pickle(bytes: &[u8]) -> Result<Snapshot, String> {
        let options = serde_pickle::DeOptions::new().replace_unresolved_globals();
        serde_pickle::from_slice(bytes, options).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Snapshot {
        let frame = Frame {
            filename: "src/main.rs".into(),
            line: 7,
            name: "main".into(),
        };
        Snapshot {
            segments: vec![SnapshotSegment {
                device: 0,
                address: 1 << 44,
                total_size: 2 << 20,
                allocated_size: 512,
                active_size: 512,
                requested_size: 100,
                stream: 0,
                segment_type: "small".into(),
                segment_pool_id: (0, 0),
                is_expandable: false,
                asleep: false,
                frames: Vec::new(),
                blocks: vec![
                    SnapshotBlock {
                        address: 1 << 44,
                        size: 512,
                        requested_size: 100,
                        state: "active_allocated".into(),
                        frames: vec![frame.clone()],
                    },
                    SnapshotBlock {
                        address: (1 << 44) + 512,
                        size: (2 << 20) - 512,
                        requested_size: 0,
                        state: "inactive".into(),
                        frames: Vec::new(),
                    },
                ],
            }],
            device_traces: vec![vec![TraceEntry {
                action: "oom".into(),
                addr: 0,
                size: 1 << 30,
                stream: 0,
                time_us: 1,
                device_free: Some(5),
                compile_context: "N/A".into(),
                user_metadata: String::new(),
                frames: Some(vec![frame]),
            }]],
            allocator_settings: AllocatorSettings {
                conf: String::new(),
                max_split_size: -1,
                garbage_collection_threshold: 0.0,
                expandable_segments: false,
                pinned_num_register_threads: 1,
                release_lock_on_cudamalloc: false,
                pinned_use_cuda_host_register: false,
                graph_capture_record_stream_reuse: false,
                roundup_power2_divisions: [(IntervalMib(1), 0), (IntervalMib(16), 2)]
                    .into_iter()
                    .collect(),
            },
            external_annotations: Vec::new(),
        }
    }

    #[test]
    fn pickle_round_trip() {
        let s = sample();
        let bytes = s.to_pickle().unwrap_or_default();
        assert_eq!(Snapshot::from_pickle(&bytes).ok(), Some(s));
        assert!(Snapshot::from_pickle(b"not a pickle").is_err());
    }

    /// CPython's own unpickler reads the file as the dict PyTorch's viewer expects.
    #[test]
    fn python_reads_it_as_pytorch_does() {
        let path =
            std::env::temp_dir().join(format!("ferrocuda-snapshot-{}.pickle", std::process::id()));
        assert!(std::fs::write(&path, sample().to_pickle().unwrap_or_default()).is_ok());
        let script = "import pickle,sys\n\
            s = pickle.load(open(sys.argv[1], 'rb'))\n\
            seg = s['segments'][0]\n\
            assert seg['segment_pool_id'] == (0, 0), seg['segment_pool_id']\n\
            assert [b['state'] for b in seg['blocks']] == ['active_allocated', 'inactive']\n\
            assert sum(b['size'] for b in seg['blocks']) == seg['total_size']\n\
            e = s['device_traces'][0][0]\n\
            assert e['action'] == 'oom' and e['device_free'] == 5 and e['frames'][0]['name'] == 'main'\n\
            assert 'addr' not in e, e\n\
            assert list(s['allocator_settings']['roundup_power2_divisions']) == ['1', '16']\n\
            assert s['allocator_settings']['PYTORCH_CUDA_ALLOC_CONF'] == ''\n\
            print('ok')";
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&path)
            .output();
        let _ = std::fs::remove_file(&path);
        let out = out.map_err(|e| format!("python3 is needed for this test: {e}"));
        assert!(out.as_ref().is_ok_and(|o| o.status.success()), "{out:?}");
    }
}
