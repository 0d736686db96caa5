//! Replaying a trace whose events use many streams (`synthetic::many_streams`): the cost of
//! a free must not grow with the number of streams the trace used. Counted, not timed: the
//! fake device counts the streams it visits ([`FakeDriver::stream_visits`]: each stream it
//! runs or looks at), and a free that walked every stream the device has would visit
//! thousands at each of the replay's driver frees (the segments released to make room,
//! then all of them when the allocator is dropped). The bench `many_streams` times it.
//!
//! [`FakeDriver::stream_visits`]: ferrocuda_driver::FakeDriver::stream_visits
use crate::synthetic;

use ferrocuda_cli::replay::{fake_device, replay_with};
use ferrocuda_driver::Call;
use ferrocuda_types::AllocatorConfig;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The device: 1 GiB holds 512 of the trace's 2 MiB segments, so past 512 streams the
/// allocator gives cached segments back (a driver free each) to make room.
const CAPACITY: u64 = 1 << 30;

#[test]
fn no_free_visits_the_streams_the_trace_used() -> TestResult {
    for streams in [300, 3_000] {
        let fake = fake_device(CAPACITY, None);
        let events = synthetic::many_streams(streams);
        let (figures, allocator) = replay_with(
            fake.clone(),
            &events,
            "default",
            AllocatorConfig::default(),
            |_| {},
        )?;
        drop(allocator);
        let n = streams as u64;
        assert_eq!(fake.calls(Call::StreamCreate), n, "one stream each");
        assert_eq!(figures.num_device_alloc, n, "one segment each");
        assert_eq!(figures.num_ooms, 0);
        if n > 512 {
            assert!(figures.num_device_free > 0, "frees made room in the replay");
        }
        assert_eq!(fake.calls(Call::Free), n, "every segment given back");
        // The fake completes work as it is queued (eager) and the replay queues none: a free
        // drains the device but finds no stream with work queued, with 300 streams or 3 000.
        assert_eq!(fake.stream_visits(), 0, "{streams} streams");
    }
    Ok(())
}

#[test]
fn the_synthetic_trace_is_shaped_as_a_snapshot_reads() {
    use ferrocuda_cli::trace::Action;
    let events = synthetic::many_streams(3);
    let actions: Vec<Action> = events.iter().map(|e| e.action).collect();
    let per_stream = [
        Action::Other, // segment_alloc
        Action::Alloc,
        Action::Other, // free_requested
        Action::FreeCompleted,
    ];
    assert_eq!(actions, per_stream.repeat(3));
    let mut streams: Vec<u64> = events.iter().map(|e| e.stream).collect();
    streams.dedup();
    assert_eq!(streams.len(), 3, "one stream after the other");
    assert!(
        streams.iter().all(|s| *s != 0),
        "side streams, none the default"
    );
}
