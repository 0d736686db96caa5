//! A snapshot as the command keeps it: the history as compact records (48 bytes an event),
//! the segments and blocks, and every stack once ([`Stacks`]: frames interned, each
//! distinct list of frames one stack, strings shared with the reader's table).
//!
//! Built from what [`crate::unpickle`] read by walking PyTorch's layout (the dict
//! `torch.cuda.memory._snapshot()` returns: `CUDACachingAllocator.cpp`, `snapshot`, and
//! `torch/csrc/cuda/memory_snapshot.cpp`, `_memory_snapshot_pickled`); keys it does not
//! know are skipped, so later PyTorch versions' additions read too. A field of the wrong type
//! is an error naming the event or segment and the field.
use crate::unpickle::heap::{Heap, Obj, ObjId, StrId, Value};
use ferrocuda_types::{AllocatorSettings, IntervalMib};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

/// Sizes above this are refused (no device has a pebibyte), so sums of a snapshot's sizes
/// fit in the statistics' signed 64-bit counters.
pub const MAX_SIZE: u64 = 1 << 50;

/// What a trace event records (`TraceEntry::Action` in `CUDACachingAllocator.h`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum TraceAction {
    /// `alloc`.
    Alloc,
    /// `free_requested`.
    FreeRequested,
    /// `free_completed`.
    FreeCompleted,
    /// `segment_alloc`.
    SegmentAlloc,
    /// `segment_free`.
    SegmentFree,
    /// `segment_map`.
    SegmentMap,
    /// `segment_unmap`.
    SegmentUnmap,
    /// `snapshot`.
    Snapshot,
    /// `oom`.
    Oom,
    /// Anything else.
    Other,
}

impl TraceAction {
    fn parse(name: &str) -> TraceAction {
        match name {
            "alloc" => TraceAction::Alloc,
            "free_requested" => TraceAction::FreeRequested,
            "free_completed" => TraceAction::FreeCompleted,
            "segment_alloc" => TraceAction::SegmentAlloc,
            "segment_free" => TraceAction::SegmentFree,
            "segment_map" => TraceAction::SegmentMap,
            "segment_unmap" => TraceAction::SegmentUnmap,
            "snapshot" => TraceAction::Snapshot,
            "oom" => TraceAction::Oom,
            _ => TraceAction::Other,
        }
    }
}

/// A stack of the snapshot ([`StackId::NONE`]: none recorded).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct StackId(pub u32);

impl StackId {
    /// No stack.
    pub const NONE: StackId = StackId(u32::MAX);
}

/// One event of a device's history.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// What happened.
    pub action: TraceAction,
    /// The block's or segment's address (for `oom`: the free device bytes).
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// The stream (its raw handle).
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// Where it happened.
    pub stack: StackId,
}

/// State of a block (`SegmentInfo`/`BlockInfo` in `CUDACachingAllocator.h`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// `active_allocated`.
    ActiveAllocated,
    /// `active_pending_free`.
    ActivePendingFree,
    /// `inactive`.
    Inactive,
}

impl BlockState {
    /// Allocated or waiting for its events.
    pub fn is_active(self) -> bool {
        self != BlockState::Inactive
    }

    /// PyTorch's name.
    pub fn name(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// A block of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for.
    pub requested_size: u64,
    /// State.
    pub state: BlockState,
    /// Where it was allocated, when recorded.
    pub stack: StackId,
}

/// A segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Device index.
    pub device: u16,
    /// Address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes of active blocks.
    pub active_size: u64,
    /// Requested bytes of active blocks.
    pub requested_size: u64,
    /// The stream (its raw handle).
    pub stream: u64,
    /// In the small pool (`segment_type` `small`).
    pub small: bool,
    /// The owning pool: `(0, 0)` for the default pools, else a private pool (a CUDA graph's
    /// or a `MemPool`'s).
    pub pool: (u64, u64),
    /// Part of an expandable segment.
    pub is_expandable: bool,
    /// Where it was allocated, when recorded.
    pub stack: StackId,
    /// Its blocks, by address.
    pub blocks: Vec<Block>,
}

/// One frame of a stack.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Function name.
    pub name: StrId,
    /// Source file.
    pub filename: StrId,
    /// Line (0 where unknown).
    pub line: i64,
}

/// Every stack of a snapshot, each once.
#[derive(Debug, Default)]
pub struct Stacks {
    strings: Vec<Box<str>>,
    frames: Vec<Frame>,
    stacks: Vec<Vec<u32>>,
}

impl Stacks {
    /// The frames of a stack, innermost first (none for [`StackId::NONE`]).
    pub fn frames(&self, id: StackId) -> impl Iterator<Item = &Frame> {
        self.stacks
            .get(id.0 as usize)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .filter_map(|&f| self.frames.get(f as usize))
    }

    /// A string of a frame.
    pub fn text(&self, id: StrId) -> &str {
        self.strings.get(id.0 as usize).map_or("", |s| s)
    }

    /// How many distinct stacks.
    pub fn len(&self) -> usize {
        self.stacks.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty()
    }
}

/// A snapshot file as read.
#[derive(Debug)]
pub struct Recording {
    /// The history of each device (`device_traces`), by device index.
    pub traces: Vec<Vec<TraceEvent>>,
    /// Segments of every device.
    pub segments: Vec<Segment>,
    /// The stacks events, segments and blocks refer to.
    pub stacks: Stacks,
    /// The settings in force.
    pub allocator_settings: AllocatorSettings,
    /// `torch.cuda.memory_stats()` of the recording process (device 0), when the file
    /// stores it under the key `memory_stats`.
    pub memory_stats: Option<BTreeMap<String, i64>>,
    /// Whether the file has `device_traces` (a snapshot taken without history has not).
    pub has_history: bool,
}

/// Where a value is, for errors: `event 3 of device 0 (device_traces[0][3])`.
#[derive(Clone, Debug)]
enum Place {
    Key(String),
    Event { device: usize, index: usize },
    Segment(usize),
    Block { segment: usize, index: usize },
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Key(k) => write!(f, "{k}"),
            Place::Event { device, index } => {
                write!(
                    f,
                    "event {index} of device {device} (device_traces[{device}][{index}])"
                )
            }
            Place::Segment(i) => write!(f, "segment {i} (segments[{i}])"),
            Place::Block { segment, index } => write!(
                f,
                "block {index} of segment {segment} (segments[{segment}].blocks[{index}])"
            ),
        }
    }
}

fn kind(heap: &Heap, v: Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) | Value::BigInt => "an integer",
        Value::Float(_) => "a float",
        Value::Str(_) => "a string",
        Value::Bytes(_) => "bytes",
        Value::Opaque => "an object",
        Value::Obj(id) => match heap.get(id) {
            Some(Obj::List(_)) => "a list",
            Some(Obj::Tuple(_)) => "a tuple",
            Some(Obj::Dict(_)) | Some(Obj::Event(_)) => "a dict",
            Some(Obj::Set(_)) => "a set",
            None => "nothing",
        },
    }
}

/// The walk from the heap to a [`Recording`].
struct Reader<'h> {
    heap: &'h Heap,
    stack_of_list: FxHashMap<ObjId, StackId>,
    frame_ids: FxHashMap<Frame, u32>,
    frames: Vec<Frame>,
    stacks: Vec<Vec<u32>>,
    /// The containers the walk is inside: meeting one again is a recursive structure.
    inside: Vec<ObjId>,
}

impl<'h> Reader<'h> {
    /// A key of a dict (keys are short strings, shared by content: a key the pickle does
    /// not have is in no dict of it).
    fn field(&self, dict: ObjId, name: &'static str) -> Option<Value> {
        let key = self.heap.find_short(name)?;
        self.heap.lookup(dict, key)
    }

    /// Refuses a container the walk is already inside.
    fn not_inside(&self, v: Value, at: &Place) -> Result<(), String> {
        match v {
            Value::Obj(id) if self.inside.contains(&id) => Err(format!(
                "{at}: a recursive structure (a container that holds itself)"
            )),
            _ => Ok(()),
        }
    }

    fn dict(&self, v: Value, at: &Place) -> Result<ObjId, String> {
        self.not_inside(v, at)?;
        match v {
            Value::Obj(id) if matches!(self.heap.get(id), Some(Obj::Dict(_) | Obj::Event(_))) => {
                Ok(id)
            }
            other => Err(format!(
                "{at}: expected a dict, found {}",
                kind(self.heap, other)
            )),
        }
    }

    fn list(&self, v: Value, at: &Place, field: &str) -> Result<&'h [Value], String> {
        self.not_inside(v, at)?;
        let heap = self.heap;
        if let Value::Obj(id) = v
            && let Some(Obj::List(items) | Obj::Tuple(items)) = heap.get(id)
        {
            return Ok(items);
        }
        Err(format!(
            "{at}{}: expected a list, found {}",
            field_suffix(field),
            kind(heap, v)
        ))
    }

    fn required(&self, dict: ObjId, name: &'static str, at: &Place) -> Result<Value, String> {
        self.field(dict, name)
            .ok_or_else(|| format!("{at}: missing field {name}"))
    }

    fn uint(&self, v: Value, at: &Place, name: &str) -> Result<u64, String> {
        match v {
            Value::Int(i) => u64::try_from(i).map_err(|_| {
                format!("{at}, field {name}: expected a non-negative integer, found {i}")
            }),
            Value::Bool(b) => Ok(u64::from(b)),
            Value::BigInt => Err(format!(
                "{at}, field {name}: an integer of 2^63 or more (no address or size reaches 2^63)"
            )),
            other => Err(format!(
                "{at}, field {name}: expected an integer, found {}",
                kind(self.heap, other)
            )),
        }
    }

    fn size(&self, v: Value, at: &Place, name: &str) -> Result<u64, String> {
        let bytes = self.uint(v, at, name)?;
        if bytes > MAX_SIZE {
            return Err(format!(
                "{at}, field {name}: {bytes} bytes is more than any device has (at most 2^50)"
            ));
        }
        Ok(bytes)
    }

    fn text(&self, v: Value, at: &Place, name: &str) -> Result<&'h str, String> {
        let heap = self.heap;
        match v {
            Value::Str(s) | Value::Bytes(s) => Ok(heap.text(s)),
            other => Err(format!(
                "{at}, field {name}: expected a string, found {}",
                kind(heap, other)
            )),
        }
    }

    /// The stack a `frames` value names: one per distinct list object, frames interned.
    fn stack(&mut self, frames: Option<Value>, at: &Place) -> Result<StackId, String> {
        let Some(v) = frames else {
            return Ok(StackId::NONE);
        };
        let Value::Obj(list_id) = v else {
            return Err(format!(
                "{at}, field frames: expected a list, found {}",
                kind(self.heap, v)
            ));
        };
        if let Some(&id) = self.stack_of_list.get(&list_id) {
            return Ok(id);
        }
        let items = self.list(v, at, "frames")?;
        self.inside.push(list_id);
        let frames = self.frame_list(items, at);
        self.inside.pop();
        let id = StackId(self.stacks.len() as u32);
        self.stacks.push(frames?);
        self.stack_of_list.insert(list_id, id);
        Ok(id)
    }

    fn frame_list(&mut self, items: &[Value], at: &Place) -> Result<Vec<u32>, String> {
        let mut frames = Vec::with_capacity(items.len());
        for (i, &item) in items.iter().enumerate() {
            let here = Place::Key(format!("{at}, frame {i}"));
            let dict = self.dict(item, &here)?;
            let name = self.required(dict, "name", &here)?;
            let filename = self.required(dict, "filename", &here)?;
            let line = self.required(dict, "line", &here)?;
            let frame = Frame {
                name: str_id(name).ok_or_else(|| format!("{here}, field name: not a string"))?,
                filename: str_id(filename)
                    .ok_or_else(|| format!("{here}, field filename: not a string"))?,
                line: match line {
                    Value::Int(l) => l,
                    _ => return Err(format!("{here}, field line: not an integer")),
                },
            };
            let next = self.frames.len() as u32;
            let id = *self.frame_ids.entry(frame).or_insert(next);
            if id == next {
                self.frames.push(frame);
            }
            frames.push(id);
        }
        Ok(frames)
    }

    fn event(&mut self, v: Value, at: &Place) -> Result<TraceEvent, String> {
        let dict = self.dict(v, at)?;
        let action = self.required(dict, "action", at)?;
        let action = TraceAction::parse(self.text(action, at, "action")?);
        let addr = match (self.field(dict, "addr"), self.field(dict, "device_free")) {
            (Some(a), _) => self.uint(a, at, "addr")?,
            (None, Some(free)) => self.uint(free, at, "device_free")?,
            (None, None) => 0,
        };
        let size = self.required(dict, "size", at)?;
        let stream = self.required(dict, "stream", at)?;
        let time_us = self.required(dict, "time_us", at)?;
        let frames = self.field(dict, "frames");
        Ok(TraceEvent {
            action,
            addr,
            size: self.size(size, at, "size")?,
            stream: self.uint(stream, at, "stream")?,
            time_us: self.uint(time_us, at, "time_us")?,
            stack: self.stack(frames, at)?,
        })
    }

    fn block(&mut self, v: Value, at: &Place) -> Result<Block, String> {
        let dict = self.dict(v, at)?;
        let address = self.required(dict, "address", at)?;
        let size = self.required(dict, "size", at)?;
        let requested = self.required(dict, "requested_size", at)?;
        let state = self.required(dict, "state", at)?;
        let state = match self.text(state, at, "state")? {
            "active_allocated" => BlockState::ActiveAllocated,
            "active_pending_free" => BlockState::ActivePendingFree,
            "inactive" => BlockState::Inactive,
            other => return Err(format!("{at}, field state: unknown state {other:?}")),
        };
        let frames = self.field(dict, "frames");
        Ok(Block {
            address: self.uint(address, at, "address")?,
            size: self.size(size, at, "size")?,
            requested_size: self.size(requested, at, "requested_size")?,
            state,
            stack: self.stack(frames, at)?,
        })
    }

    fn segment(&mut self, v: Value, index: usize) -> Result<Segment, String> {
        let at = Place::Segment(index);
        let dict = self.dict(v, &at)?;
        self.inside.push(dict);
        let segment = self.segment_fields(dict, index);
        self.inside.pop();
        segment
    }

    fn segment_fields(&mut self, dict: ObjId, index: usize) -> Result<Segment, String> {
        let at = Place::Segment(index);
        let num = |r: &mut Self, name: &'static str| -> Result<u64, String> {
            let v = r.required(dict, name, &at)?;
            match name {
                "address" | "stream" => r.uint(v, &at, name),
                _ => r.size(v, &at, name),
            }
        };
        let address = num(self, "address")?;
        let total_size = num(self, "total_size")?;
        let allocated_size = num(self, "allocated_size")?;
        let active_size = num(self, "active_size")?;
        let requested_size = num(self, "requested_size")?;
        let stream = num(self, "stream")?;
        let device = self.required(dict, "device", &at)?;
        let device = u16::try_from(self.uint(device, &at, "device")?)
            .map_err(|_| format!("{at}, field device: not a device index"))?;
        let segment_type = self.required(dict, "segment_type", &at)?;
        let small = self.text(segment_type, &at, "segment_type")? == "small";
        let pool = self.required(dict, "segment_pool_id", &at)?;
        let pool = match self.list(pool, &at, "segment_pool_id")? {
            &[a, b] => (
                self.uint(a, &at, "segment_pool_id")?,
                self.uint(b, &at, "segment_pool_id")?,
            ),
            _ => {
                return Err(format!(
                    "{at}, field segment_pool_id: expected two integers"
                ));
            }
        };
        let is_expandable = match self.required(dict, "is_expandable", &at)? {
            Value::Bool(b) => b,
            other => {
                return Err(format!(
                    "{at}, field is_expandable: expected a bool, found {}",
                    kind(self.heap, other)
                ));
            }
        };
        let frames = self.field(dict, "frames");
        let stack = self.stack(frames, &at)?;
        let blocks_value = self.required(dict, "blocks", &at)?;
        let mut blocks = Vec::new();
        for (i, &b) in self.list(blocks_value, &at, "blocks")?.iter().enumerate() {
            blocks.push(self.block(
                b,
                &Place::Block {
                    segment: index,
                    index: i,
                },
            )?);
        }
        Ok(Segment {
            device,
            address,
            total_size,
            allocated_size,
            active_size,
            requested_size,
            stream,
            small,
            pool,
            is_expandable,
            stack,
            blocks,
        })
    }

    fn settings(&mut self, v: Value) -> Result<AllocatorSettings, String> {
        let at = Place::Key("allocator_settings".into());
        let dict = self.dict(v, &at)?;
        let mut s = AllocatorSettings::default();
        for (k, v) in self.heap.pairs(dict) {
            let Value::Str(k) = k else { continue };
            let name = self.heap.text(k);
            let int = |v: Value| match v {
                Value::Int(i) => Ok(i),
                Value::Bool(b) => Ok(i64::from(b)),
                other => Err(format!(
                    "{at}, field {name}: expected an integer, found {}",
                    kind(self.heap, other)
                )),
            };
            let flag = |v: Value| match v {
                Value::Bool(b) => Ok(b),
                Value::Int(i) => Ok(i != 0),
                other => Err(format!(
                    "{at}, field {name}: expected a bool, found {}",
                    kind(self.heap, other)
                )),
            };
            match name {
                "PYTORCH_CUDA_ALLOC_CONF" => s.conf = self.text(v, &at, name)?.to_owned(),
                "max_split_size" => s.max_split_size = int(v)?,
                "garbage_collection_threshold" => {
                    s.garbage_collection_threshold = match v {
                        Value::Float(f) => f,
                        other => int(other)? as f64,
                    }
                }
                "expandable_segments" => s.expandable_segments = flag(v)?,
                "pinned_num_register_threads" => {
                    s.pinned_num_register_threads = u64::try_from(int(v)?).unwrap_or(0)
                }
                "release_lock_on_cudamalloc" => s.release_lock_on_cudamalloc = flag(v)?,
                "pinned_use_cuda_host_register" => s.pinned_use_cuda_host_register = flag(v)?,
                "graph_capture_record_stream_reuse" => {
                    s.graph_capture_record_stream_reuse = flag(v)?
                }
                "roundup_power2_divisions" => {
                    let divisions = self.dict(v, &at)?;
                    for (k, v) in self.heap.pairs(divisions) {
                        let bound = match k {
                            Value::Str(t) => self.heap.text(t).parse().ok(),
                            Value::Int(i) => u64::try_from(i).ok(),
                            _ => None,
                        };
                        let (Some(bound), Value::Int(d)) = (bound, v) else {
                            return Err(format!(
                                "{at}, field roundup_power2_divisions: expected MiB bounds and counts"
                            ));
                        };
                        s.roundup_power2_divisions
                            .insert(IntervalMib(bound), u64::try_from(d).unwrap_or(0));
                    }
                }
                _ => {}
            }
        }
        Ok(s)
    }

    fn memory_stats(&self, v: Value) -> Result<BTreeMap<String, i64>, String> {
        let at = Place::Key("memory_stats".into());
        let dict = self.dict(v, &at)?;
        let mut out = BTreeMap::new();
        for (k, v) in self.heap.pairs(dict) {
            let (Value::Str(k), Value::Int(v)) = (k, v) else {
                continue;
            };
            out.insert(self.heap.text(k).to_owned(), v);
        }
        Ok(out)
    }
}

fn field_suffix(field: &str) -> String {
    if field.is_empty() {
        String::new()
    } else {
        format!(", field {field}")
    }
}

fn str_id(v: Value) -> Option<StrId> {
    match v {
        Value::Str(s) | Value::Bytes(s) => Some(s),
        _ => None,
    }
}

/// Walks what the reader built into a [`Recording`], then keeps the strings the stacks
/// need (the reader's table, whole).
pub fn from_heap(heap: Heap, top: Value) -> Result<Recording, String> {
    let mut r = Reader {
        heap: &heap,
        stack_of_list: FxHashMap::default(),
        frame_ids: FxHashMap::default(),
        frames: Vec::new(),
        stacks: Vec::new(),
        inside: Vec::new(),
    };
    let root = match top {
        Value::Obj(id) => match heap.get(id) {
            Some(Obj::Dict(_) | Obj::Event(_)) => id,
            _ => return Err("a pickled list, tuple or set, not a dict".into()),
        },
        _ => return Err("a pickled scalar, not a dict".into()),
    };
    r.inside.push(root);
    let segments_value = r.field(root, "segments");
    let traces_value = r.field(root, "device_traces");
    if segments_value.is_none() && traces_value.is_none() {
        return Err("a dict without device_traces and segments (the keys of \
                    torch.cuda.memory._snapshot())"
            .into());
    }
    let mut traces = Vec::new();
    if let Some(v) = traces_value {
        let at = Place::Key("device_traces".into());
        let devices = r.list(v, &at, "")?;
        if let Value::Obj(id) = v {
            r.inside.push(id);
        }
        for (device, &t) in devices.iter().enumerate() {
            let at = Place::Key(format!("device_traces[{device}]"));
            let events = r.list(t, &at, "")?;
            let mut out = Vec::with_capacity(events.len());
            for (index, &e) in events.iter().enumerate() {
                out.push(r.event(e, &Place::Event { device, index })?);
            }
            traces.push(out);
        }
        r.inside.truncate(1);
    }
    let mut segments = Vec::new();
    if let Some(v) = segments_value {
        for (i, &s) in r
            .list(v, &Place::Key("segments".into()), "")?
            .iter()
            .enumerate()
        {
            segments.push(r.segment(s, i)?);
        }
    }
    check_totals(&segments)?;
    let allocator_settings = match r.field(root, "allocator_settings") {
        Some(v) => r.settings(v)?,
        None => AllocatorSettings::default(),
    };
    let memory_stats = match r.field(root, "memory_stats") {
        Some(Value::None) | None => None,
        Some(v) => Some(r.memory_stats(v)?),
    };
    let (frames, stacks) = (r.frames, r.stacks);
    Ok(Recording {
        has_history: traces_value.is_some(),
        traces,
        segments,
        stacks: Stacks {
            strings: heap.into_strings(),
            frames,
            stacks,
        },
        allocator_settings,
        memory_stats,
    })
}

/// Refuses segment totals that would overflow a statistic.
fn check_totals(segments: &[Segment]) -> Result<(), String> {
    let mut totals: BTreeMap<u16, u64> = BTreeMap::new();
    for seg in segments {
        let blocks = seg
            .blocks
            .iter()
            .map(|b| b.size)
            .fold(0u64, u64::saturating_add);
        let total = totals.entry(seg.device).or_default();
        *total = total.saturating_add(seg.total_size).saturating_add(blocks);
        if *total > 1 << 60 {
            return Err(format!(
                "segments of device {}: more than 2^60 bytes in all",
                seg.device
            ));
        }
    }
    Ok(())
}
