//! When a free expandable page may be unmapped without a stream synchronization
//! (`expandable_segments_reclaim`). The driver's unmap does not wait for queued work
//! (PyTorch's `ExpandableSegment::unmapHandles` synchronizes the stream first), so a page
//! may be moved only once the work enqueued before its last free has run.
//!
//! The clock keeps one epoch for the allocator. A free stamps the pages it covers with the
//! current epoch (the stamps live in the segment, one per page). A reclaim records a mark:
//! an event on the stream that starts a new epoch. A page stamped `e` is safe once the
//! stream has completed a mark started after `e`, which an event query tells without
//! blocking; marks complete in order on their stream, so each stream needs only the newest
//! completed one. Pages never freed since they were mapped carry stamp 0 and are always safe.
//!
//! Marks fall due every few frees of a segment (so that a step's late frees are covered by
//! a mark the device reaches soon) and at every reclaim. A stream found idle (a query, not
//! a wait: after the program's own synchronization, say) makes every page stamped so far
//! safe. When too few pages are known safe, a reclaim may wait for an older mark, never for
//! the newest ones.
use ferrocuda_driver::Driver;
use ferrocuda_types::{EventHandle, StreamHandle};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// How many newer marks a mark needs before a reclaim waits for it: a wait for the newest
/// would drain the stream's queue, as the synchronization this design avoids does.
const MARKS_BEHIND: usize = 4;

/// The first epoch: pages stamped before it (0, never freed since mapped) are always safe.
const FIRST_EPOCH: u64 = 1;

/// Marks of one stream.
#[derive(Debug)]
struct StreamMarks {
    /// Recorded and not seen complete, oldest first, with the epoch each started.
    outstanding: VecDeque<(EventHandle, u64)>,
    /// Pages stamped before this epoch are safe on this stream.
    safe_before: u64,
}

impl Default for StreamMarks {
    fn default() -> StreamMarks {
        StreamMarks {
            outstanding: VecDeque::new(),
            safe_before: FIRST_EPOCH,
        }
    }
}

/// The epoch, and the marks of every stream that freed expandable pages.
#[derive(Debug)]
pub(crate) struct ReclaimClock {
    epoch: u64,
    streams: FxHashMap<u64, StreamMarks>,
}

impl Default for ReclaimClock {
    fn default() -> ReclaimClock {
        ReclaimClock {
            epoch: FIRST_EPOCH,
            streams: FxHashMap::default(),
        }
    }
}

impl ReclaimClock {
    /// The stamp a free's pages take now.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// `event` was just recorded on `stream`: it starts a new epoch.
    pub(crate) fn marked(&mut self, stream: StreamHandle, event: EventHandle) {
        self.epoch += 1;
        let marks = self.streams.entry(stream.raw).or_default();
        marks.outstanding.push_back((event, self.epoch));
    }

    /// Queries `stream`'s marks, oldest first, up to the first not complete (a failed
    /// query counts as not complete). Returns the events of the completed ones, free to be
    /// recorded again, and the stamp below which pages are now safe.
    pub(crate) fn settle(
        &mut self,
        driver: &dyn Driver,
        stream: StreamHandle,
    ) -> (Vec<EventHandle>, u64) {
        let Some(marks) = self.streams.get_mut(&stream.raw) else {
            return (Vec::new(), FIRST_EPOCH);
        };
        let mut done = Vec::new();
        while let Some(&(event, epoch)) = marks.outstanding.front()
            && driver.event_query(event).unwrap_or(false)
        {
            marks.outstanding.pop_front();
            marks.safe_before = epoch;
            done.push(event);
        }
        (done, marks.safe_before)
    }

    /// `stream` has run everything enqueued so far (an idle stream): every page stamped
    /// until now is safe. Returns its outstanding marks' events, free to be recorded again,
    /// and the stamp below which pages are safe.
    pub(crate) fn idle(&mut self, stream: StreamHandle) -> (Vec<EventHandle>, u64) {
        // A new epoch, so that frees from now on are not taken for ones the query covered.
        self.epoch += 1;
        let safe_before = self.epoch;
        let marks = self.streams.entry(stream.raw).or_default();
        marks.safe_before = safe_before;
        let done = marks.outstanding.drain(..).map(|(e, _)| e).collect();
        (done, safe_before)
    }

    /// The newest outstanding mark of `stream` with [`MARKS_BEHIND`] newer ones after it:
    /// one worth waiting for when too few pages are known safe (the work queued behind
    /// it keeps the device busy while the host waits).
    pub(crate) fn mark_to_wait_for(&self, stream: StreamHandle) -> Option<EventHandle> {
        let outstanding = &self.streams.get(&stream.raw)?.outstanding;
        let at = outstanding.len().checked_sub(MARKS_BEHIND + 1)?;
        outstanding.get(at).map(|&(event, _)| event)
    }

    /// Every outstanding mark's event (the allocator is going away; its streams were
    /// synchronized).
    pub(crate) fn take_events(&mut self) -> Vec<EventHandle> {
        self.streams
            .values_mut()
            .flat_map(|m| m.outstanding.drain(..).map(|(e, _)| e))
            .collect()
    }
}
