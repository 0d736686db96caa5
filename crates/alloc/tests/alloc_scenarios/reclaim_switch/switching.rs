use super::*;

/// Off: frees with queued work; on; growth must map new pages only while that work is
/// queued, even after partial advances that run a mark recorded *before* the switch.
#[test]
fn switch_on_old_mark_completed_does_not_make_pages_safe() {
    ok((|| {
        let mut t = H::new(80 * GIB, RECLAIM, Completion::Manual, 1);
        let s = LEGACY;
        let xs: Vec<_> = (0..6).map(|_| t.a.allocate(10 * MIB, s).unwrap()).collect();
        t.fake.advance_all();
        // A mark recorded while on (busy stream): free xs[0] late, grow.
        t.write(&xs[0], 1, s);
        t.a.free(xs[0].ptr).unwrap();
        t.alloc(12 * MIB, s)?; // records mark M1 (queued after xs[0]'s write)
        t.a.update_config("expandable_segments_reclaim:False")
            .unwrap();
        // Off: xs[1], xs[3] freed with work queued *after* M1.
        for i in [1, 3] {
            t.write(&xs[i], 0xEE, s);
            t.a.free(xs[i].ptr).unwrap();
        }
        t.a.update_config("expandable_segments_reclaim:True")
            .unwrap();
        // Run xs[0]'s write and M1 only: xs[1]/xs[3]'s writes still queued.
        let n0 = probes(&xs[0]).len();
        t.fake.advance(s, Some(n0 + 1)).unwrap();
        assert!(t.fake.pending(s).unwrap() > 0);
        let r0 = t.reserved();
        t.alloc(40 * MIB, s)?;
        if t.reserved() - r0 != 40 * MIB {
            return Err(format!(
                "pages moved before a post-switch mark completed: {} MiB new of 40",
                (t.reserved() - r0) / MIB
            ));
        }
        for i in [2, 4, 5] {
            t.live.push((xs[i], 0));
            let tag = t.next_tag();
            t.write(&xs[i], tag, s);
            t.live.last_mut().unwrap().1 = tag;
        }
        t.inv()?;
        t.finish()
    })());
}

/// Toggle on/off/on/off/on with late frees in every phase and growth in every on-phase,
/// never letting the stream drain; three streams; then the device runs, and more growth.
#[test]
fn toggle_many_times_with_work_queued() {
    ok((|| {
        let mut t = H::new(80 * GIB, RECLAIM, Completion::Manual, 3);
        let ss = t.streams.clone();
        let mut pools: Vec<Vec<Allocation>> = ss
            .iter()
            .map(|&s| {
                (0..10)
                    .map(|_| t.a.allocate(6 * MIB + 4096, s).unwrap())
                    .collect()
            })
            .collect();
        t.fake.advance_all();
        for round in 0..8 {
            let on = round % 2 == 0;
            t.a.update_config(if on {
                "expandable_segments_reclaim:True"
            } else {
                "expandable_segments_reclaim:False"
            })
            .unwrap();
            for (si, &s) in ss.iter().enumerate() {
                if let Some(x) = pools[si].pop() {
                    t.write(&x, 0xEE, s);
                    t.a.free(x.ptr).unwrap();
                }
                // Growth while work stays queued (one item advanced per stream): only the
                // data checks at the end judge what moved.
                t.alloc((8 + round as u64) * MIB, s)?;
                t.fake.advance(s, Some(1)).unwrap();
                t.inv()?;
            }
        }
        // Every remaining block stays live with a tag.
        for pool in &mut pools {
            for x in pool.drain(..) {
                t.keep(x);
            }
        }
        t.fake.advance_all();
        for &s in &ss {
            t.alloc(30 * MIB, s)?;
        }
        t.inv()?;
        t.finish()
    })());
}

/// Merged block: piece 1 freed with reclaim on (its last use ran, covered by a completed
/// mark), piece 2 freed while off with work queued; on; growth. Only piece 1's pages may
/// move before piece 2's work runs.
#[test]
fn merged_from_pieces_freed_on_and_off() {
    ok((|| {
        let mut t = H::new(80 * GIB, RECLAIM, Completion::Manual, 1);
        let s = LEGACY;
        let xs: Vec<_> = (0..4).map(|_| t.a.allocate(10 * MIB, s).unwrap()).collect();
        t.fake.advance_all();
        t.write(&xs[0], 1, s);
        t.a.free(xs[0].ptr).unwrap();
        t.alloc(4 * MIB, s)?; // busy: mark M1
        t.fake.advance_all(); // M1 done; xs[0] known safe (after a settle)
        t.a.update_config("expandable_segments_reclaim:False")
            .unwrap();
        t.write(&xs[1], 0xEE, s);
        t.a.free(xs[1].ptr).unwrap(); // merges with xs[0]
        t.a.update_config("expandable_segments_reclaim:True")
            .unwrap();
        let r0 = t.reserved();
        t.alloc(44 * MIB, s)?;
        // The switch stamps every page: not even xs[0]'s may move (conservative).
        if t.reserved() - r0 != 44 * MIB {
            return Err(format!(
                "moved pages before a post-switch mark: {} MiB new of 44",
                (t.reserved() - r0) / MIB
            ));
        }
        for i in [2, 3] {
            t.keep(xs[i]);
        }
        t.inv()?;
        t.finish()
    })());
}

/// Two streams: S1's frees made while off with work queued; on; S2 goes idle and frees a
/// lot (marks fall due, idle queries); S2 growth may take S2's pages only; S1 growth maps
/// new pages.
#[test]
fn other_stream_idle_does_not_free_this_streams_pages() {
    ok((|| {
        let mut t = H::new(80 * GIB, PLAIN, Completion::Manual, 3);
        let (s1, s2) = (t.streams[1], t.streams[2]);
        let a1: Vec<_> = (0..4)
            .map(|_| t.a.allocate(10 * MIB, s1).unwrap())
            .collect();
        let a2: Vec<_> = (0..4)
            .map(|_| t.a.allocate(10 * MIB, s2).unwrap())
            .collect();
        t.fake.advance_all();
        for x in [&a1[0], &a1[2]] {
            t.write(x, 0xEE, s1);
            t.a.free(x.ptr).unwrap();
        }
        t.a.update_config("expandable_segments_reclaim:True")
            .unwrap();
        for x in [&a2[0], &a2[2]] {
            t.a.free(x.ptr).unwrap();
        }
        for _ in 0..40 {
            let y = t.a.allocate(512 * 1024 * 3, s2).unwrap();
            t.a.free(y.ptr).unwrap();
        }
        t.alloc(30 * MIB, s2)?; // s2 idle: its 20 MiB move
        let r0 = t.reserved();
        t.alloc(30 * MIB, s1)?;
        if t.reserved() - r0 != 30 * MIB {
            return Err(format!(
                "s1 pages moved: {} MiB new of 30",
                (t.reserved() - r0) / MIB
            ));
        }
        for x in [a1[1], a1[3], a2[1], a2[3]] {
            t.keep(x);
        }
        t.inv()?;
        t.finish()
    })());
}

/// record_stream use on a second stream while off: the deferred free completes (s2 ran)
/// while its own stream still has queued work; on; growth.
#[test]
fn record_stream_free_while_off_then_on() {
    ok((|| {
        let mut t = H::new(80 * GIB, PLAIN, Completion::Manual, 2);
        let s2 = t.streams[1];
        let xs: Vec<_> = (0..4)
            .map(|_| t.a.allocate(10 * MIB, LEGACY).unwrap())
            .collect();
        t.fake.advance_all();
        t.write(&xs[1], 0xEE, LEGACY); // own stream work, still queued
        t.a.record_stream(xs[1].ptr, s2).unwrap();
        t.write(&xs[1], 0xED, s2);
        t.a.free(xs[1].ptr).unwrap();
        t.fake.advance(s2, None).unwrap(); // s2 done: the event completes
        // A request while off processes the event: xs[1] is freed for real while off.
        t.alloc(4096, LEGACY)?;
        assert!(!t.a.blocks().iter().any(|b| b.pending_events));
        t.a.update_config("expandable_segments_reclaim:True")
            .unwrap();
        let r0 = t.reserved();
        t.alloc(30 * MIB, LEGACY)?;
        if t.reserved() - r0 != 30 * MIB {
            return Err(format!(
                "moved under queued own-stream work: {} MiB new",
                (t.reserved() - r0) / MIB
            ));
        }
        for i in [0, 2, 3] {
            t.keep(xs[i]);
        }
        t.inv()?;
        t.finish()
    })());
}

/// Switching expandable_segments itself: plain segments (expandable off), then expandable
/// on, late frees, expandable off, late frees (of expandable blocks), expandable + reclaim
/// on in one update, growth; and the umbrella key `ferrocuda_recommended`.
#[test]
fn switch_expandable_and_umbrella() {
    for on in [
        "expandable_segments:True,expandable_segments_reclaim:True",
        "ferrocuda_recommended:True",
    ] {
        ok((|| {
            let mut t = H::new(80 * GIB, "", Completion::Manual, 1);
            let s = LEGACY;
            let plain: Vec<_> = (0..3).map(|_| t.a.allocate(12 * MIB, s).unwrap()).collect();
            t.a.update_config("expandable_segments:True,expandable_segments_page_mb:2")
                .unwrap();
            let xs: Vec<_> = (0..6).map(|_| t.a.allocate(10 * MIB, s).unwrap()).collect();
            t.fake.advance_all();
            for i in [0, 2] {
                t.write(&xs[i], 0xEE, s);
                t.a.free(xs[i].ptr).unwrap();
            }
            t.a.update_config("expandable_segments:False").unwrap();
            t.write(&xs[4], 0xEE, s);
            t.a.free(xs[4].ptr).unwrap();
            t.write(&plain[1], 0xEE, s);
            t.a.free(plain[1].ptr).unwrap();
            t.a.update_config(on).unwrap();
            assert!(t.a.config().expandable.reclaim, "{on}");
            let r0 = t.reserved();
            t.alloc(50 * MIB, s)?;
            if t.reserved() - r0 != 50 * MIB {
                return Err(format!(
                    "{on}: moved under queued work: {} MiB new",
                    (t.reserved() - r0) / MIB
                ));
            }
            t.fake.advance_all();
            t.alloc(30 * MIB, s)?;
            for x in [xs[1], xs[3], xs[5], plain[0], plain[2]] {
                t.keep(x);
            }
            t.inv()?;
            t.finish()
        })());
    }
}

/// empty_cache while off (with frees queued), more late frees, on, growth; and an OOM in
/// between on a small device.
#[test]
fn empty_cache_and_oom_between() {
    ok((|| {
        let mut t = H::new(200 * MIB, PLAIN, Completion::Manual, 2);
        let s = LEGACY;
        let xs: Vec<_> = (0..8).map(|_| t.a.allocate(16 * MIB, s).unwrap()).collect();
        t.fake.advance_all();
        for i in [0, 2] {
            t.write(&xs[i], 0xEE, s);
            t.a.free(xs[i].ptr).unwrap();
        }
        t.a.empty_cache();
        for i in [3, 5] {
            t.write(&xs[i], 0xEE, s);
            t.a.free(xs[i].ptr).unwrap();
        }
        t.a.update_config("expandable_segments_reclaim:True")
            .unwrap();
        // 200 MiB device, 4*16 live + 32 freed-with-work: 60 MiB fits only by the OOM path.
        let got = t.alloc(120 * MIB, s)?;
        let _ = got;
        // Off again, late frees, an OOM that fails, on, growth.
        t.a.update_config("expandable_segments_reclaim:False")
            .unwrap();
        t.write(&xs[6], 0xEE, s);
        t.a.free(xs[6].ptr).unwrap();
        let _ = t.alloc(400 * MIB, s)?; // fails
        t.a.update_config("expandable_segments_reclaim:True")
            .unwrap();
        t.alloc(14 * MIB, s)?;
        for i in [1, 4, 7] {
            t.keep(xs[i]);
        }
        t.inv()?;
        t.finish()
    })());
}

/// Thread-cache parked blocks at the switch: a credited block freed (parked, lock-free)
/// with work queued while off, then on; growth.
#[test]
fn parked_block_at_switch() {
    ok((|| {
        let mut t = H::new(80 * GIB, PLAIN, Completion::Manual, 1);
        let s = LEGACY;
        let keep = t.a.allocate(10 * MIB, s).unwrap();
        let x = t.a.allocate(20 * MIB, s).unwrap();
        let guard = t.a.allocate(2 * MIB, s).unwrap(); // x is interior
        t.a.free(x.ptr).unwrap();
        let x2 = t.a.allocate(20 * MIB, s).unwrap(); // credited: the last allocation
        assert_eq!(x2.ptr, x.ptr);
        t.fake.advance_all();
        t.write(&x2, 0xEE, s);
        t.a.free(x2.ptr).unwrap(); // parked if credited
        t.a.update_config("expandable_segments_reclaim:True")
            .unwrap();
        let r0 = t.reserved();
        t.alloc(40 * MIB, s)?;
        if t.reserved() - r0 != 40 * MIB {
            return Err(format!(
                "moved under queued work: {} MiB new",
                (t.reserved() - r0) / MIB
            ));
        }
        for k in [keep, guard] {
            t.keep(k);
        }
        t.inv()?;
        t.finish()
    })());
}
