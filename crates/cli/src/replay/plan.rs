//! Where a trace becomes the timed loop's steps: before the clock starts, every `alloc` and
//! `free_completed` event is turned into a step on a dense slot, and the recorded streams are
//! listed in the order of their first use, as PyTorch's own replay
//! (`shared/tools/torch_replay.py`) prepares its arrays before its clock.
//!
//! A slot stands for one recorded address from its first `alloc` to the `free_completed`
//! that ends it; a later `alloc` of the same address before that free (the trace reused an
//! address without freeing it) lands in the same slot. At run time a slot holds the block
//! most recently allocated for that address, or nothing (before the first success, after
//! an out-of-memory error, after the free), exactly as the map from address to block the
//! replay kept before: a slot is handed to another address only after its free, when it is
//! empty whatever happened at run time.
use crate::trace::{Action, Event};
use std::collections::HashMap;

/// One step of the timed loop.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Allocate `size` bytes on the `stream`-th stream of [`Plan::streams`] into `slot`,
    /// freeing the block the slot held, if any.
    Alloc {
        /// The slot.
        slot: usize,
        /// Index into [`Plan::streams`].
        stream: usize,
        /// Requested bytes.
        size: u64,
    },
    /// Free the block `slot` holds, if any (none where its allocations ran out of memory).
    Free {
        /// The slot.
        slot: usize,
    },
}

/// A recorded stream, by first use.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct RecordedStream {
    /// The recording's stream number (0: the default stream).
    pub(crate) id: u64,
    /// The trace event that first allocated on it.
    pub(crate) first_use: usize,
}

/// A device trace ready for the timed loop.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The steps, in trace order.
    pub(crate) steps: Vec<Step>,
    /// For each step, the index of its trace event (for progress and error messages).
    pub(crate) origin: Vec<usize>,
    /// Slots needed (the most recorded addresses live at once).
    pub(crate) slots: usize,
    /// The streams allocated on, in order of first use.
    pub(crate) streams: Vec<RecordedStream>,
}

impl Plan {
    /// The steps of `events`: every `alloc`, and every `free_completed` of an address an
    /// `alloc` of the trace handed out and no free has ended since (others free nothing).
    pub(crate) fn new(events: &[Event]) -> Plan {
        let mut plan = Plan::default();
        let mut slot_of: HashMap<u64, usize> = HashMap::new();
        let mut stream_of: HashMap<u64, usize> = HashMap::new();
        let mut spare: Vec<usize> = Vec::new();
        for (index, e) in events.iter().enumerate() {
            let step = match e.action {
                Action::Alloc => {
                    let streams = &mut plan.streams;
                    let stream = *stream_of.entry(e.stream).or_insert_with(|| {
                        streams.push(RecordedStream {
                            id: e.stream,
                            first_use: index,
                        });
                        streams.len() - 1
                    });
                    let slots = &mut plan.slots;
                    let slot = *slot_of.entry(e.addr).or_insert_with(|| {
                        spare.pop().unwrap_or_else(|| {
                            *slots += 1;
                            *slots - 1
                        })
                    });
                    Step::Alloc {
                        slot,
                        stream,
                        size: e.size,
                    }
                }
                Action::FreeCompleted => match slot_of.remove(&e.addr) {
                    Some(slot) => {
                        spare.push(slot);
                        Step::Free { slot }
                    }
                    None => continue,
                },
                Action::Other => continue,
            };
            plan.steps.push(step);
            plan.origin.push(index);
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(action: Action, addr: u64, size: u64, stream: u64) -> Event {
        Event {
            action,
            addr,
            size,
            stream,
        }
    }

    #[test]
    fn slots_follow_addresses_and_are_reused_after_a_free() {
        use Action::{Alloc, FreeCompleted, Other};
        let events = [
            ev(Other, 0, 0, 0),
            ev(Alloc, 0xa0, 10, 7),
            ev(Alloc, 0xb0, 20, 0),
            ev(Alloc, 0xa0, 30, 7), // reused without a free: the same slot
            ev(FreeCompleted, 0xc0, 0, 0), // never allocated: no step
            ev(FreeCompleted, 0xa0, 30, 7),
            ev(Alloc, 0xd0, 40, 9),        // takes the freed slot
            ev(FreeCompleted, 0xa0, 0, 0), // already freed: no step
        ];
        let plan = Plan::new(&events);
        assert_eq!(
            plan.steps,
            vec![
                Step::Alloc {
                    slot: 0,
                    stream: 0,
                    size: 10
                },
                Step::Alloc {
                    slot: 1,
                    stream: 1,
                    size: 20
                },
                Step::Alloc {
                    slot: 0,
                    stream: 0,
                    size: 30
                },
                Step::Free { slot: 0 },
                Step::Alloc {
                    slot: 0,
                    stream: 2,
                    size: 40
                },
            ]
        );
        assert_eq!(plan.origin, vec![1, 2, 3, 5, 6]);
        assert_eq!(plan.slots, 2);
        let ids: Vec<(u64, usize)> = plan.streams.iter().map(|s| (s.id, s.first_use)).collect();
        assert_eq!(ids, vec![(7, 1), (0, 2), (9, 6)]);
    }
}
