//! The watchdog (`ProcessGroup::with_timeout`): a collective that does not complete within
//! the timeout (the fake device in manual completion: its work never runs) fails the group
//! and aborts the communicator; every later call, and a host wait for work in flight, is a
//! typed error instead of a hang. Work that completes in time, and a group without a
//! watchdog, are left alone; an asynchronous error of the backend fails the group too.
use ferrocuda_dist::{
    Collective, CollectiveCall, DistError, FakeGroup, ProcessGroup, ReduceOp, Result,
};
use ferrocuda_driver::FakeDriver;
use ferrocuda_driver::fake::Completion;
use ferrocuda_stream::{DeviceBuffer, Runtime};
use ferrocuda_types::{DeviceIndex, StreamHandle};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const D0: DeviceIndex = DeviceIndex(0);
type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// A one-rank fake group.
type OneRank = (Arc<FakeDriver>, Arc<Runtime>, ProcessGroup);

fn one_rank() -> std::result::Result<OneRank, Box<dyn std::error::Error>> {
    let fake = Arc::new(FakeDriver::builder().build());
    let rt = Runtime::new(fake.clone());
    let rank = FakeGroup::ranks(fake.clone(), &[D0])?
        .pop()
        .ok_or("no rank")?;
    let group = ProcessGroup::new(rt.clone(), Box::new(rank))?;
    Ok((fake, rt, group))
}

#[test]
fn a_collective_that_never_completes_fails_the_group() -> TestResult {
    let (fake, rt, group) = one_rank()?;
    let group = group.with_timeout(Duration::from_millis(200))?;
    let x = DeviceBuffer::from_slice(&rt, D0, &[1.0f32; 16])?;
    fake.set_completion(Completion::Manual);
    let work = group.all_reduce(&x, ReduceOp::Sum)?;
    let t0 = Instant::now();
    let e = work.synchronize().unwrap_err();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    match &e {
        DistError::CollectiveTimeout { seq: 1, what, .. } => assert_eq!(what, "ALLREDUCE"),
        other => panic!("expected a collective timeout, got {other:?}"),
    }
    assert!(e.to_string().starts_with(
        "Watchdog caught collective operation timeout: Work(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)=200) ran for "
    ));
    assert_eq!(group.error(), Some(e.clone()));
    // Every later call is refused, naming the first failure.
    match group.broadcast(&x, 0) {
        Err(DistError::Aborted { reason }) => assert_eq!(reason, e.to_string()),
        other => panic!("expected Aborted, got {other:?}"),
    }
    fake.set_completion(Completion::Eager);
    fake.advance_all();
    Ok(())
}

#[test]
fn work_that_completes_in_time_is_left_alone() -> TestResult {
    let (_fake, rt, group) = one_rank()?;
    let group = group.with_timeout(Duration::from_millis(100))?;
    let x = DeviceBuffer::from_slice(&rt, D0, &[2.0f32; 8])?;
    for _ in 0..5 {
        group.all_reduce(&x, ReduceOp::Sum)?.synchronize()?;
    }
    std::thread::sleep(Duration::from_millis(350));
    assert_eq!(group.error(), None);
    group.all_reduce(&x, ReduceOp::Max)?.wait()?;
    assert_eq!(x.to_host()?, vec![2.0; 8]);
    Ok(())
}

#[test]
fn abort_refuses_every_later_call() -> TestResult {
    let (_fake, rt, group) = one_rank()?;
    let x = DeviceBuffer::from_slice(&rt, D0, &[1i64; 4])?;
    group.all_reduce(&x, ReduceOp::Sum)?.wait()?;
    group.abort()?;
    assert!(matches!(
        group.all_reduce(&x, ReduceOp::Sum),
        Err(DistError::Aborted { .. })
    ));
    Ok(())
}

/// A backend whose collectives do nothing, whose asynchronous error appears when asked, and
/// which counts its aborts.
#[derive(Debug, Default)]
struct Flaky {
    broken: AtomicBool,
    aborts: AtomicUsize,
}

/// The group's handle of a [`Flaky`] the test keeps too.
#[derive(Debug)]
struct Shared(Arc<Flaky>);

impl Collective for Shared {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn device(&self) -> DeviceIndex {
        D0
    }
    fn collective(&self, _: &CollectiveCall, _: StreamHandle) -> Result<()> {
        Ok(())
    }
    fn abort(&self) -> Result<()> {
        self.0.aborts.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn async_error(&self) -> Result<()> {
        if self.0.broken.load(Ordering::SeqCst) {
            return Err(DistError::Mismatched("the peer went away".into()));
        }
        Ok(())
    }
}

#[test]
fn an_asynchronous_error_aborts_once_and_fails_the_group() -> TestResult {
    let fake = Arc::new(FakeDriver::builder().build());
    let rt = Runtime::new(fake);
    let flaky = Arc::new(Flaky::default());
    let group = ProcessGroup::new(rt.clone(), Box::new(Shared(flaky.clone())))?
        .with_timeout(Duration::from_millis(50))?;
    let x = DeviceBuffer::from_slice(&rt, D0, &[1.0f32])?;
    group.all_reduce(&x, ReduceOp::Sum)?.synchronize()?;
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        (group.error(), flaky.aborts.load(Ordering::SeqCst)),
        (None, 0)
    );
    flaky.broken.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    while group.error().is_none() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    match group.error() {
        Some(DistError::Aborted { reason }) => {
            assert!(reason.contains("the peer went away"), "{reason}")
        }
        other => panic!("expected Aborted, got {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(flaky.aborts.load(Ordering::SeqCst), 1, "aborted once");
    assert!(matches!(
        group.all_reduce(&x, ReduceOp::Sum),
        Err(DistError::Aborted { .. })
    ));
    Ok(())
}
