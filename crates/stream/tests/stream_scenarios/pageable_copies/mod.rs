//! Copies from pageable memory staged by threads (`pageable_copy_threads`), where only the
//! fake device can show it: which driver calls a copy makes, that a copy never waits for
//! another stream's transfers, what happens when slots run out, when a transfer fails, in a
//! capture, and that the slots go back with the runtime. (Bytes and stream order on both
//! backends: the conformance suite's `pageable_copies_staged_by_threads`.) The submodules are
//! adversarial scenarios, each against the driver's copy and under a time limit:
//! [`bytes_and_order`], [`captures_and_failures`], [`threads_and_slots`].
use ferrocuda_driver::{Call, Driver, DriverError, FakeDriver, fake::Completion};
use ferrocuda_stream::{CHUNK, DEPTH, DeviceBuffer, Runtime, STAGED_MIN, StreamError};
use ferrocuda_testkit::StagedCopies;
use ferrocuda_types::{CaptureMode, DeviceIndex};
use std::sync::Arc;

mod bytes_and_order;
mod captures_and_failures;
mod reads;
mod reads_adversarial;
mod support;
mod threads_and_slots;

use support::{fake_n, pattern, runtime};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const D0: DeviceIndex = DeviceIndex(0);

/// One fake device (`support`'s) with `threads` staging threads.
fn fake(completion: Completion, threads: usize) -> (Arc<FakeDriver>, Arc<Runtime>) {
    let fake = fake_n(completion, 1);
    let rt = runtime(&fake, threads);
    (fake, rt)
}

/// A fake device with `threads` staging threads, `bytes` of values and a buffer for them.
type Setup = (Arc<FakeDriver>, Arc<Runtime>, Vec<u8>, DeviceBuffer<u8>);

fn one_copy(completion: Completion, threads: usize, bytes: usize) -> Result<Setup, StreamError> {
    let (fake, rt) = fake(completion, threads);
    let values = pattern(bytes, bytes % 7);
    let buf = DeviceBuffer::<u8>::uninit(&rt, D0, bytes)?;
    Ok((fake, rt, values, buf))
}

/// How many calls of each kind in `calls` `f` made on `fake`, in order.
fn calls_during(
    fake: &FakeDriver,
    calls: &[Call],
    f: impl FnOnce() -> Result<(), StreamError>,
) -> Result<Vec<u64>, StreamError> {
    let before: Vec<u64> = calls.iter().map(|&c| fake.calls(c)).collect();
    f()?;
    Ok(calls
        .iter()
        .zip(before)
        .map(|(&c, b)| fake.calls(c) - b)
        .collect())
}

#[test]
fn a_staged_copy_moves_each_chunk_through_a_slot_and_small_ones_go_to_the_driver() -> TestResult {
    let (fake, rt) = fake(Completion::Eager, 2);
    let kinds = [Call::MemcpyHtoD, Call::MemcpyHtoDPinned, Call::HostAlloc];
    let small = pattern(STAGED_MIN - 1, 1);
    let buf = DeviceBuffer::<u8>::uninit(&rt, D0, small.len())?;
    assert_eq!(
        calls_during(&fake, &kinds, || buf.copy_from_host(&small))?,
        [1, 0, 0],
        "below the staged minimum the driver copies, and no slot is made"
    );
    assert_eq!(buf.to_host()?, small);

    let big = pattern(5 * CHUNK + 3, 2);
    let buf = DeviceBuffer::<u8>::uninit(&rt, D0, big.len())?;
    assert_eq!(
        calls_during(&fake, &kinds, || buf.copy_from_host(&big))?,
        [0, 6, 6],
        "six chunks, each through a slot of its own (2 threads × {DEPTH} slots)"
    );
    assert_eq!(buf.to_host()?, big);
    let again = pattern(big.len(), 3);
    assert_eq!(
        calls_during(&fake, &kinds, || buf.copy_from_host(&again))?,
        [0, 6, 0],
        "the next copy reuses the slots, now idle"
    );
    assert_eq!(buf.to_host()?, again);

    StagedCopies::install(&rt, 0);
    assert_eq!(
        calls_during(&fake, &kinds, || buf.copy_from_host(&big))?,
        [1, 0, 0],
        "0 threads: the driver"
    );
    Ok(())
}

#[test]
fn a_staged_copy_never_waits_for_another_streams_transfers() -> TestResult {
    let (fake, rt) = fake(Completion::Manual, 1);
    let (s1, s2) = (rt.new_stream(D0, 0)?, rt.new_stream(D0, 0)?);
    let (a, b) = (pattern(3 * CHUNK, 4), pattern(3 * CHUNK, 5));
    let (x, y) = (
        DeviceBuffer::<u8>::uninit(&rt, D0, a.len())?,
        DeviceBuffer::<u8>::uninit(&rt, D0, b.len())?,
    );
    {
        let _g = rt.stream_guard(&s1)?;
        x.copy_from_host(&a)?;
    }
    let pending = fake.pending(s1.handle())?;
    assert!(
        pending >= 3,
        "the first copy's transfers wait on their stream"
    );
    {
        let _g = rt.stream_guard(&s2)?;
        y.copy_from_host(&b)?;
    }
    assert_eq!(
        fake.pending(s1.handle())?,
        pending,
        "the second copy took new slots instead of waiting for the first's"
    );
    assert_eq!(fake.calls(Call::HostAlloc), 6);
    s1.synchronize()?;
    s2.synchronize()?;
    assert_eq!((x.to_host()?, y.to_host()?), (a, b));
    Ok(())
}

#[test]
fn with_every_slot_busy_and_the_bound_reached_a_copy_goes_to_the_driver() -> TestResult {
    let (fake, rt) = fake(Completion::Manual, 1);
    // One thread keeps at most 2 × DEPTH slots; each copy takes DEPTH.
    let streams = [
        rt.new_stream(D0, 0)?,
        rt.new_stream(D0, 0)?,
        rt.new_stream(D0, 0)?,
    ];
    let mut copies = Vec::new();
    for (k, s) in streams.iter().enumerate() {
        let values = pattern(DEPTH * CHUNK, 10 + k);
        let buf = DeviceBuffer::<u8>::uninit(&rt, D0, values.len())?;
        let _g = rt.stream_guard(s)?;
        buf.copy_from_host(&values)?;
        copies.push((buf, values));
    }
    assert_eq!(fake.calls(Call::HostAlloc) as usize, 2 * DEPTH);
    assert_eq!(
        fake.calls(Call::MemcpyHtoD),
        1,
        "the third copy, by the driver"
    );
    for ((buf, values), s) in copies.iter().zip(&streams) {
        s.synchronize()?;
        assert_eq!(&buf.to_host()?, values);
    }
    Ok(())
}

#[test]
fn a_failed_transfer_ends_the_copy_with_the_drivers_error_and_the_next_copy_works() -> TestResult {
    let (fake, _rt, values, buf) = one_copy(Completion::Eager, 2, 6 * CHUNK)?;
    fake.fail_nth(Call::MemcpyHtoDPinned, 3, DriverError::INVALID_VALUE);
    assert_eq!(
        buf.copy_from_host(&values),
        Err(StreamError::Driver(DriverError::INVALID_VALUE))
    );
    fake.fail_nth(Call::EventRecord, 2, DriverError::INVALID_VALUE);
    assert_eq!(
        buf.copy_from_host(&values),
        Err(StreamError::Driver(DriverError::INVALID_VALUE))
    );
    buf.copy_from_host(&values)?;
    assert_eq!(buf.to_host()?, values);
    Ok(())
}

#[test]
fn into_a_capturing_stream_a_staged_copy_fails_as_the_drivers_does() -> TestResult {
    let mut errors = Vec::new();
    for threads in [0, 3] {
        let (fake, rt, values, buf) = one_copy(Completion::Eager, threads, 4 * CHUNK)?;
        let s = rt.new_stream(D0, 0)?;
        let _g = rt.stream_guard(&s)?;
        fake.stream_begin_capture(s.handle(), CaptureMode::ThreadLocal)?;
        errors.push(buf.copy_from_host(&values));
        let graph = fake.stream_end_capture(s.handle());
        if let Ok(g) = graph {
            fake.graph_destroy(g)?;
        }
        assert_eq!(fake.calls(Call::HostAlloc), 0, "no slot made");
    }
    assert!(errors[0].is_err(), "{errors:?}");
    assert_eq!(errors[0], errors[1]);
    Ok(())
}

#[test]
fn copies_from_several_threads_at_once_each_land_whole() -> TestResult {
    let (_, rt) = fake(Completion::Eager, 2);
    std::thread::scope(|scope| -> TestResult {
        let workers: Vec<_> = (0..4)
            .map(|k| {
                let rt = &rt;
                scope.spawn(move || -> Result<(), StreamError> {
                    for round in 0..3 {
                        let values = pattern(3 * CHUNK + 17 * k, 20 + k + round);
                        let buf = DeviceBuffer::<u8>::uninit(rt, D0, values.len())?;
                        buf.copy_from_host(&values)?;
                        assert_eq!(buf.to_host()?, values, "thread {k}, round {round}");
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| "a copying thread panicked")??;
        }
        Ok(())
    })
}

#[test]
fn the_slots_go_back_with_the_runtime() -> TestResult {
    let (fake, rt, values, buf) = one_copy(Completion::Manual, 2, 9 * CHUNK)?;
    buf.copy_from_host(&values)?;
    let made = fake.calls(Call::HostAlloc);
    assert_eq!(made as usize, 2 * DEPTH);
    drop(buf);
    drop(rt);
    assert_eq!(fake.calls(Call::HostFree), made, "every slot freed");
    assert_eq!(
        fake.calls(Call::EventDestroy),
        fake.calls(Call::EventCreate),
        "every slot's event destroyed"
    );
    Ok(())
}

#[test]
fn fewer_threads_give_the_slots_beyond_their_bound_back() -> TestResult {
    let (fake, rt, values, buf) = one_copy(Completion::Eager, 4, 20 * CHUNK)?;
    buf.copy_from_host(&values)?;
    assert_eq!(fake.calls(Call::HostAlloc) as usize, 4 * DEPTH);
    StagedCopies::install(&rt, 1);
    buf.copy_from_host(&values)?;
    assert_eq!(
        fake.calls(Call::HostFree) as usize,
        4 * DEPTH - 2 * DEPTH,
        "one thread keeps 2 × {DEPTH} slots: the rest go back once idle"
    );
    assert_eq!(fake.calls(Call::HostAlloc) as usize, 4 * DEPTH, "none made");
    assert_eq!(buf.to_host()?, values);
    Ok(())
}
