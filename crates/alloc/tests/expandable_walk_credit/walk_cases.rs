//! Hand-made layouts around best fit's walk over expandable blocks, each run with the
//! thread cache and with `thread_cache:False`: the same pointers at every allocation (the
//! churns free and ask for the same bytes again and again, the credit's case), the same
//! statistics and blocks. Each also checks the pointer PyTorch's rule gives and, through
//! the model in `harness`, that the pair met the intended case of the walk.
use crate::common::{GIB, LEGACY, MIB};
use crate::harness::*;
use ferrocuda_alloc::Allocation;
use ferrocuda_driver::{Call, Driver, fake::Completion};
use ferrocuda_types::{DevicePtr, StreamHandle};

/// What a scenario records: every pointer handed out (and labels), the same on both sides;
/// and, on the reference only, the model's case of each churn.
#[derive(Default)]
struct Rec {
    trace: Vec<String>,
    cases: Vec<String>,
}

impl Rec {
    fn alloc(&mut self, side: &Side, bytes: u64, stream: StreamHandle) -> Allocation {
        let x = side
            .a
            .allocate(bytes, stream)
            .unwrap_or_else(|e| panic!("allocate({bytes}): {e}"));
        self.trace.push(format!("a {:#x}+{}", x.ptr.0, x.size));
        x
    }
    fn free(&mut self, side: &Side, p: DevicePtr) {
        side.a.free(p).unwrap_or_else(|e| panic!("free: {e}"));
    }
    fn free_all(&mut self, side: &Side, ps: &[&Allocation]) {
        for p in ps {
            self.free(side, p.ptr);
        }
    }
    /// Allocates `bytes` on `stream`, then frees and asks again `n` times; returns the
    /// last block, after checking every round gave the first one's address.
    fn churn(&mut self, side: &Side, bytes: u64, stream: StreamHandle, n: usize) -> Allocation {
        let mut x = self.alloc(side, bytes, stream);
        if !side.tc {
            self.cases.push(classify_on(side, &x));
        }
        let first = x.ptr;
        for _ in 0..n {
            self.free(side, x.ptr);
            x = self.alloc(side, bytes, stream);
            assert_eq!(x.ptr, first, "the same block every round (tc {})", side.tc);
        }
        x
    }
}

/// Runs `scenario` on both sides; compares traces, statistics and blocks; returns the
/// reference's record.
fn both(case: &Case, scenario: impl Fn(&Side, &mut Rec)) -> Rec {
    let tc = Side::new(case, true);
    let rf = Side::new(case, false);
    let (mut r1, mut r2) = (Rec::default(), Rec::default());
    scenario(&tc, &mut r1);
    scenario(&rf, &mut r2);
    assert_eq!(r1.trace, r2.trace, "{case:?}: thread cache vs single lock");
    if let Err(e) = finish(&tc, &rf) {
        panic!("{case:?}: {e}");
    }
    r2
}

fn case(conf: &str, capacity: u64) -> Case {
    Case::new(conf, capacity, Completion::Eager, 2)
}

/// `n` blocks of `bytes`, each freed and asked for again once right away, so that its
/// thread-cache credit is used: credits that end unused are granted less often (down to
/// one request in 1024), and the churns that follow should get theirs.
fn allocs(rec: &mut Rec, side: &Side, n: usize, bytes: u64, s: StreamHandle) -> Vec<Allocation> {
    (0..n)
        .map(|_| {
            let x = rec.alloc(side, bytes, s);
            rec.free(side, x.ptr);
            let y = rec.alloc(side, bytes, s);
            assert_eq!(x.ptr, y.ptr);
            y
        })
        .collect()
}

const PLAIN_CONFS: [&str; 2] = [
    "expandable_segments:True",
    "expandable_segments:True,expandable_segments_page_mb:2",
];
/// (The recommended set's small blocks stay inside their pages, where no walk happens:
/// its other keys' walk is checked here, the page bound in the random programs.)
const RECLAIM_CONFS: [&str; 2] = [
    "expandable_segments:True,expandable_segments_reclaim:True",
    "ferrocuda_recommended:True,expandable_segments_small_page_bound:False",
];

fn all_confs() -> impl Iterator<Item = (&'static str, bool)> {
    PLAIN_CONFS
        .iter()
        .map(|c| (*c, false))
        .chain(RECLAIM_CONFS.iter().map(|c| (*c, true)))
}

fn assert_case(rec: &Rec, i: usize, want: &str, ctx: &str) {
    assert!(
        rec.cases[i].contains(want),
        "{ctx}: churn {i} met {:?}, wanted {want:?} (all: {:?})",
        rec.cases[i],
        rec.cases
    );
}

/// The commit's example: six 1 MiB blocks in the small pool's segment; the sixth (before the
/// unmapped tail), the second and the third freed. 1 MiB goes to the second (split from the
/// 2 MiB run, the frontier block passed over), and its free+allocate gets it back. The
/// frontier block is smaller than the merged one.
#[test]
fn frontier_smaller_than_the_merged_run() {
    for (conf, _) in all_confs() {
        let rec = both(&case(conf, 80 * GIB), |side, rec| {
            let p = allocs(rec, side, 6, MIB, LEGACY);
            rec.free_all(side, &[&p[5], &p[1], &p[2]]);
            let x = rec.churn(side, MIB, LEGACY, 5);
            assert_eq!(x.ptr, p[1].ptr);
            // The remainder (p2) next: alone between two live blocks, before the frontier
            // block by address.
            let y = rec.churn(side, MIB, LEGACY, 3);
            assert_eq!(y.ptr, p[2].ptr);
            // Then the frontier block itself, the only candidate left.
            let z = rec.churn(side, MIB, LEGACY, 3);
            assert_eq!(z.ptr, p[5].ptr);
        });
        assert_case(
            &rec,
            0,
            "chosen after passing 1 (first smaller, first grows: true)",
            conf,
        );
        assert_case(&rec, 1, "merged block (alone) first", conf);
        assert_case(
            &rec,
            2,
            "merged block (alone, itself the frontier) first",
            conf,
        );
    }
}

/// The same with a run of three and 512 KiB requests: the merged block is 1.5 MiB, then
/// 1 MiB, then the lone 512 KiB pieces, while the frontier block (1 MiB) waits.
#[test]
fn runs_of_several_sizes_split_down() {
    for (conf, _) in all_confs() {
        let rec = both(&case(conf, 80 * GIB), |side, rec| {
            let p = allocs(rec, side, 8, MIB, LEGACY);
            rec.free_all(side, &[&p[7], &p[2], &p[3]]);
            let mut kept = Vec::new();
            for _ in 0..4 {
                kept.push(rec.churn(side, 512 * 1024, LEGACY, 3));
            }
            let got: Vec<u64> = kept.iter().map(|x| x.ptr.0 - p[0].ptr.0).collect();
            let k = 512 * 1024;
            assert_eq!(got, [4 * k, 5 * k, 6 * k, 7 * k]);
            // (The third and fourth: the 1 MiB left of the run, then its 512 KiB rest,
            // before the frontier block by address: first.)
            // The frontier block's turn.
            let f = rec.churn(side, 512 * 1024, LEGACY, 3);
            assert_eq!(f.ptr, p[7].ptr);
        });
        for i in 0..2 {
            assert_case(&rec, i, "chosen after passing 1", conf);
        }
        assert_case(
            &rec,
            2,
            "merged block (with its free neighbour) first",
            conf,
        );
    }
}

/// Two segments of one stream (a reservation of a tenth of a 64 MiB device: 8 MiB each).
/// The first segment's last page is given back by `empty_cache`, so its last mapped block,
/// freed, is a frontier block *equal* in size to the merged block and *before* it by
/// address (in the earlier segment): the walk passes it.
#[test]
fn frontier_equal_in_an_earlier_segment() {
    for (conf, _) in all_confs() {
        let conf = format!("{conf},expandable_segments_reserve:0.1");
        let rec = both(&case(&conf, 64 * MIB), |side, rec| {
            let a = allocs(rec, side, 8, MIB, LEGACY);
            let b = allocs(rec, side, 4, MIB, LEGACY);
            assert!(a[7].ptr.0 + MIB <= b[0].ptr.0, "segment A before segment B");
            rec.free_all(side, &[&a[6], &a[7]]);
            side.a.empty_cache();
            rec.free_all(side, &[&a[5], &b[1]]);
            let x = rec.churn(side, MIB, LEGACY, 5);
            assert_eq!(x.ptr, b[1].ptr, "b1, past a5 (1 MiB + its 2 MiB tail)");
            let y = rec.churn(side, MIB, LEGACY, 3);
            assert_eq!(y.ptr, a[5].ptr);
        });
        assert_case(
            &rec,
            0,
            "chosen after passing 1 (first equal, first grows: true)",
            &conf,
        );
    }
}

/// One segment with a hole `empty_cache` left between mapped blocks: the block before the
/// hole, equal in size to the merged block and before it by address, can grow into the
/// hole by PyTorch's rule (the walk passes it) but not by reclaim's (it is chosen).
#[test]
fn frontier_equal_before_a_hole() {
    for (conf, reclaim) in all_confs() {
        let rec = both(&case(conf, 80 * GIB), |side, rec| {
            // Two 1 MiB blocks per 2 MiB page of the small pool.
            let q = allocs(rec, side, 8, MIB, LEGACY);
            rec.free_all(side, &[&q[2], &q[3]]);
            side.a.empty_cache(); // a hole where q2, q3 were
            rec.free_all(side, &[&q[1], &q[5]]);
            let x = rec.churn(side, MIB, LEGACY, 5);
            let want = if reclaim { &q[1] } else { &q[5] };
            assert_eq!(x.ptr, want.ptr);
            let y = rec.churn(side, MIB, LEGACY, 3);
            let want = if reclaim { &q[5] } else { &q[1] };
            assert_eq!(y.ptr, want.ptr);
        });
        if reclaim {
            assert_case(&rec, 0, "merged block (alone) first", conf);
        } else {
            assert_case(
                &rec,
                0,
                "chosen after passing 1 (first equal, first grows: true)",
                conf,
            );
        }
    }
}

/// The merged block is itself the frontier (before the segment's unmapped tail) and is
/// chosen after the walk passed a block before a larger hole. A 16 MiB device: the small
/// pool's range is 18 MiB, so the tail is short (4 MiB) and the hole (8 MiB) longer.
#[test]
fn merged_block_is_the_frontier_after_a_hole() {
    for (conf, reclaim) in all_confs() {
        let rec = both(&case(conf, 16 * MIB), |side, rec| {
            let r = allocs(rec, side, 14, MIB, LEGACY);
            let hole: Vec<&Allocation> = r[2..10].iter().collect();
            rec.free_all(side, &hole);
            side.a.empty_cache();
            rec.free_all(side, &[&r[1], &r[13]]);
            let x = rec.churn(side, MIB, LEGACY, 5);
            let want = if reclaim { &r[1] } else { &r[13] };
            assert_eq!(x.ptr, want.ptr);
            let y = rec.churn(side, MIB, LEGACY, 3);
            let want = if reclaim { &r[13] } else { &r[1] };
            assert_eq!(y.ptr, want.ptr);
        });
        if !reclaim {
            assert_case(
                &rec,
                0,
                "merged block (alone, itself the frontier) chosen after passing 1",
                conf,
            );
        }
    }
}

/// A frontier block larger than the merged one: the merged block comes first; when it can
/// grow (before a hole) the walk stops at it unless a later candidate could grow to less.
#[test]
fn frontier_larger_than_the_merged_block() {
    for (conf, _) in all_confs() {
        let rec = both(&case(conf, 80 * GIB), |side, rec| {
            let p = allocs(rec, side, 10, MIB, LEGACY);
            // The last two (one page) freed: a 2 MiB frontier run.
            rec.free_all(side, &[&p[8], &p[9], &p[1]]);
            let x = rec.churn(side, MIB, LEGACY, 4);
            assert_eq!(x.ptr, p[1].ptr);
            // A hole after p3 (page [4, 6) MiB): p3 freed can grow into it.
            rec.free_all(side, &[&p[4], &p[5]]);
            side.a.empty_cache(); // also gives back the frontier run's page
            rec.free(side, p[3].ptr);
            let y = rec.churn(side, MIB, LEGACY, 4);
            assert_eq!(y.ptr, p[3].ptr);
        });
        assert_case(&rec, 0, "merged block (alone) first", conf);
        assert_case(&rec, 1, "merged block (alone", conf);
    }
}

/// The same layout on two streams at once, churns interleaved: each stream's segment has
/// its own walk, and the other stream's blocks never compete.
#[test]
fn two_streams_interleaved() {
    for (conf, _) in all_confs() {
        let rec = both(&case(conf, 80 * GIB), |side, rec| {
            let s1 = side.streams[1];
            let p = allocs(rec, side, 6, MIB, LEGACY);
            let q = allocs(rec, side, 6, MIB, s1);
            rec.free_all(side, &[&p[5], &p[1], &p[2], &q[5], &q[2], &q[3]]);
            for _ in 0..3 {
                let x = rec.churn(side, MIB, LEGACY, 2);
                let y = rec.churn(side, MIB, s1, 2);
                assert_eq!((x.ptr, y.ptr), (p[1].ptr, q[2].ptr));
                rec.free(side, x.ptr);
                rec.free(side, y.ptr);
            }
            // 512 KiB on the other stream of the same size class.
            let z = rec.churn(side, 512 * 1024, s1, 3);
            assert_eq!(z.ptr, q[2].ptr);
        });
        assert_case(&rec, 0, "chosen after passing 1", conf);
        assert_case(&rec, 1, "chosen after passing 1", conf);
    }
}

/// Large pool, 20 MiB pages: six 6 MiB blocks leave a 4 MiB remainder at the frontier of
/// the second page; the second and third freed make a 12 MiB run. 6 MiB goes to the run
/// (past the 4 MiB... which does not fit) — then with 4 MiB requests the frontier remainder
/// (4 MiB, first) is passed for the run.
#[test]
fn large_pool_20mib_pages() {
    for conf in [
        "expandable_segments:True",
        "expandable_segments:True,expandable_segments_reclaim:True",
    ] {
        let rec = both(&case(conf, 80 * GIB), |side, rec| {
            let p = allocs(rec, side, 6, 6 * MIB, LEGACY); // 36 MiB: two pages, 4 MiB left
            rec.free_all(side, &[&p[1], &p[2]]);
            let x = rec.churn(side, 4 * MIB, LEGACY, 5);
            assert_eq!(
                x.ptr, p[1].ptr,
                "the 12 MiB run, past the 4 MiB frontier block"
            );
            let y = rec.churn(side, 6 * MIB, LEGACY, 3);
            assert_eq!(y.ptr.0, p[1].ptr.0 + 4 * MIB, "the rest of the run (8 MiB)");
            // Equal sizes: the frontier block (4 MiB) and a 4 MiB piece before it.
            rec.free(side, x.ptr);
            let z = rec.churn(side, 4 * MIB, LEGACY, 3);
            assert_eq!(z.ptr, p[1].ptr);
        });
        assert_case(
            &rec,
            0,
            "chosen after passing 1 (first smaller, first grows: true)",
            conf,
        );
        assert_case(&rec, 2, "merged block (alone) first", conf);
    }
}

/// Large pool with 2 MiB pages and several segments per stream (a tenth of a 160 MiB
/// device: 16 MiB each): frontier blocks of earlier segments before the merged block.
#[test]
fn large_pool_several_segments() {
    for (conf, _) in all_confs() {
        let conf = format!("{conf},expandable_segments_page_mb:2,expandable_segments_reserve:0.1");
        let rec = both(&case(&conf, 160 * MIB), |side, rec| {
            let a = allocs(rec, side, 4, 4 * MIB, LEGACY); // segment A full
            let b = allocs(rec, side, 4, 4 * MIB, LEGACY); // segment B full
            assert!(a[3].ptr.0 < b[0].ptr.0);
            rec.free(side, a[3].ptr);
            side.a.empty_cache(); // A's last 4 MiB unmapped: A has a tail
            rec.free_all(side, &[&a[2], &b[1], &b[2]]);
            // a2 (4 MiB, before A's 4 MiB tail: 8) first; the run b1+b2 (8 MiB) could grow
            // to no less; so a2.
            let x = rec.churn(side, 4 * MIB, LEGACY, 3);
            assert_eq!(x.ptr, a[2].ptr);
            rec.free(side, x.ptr);
            // 2 MiB: a2 (4, grows to 8) passed for... the run (8): not less, so a2 again.
            let y = rec.churn(side, 2 * MIB, LEGACY, 3);
            assert_eq!(y.ptr, a[2].ptr);
            rec.free(side, y.ptr);
            // Now make the run shorter than a2's reach: b2 taken again.
            let b2 = rec.alloc(side, 4 * MIB, LEGACY);
            assert_eq!(b2.ptr, a[2].ptr);
            let b1 = rec.churn(side, 4 * MIB, LEGACY, 3);
            assert_eq!(b1.ptr, b[1].ptr);
        });
        let _ = rec;
    }
}

/// `max_split_size_mb:20`: the walk passes the frontier block for an oversize run, which
/// the oversize rule then refuses: the request grows at the frontier instead, taking the
/// frontier block (no credit, the same pointers). A request above `max_split_size` takes
/// the run.
#[test]
fn oversize_run_after_the_walk() {
    for conf in [
        "expandable_segments:True,expandable_segments_page_mb:2,max_split_size_mb:20",
        "expandable_segments:True,expandable_segments_page_mb:2,max_split_size_mb:20,expandable_segments_reclaim:True",
        "expandable_segments:True,max_split_size_mb:20",
    ] {
        let rec = both(&case(conf, 80 * GIB), |side, rec| {
            let p = allocs(rec, side, 6, 8 * MIB, LEGACY);
            rec.free_all(side, &[&p[5], &p[1], &p[2], &p[3]]);
            // 8 MiB: p5 (8 MiB, frontier) first; the 24 MiB run could grow to less, but it
            // is oversize for an 8 MiB request.
            let x = rec.churn(side, 8 * MIB, LEGACY, 4);
            assert_eq!(x.ptr, p[5].ptr);
            rec.free(side, x.ptr);
            // 21 MiB (above max_split_size): the run fits, and is not 20 MiB too large.
            let y = rec.churn(side, 21 * MIB, LEGACY, 4);
            assert_eq!(y.ptr, p[1].ptr);
        });
        eprintln!("{conf}: {:?}", rec.cases);
    }
}

/// Another thread frees a block while this thread's request maps pages (the lock released):
/// the block the request gets is credited only if best fit over the list its free would
/// leave, the other thread's block included, chooses it. Holes of every size pair: the
/// request grows into the first hole (`h1` MiB, its remainder still unmapped after it), the
/// freed block sits before the second hole (`h2` MiB).
#[test]
fn a_block_freed_while_mapping_before_another_hole() {
    for (conf, reclaim) in all_confs() {
        for h1 in [2u64, 4, 6] {
            for h2 in [2u64, 4, 6] {
                let rec = both(&case(conf, 80 * GIB), |side, rec| {
                    // 1 MiB blocks: r0 r1 [hole h1] r.. g [hole h2] r.. r_last
                    let n = (2 + h1 + 2 + h2 + 2) as usize;
                    let r = allocs(rec, side, n, MIB, LEGACY);
                    let h1_at = 2;
                    let g_at = 2 + h1 as usize + 1;
                    let h2_at = g_at + 1;
                    let holes: Vec<&Allocation> = r[h1_at..h1_at + h1 as usize]
                        .iter()
                        .chain(&r[h2_at..h2_at + h2 as usize])
                        .collect();
                    rec.free_all(side, &holes);
                    side.a.empty_cache();
                    let a2 = side.a.clone();
                    let g = r[g_at].ptr;
                    side.fake.before_next(Call::VmMap, move || {
                        std::thread::spawn(move || a2.free(g).unwrap())
                            .join()
                            .unwrap();
                    });
                    let x = rec.alloc(side, MIB, LEGACY);
                    if !side.tc {
                        rec.cases.push(classify_on(side, &x));
                    }
                    assert_eq!(x.ptr, r[h1_at].ptr, "grown into the first hole");
                    rec.free(side, x.ptr);
                    let y = rec.alloc(side, MIB, LEGACY);
                    // PyTorch: g (1 MiB, reach 1 + h2) first; the block grown into,
                    // merged (2 MiB, reach 2 + h1 - 2), is next: passed to if it reaches
                    // less. Reclaim: g cannot grow and is chosen.
                    let x_wins = !reclaim && h1 < 1 + h2;
                    let want = if x_wins { r[h1_at].ptr } else { g };
                    assert_eq!(y.ptr, want, "h1 {h1} h2 {h2}");
                    rec.free(side, y.ptr);
                    let z = rec.churn(side, MIB, LEGACY, 4);
                    assert_eq!(z.ptr, want);
                });
                let label = &rec.cases[0];
                let x_wins = !reclaim && h1 < 1 + h2;
                if x_wins {
                    assert!(
                        label.contains("chosen after passing 1"),
                        "{conf} {h1} {h2}: {label}"
                    );
                } else {
                    assert!(label.contains("no credit"), "{conf} {h1} {h2}: {label}");
                }
            }
        }
    }
}

/// A credited block whose next round another thread interrupts: the thread holding the
/// credit parks its block, another thread asks for the same bytes (it gets the parked block,
/// settled first), then the first thread asks again.
#[test]
fn a_parked_block_after_the_walk_goes_to_another_thread() {
    for (conf, _) in all_confs() {
        let c = case(conf, 80 * GIB);
        let run = |side: &Side| -> Vec<u64> {
            let mut out = Vec::new();
            let p: Vec<Allocation> = (0..6)
                .map(|_| side.a.allocate(MIB, LEGACY).unwrap())
                .collect();
            for i in [5, 1, 2] {
                side.a.free(p[i].ptr).unwrap();
            }
            let x = side.a.allocate(MIB, LEGACY).unwrap();
            side.a.free(x.ptr).unwrap(); // parked, if credited
            let x = side.a.allocate(MIB, LEGACY).unwrap();
            out.push(x.ptr.0);
            side.a.free(x.ptr).unwrap();
            let a = side.a.clone();
            let y = std::thread::spawn(move || {
                let y = a.allocate(MIB, LEGACY).unwrap();
                a.free(y.ptr).unwrap();
                let y2 = a.allocate(MIB, LEGACY).unwrap();
                assert_eq!(y2.ptr, y.ptr);
                y2
            })
            .join()
            .unwrap();
            out.push(y.ptr.0);
            let z = side.a.allocate(MIB, LEGACY).unwrap();
            out.push(z.ptr.0);
            side.a.free(z.ptr).unwrap();
            let z2 = side.a.allocate(MIB, LEGACY).unwrap();
            out.push(z2.ptr.0);
            out.iter().map(|v| v - p[0].ptr.0).collect()
        };
        let tc = Side::new(&c, true);
        let rf = Side::new(&c, false);
        let (a, b) = (run(&tc), run(&rf));
        assert_eq!(a, b, "{conf}");
        assert_eq!(b, [MIB, MIB, 2 * MIB, 2 * MIB], "{conf}");
        finish(&tc, &rf).unwrap();
    }
}

/// Expandable segments switched off and on around a credit: with them off only ordinary
/// blocks serve; on again, a mixed free list (ordinary blocks and an expandable segment's)
/// is walked. The walk passes the expandable frontier block for an ordinary block.
#[test]
fn mixed_ordinary_and_expandable_lists() {
    for (conf, _) in all_confs() {
        let rec = both(&case(conf, 80 * GIB), |side, rec| {
            let e = allocs(rec, side, 6, MIB, LEGACY); // expandable, small pool
            side.a.update_config("expandable_segments:False").unwrap();
            let o = allocs(rec, side, 2, MIB, LEGACY); // an ordinary 2 MiB segment
            rec.free_all(side, &[&e[5], &o[0], &o[1]]);
            // Off: only ordinary blocks serve.
            let x = rec.churn(side, MIB, LEGACY, 3);
            assert_eq!(x.ptr, o[0].ptr);
            rec.free(side, x.ptr);
            side.a.update_config("expandable_segments:True").unwrap();
            // On: e5 (1 MiB, frontier) first, the ordinary 2 MiB segment could grow to less.
            let y = rec.churn(side, MIB, LEGACY, 3);
            assert_eq!(y.ptr, o[0].ptr);
            // 512 KiB: the same.
            rec.free(side, y.ptr);
            let z = rec.churn(side, 512 * 1024, LEGACY, 3);
            assert_eq!(z.ptr, o[0].ptr);
        });
        assert_case(
            &rec,
            1,
            "ord: merged block (with its free neighbour) chosen after passing 1",
            conf,
        );
    }
}

/// Many frontier candidates: several segments of one stream, each with a freed last block
/// before its tail, tails of different lengths (the walk takes several steps).
#[test]
fn a_walk_of_several_steps() {
    for (conf, _) in all_confs() {
        let conf = format!("{conf},expandable_segments_reserve:0.1");
        let rec = both(&case(&conf, 64 * MIB), |side, rec| {
            // Four small-pool segments of 8 MiB, filled.
            let segs: Vec<Vec<Allocation>> =
                (0..4).map(|_| allocs(rec, side, 8, MIB, LEGACY)).collect();
            // Give back 6, 4, 2 MiB at the ends of the first three (tails of those lengths).
            for (s, give) in segs.iter().zip([6usize, 4, 2]) {
                let tail: Vec<&Allocation> = s[8 - give..].iter().collect();
                rec.free_all(side, &tail);
            }
            side.a.empty_cache();
            // Their last mapped blocks freed: 1 MiB frontier blocks reaching 7, 5, 3 MiB.
            rec.free_all(side, &[&segs[0][1], &segs[1][3], &segs[2][5]]);
            // And an interior 1 MiB block of the last segment.
            rec.free(side, segs[3][4].ptr);
            let x = rec.churn(side, MIB, LEGACY, 5);
            assert_eq!(x.ptr, segs[3][4].ptr);
        });
        assert_case(&rec, 0, "chosen after passing 3", &conf);
    }
}

/// `empty_cache` and a record_stream free between credits: the churns after it meet the
/// same walk again (a credit granted after each locked step).
#[test]
fn credits_across_empty_cache_and_record_stream() {
    for (conf, _) in all_confs() {
        let c = Case::new(conf, 80 * GIB, Completion::Manual, 2);
        let rec = both(&c, |side, rec| {
            let s1 = side.streams[1];
            let p = allocs(rec, side, 8, MIB, LEGACY);
            rec.free_all(side, &[&p[7], &p[1], &p[2]]);
            let x = rec.churn(side, MIB, LEGACY, 3);
            assert_eq!(x.ptr, p[1].ptr);
            // p4 used on s1 and freed: pending until s1 runs.
            side.a.record_stream(p[4].ptr, s1).unwrap();
            side.fake
                .memset_async(p[4].ptr, ferrocuda_types::MemsetValue::U8(1), 1, s1)
                .unwrap();
            rec.free(side, p[4].ptr);
            let y = rec.churn(side, MIB, LEGACY, 3); // no credit while an event is pending
            assert_eq!(y.ptr, p[2].ptr);
            side.fake.advance_all();
            side.a.empty_cache();
            rec.free(side, x.ptr);
            let z = rec.churn(side, MIB, LEGACY, 3);
            assert_eq!(z.ptr, p[1].ptr);
        });
        let _ = rec;
    }
}
