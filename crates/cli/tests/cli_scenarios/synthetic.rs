//! Synthetic device traces, shaped as a PyTorch snapshot's `device_traces[0]` reads
//! ([`ferrocuda_cli::trace::events`]): for the replay's tests and benches (the bench
//! `many_streams` includes this file by path).
use ferrocuda_cli::trace::{Action, Event};

/// Where the recording's `cudaStream_t` values start (PyTorch records the raw handle: a
/// heap address, never 0 for a stream of its own).
const STREAM_BASE: u64 = 0x5633_a000_0000;
/// Where the recording's segments start (a real device address).
const SEGMENT_BASE: u64 = 0x7f2e_0000_0000;
/// The recording's small-pool segment (PyTorch's 2 MiB `kSmallBuffer`).
const SEGMENT: u64 = 2 << 20;

/// A trace where each of `streams` side streams, one after the other, allocates a small
/// block, frees it, and sees the free complete, as PyTorch records it: `segment_alloc`
/// (the stream's own segment: PyTorch pools are per stream), `alloc`, `free_requested`,
/// `free_completed`. Sizes cycle through 512 B .. 4 KiB so rounding has work to do. The
/// replay creates one stream per recorded stream, so the fake device ends with `streams`
/// streams, every one of which had work queued once.
pub(crate) fn many_streams(streams: usize) -> Vec<Event> {
    let mut events = Vec::with_capacity(streams * 4);
    for i in 0..streams as u64 {
        let stream = STREAM_BASE + i * 0x40;
        let segment = SEGMENT_BASE + i * SEGMENT;
        let size = 512 * (1 + i % 8);
        let event = |action, addr, size| Event {
            action,
            addr,
            size,
            stream,
        };
        events.push(event(Action::Other, segment, SEGMENT)); // segment_alloc
        events.push(event(Action::Alloc, segment, size));
        events.push(event(Action::Other, segment, size)); // free_requested
        events.push(event(Action::FreeCompleted, segment, size));
    }
    events
}
