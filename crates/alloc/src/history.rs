//! Allocation history (`torch.cuda.memory._record_memory_history`): a ring buffer of trace
//! entries, and Rust backtraces as frames.
//!
//! A stack is cut after its last frame of allocation plumbing, so that it starts at the
//! caller. This crate knows its own plumbing (its frames and the backtrace crate's); which
//! frames of the layers above are plumbing is theirs to say, in
//! [`HistoryOptions::skip_frames`] (the facade's `record_memory_history` names the stream
//! layer's buffer and memory-resource modules and its own).
use ferrocuda_types::{Frame, TraceEntry};
use parking_lot::RwLock;
use std::collections::VecDeque;
use std::sync::{Arc, LazyLock};

/// What is recorded (`enabled=`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum HistoryMode {
    /// Nothing (`None`).
    #[default]
    Off,
    /// Only what live allocations need (`"state"`): the trace keeps one entry.
    State,
    /// A ring buffer of every event (`"all"`).
    All,
}

/// Which stacks are kept (`context=`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum HistoryContext {
    /// None (`None`).
    #[default]
    Never,
    /// Allocation stacks of live blocks (`"state"`).
    State,
    /// Also on `alloc` trace entries (`"alloc"`).
    Alloc,
    /// Also free stacks (`"all"`).
    All,
}

/// Frames of allocation plumbing, cut from the top of a recorded stack.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SkipFrames {
    /// Function-name prefixes, e.g. `"my_crate::buffers::"`; the `<` that opens a trait
    /// method's name (`<my_crate::buffers::Pool as Trait>::allocate`) is ignored.
    pub names: Vec<String>,
    /// Fragments of source paths, e.g. `"/my_crate/src/buffers.rs"`: inlined frames of
    /// optimised builds carry bare names, so their file decides.
    pub files: Vec<String>,
}

impl SkipFrames {
    /// Frames whose names start with one of `names` or whose files contain one of `files`.
    pub fn new(names: &[&str], files: &[&str]) -> SkipFrames {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        SkipFrames {
            names: strings(names),
            files: strings(files),
        }
    }

    /// This crate's own frames and the backtrace crate's, always skipped.
    fn own() -> SkipFrames {
        SkipFrames::new(
            &["backtrace::", "ferrocuda_alloc::"],
            &["/backtrace-0.", "/crates/alloc/src/", "/ferrocuda-alloc-"],
        )
    }

    fn matches(&self, frame: &Frame) -> bool {
        let name = frame.name.trim_start_matches('<');
        let file = frame.filename.replace('\\', "/");
        self.names.iter().any(|p| name.starts_with(p.as_str()))
            || self.files.iter().any(|p| file.contains(p.as_str()))
    }

    /// Adds `other`'s entries that are not here yet.
    fn merge(&mut self, other: &SkipFrames) {
        for (mine, theirs) in [
            (&mut self.names, &other.names),
            (&mut self.files, &other.files),
        ] {
            for p in theirs {
                if !mine.contains(p) {
                    mine.push(p.clone());
                }
            }
        }
    }

    /// Where the caller's part of `frames` (innermost first) starts: after the last
    /// plumbing frame (std glue between plumbing frames goes with them).
    fn caller_start(&self, frames: &[Frame]) -> usize {
        frames
            .iter()
            .rposition(|f| self.matches(f))
            .map_or(0, |i| i + 1)
    }
}

/// How history is recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryOptions {
    /// `enabled=`.
    pub mode: HistoryMode,
    /// `context=`.
    pub context: HistoryContext,
    /// Entries kept in the ring buffer (`max_entries=`).
    pub max_entries: usize,
    /// Plumbing frames of the layers above, skipped with this crate's own when a stack is
    /// recorded (none by default). They name code, not memory, so they are merged into one
    /// process-wide set that only grows: skipping another layer's plumbing is never wrong.
    pub skip_frames: SkipFrames,
}

impl Default for HistoryOptions {
    fn default() -> Self {
        HistoryOptions {
            mode: HistoryMode::Off,
            context: HistoryContext::Never,
            max_entries: usize::MAX,
            skip_frames: SkipFrames::default(),
        }
    }
}

impl HistoryOptions {
    /// From PyTorch's string arguments, with PyTorch's error messages.
    pub fn parse(
        enabled: Option<&str>,
        context: Option<&str>,
        max_entries: usize,
    ) -> Result<HistoryOptions, String> {
        let mode = match enabled {
            None => HistoryMode::Off,
            Some("state") => HistoryMode::State,
            Some("all") => HistoryMode::All,
            Some(_) => return Err("expected state to be 'state', 'all', or None".into()),
        };
        let context = match context {
            None => HistoryContext::Never,
            Some("state") => HistoryContext::State,
            Some("alloc") => HistoryContext::Alloc,
            Some("all") => HistoryContext::All,
            Some(_) => return Err("expected context to be 'state', 'alloc', 'all', or None".into()),
        };
        Ok(HistoryOptions {
            mode,
            context,
            max_entries: max_entries.max(1),
            skip_frames: SkipFrames::default(),
        })
    }
}

/// The ring buffer, and the stacks segments were allocated with.
#[derive(Debug, Default)]
pub(crate) struct History {
    pub(crate) options: HistoryOptions,
    entries: VecDeque<TraceEntry>,
    /// Where each live segment was allocated, by address, when a context was recorded
    /// (PyTorch's `context_when_segment_allocated`): a snapshot's segment `frames`, and
    /// the `segment_free` entry's.
    segment_frames: rustc_hash::FxHashMap<u64, Arc<[Frame]>>,
    /// Recordings of requests underway ([`History::begin_recording`]; they may nest).
    recordings: usize,
    /// While one is: the positions in `entries` of the `free_requested` entries whose
    /// block had other streams' uses (a capture frees those only at its end; the trace
    /// itself cannot always tell them apart).
    frees_with_uses: Vec<usize>,
}

impl History {
    /// Whether trace entries carry frames (context `"alloc"` or `"all"`): PyTorch's
    /// `record_trace` keeps the context it is given only then.
    pub(crate) fn entries_have_frames(&self) -> bool {
        self.options.context >= HistoryContext::Alloc
    }

    /// A segment was allocated at `ptr` by a request with `frames`: the `segment_alloc`
    /// entry, and the frames kept for the segment.
    pub(crate) fn segment_allocated(&mut self, ptr: u64, size: u64, stream: u64, frames: Frames) {
        if let Some(f) = frames {
            self.segment_frames.insert(ptr, f.clone());
        }
        let on_trace = frames.filter(|_| self.entries_have_frames());
        self.record("segment_alloc", ptr, size, stream, on_trace);
    }

    /// The segment at `ptr` was freed: the `segment_free` entry, with the segment's
    /// allocation frames.
    pub(crate) fn segment_freed(&mut self, ptr: u64, size: u64, stream: u64) {
        let frames = self.segment_frames.remove(&ptr);
        let on_trace = frames.as_ref().filter(|_| self.entries_have_frames());
        self.record("segment_free", ptr, size, stream, on_trace);
    }

    /// The frames the segment at `ptr` was allocated with (empty without).
    pub(crate) fn segment_frames(&self, ptr: u64) -> Vec<Frame> {
        self.segment_frames
            .get(&ptr)
            .map(|f| f.to_vec())
            .unwrap_or_default()
    }

    pub(crate) fn set(&mut self, options: HistoryOptions) {
        SKIPPED.write().merge(&options.skip_frames);
        if options.mode == HistoryMode::Off {
            self.entries.clear();
        }
        self.options = options;
        self.trim();
    }

    fn capacity(&self) -> usize {
        match self.options.mode {
            HistoryMode::Off => 0,
            HistoryMode::State => 1,
            HistoryMode::All => self.options.max_entries,
        }
    }

    fn trim(&mut self) {
        while self.entries.len() > self.capacity() {
            self.entries.pop_front();
        }
    }

    /// Records an event; `frames` only if the context asks for them on this action.
    /// (The check is inlined into the allocator's hot paths; recording is not.)
    #[inline]
    pub(crate) fn record(&mut self, action: &str, addr: u64, size: u64, stream: u64, f: Frames) {
        if self.options.mode != HistoryMode::Off {
            self.push(action, addr, size, stream, f);
        }
    }

    fn push(&mut self, action: &str, addr: u64, size: u64, stream: u64, frames: Frames) {
        self.entries.push_back(TraceEntry {
            action: action.to_owned(),
            addr,
            size,
            stream,
            time_us: now_us(),
            device_free: None,
            compile_context: "N/A".into(),
            user_metadata: String::new(),
            frames: frames.map(|f| f.to_vec()),
        });
        self.trim();
    }

    pub(crate) fn record_oom(&mut self, size: u64, device_free: u64, stream: u64) {
        self.record("oom", 0, size, stream, None);
        if let Some(e) = self.entries.back_mut().filter(|e| e.action == "oom") {
            e.device_free = Some(device_free);
        }
    }

    pub(crate) fn entries(&self) -> Vec<TraceEntry> {
        self.entries.iter().cloned().collect()
    }

    /// Keeps every event from now on (mode `all`, no limit, the context as it was) until
    /// [`History::end_recording`]; returns the options to restore and where the recording
    /// starts.
    pub(crate) fn begin_recording(&mut self) -> (HistoryOptions, usize) {
        let saved = self.options.clone();
        self.options.mode = HistoryMode::All;
        self.options.max_entries = usize::MAX;
        self.recordings += 1;
        (saved, self.entries.len())
    }

    /// The `free_requested` entry just recorded was of a block other streams used.
    #[inline]
    pub(crate) fn mark_free_with_uses(&mut self) {
        if self.recordings > 0 && !self.entries.is_empty() {
            self.frees_with_uses.push(self.entries.len() - 1);
        }
    }

    /// The events since `from` with the positions among them of the frees of blocks other
    /// streams used, and the options `saved` back (which keep of them what they would
    /// have kept). (Nothing trims the events while a recording is underway: it keeps them
    /// all.)
    pub(crate) fn end_recording(
        &mut self,
        saved: HistoryOptions,
        from: usize,
    ) -> (Vec<TraceEntry>, Vec<usize>) {
        let recorded = self.entries.iter().skip(from).cloned().collect();
        let with_uses = (self.frees_with_uses.iter())
            .filter_map(|&i| i.checked_sub(from))
            .collect();
        self.recordings = self.recordings.saturating_sub(1);
        if self.recordings == 0 {
            self.frees_with_uses.clear();
        }
        self.set(saved);
        (recorded, with_uses)
    }
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The stack of an event, when recorded.
pub(crate) type Frames<'a> = Option<&'a Arc<[Frame]>>;

/// The frames every recorded stack skips: this crate's own, and those the layers above
/// gave in [`HistoryOptions::skip_frames`]. Read (briefly) before an allocator takes its
/// lock, written under it: a leaf lock, never held while taking another.
static SKIPPED: LazyLock<RwLock<SkipFrames>> = LazyLock::new(|| RwLock::new(SkipFrames::own()));

/// The calling thread's stack, innermost first, starting after the last frame of
/// allocation plumbing (see [`SKIPPED`]).
pub(crate) fn capture_frames() -> Arc<[Frame]> {
    let mut frames = Vec::new();
    backtrace::trace(|f| {
        backtrace::resolve_frame(f, |s| {
            frames.push(Frame {
                filename: s
                    .filename()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "??".into()),
                line: s.lineno().unwrap_or(0),
                name: s
                    .name()
                    .map(|n| format!("{n:#}"))
                    .unwrap_or_else(|| "??".into()),
            });
        });
        frames.len() < 96
    });
    let start = SKIPPED.read().caller_start(&frames);
    frames.drain(..start);
    frames.truncate(64);
    frames.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(name: &str, filename: &str) -> Frame {
        Frame {
            filename: filename.into(),
            line: 1,
            name: name.into(),
        }
    }

    #[test]
    fn own_frames_are_recognised_in_any_shape() {
        let own = SkipFrames::own();
        for name in [
            "ferrocuda_alloc::allocator::CachingAllocator::allocate",
            "<ferrocuda_alloc::devices::DeviceAllocators as ferrocuda_stream::memory::MemoryResource>::allocate",
        ] {
            assert!(own.matches(&frame(name, "??")), "{name}");
        }
        // Inlined frames of an optimised build: a bare name, known by its file.
        assert!(own.matches(&frame(
            "capture_frames",
            "/src/ferrocuda/crates/alloc/src/history.rs"
        )));
        assert!(own.matches(&frame(
            "capture_frames",
            "C:\\src\\ferrocuda\\crates\\alloc\\src\\history.rs"
        )));
        assert!(own.matches(&frame(
            "trace",
            "/cargo/registry/src/index/backtrace-0.3.76/src/backtrace/mod.rs"
        )));
        assert!(!own.matches(&frame("my_trainer::step", "/src/trainer/src/step.rs")));
        // The layers above are not this crate's to name.
        assert!(!own.matches(&frame(
            "ferrocuda_stream::buffer::DeviceBuffer<T>::uninit",
            "/src/ferrocuda/crates/stream/src/buffer.rs"
        )));
    }

    #[test]
    fn the_caller_starts_after_the_plumbing_the_layers_above_name() {
        let stack = [
            frame("backtrace::trace", "??"),
            frame("ferrocuda_alloc::history::capture_frames", "??"),
            frame(
                "ferrocuda_alloc::allocator::CachingAllocator::allocate",
                "??",
            ),
            frame("uninit", "/src/app/vendor/buffers/src/lib.rs"),
            frame("buffers::Buffer::new", "/src/app/vendor/buffers/src/lib.rs"),
            frame("app::step", "/src/app/src/main.rs"),
            frame("app::main", "/src/app/src/main.rs"),
        ];
        let mut skip = SkipFrames::own();
        assert_eq!(skip.caller_start(&stack), 3, "alone: after the allocator");
        let above = SkipFrames::new(&["buffers::"], &["/buffers/src/lib.rs"]);
        skip.merge(&above);
        skip.merge(&above);
        assert_eq!(skip.names.len(), 3, "merging twice adds nothing");
        assert_eq!(skip.caller_start(&stack), 5, "then after the buffers crate");
        assert_eq!(stack[5].name, "app::step");
    }
}
