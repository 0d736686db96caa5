//! The producer's side of sharing: counters in shared-memory files, one per send, and the
//! blocks whose counters are not all 0 (PyTorch's `CudaIPCSentData`,
//! `CudaIPCRefCountersFile` and `CudaIPCSentDataLimbo`, `torch/csrc/CudaIPCTypes.cpp`).
use super::{IpcError, IpcStats, MAXIMUM_EVENTS_TO_USE, REF_COUNTER_FILE_SIZE};
use ferrocuda_driver::shared_counters::SharedCounters;
use ferrocuda_types::EventHandle;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One send of a block: its counter and the event recorded at the send.
pub(super) struct Send {
    pub(super) file: Arc<SharedCounters>,
    pub(super) slot: usize,
    pub(super) event: Option<EventHandle>,
}

impl Send {
    fn released(&self) -> bool {
        self.file
            .counter(self.slot)
            .is_none_or(|c| c.load(Ordering::SeqCst) <= 0)
    }
}

/// A shared block: its bytes and every send of it.
#[derive(Default)]
pub(super) struct SentBlock {
    pub(super) bytes: u64,
    pub(super) sends: Vec<Send>,
}

impl SentBlock {
    /// Whether every consumer has given it back.
    fn released(&self) -> bool {
        self.sends.iter().all(Send::released)
    }
}

/// The file counters are taken from, and how many it has given.
struct CurrentFile {
    file: Arc<SharedCounters>,
    next: usize,
}

#[derive(Default)]
struct Sent {
    /// Shared blocks the producer still holds, by address.
    live: FxHashMap<u64, SentBlock>,
    /// Shared blocks the producer freed, held for their consumers, in the order they were
    /// freed (the order a collection frees them in, as PyTorch's limbo).
    limbo: Vec<(u64, SentBlock)>,
    current: Option<CurrentFile>,
    /// Files made so far (their names' last part).
    files_made: u64,
    events_used: usize,
}

impl Sent {
    /// Whether the block at `ptr` waits in the limbo.
    fn in_limbo(&self, ptr: u64) -> bool {
        self.limbo.iter().any(|(p, _)| *p == ptr)
    }

    /// The file to take counters from: the current one, or a new one (PyTorch's
    /// `/torch_<pid>_<random>_<n>`).
    fn take_file(&mut self) -> Result<CurrentFile, IpcError> {
        if let Some(current) = self.current.take() {
            return Ok(current);
        }
        self.files_made += 1;
        let name = format!(
            "/torch_{}_{}_{}",
            std::process::id(),
            random_word(),
            self.files_made
        );
        let file = SharedCounters::create(&name, REF_COUNTER_FILE_SIZE).map_err(|e| {
            IpcError::CounterFile {
                name: name.clone(),
                reason: e.to_string(),
            }
        })?;
        Ok(CurrentFile {
            file: Arc::new(file),
            next: 0,
        })
    }
}

/// One allocator's sharing state (both sides).
#[derive(Default)]
pub(crate) struct Sharing {
    sent: Mutex<Sent>,
    /// Whether any block is shared or in the limbo: what `free` and the allocation miss
    /// look at before anything else.
    any_sent: AtomicBool,
    any_limbo: AtomicBool,
    /// The consumer's open handles (see `opened`).
    pub(super) opened: super::opened::OpenedCache,
    pub(super) opened_handles: Arc<AtomicU64>,
    pub(super) opened_bytes: Arc<AtomicU64>,
}

impl Sharing {
    #[inline(always)]
    pub(crate) fn any_sent(&self) -> bool {
        self.any_sent.load(Ordering::Relaxed)
    }

    #[inline(always)]
    pub(crate) fn any_limbo(&self) -> bool {
        self.any_limbo.load(Ordering::Relaxed)
    }

    /// A fresh counter set to 1, from the current file or a new one.
    pub(super) fn take_counter(&self) -> Result<(Arc<SharedCounters>, usize), IpcError> {
        let mut sent = self.sent.lock();
        let mut current = sent.take_file()?;
        let (file, slot) = (Arc::clone(&current.file), current.next);
        if let Some(c) = file.counter(slot) {
            c.store(1, Ordering::SeqCst);
        }
        current.next += 1;
        // A full file is let go: the next send makes another.
        if current.next < file.slots() {
            sent.current = Some(current);
        }
        Ok((file, slot))
    }

    /// Whether a send may record an event (and counts it), or must synchronize instead.
    pub(super) fn take_event_slot(&self) -> bool {
        let mut sent = self.sent.lock();
        let ok = sent.events_used < MAXIMUM_EVENTS_TO_USE;
        sent.events_used += usize::from(ok);
        ok
    }

    /// Notes a send of the live block at `ptr` of `bytes`.
    pub(super) fn add_send(&self, ptr: u64, bytes: u64, send: Send) {
        let mut sent = self.sent.lock();
        let block = sent.live.entry(ptr).or_default();
        block.bytes = bytes;
        block.sends.push(send);
        self.any_sent.store(true, Ordering::Relaxed);
    }

    /// Whether the block at `ptr` waits in the limbo: freed already, so not the
    /// producer's to free or share again.
    pub(super) fn in_limbo(&self, ptr: u64) -> bool {
        self.any_limbo() && self.sent.lock().in_limbo(ptr)
    }

    /// The producer frees `ptr`: `None` if it was not shared; `Some(None)` if it waits in
    /// the limbo already (a second free); else whether it goes to the limbo now (consumers
    /// hold it), with the sends to finish when it does not.
    pub(super) fn on_free(&self, ptr: u64) -> Option<Option<(bool, Vec<Send>)>> {
        let mut sent = self.sent.lock();
        let Some(block) = sent.live.remove(&ptr) else {
            return sent.in_limbo(ptr).then_some(None);
        };
        let out = if block.released() {
            (false, block.sends)
        } else {
            sent.limbo.push((ptr, block));
            (true, Vec::new())
        };
        self.update_flags(&sent);
        Some(Some(out))
    }

    /// Takes the limbo's blocks every consumer gave back, with their sends, in the order
    /// they entered it.
    pub(super) fn take_collectable(&self) -> Vec<(u64, SentBlock)> {
        let mut sent = self.sent.lock();
        let (done, kept) = std::mem::take(&mut sent.limbo)
            .into_iter()
            .partition(|(_, b)| b.released());
        sent.limbo = kept;
        self.update_flags(&sent);
        done
    }

    /// Gives back the event slots of finished sends.
    pub(super) fn return_events(&self, events: usize) {
        let mut sent = self.sent.lock();
        sent.events_used = sent.events_used.saturating_sub(events);
    }

    fn update_flags(&self, sent: &Sent) {
        let limbo = !sent.limbo.is_empty();
        self.any_limbo.store(limbo, Ordering::Relaxed);
        self.any_sent
            .store(limbo || !sent.live.is_empty(), Ordering::Relaxed);
    }

    /// Drops the current counter file once nothing is shared (PyTorch's
    /// `safe_clean_current_file`): its name goes with the last mapping.
    pub(super) fn clean_current_file(&self) {
        let mut sent = self.sent.lock();
        if sent.live.is_empty() && sent.limbo.is_empty() {
            sent.current = None;
        }
    }

    pub(super) fn stats(&self) -> IpcStats {
        let sent = self.sent.lock();
        let limbo = sent.limbo.iter().map(|(_, b)| b);
        let limbo_bytes = limbo.clone().map(|b| b.bytes).sum::<u64>();
        let live_bytes = sent.live.values().map(|b| b.bytes).sum::<u64>();
        let open_sends = sent
            .live
            .values()
            .chain(limbo)
            .flat_map(|b| &b.sends)
            .filter(|s| !s.released())
            .count() as u64;
        IpcStats {
            shared_blocks: (sent.live.len() + sent.limbo.len()) as u64,
            shared_bytes: live_bytes + limbo_bytes,
            limbo_blocks: sent.limbo.len() as u64,
            limbo_bytes,
            open_sends,
            opened_handles: self.opened_handles.load(Ordering::Relaxed),
            opened_bytes: self.opened_bytes.load(Ordering::Relaxed),
        }
    }
}

/// A random word for file names (PyTorch uses `std::random_device`): the clock through
/// std's randomly keyed hasher.
fn random_word() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() as u32
}
