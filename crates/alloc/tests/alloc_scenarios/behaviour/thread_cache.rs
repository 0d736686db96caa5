use super::*;
use std::sync::mpsc;

#[test]
fn a_freed_block_comes_back_and_every_reuse_is_counted() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let first = a.allocate(MIB, LEGACY)?;
    a.free(first.ptr)?;
    for _ in 0..999 {
        let x = a.allocate(MIB, LEGACY)?;
        assert_eq!(
            x, first,
            "the same block, as PyTorch's free and best fit give"
        );
        a.free(x.ptr)?;
    }
    assert_eq!(stat(&a, "allocation.all.allocated"), 1000);
    assert_eq!(stat(&a, "allocation.small_pool.freed"), 1000);
    assert_eq!(stat(&a, "allocated_bytes.all.allocated"), 1000 * MIB as i64);
    // The remainder of the segment merged and split again every time.
    assert_eq!(stat(&a, "inactive_split.all.allocated"), 1000);
    assert_eq!(stat(&a, "inactive_split.all.current"), 0);
    for _ in 0..500 {
        let x = a.allocate(MIB, LEGACY)?;
        a.free(x.ptr)?;
    }
    assert_eq!(stat(&a, "allocation.all.allocated"), 1500);
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    a.check_invariants()?;
    Ok(())
}

/// Runs `f` on a new thread and waits for it: everything before happens-before it, and
/// it happens-before everything after.
fn on_another_thread<T: Send>(
    f: impl FnOnce() -> Result<T, AllocError> + Send,
) -> Result<T, Box<dyn std::error::Error>> {
    let result =
        std::thread::scope(|s| s.spawn(f).join()).map_err(|_| "the other thread panicked")?;
    Ok(result?)
}

/// Thread A frees, then hands over to thread B: B's request sees A's free, as under
/// PyTorch's one mutex (A's block comes back, not a new piece of the segment).
#[test]
fn a_block_freed_before_a_hand_over_serves_the_other_thread() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let x = a.allocate(MIB, LEGACY)?;
    a.free(x.ptr)?;
    let y = on_another_thread(|| a.allocate(MIB, LEGACY))?;
    assert_eq!(y.ptr, x.ptr);
    assert_eq!(stat(&a, "allocated_bytes.all.peak"), MIB as i64);
    assert_eq!(stat(&a, "active_bytes.all.peak"), MIB as i64);
    assert_eq!(stat(&a, "requested_bytes.all.peak"), MIB as i64);
    a.check_invariants()?;
    Ok(())
}

/// Another thread's request after a hand-over processes events first: a block freed
/// behind `record_stream`, whose stream has since finished, is found by the owner of
/// the last credit too.
#[test]
fn a_request_after_another_threads_record_stream_free_processes_events() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Manual);
    let s1 = new_stream(&fake)?;
    let x = a.allocate(MIB, LEGACY)?;
    a.free(x.ptr)?; // parked in this thread's slot
    let y = a.allocate(MIB, LEGACY)?;
    assert_eq!(y.ptr, x.ptr);
    on_another_thread(|| {
        a.record_stream(y.ptr, s1)?;
        a.free(y.ptr)
    })?;
    fake.advance(s1, None)?;
    let z = a.allocate(MIB, LEGACY)?;
    assert_eq!(z.ptr, x.ptr, "the event completed: the block is free again");
    assert_eq!(stat(&a, "active.all.current"), 1);
    a.check_invariants()?;
    Ok(())
}

/// A layout change by another thread around a block this thread keeps reusing: the
/// statistics stay those of the single-lock path.
#[test]
fn another_threads_split_around_a_reused_block_keeps_the_books() -> TestResult {
    let run = |config: &str| -> Result<Vec<i64>, Box<dyn std::error::Error>> {
        let (_, a) = setup(80 * GIB, config, Completion::Eager);
        let x = a.allocate(3 * MIB, LEGACY)?;
        a.free(x.ptr)?;
        let x = a.allocate(3 * MIB, LEGACY)?;
        let tail = on_another_thread(|| a.allocate(4 * MIB, LEGACY))?;
        a.free(x.ptr)?;
        let x = a.allocate(3 * MIB, LEGACY)?;
        on_another_thread(|| a.free(tail.ptr))?;
        a.free(x.ptr)?;
        let x = a.allocate(3 * MIB, LEGACY)?;
        let stats = a.stats().to_map();
        a.free(x.ptr)?;
        a.check_invariants()?;
        let mut values: Vec<_> = stats.into_iter().collect();
        values.sort();
        Ok(values.into_iter().map(|(_, v)| v).collect())
    };
    assert_eq!(run("")?, run("thread_cache:False")?);
    Ok(())
}

#[test]
fn a_credited_block_freed_by_another_thread_is_freed_once() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let x = a.allocate(MIB, LEGACY)?;
    std::thread::scope(|s| s.spawn(|| a.free(x.ptr)).join())
        .map_err(|_| "the freeing thread panicked")??;
    assert!(
        matches!(a.free(x.ptr), Err(AllocError::InvalidPointer(_))),
        "a second free is an error, not a park"
    );
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    let y = a.allocate(MIB, LEGACY)?;
    assert_eq!(y.ptr, x.ptr, "free in the pool again");
    a.check_invariants()?;
    Ok(())
}

#[test]
fn a_parked_block_freed_again_is_an_invalid_pointer() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let x = a.allocate(4096, LEGACY)?;
    a.free(x.ptr)?;
    assert!(matches!(a.free(x.ptr), Err(AllocError::InvalidPointer(_))));
    // Another thread freeing the parked block is refused the same way.
    let y = a.allocate(4096, LEGACY)?;
    a.free(y.ptr)?;
    let other = std::thread::scope(|s| s.spawn(|| a.free(y.ptr)).join())
        .map_err(|_| "the freeing thread panicked")?;
    assert!(matches!(other, Err(AllocError::InvalidPointer(_))));
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn a_block_parked_by_an_exited_thread_is_freed() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let x = std::thread::scope(|s| {
        s.spawn(|| -> Result<Allocation, AllocError> {
            let x = a.allocate(12 * MIB, LEGACY)?;
            a.free(x.ptr)?;
            Ok(x)
        })
        .join()
    })
    .map_err(|_| "the thread panicked")??;
    // The reader settles it...
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    assert_eq!(stat(&a, "active_bytes.all.current"), 0);
    // ... and the next request finds it.
    let y = a.allocate(12 * MIB, LEGACY)?;
    assert_eq!(y.ptr, x.ptr);
    assert_eq!(stat(&a, "segment.all.current"), 1);
    a.check_invariants()?;
    Ok(())
}

#[test]
fn a_request_that_would_grow_takes_blocks_other_threads_parked() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let (parked_tx, parked_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let found = std::thread::scope(|s| -> Result<DevicePtr, AllocError> {
        let a = &a;
        s.spawn(move || -> Result<(), AllocError> {
            let x = a.allocate(12 * MIB, LEGACY)?;
            a.free(x.ptr)?; // parked: this thread is still alive
            parked_tx.send(x.ptr).ok();
            done_rx.recv().ok();
            Ok(())
        });
        let parked = parked_rx.recv().unwrap_or(DevicePtr(0));
        let y = a.allocate(12 * MIB, LEGACY)?;
        done_tx.send(()).ok();
        assert_eq!(y.ptr, parked, "no new segment while a parked block fits");
        Ok(y.ptr)
    })?;
    assert_ne!(found, DevicePtr(0));
    assert_eq!(stat(&a, "num_device_alloc"), 1);
    a.check_invariants()?;
    Ok(())
}

/// The other thread of [`freed_during_next`], to join once the call has returned.
type Freeing = std::thread::JoinHandle<Result<(), AllocError>>;

/// Has another thread allocate a block with `prepare` and free it while this thread is
/// inside its next driver call of kind `call` (the allocator's lock released). Returns
/// the block's address and the other thread, to join once that call has returned.
fn freed_during_next(
    fake: &FakeDriver,
    a: &Arc<CachingAllocator>,
    call: Call,
    prepare: impl FnOnce(&CachingAllocator) -> Result<DevicePtr, AllocError> + Send + 'static,
) -> Result<(DevicePtr, Freeing), Box<dyn std::error::Error>> {
    let (ptr_tx, ptr_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let other = {
        let a = a.clone();
        std::thread::spawn(move || -> Result<(), AllocError> {
            let ptr = prepare(&a)?;
            a.allocate(512, LEGACY)?; // the slot's credit moves on: the free takes the lock
            ptr_tx.send(ptr).ok();
            go_rx.recv().ok();
            a.free(ptr)?;
            done_tx.send(()).ok();
            Ok(())
        })
    };
    let ptr = ptr_rx
        .recv()
        .map_err(|_| "the other thread stopped before its free")?;
    fake.before_next(call, move || {
        go_tx.send(()).ok();
        done_rx.recv().ok();
    });
    Ok((ptr, other))
}

/// While a request waits for the driver (the allocator's lock released), another
/// thread frees a block that fits it better. PyTorch's free of the new block followed by
/// the same request would find that block, so the new one is not credited: the
/// request's next round gets the better block, not its own freed one.
#[test]
fn a_block_freed_during_a_driver_call_wins_the_next_round() -> TestResult {
    let (fake, a) = setup(80 * GIB, "", Completion::Eager);
    let a = Arc::new(a);
    let (better, other) = freed_during_next(&fake, &a, Call::Malloc, |a| {
        Ok(a.allocate(12 * MIB, LEGACY)?.ptr)
    })?;
    let x = a.allocate(12 * MIB, LEGACY)?; // a new segment; `better` is freed meanwhile
    other.join().map_err(|_| "the other thread panicked")??;
    assert_ne!(x.ptr, better);
    next_round_gets(
        &a,
        x,
        better,
        "best fit: the lower of two equal free blocks",
    )
}

/// With expandable segments, a block at the mapped frontier loses to a free interior
/// block that fits, even a larger one (spec §4.5): when another thread frees such a block
/// while this one maps pages (lock released), the block just mapped gets no credit, and
/// its next round goes to the interior block as in PyTorch.
#[test]
fn an_interior_block_freed_while_mapping_wins_over_the_frontier() -> TestResult {
    let (fake, a) = setup(80 * GIB, "expandable_segments:True", Completion::Eager);
    let a = Arc::new(a);
    let (interior, other) = freed_during_next(&fake, &a, Call::VmMap, |a| {
        let interior = a.allocate(50 * MIB, LEGACY)?; // three 20 MiB pages...
        a.allocate(10 * MIB, LEGACY)?; // ... filled up to the frontier
        Ok(interior.ptr)
    })?;
    // Two more pages: the block ends 15 MiB short of the new frontier.
    let x = a.allocate(25 * MIB, LEGACY)?;
    other.join().map_err(|_| "the other thread panicked")??;
    assert_eq!(x.ptr, interior.offset(60 * MIB));
    next_round_gets(
        &a,
        x,
        interior,
        "the interior block, which cannot grow, before the frontier, which can",
    )
}

/// Frees `x` and asks for its bytes again: the block at `want` must come back.
fn next_round_gets(a: &CachingAllocator, x: Allocation, want: DevicePtr, why: &str) -> TestResult {
    a.free(x.ptr)?;
    let again = a.allocate(x.requested, LEGACY)?;
    assert_eq!(again.ptr, want, "{why}");
    a.check_invariants()?;
    Ok(())
}

#[test]
fn many_threads_keep_exact_books() -> TestResult {
    let (_, a) = setup(80 * GIB, "", Completion::Eager);
    let a = Arc::new(a);
    let done = std::sync::atomic::AtomicBool::new(false);
    let ops: i64 = std::thread::scope(|s| {
        // A reader settling every slot again and again while the workers run.
        s.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let live = a.stats().allocation.all.current;
                assert!((0..=8 * 10).contains(&live), "{live} live blocks");
                a.reset_peak_stats();
                std::thread::yield_now();
            }
        });
        let workers: Vec<_> = (0..8u64)
            .map(|t| {
                let a = a.clone();
                s.spawn(move || -> Result<i64, AllocError> {
                    let mut held = Vec::new();
                    let mut count = 0;
                    for i in 0..20_000u64 {
                        // Mostly pairs (the thread cache), some blocks kept a while.
                        let x = a.allocate(512 << ((i * 7 + t) % 13), LEGACY)?;
                        count += 1;
                        if i % 5 == 0 {
                            held.push(x.ptr);
                        } else {
                            a.free(x.ptr)?;
                        }
                        if held.len() > 8 {
                            a.free(held.remove(0))?;
                        }
                    }
                    held.into_iter().try_for_each(|p| a.free(p))?;
                    Ok(count)
                })
            })
            .collect();
        let total = workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|_| panic!("a worker panicked")))
            .sum::<Result<i64, AllocError>>();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        total
    })?;
    assert_eq!(stat(&a, "allocation.all.allocated"), ops);
    assert_eq!(stat(&a, "allocation.all.freed"), ops);
    assert_eq!(stat(&a, "allocation.all.current"), 0);
    assert_eq!(stat(&a, "active_bytes.all.current"), 0);
    a.check_invariants()?;
    Ok(())
}

/// Random single-threaded programs under expandable segments, with and without page
/// reclaim (whose best fit counts only a segment's unmapped tail as room to grow), and an
/// occasional `empty_cache` that leaves holes between mapped blocks: the thread cache's
/// credits hand out the pointer the single-lock path hands out at every allocation, and
/// the statistics and blocks end the same.
#[test]
fn expandable_programs_match_the_single_lock_path() -> TestResult {
    const SIZES: [u64; 8] = [512, 4096, 700_000, MIB, 3 * MIB, 4 * MIB, 6 * MIB, 10 * MIB];
    for conf in [
        "expandable_segments:True,expandable_segments_page_mb:2",
        "expandable_segments:True,expandable_segments_page_mb:2,expandable_segments_reclaim:True",
        "ferrocuda_recommended:True",
    ] {
        for seed in 1..=20u64 {
            let (_, ours) = setup(80 * GIB, conf, Completion::Eager);
            let (_, single) = setup(
                80 * GIB,
                &format!("{conf},thread_cache:False"),
                Completion::Eager,
            );
            let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let mut live: Vec<Option<(DevicePtr, u64)>> = vec![None; 12];
            // Half the allocations after a free ask for the freed size (a credit's case).
            let mut freed = None;
            for step in 0..2_000 {
                let r = next();
                let slot = (r % 12) as usize;
                if r % 97 == 0 {
                    ours.empty_cache();
                    single.empty_cache();
                }
                match live[slot].take() {
                    Some((p, bytes)) => {
                        ours.free(p)?;
                        single.free(p)?;
                        freed = Some(bytes);
                    }
                    None => {
                        let bytes = match freed.take() {
                            Some(bytes) if r & (1 << 20) != 0 => bytes,
                            _ => SIZES[((r >> 32) % SIZES.len() as u64) as usize],
                        };
                        let (a, b) = (
                            ours.allocate(bytes, LEGACY)?,
                            single.allocate(bytes, LEGACY)?,
                        );
                        assert_eq!(a.ptr, b.ptr, "{conf}, seed {seed}, step {step}");
                        live[slot] = Some((a.ptr, bytes));
                    }
                }
            }
            assert_eq!(ours.stats(), single.stats(), "{conf}, seed {seed}");
            assert_eq!(ours.blocks(), single.blocks(), "{conf}, seed {seed}");
            ours.check_invariants()?;
        }
    }
    Ok(())
}
