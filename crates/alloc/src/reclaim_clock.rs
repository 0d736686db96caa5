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
//! Only frees made with reclaim on stamp (the others skip the work): switching it on stamps
//! every page with the current epoch, so none is taken as safe before a mark recorded after
//! the switch has completed or its stream is found idle.
//!
//! Marks fall due every few frees of a segment (so that a step's late frees are covered by
//! a mark the device reaches soon) and at every reclaim. A stream found idle (a query, not
//! a wait: after the program's own synchronization, say) makes every page stamped so far
//! safe. When too few pages are known safe, a reclaim may wait for an older mark, never for
//! the newest ones.
//!
//! A mark falls due on a stream found idle records nothing: a query says every page
//! stamped so far is safe, without an event (cheaper than recording one). And when marks
//! keep falling due on an idle stream they fall due half as often, down to one per
//! [`MAX_FREES_PER_MARK`] frees, back to every [`MIN_FREES_PER_MARK`] as soon as one finds
//! the stream busy: a steady state that frees on an idle stream pays one query now and then.
//!
//! Page reclaim falls dormant after [`DORMANT_AFTER`] frees without a reclaim (a steady
//! state whose segments no longer grow, where stamps are written and never read): frees
//! then stamp nothing and count toward no mark, and the hot path costs what PyTorch's
//! expandable segments cost. The next growth that would reclaim wakes it as switching it on
//! does: every page is stamped with the current epoch, so none is safe before a mark
//! recorded from then on has completed or its stream is found idle. That growth finds no
//! page safe on a busy stream (it maps new memory, as PyTorch's expandable segments
//! would), the ones after it do as before.
//!
//! Marks are settled at reclaims, and a stream that frees on a busy stream without ever
//! needing a reclaim would gather marks, and an event each, without end. So a stream keeps
//! at most [`MARKS_KEPT`] outstanding: at that many, its completed ones are settled first,
//! and if the device is still that far behind, the oldest mark's event is recorded again as
//! the newest (the pages it covered wait for the next one instead, which the device
//! reaches soon after: a reclaim waits behind the newest few, never the oldest).
use ferrocuda_driver::Driver;
use ferrocuda_types::{EventHandle, StreamHandle};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

/// How many newer marks a mark needs before a reclaim waits for it: a wait for the newest
/// would drain the stream's queue, as the synchronization this design avoids does.
const MARKS_BEHIND: usize = 4;

/// At first, every this many frees in a segment a reclaim mark falls due on its stream:
/// pages freed late in a step are then covered by a mark the device reaches soon after,
/// not only by the next growth's (which it has not reached when that growth looks).
const MIN_FREES_PER_MARK: u32 = 16;

/// The fewest marks: one per this many frees, reached while the device keeps up.
const MAX_FREES_PER_MARK: u32 = 16 << 6;

/// Frees (counted at the marks they make due) after which page reclaim, not needed by any
/// growth meanwhile, falls dormant: a steady state that never grows stops paying for stamps
/// it would never read (see the module's text).
pub(crate) const DORMANT_AFTER: u64 = 1 << 16;

/// The most outstanding marks a stream keeps: far more than a reclaim waits behind, and
/// more than a lagging training step records (a GPT-2 step replayed with the device two
/// steps behind keeps about 300).
pub(crate) const MARKS_KEPT: usize = 1024;

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
    /// Frees of a segment between marks (see the module's text).
    frees_per_mark: u32,
}

impl Default for ReclaimClock {
    fn default() -> ReclaimClock {
        ReclaimClock {
            epoch: FIRST_EPOCH,
            streams: FxHashMap::default(),
            frees_per_mark: MIN_FREES_PER_MARK,
        }
    }
}

impl ReclaimClock {
    /// The stamp a free's pages take now.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many frees of a segment make a mark due now.
    pub(crate) fn frees_per_mark(&self) -> u32 {
        self.frees_per_mark
    }

    /// Outstanding marks of `stream`.
    pub(crate) fn outstanding(&self, stream: StreamHandle) -> usize {
        self.streams
            .get(&stream.raw)
            .map_or(0, |m| m.outstanding.len())
    }

    /// A due mark found its stream idle (marks may be rarer) or busy (as frequent as at
    /// first).
    pub(crate) fn adapt(&mut self, idle: bool) {
        self.frees_per_mark = if idle {
            (self.frees_per_mark * 2).min(MAX_FREES_PER_MARK)
        } else {
            MIN_FREES_PER_MARK
        };
    }

    /// Takes `stream`'s oldest outstanding mark out, to record its event again (see
    /// [`MARKS_KEPT`]).
    pub(crate) fn take_oldest(&mut self, stream: StreamHandle) -> Option<EventHandle> {
        let marks = self.streams.get_mut(&stream.raw)?;
        marks.outstanding.pop_front().map(|(event, _)| event)
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
