//! An in-process collectives backend over the fake device's devices: what CI runs instead
//! of NCCL. Ranks are threads (one per device, as with `ncclCommInitRank`); each call is a
//! rendezvous of all ranks on the host, and the data moves in stream order: each rank
//! records an event on its stream, a group stream waits for all of them, runs a host kernel
//! that reads every rank's input and writes every rank's output, and records an event that
//! every rank's stream waits for. So a collective completes on a rank's stream only after
//! the work before it on every rank's stream, as NCCL's kernels do, in eager and in manual
//! completion alike, and without a host synchronisation. A call captured into a graph (the
//! group stream joins the capture through its waits) runs again at every replay. Send and
//! receive meet in pairs (a sender and its receiver) the same way.
use crate::collective::{check_host_call, check_ranks};
use crate::{Collective, DistError, Result};
use ferrocuda_driver::nccl::{CollectiveCall, CollectiveOp, ReduceOp};
use ferrocuda_driver::{Driver, FakeDriver, KernelContext};
use ferrocuda_types::{
    CaptureStatus, DType, DeviceIndex, DevicePtr, EventFlags, EventHandle, FunctionHandle,
    KernelArg, LaunchConfig, StreamFlags, StreamHandle,
};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What one collective does, the same on every rank but for the buffers.
#[derive(Clone, Debug, PartialEq)]
enum Kind {
    AllReduce(ReduceOp),
    Broadcast(usize),
    ReduceScatter(ReduceOp),
    AllGather,
    /// Rank `.0` sends to rank `.1` (the sender's buffer is `send`, the receiver's `recv`).
    SendRecv(usize, usize),
}

/// Who meets for a call: every rank, or a sender and its receiver.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
enum Meeting {
    All,
    Pair(usize, usize),
}

/// One rank's part of a call: what, its buffers, and the event ending its input.
#[derive(Clone, Debug)]
struct Arrival {
    kind: Kind,
    count: usize,
    dtype: DType,
    send: DevicePtr,
    recv: DevicePtr,
    ready: EventHandle,
}

/// The call in progress: who has arrived, and the outcome once the last has.
#[derive(Default)]
struct Round {
    arrived: Vec<Option<Arrival>>,
    done: Option<std::result::Result<EventHandle, DistError>>,
    left: usize,
}

struct Shared {
    driver: Arc<FakeDriver>,
    size: usize,
    stream: StreamHandle,
    function: FunctionHandle,
    rounds: Mutex<HashMap<Meeting, Round>>,
    turn: Condvar,
    /// Calls enqueued and not yet run by the host kernel, by call number, and whether a
    /// graph captured them (then they stay: every replay runs them again).
    plans: Arc<Mutex<Plans>>,
    next: AtomicU64,
    /// Events made for calls, destroyed with the group.
    events: Mutex<Vec<EventHandle>>,
    /// Calls completed by the host kernel.
    completed: Arc<AtomicU64>,
    /// Ranks whose every handle was dropped: a call waiting for one of them fails.
    gone: Vec<AtomicBool>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeGroup")
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        for e in self.events.get_mut().drain(..) {
            let _ = self.driver.event_destroy(e);
        }
    }
}

type Plans = HashMap<u64, (Vec<Arrival>, bool)>;

static NEXT_GROUP: AtomicU64 = AtomicU64::new(1);

/// A group of ranks on the fake device's devices (the fake's `ncclCommInitAll`).
#[derive(Debug, Clone)]
pub struct FakeGroup {
    shared: Arc<Shared>,
}

impl FakeGroup {
    /// A group with rank `i` on `devices[i]`, its group stream on the first device.
    pub fn ranks(driver: Arc<FakeDriver>, devices: &[DeviceIndex]) -> Result<Vec<FakeRank>> {
        let first = *devices
            .first()
            .ok_or(DistError::InvalidRank { rank: 0, size: 0 })?;
        let name = format!(
            "ferrocuda_fake_collective_{}",
            NEXT_GROUP.fetch_add(1, Ordering::Relaxed)
        );
        let plans: Arc<Mutex<Plans>> = Arc::default();
        let completed: Arc<AtomicU64> = Arc::default();
        let (p, c) = (plans.clone(), completed.clone());
        driver.register_kernel(&name, move |ctx| {
            let call: u64 = ctx.arg(0)?;
            let plan = {
                let mut plans = p.lock();
                match plans.get(&call) {
                    Some((plan, true)) => plan.clone(),
                    _ => plans.remove(&call).ok_or("unknown call")?.0,
                }
            };
            run(ctx, &plan)?;
            c.fetch_add(1, Ordering::Relaxed);
            Ok(())
        });
        let image = driver
            .compile_source(first, &format!("__global__ void {name}() {{}}"), &name)
            .map_err(|e| DistError::Stream(e.into()))?;
        let module = driver.module_load(first, &image)?;
        let function = driver.module_function(module, &name)?;
        let stream = driver.stream_create(first, StreamFlags::default())?;
        let shared = Arc::new(Shared {
            driver: driver.clone(),
            size: devices.len(),
            stream,
            function,
            rounds: Mutex::new(HashMap::new()),
            turn: Condvar::new(),
            plans,
            next: AtomicU64::new(0),
            events: Mutex::new(Vec::new()),
            completed,
            gone: devices.iter().map(|_| AtomicBool::new(false)).collect(),
        });
        let group = FakeGroup { shared };
        Ok(devices
            .iter()
            .enumerate()
            .map(|(rank, &device)| FakeRank {
                _membership: Arc::new(Membership {
                    shared: group.shared.clone(),
                    rank,
                }),
                group: group.clone(),
                rank,
                device,
            })
            .collect())
    }
}

/// One rank of a [`FakeGroup`]. Once every clone of a rank is dropped, the rank has left
/// the group: the others' calls that wait for it fail with [`DistError::RankGone`] instead
/// of waiting forever.
#[derive(Debug, Clone)]
pub struct FakeRank {
    group: FakeGroup,
    rank: usize,
    device: DeviceIndex,
    _membership: Arc<Membership>,
}

/// A rank's presence in the group, shared by its clones.
#[derive(Debug)]
struct Membership {
    shared: Arc<Shared>,
    rank: usize,
}

impl Drop for Membership {
    fn drop(&mut self) {
        if let Some(gone) = self.shared.gone.get(self.rank) {
            gone.store(true, Ordering::Release);
        }
        // Under the lock, so that a waiter between its check and its wait sees it.
        let _rounds = self.shared.rounds.lock();
        self.shared.turn.notify_all();
    }
}

impl FakeRank {
    /// Collectives the group's host kernel has completed so far.
    pub fn completed(&self) -> u64 {
        self.group.shared.completed.load(Ordering::Relaxed)
    }

    /// The group's own stream (where the data moves).
    pub fn group_stream(&self) -> StreamHandle {
        self.group.shared.stream
    }

    fn call(&self, kind: Kind, call: &CollectiveCall, stream: StreamHandle) -> Result<()> {
        let sh = &self.group.shared;
        let d = &sh.driver;
        check_host_call(self.device, call, stream)?;
        let ready = d.event_create(self.device, EventFlags::default())?;
        sh.events.lock().push(ready);
        d.event_record(ready, stream)?;
        let (meeting, slot, parties) = match &kind {
            &Kind::SendRecv(from, to) => (Meeting::Pair(from, to), usize::from(self.rank == to), 2),
            _ => (Meeting::All, self.rank, sh.size),
        };
        let arrival = Arrival {
            kind,
            count: call.count,
            dtype: call.dtype,
            send: call.send,
            recv: call.recv,
            ready,
        };
        let mut rounds = sh.rounds.lock();
        // A previous call still being left by slower ranks.
        while rounds.get(&meeting).is_some_and(|r| r.done.is_some()) {
            sh.turn.wait(&mut rounds);
        }
        let round = rounds.entry(meeting).or_insert_with(|| Round {
            arrived: vec![None; parties],
            ..Round::default()
        });
        round.arrived[slot] = Some(arrival);
        let outcome = if round.arrived.iter().all(Option::is_some) {
            let arrivals: Vec<Arrival> = round.arrived.iter().flatten().cloned().collect();
            drop(rounds);
            let outcome = self.enqueue(arrivals);
            rounds = sh.rounds.lock();
            if let Some(round) = rounds.get_mut(&meeting) {
                round.done = Some(outcome.clone());
            }
            sh.turn.notify_all();
            outcome
        } else {
            loop {
                if let Some(done) = rounds.get(&meeting).and_then(|r| r.done.clone()) {
                    break done;
                }
                let missing = rounds.get(&meeting).and_then(|r| {
                    r.arrived
                        .iter()
                        .enumerate()
                        .filter(|(_, a)| a.is_none())
                        .map(|(slot, _)| match meeting {
                            Meeting::All => slot,
                            Meeting::Pair(from, to) => [from, to][slot],
                        })
                        .find(|&rank| sh.gone.get(rank).is_some_and(|g| g.load(Ordering::Acquire)))
                });
                if let Some(rank) = missing {
                    // Withdraw, so that the round does not wait for this rank either.
                    if let Some(round) = rounds.get_mut(&meeting) {
                        round.arrived[slot] = None;
                        if round.arrived.iter().all(Option::is_none) {
                            rounds.remove(&meeting);
                        }
                    }
                    sh.turn.notify_all();
                    return Err(DistError::RankGone { rank });
                }
                sh.turn.wait(&mut rounds);
            }
        };
        if let Some(round) = rounds.get_mut(&meeting) {
            round.left += 1;
            if round.left == parties {
                rounds.remove(&meeting);
                sh.turn.notify_all();
            }
        }
        drop(rounds);
        Ok(d.stream_wait_event(stream, outcome?)?)
    }

    /// The last rank to arrive: checks the ranks agree, then enqueues the data movement on
    /// the group stream after every rank's input and returns the event ending it.
    fn enqueue(&self, arrivals: Vec<Arrival>) -> std::result::Result<EventHandle, DistError> {
        let sh = &self.group.shared;
        let d = &sh.driver;
        let first = &arrivals[0];
        if let Some(a) = arrivals
            .iter()
            .find(|a| a.kind != first.kind || a.count != first.count || a.dtype != first.dtype)
        {
            return Err(DistError::Mismatched(format!(
                "{:?} of {} {:?} against {:?} of {} {:?}",
                first.kind, first.count, first.dtype, a.kind, a.count, a.dtype
            )));
        }
        for a in &arrivals {
            d.stream_wait_event(sh.stream, a.ready)?;
        }
        let call = sh.next.fetch_add(1, Ordering::Relaxed);
        // Waiting for events recorded in a capture made the group stream join it.
        let captured = d.stream_capture_status(sh.stream)? != CaptureStatus::None;
        sh.plans.lock().insert(call, (arrivals, captured));
        d.launch(
            sh.function,
            &LaunchConfig::for_elements(1, 1),
            &[KernelArg::value(&call)],
            sh.stream,
        )?;
        let done = d.event_create(DeviceIndex(sh.stream.device.0), EventFlags::default())?;
        sh.events.lock().push(done);
        d.event_record(done, sh.stream)?;
        Ok(done)
    }
}

/// The host kernel's work for one call.
fn run(ctx: &mut KernelContext<'_>, plan: &[Arrival]) -> std::result::Result<(), String> {
    match plan.first().map(|a| a.dtype) {
        Some(DType::F32) => run_typed::<f32>(ctx, plan),
        Some(DType::F64) => run_typed::<f64>(ctx, plan),
        Some(DType::I32) => run_typed::<i32>(ctx, plan),
        Some(DType::I64) => run_typed::<i64>(ctx, plan),
        other => Err(format!("the fake group does not reduce {other:?}")),
    }
}

/// Element arithmetic the fake reduces with.
pub(crate) trait Num: bytemuck::Pod + PartialOrd {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div_by(self, n: usize) -> Self;
}

macro_rules! num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            fn add(self, o: Self) -> Self { self + o }
            fn mul(self, o: Self) -> Self { self * o }
            fn div_by(self, n: usize) -> Self { self / (n as $t) }
        }
    )*};
}
num!(f32, f64, i32, i64);

pub(crate) fn reduce<T: Num>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut out = inputs[0].clone();
    for input in &inputs[1..] {
        for (o, &x) in out.iter_mut().zip(input) {
            *o = match op {
                ReduceOp::Product => o.mul(x),
                ReduceOp::Max if x > *o => x,
                ReduceOp::Min if x < *o => x,
                ReduceOp::Max | ReduceOp::Min => *o,
                _ => o.add(x),
            };
        }
    }
    if op == ReduceOp::Avg {
        out.iter_mut().for_each(|o| *o = o.div_by(inputs.len()));
    }
    out
}

fn run_typed<T: Num>(
    ctx: &mut KernelContext<'_>,
    plan: &[Arrival],
) -> std::result::Result<(), String> {
    let (n, size) = (plan[0].count, plan.len());
    let read = |ctx: &KernelContext<'_>, len| -> std::result::Result<Vec<Vec<T>>, String> {
        plan.iter().map(|a| ctx.read::<T>(a.send, len)).collect()
    };
    match plan[0].kind {
        Kind::AllReduce(op) => {
            let out = reduce(&read(ctx, n)?, op);
            plan.iter().try_for_each(|a| ctx.write(a.recv, &out))
        }
        Kind::Broadcast(root) => {
            let src = plan.get(root).ok_or("root out of range")?;
            let data = ctx.read::<T>(src.send, n)?;
            plan.iter().try_for_each(|a| ctx.write(a.recv, &data))
        }
        Kind::ReduceScatter(op) => {
            let out = reduce(&read(ctx, n * size)?, op);
            plan.iter()
                .zip(out.chunks(n.max(1)))
                .try_for_each(|(a, block)| ctx.write(a.recv, block))
        }
        Kind::AllGather => {
            let all: Vec<T> = read(ctx, n)?.concat();
            plan.iter().try_for_each(|a| ctx.write(a.recv, &all))
        }
        Kind::SendRecv(..) => {
            let (from, to) = (&plan[0], plan.get(1).ok_or("a send without its receive")?);
            let data = ctx.read::<T>(from.send, n)?;
            ctx.write(to.recv, &data)
        }
    }
}

impl Collective for FakeRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.group.shared.size
    }
    fn device(&self) -> DeviceIndex {
        self.device
    }
    fn collective(&self, call: &CollectiveCall, stream: StreamHandle) -> Result<()> {
        check_ranks(call.op, self.rank, self.size())?;
        let kind = match call.op {
            CollectiveOp::AllReduce(op) => Kind::AllReduce(op),
            CollectiveOp::Broadcast { root } => Kind::Broadcast(root),
            CollectiveOp::ReduceScatter(op) => Kind::ReduceScatter(op),
            CollectiveOp::AllGather => Kind::AllGather,
            CollectiveOp::Send { peer } => Kind::SendRecv(self.rank, peer),
            CollectiveOp::Recv { peer } => Kind::SendRecv(peer, self.rank),
        };
        self.call(kind, call, stream)
    }
}
