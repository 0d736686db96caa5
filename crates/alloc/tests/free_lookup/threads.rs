//! Many threads: racing frees, and a lock-step differential against the single lock.
use crate::common::{LEGACY, MIB, Rng, new_stream};
use crate::{device, invalid};
use ferrocuda_alloc::{AllocError, CachingAllocator};
use ferrocuda_types::{DevicePtr, StreamHandle};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Barrier, Mutex};

/// PyTorch's `free` under its one lock: threads racing to free the same pointers free
/// each exactly once, every other attempt is refused (`InvalidPointer`); then nothing is
/// allocated or active and every segment is whole. Each thread allocated its share first,
/// so frees are also parked in its thread cache, published, and served by other threads.
#[test]
fn racing_frees_of_the_same_pointers_succeed_once_each() {
    const THREADS: u64 = 4;
    for config in ["", "thread_cache:False", "expandable_segments:True"] {
        let (_fake, a) = device(config);
        for round in 0..10 {
            let (all, barrier) = (Mutex::new(Vec::new()), Barrier::new(THREADS as usize));
            let race = |t: u64| {
                let mut rng = Rng::new(t + 10 * round);
                let sizes = [512, 4096, 70_000, MIB + 1, 3 * MIB];
                for _ in 0..600 {
                    let p = a.allocate(rng.pick(&sizes), LEGACY).unwrap().ptr.0;
                    all.lock().unwrap().push(p);
                }
                barrier.wait();
                let mut order = all.lock().unwrap().clone();
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i as u64 + 1) as usize);
                }
                let won = order.into_iter().filter(|&p| match a.free(DevicePtr(p)) {
                    Ok(()) => true,
                    r => r != invalid(p) && panic!("{config} thread {t}: {r:?}"),
                });
                won.collect::<Vec<_>>()
            };
            let mut won: Vec<u64> = std::thread::scope(|s| {
                let threads: Vec<_> = (0..THREADS).map(|t| s.spawn(move || race(t))).collect();
                let won = threads.into_iter().map(|h| h.join().unwrap());
                won.flatten().collect()
            });
            let mut want = all.into_inner().unwrap();
            won.sort_unstable();
            want.sort_unstable();
            assert!(won == want, "{config} {round}: not each freed once");
            let s = a.stats();
            let (active, split) = (s.active.all.current, s.inactive_split.all.current);
            assert_eq!((s.allocated_bytes.all.current, active, split), (0, 0, 0));
            let whole = a.blocks().len() as i64 == s.segment.all.current;
            let expandable = config.contains("expandable");
            assert!(whole || expandable, "{config}: left split");
            a.check_invariants().unwrap();
        }
    }
}

/// One allocator of a pair, with its streams (the fake devices give both the same).
struct Side {
    a: CachingAllocator,
    streams: [StreamHandle; 2],
}

#[derive(Copy, Clone, Debug)]
enum Op {
    Alloc(u64, usize),
    Free(u64),
    RecordStream(u64),
    EmptyCache,
    Settings(&'static str),
    Stats,
}

#[derive(Clone, Debug, PartialEq)]
enum Out {
    Alloc(Result<(u64, u64), AllocError>),
    Done(Result<(), AllocError>),
    Stats(Box<ferrocuda_types::DeviceStats>),
}

impl Side {
    fn run(&self, op: Op) -> Out {
        let a = &self.a;
        match op {
            Op::Alloc(n, s) => {
                Out::Alloc(a.allocate(n, self.streams[s]).map(|b| (b.ptr.0, b.size)))
            }
            Op::Free(p) => Out::Done(a.free(DevicePtr(p))),
            Op::RecordStream(p) => Out::Done(a.record_stream(DevicePtr(p), self.streams[1])),
            Op::EmptyCache => {
                a.empty_cache();
                Out::Done(Ok(()))
            }
            Op::Settings(s) => Out::Done(a.update_config(s)),
            Op::Stats => Out::Stats(Box::new(a.stats())),
        }
    }
}

/// PyTorch gives one result for a program whose steps are ordered by happens-before,
/// whichever threads run them: random programs (frees of live, stale and interior
/// pointers among a thousand and more live blocks, `record_stream`, `empty_cache`,
/// `update_config` switching `roundup_power2_divisions` on and off), each step handed to
/// one of three threads, give the same pointers, errors and statistics with the thread
/// cache as on the single-lock reference (`thread_cache:False`).
#[test]
fn lock_step_threads_match_the_single_lock_reference() {
    const SETTINGS: [&str; 4] = [
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[2:1,4:8,>:2]",
        "",
        "max_split_size_mb:40,roundup_power2_divisions:[1:16,>:0]",
    ];
    for seed in 1..=3u64 {
        let sides: Arc<[Side; 2]> = Arc::new(["", "thread_cache:False"].map(|config| {
            let (fake, a) = device(config);
            let streams = [LEGACY, new_stream(&fake).unwrap()];
            Side { a, streams }
        }));
        let (reply, replies) = channel::<[Out; 2]>();
        let workers: Vec<Sender<Op>> = (0..3)
            .map(|_| {
                let (tx, rx) = channel::<Op>();
                let (sides, reply) = (sides.clone(), reply.clone());
                std::thread::spawn(move || {
                    while let Ok(op) = rx.recv() {
                        let _ = reply.send([sides[0].run(op), sides[1].run(op)]);
                    }
                });
                tx
            })
            .collect();
        let mut rng = Rng::new(seed);
        let (mut live, mut gone, mut steps) = (Vec::<(u64, u64)>::new(), Vec::new(), Vec::new());
        let (mut most, mut refusals) = (0, 0);
        for step in 0..5000 {
            let roll = if live.is_empty() { 0 } else { rng.below(100) };
            let pick = rng.below(live.len() as u64) as usize;
            let (p, size) = live.get(pick).copied().unwrap_or_default();
            let most_bytes = if rng.pct(5) { 13 * MIB } else { 80_000 };
            let op = match roll {
                0..=51 => Op::Alloc(1 + rng.below(most_bytes), usize::from(rng.pct(20))),
                52..=79 => Op::Free(p),
                80..=84 if !gone.is_empty() => Op::Free(gone[pick % gone.len()]),
                80..=89 => Op::Free(p + 512 * rng.below(size / 512).max(1)),
                90..=93 => Op::RecordStream(p),
                94..=95 => Op::EmptyCache,
                96 => Op::Settings(SETTINGS[rng.below(4) as usize]),
                _ => Op::Stats,
            };
            steps.push(op);
            workers[rng.below(3) as usize].send(op).unwrap();
            let [ours, reference] = replies.recv().unwrap();
            let last = &steps[steps.len().saturating_sub(25)..];
            assert!(
                ours == reference,
                "seed {seed} step {step}: thread cache {ours:?}\nreference {reference:?}\n\
                 last steps: {last:?}"
            );
            match (op, ours) {
                (Op::Alloc(..), Out::Alloc(Ok(b))) => live.push(b),
                (Op::Free(p), Out::Done(Ok(()))) => {
                    let i = live.iter().position(|b| b.0 == p).expect("a live block");
                    gone.push(live.swap_remove(i).0);
                }
                (Op::Free(p), r) => {
                    refusals += 1;
                    assert_eq!(r, Out::Done(invalid(p)), "seed {seed} step {step}");
                }
                (_, Out::Done(r)) => assert_eq!(r, Ok(()), "seed {seed} step {step}"),
                (_, r) => assert!(matches!(r, Out::Alloc(Ok(_)) | Out::Stats(_)), "{r:?}"),
            }
            most = most.max(live.len());
        }
        drop(workers);
        let busy = most > 1000 && refusals > 300;
        assert!(busy, "{seed}: {most} live, {refusals}");
        let same = sides[0].a.stats() == sides[1].a.stats();
        assert!(same, "{seed}: statistics at the end");
        sides.iter().for_each(|x| x.a.check_invariants().unwrap());
    }
}
