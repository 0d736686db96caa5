//! Allocation history (`torch.cuda.memory._record_memory_history`): a ring buffer of trace
//! entries, and Rust backtraces as frames.
use ferrocuda_types::{Frame, TraceEntry};
use std::collections::VecDeque;
use std::sync::Arc;

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

/// How history is recorded.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HistoryOptions {
    /// `enabled=`.
    pub mode: HistoryMode,
    /// `context=`.
    pub context: HistoryContext,
    /// Entries kept in the ring buffer (`max_entries=`).
    pub max_entries: usize,
}

impl Default for HistoryOptions {
    fn default() -> Self {
        HistoryOptions {
            mode: HistoryMode::Off,
            context: HistoryContext::Never,
            max_entries: usize::MAX,
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
        })
    }
}

/// The ring buffer.
#[derive(Debug, Default)]
pub(crate) struct History {
    pub(crate) options: HistoryOptions,
    entries: VecDeque<TraceEntry>,
}

impl History {
    pub(crate) fn set(&mut self, options: HistoryOptions) {
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
            frames: frames.map(|f| f.to_vec()).unwrap_or_default(),
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
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The stack of an event, when recorded.
pub(crate) type Frames<'a> = Option<&'a Arc<[Frame]>>;

/// Frames of ferrocuda's own allocation plumbing, dropped from the top of a stack so that
/// the first frame is the caller's. Inlined frames of optimised builds carry bare names
/// (`capture_frames`), so their source file decides too.
fn is_internal(frame: &Frame) -> bool {
    let by_name = [
        "backtrace::",
        "ferrocuda_alloc::",
        "ferrocuda_stream::buffer::",
        "ferrocuda_stream::memory::",
        "ferrocuda::memory::",
    ]
    .iter()
    .any(|p| frame.name.trim_start_matches('<').starts_with(p));
    let file = frame.filename.replace('\\', "/");
    let by_file = [
        "/backtrace-0.",
        "/crates/alloc/src/",
        "/ferrocuda-alloc-",
        "/crates/stream/src/buffer.rs",
        "/crates/stream/src/memory.rs",
    ]
    .iter()
    .any(|p| file.contains(p));
    by_name || by_file
}

/// The calling thread's stack, innermost first, starting after the last frame of
/// ferrocuda's allocation plumbing (std glue between our frames is dropped with them).
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
    let start = frames.iter().rposition(is_internal).map_or(0, |i| i + 1);
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
    fn internal_frames_are_recognised_in_any_shape() {
        for name in [
            "ferrocuda_alloc::allocator::CachingAllocator::allocate",
            "<ferrocuda_alloc::devices::DeviceAllocators as ferrocuda_stream::memory::MemoryResource>::allocate",
            "ferrocuda_stream::buffer::DeviceBuffer<T>::uninit",
        ] {
            assert!(is_internal(&frame(name, "??")), "{name}");
        }
        // Inlined frames of an optimised build: a bare name, known by its file.
        assert!(is_internal(&frame(
            "capture_frames",
            "/src/ferrocuda/crates/alloc/src/history.rs"
        )));
        assert!(is_internal(&frame(
            "trace",
            "/cargo/registry/src/index/backtrace-0.3.76/src/backtrace/mod.rs"
        )));
        assert!(!is_internal(&frame(
            "my_trainer::step",
            "/src/trainer/src/step.rs"
        )));
        assert!(!is_internal(&frame(
            "ferrocuda_stream::stream::Stream::launch",
            "/src/ferrocuda/crates/stream/src/stream.rs"
        )));
    }
}
