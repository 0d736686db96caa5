//! Random single-threaded programs, thread cache on against `thread_cache:False`: the same
//! pointer at every allocation, the same statistics and blocks where read and at the end.
//! The generators free blocks at random out of expandable segments (runs of merged free
//! blocks, the block before the unmapped tail freed, holes from `empty_cache`) and then
//! free and ask for the same bytes again, mostly on the block allocated last (the one a
//! credit can be on).
use crate::common::{GIB, MIB};
use crate::harness::*;
use ferrocuda_driver::fake::Completion;

/// Which sizes a program asks for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Sizes {
    Large,
    Mixed,
    /// 1 MiB and 512 KiB blocks (small pool) and 2-6 MiB (large): many equal sizes, so the
    /// frontier block often ties with the merged one.
    Even,
    /// Any multiple of 512 up to 1 MiB and of 2 MiB up to 12 MiB.
    Any,
}

pub(crate) fn size(r: &mut Rng, sizes: Sizes) -> u64 {
    match sizes {
        Sizes::Large => r.pick(&LARGE),
        Sizes::Mixed => {
            if r.pct(50) {
                r.pick(&SMALL)
            } else {
                r.pick(&LARGE)
            }
        }
        Sizes::Even => r.pick(&[
            MIB,
            MIB,
            MIB,
            512 * 1024,
            512 * 1024,
            2 * MIB,
            2 * MIB,
            4 * MIB,
            6 * MIB,
        ]),
        Sizes::Any => {
            if r.pct(50) {
                512 * (1 + r.below(2048))
            } else {
                2 * MIB * (1 + r.below(6)) - 512 * r.below(2)
            }
        }
    }
}

/// What a generator mixes in besides allocations and frees.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gen {
    pub sizes: Sizes,
    pub len: usize,
    /// `update_config` strings to toggle at run time.
    pub toggles: &'static [&'static str],
    /// `thread_cache` switched at run time on the thread-cache side.
    pub tc_toggles: bool,
    pub fractions: bool,
    /// [`Op::GrowWithFree`] now and then.
    pub grow_with_free: bool,
}

impl Gen {
    pub(crate) const fn new(sizes: Sizes, len: usize) -> Gen {
        Gen {
            sizes,
            len,
            toggles: &[],
            tc_toggles: false,
            fractions: false,
            grow_with_free: true,
        }
    }
}

pub(crate) fn gen_op(r: &mut Rng, g: &Gen) -> Op {
    let k = 1 + r.below(3) as u8;
    let len = 110;
    loop {
        let op = match r.below(len) {
            0..=15 => Op::Alloc {
                bytes: size(r, g.sizes),
                stream: r.below(4) as usize,
            },
            16..=29 => Op::AllocChurn {
                bytes: size(r, g.sizes),
                stream: r.below(4) as usize,
                k,
            },
            30..=41 => Op::ChurnLast { k },
            42..=49 => Op::Churn {
                pick: r.next() as usize,
                k,
            },
            50..=71 => Op::Free {
                pick: r.next() as usize,
            },
            72..=75 => Op::FreeRealloc {
                pick: r.next() as usize,
                bytes: size(r, g.sizes),
            },
            76..=79 => Op::RecordFree {
                pick: r.next() as usize,
                stream: r.below(4) as usize,
            },
            80..=82 => Op::Write {
                pick: r.next() as usize,
            },
            83..=84 => Op::Advance {
                stream: r.below(4) as usize,
            },
            85..=86 => Op::Drain,
            87..=89 => Op::EmptyCache,
            90..=93 if !g.toggles.is_empty() => Op::Config(r.pick(g.toggles)),
            94 if g.tc_toggles => Op::ThreadCache(r.pct(60)),
            95 if g.fractions => Op::Fraction(r.pick(&[1.0, 0.9, 0.5, 0.3])),
            96..=99 => Op::Stats,
            100..=102 => Op::ChurnLast { k: 1 },
            103..=105 if g.grow_with_free => Op::GrowWithFree {
                bytes: size(r, g.sizes),
                stream: r.below(4) as usize,
                pick: r.next() as usize,
                k,
                call: r.below(4) as usize,
                churn: if r.pct(50) { size(r, g.sizes) } else { 0 },
            },
            106..=107 => Op::ResetStats(r.pct(30)),
            108..=109 if g.grow_with_free => Op::GrowWithFreeBeforeHole {
                bytes: size(r, g.sizes),
                stream: r.below(4) as usize,
                pick: r.next() as usize,
                k,
                churn: if r.pct(30) { size(r, g.sizes) } else { 0 },
            },
            _ => continue,
        };
        return op;
    }
}

pub(crate) fn gen_program(seed: u64, g: &Gen) -> Vec<Op> {
    let mut r = Rng::new(seed ^ 0x005E_ED0F_CAFE);
    (0..g.len).map(|_| gen_op(&mut r, g)).collect()
}

/// Runs `n` seeds from `base` of `g` under `case` (statistics compared after every step in
/// every fourth program), prints the coverage, and returns how many pairs met the new case.
pub(crate) fn check(name: &str, case: Case, base: u64, n: u64, g: Gen) -> u64 {
    let cov = check_seeds(
        name,
        &case,
        seeds(base, n),
        |seed| seed % 4 == 3,
        |seed| gen_program(seed, &g),
    );
    cov.report(name);
    cov.walked_to_merged()
}

const PLAIN2: &str = "expandable_segments:True,expandable_segments_page_mb:2";
const PLAIN20: &str = "expandable_segments:True";
const RECLAIM2: &str =
    "expandable_segments:True,expandable_segments_page_mb:2,expandable_segments_reclaim:True";
const RECLAIM20: &str = "expandable_segments:True,expandable_segments_reclaim:True";
const RECOMMENDED: &str = "ferrocuda_recommended:True";
const BOUND2: &str = "expandable_segments:True,expandable_segments_page_mb:2,expandable_segments_small_page_bound:True";
const BOUND_RECLAIM2: &str = "expandable_segments:True,expandable_segments_reclaim:True,expandable_segments_small_page_bound:True";

#[test]
fn small_pool_even_sizes_small_device() {
    // A 48 MiB device: the small pool's unmapped tail is short, so the frontier block's
    // expandable size is comparable to the runs before it.
    let hit = check(
        "small_even_48M",
        Case::new(PLAIN20, 48 * MIB, Completion::Eager, 1),
        1,
        30,
        Gen::new(Sizes::Even, 250),
    );
    assert!(hit > 0, "no pair met the walk past a candidate");
}

/// Small blocks kept inside their pages (`expandable_segments_small_page_bound`), with and
/// without reclaim, the device keeping up and lagging: no walk happens in the small pool,
/// so only the results are compared.
#[test]
fn small_blocks_inside_their_pages() {
    for (conf, completion, base) in [
        (BOUND2, Completion::Eager, 1100),
        (BOUND_RECLAIM2, Completion::Manual, 1150),
    ] {
        check(
            "small_page_bound",
            Case::new(conf, 64 * MIB, completion, 2),
            base,
            25,
            Gen::new(Sizes::Even, 250),
        );
    }
}

#[test]
fn plain_2mib_pages_mixed_sizes() {
    let hit = check(
        "plain2_mixed",
        Case::new(PLAIN2, 160 * MIB, Completion::Eager, 2),
        100,
        30,
        Gen::new(Sizes::Mixed, 250),
    );
    assert!(hit > 0);
}

#[test]
fn plain_20mib_pages_large_sizes() {
    check(
        "plain20_large",
        Case::new(PLAIN20, 400 * MIB, Completion::Eager, 2),
        200,
        25,
        Gen::new(Sizes::Large, 250),
    );
}

#[test]
fn plain_any_sizes_big_device() {
    check(
        "plain2_any_16G",
        Case::new(PLAIN2, 16 * GIB, Completion::Eager, 1),
        300,
        25,
        Gen::new(Sizes::Any, 250),
    );
}

#[test]
fn reclaim_eager_and_lagging() {
    for (conf, cap, completion, base) in [
        (RECLAIM2, 96 * MIB, Completion::Eager, 400),
        (RECLAIM2, 96 * MIB, Completion::Manual, 450),
        (RECLAIM20, 300 * MIB, Completion::Eager, 500),
    ] {
        check(
            "reclaim",
            Case::new(conf, cap, completion, 2),
            base,
            15,
            Gen::new(Sizes::Mixed, 220),
        );
    }
}

#[test]
fn recommended_lagging_with_toggles() {
    let g = Gen {
        toggles: &[
            "expandable_segments_reclaim:False",
            "expandable_segments_reclaim:True",
        ],
        ..Gen::new(Sizes::Even, 220)
    };
    check(
        "recommended",
        Case::new(RECOMMENDED, 80 * MIB, Completion::Manual, 3),
        600,
        25,
        g,
    );
}

#[test]
fn max_split_and_roundup() {
    for (conf, base, sizes) in [
        (
            "expandable_segments:True,expandable_segments_page_mb:2,max_split_size_mb:20",
            700,
            Sizes::Mixed,
        ),
        (
            "expandable_segments:True,max_split_size_mb:21",
            720,
            Sizes::Large,
        ),
        (
            "expandable_segments:True,expandable_segments_page_mb:2,roundup_power2_divisions:4",
            740,
            Sizes::Any,
        ),
        (
            "ferrocuda_recommended:True,max_split_size_mb:24,roundup_power2_divisions:4",
            760,
            Sizes::Any,
        ),
    ] {
        check(
            "max_split/roundup",
            Case::new(conf, 128 * MIB, Completion::Eager, 2),
            base,
            10,
            Gen::new(sizes, 220),
        );
    }
}

#[test]
fn garbage_collection_with_fractions() {
    let g = Gen {
        fractions: true,
        // (A re-parse without the key turns collection off, as PyTorch's does: credits
        // are granted again until it is turned back on.)
        toggles: &[
            "garbage_collection_threshold:0.5",
            "garbage_collection_threshold:0.5,expandable_segments_reclaim:True",
            "expandable_segments:True",
        ],
        ..Gen::new(Sizes::Mixed, 220)
    };
    check(
        "gc",
        Case::new(
            "expandable_segments:True,expandable_segments_page_mb:2,garbage_collection_threshold:0.5",
            128 * MIB,
            Completion::Eager,
            2,
        ),
        800,
        20,
        g,
    );
}

#[test]
fn run_time_toggles() {
    let g = Gen {
        toggles: &[
            "expandable_segments:False",
            "expandable_segments:True",
            "expandable_segments:True",
            "expandable_segments_reclaim:True",
            "expandable_segments_reclaim:False",
            "expandable_segments_page_mb:2",
            "expandable_segments_page_mb:20",
            "expandable_segments_small_page_bound:True",
            "expandable_segments_small_page_bound:False",
            "max_split_size_mb:20",
            "max_split_size_mb:100",
            "roundup_power2_divisions:4",
            "roundup_power2_divisions:1",
        ],
        tc_toggles: true,
        fractions: true,
        ..Gen::new(Sizes::Mixed, 250)
    };
    for (completion, base) in [(Completion::Eager, 900), (Completion::Manual, 950)] {
        check(
            "toggles",
            Case::new(PLAIN2, 192 * MIB, completion, 2),
            base,
            15,
            g,
        );
    }
}

#[test]
fn small_devices_out_of_memory() {
    for (conf, cap, base) in [
        (PLAIN2, 24 * MIB, 1000),
        (RECLAIM2, 24 * MIB, 1020),
        (PLAIN20, 44 * MIB, 1040),
        (RECOMMENDED, 30 * MIB, 1060),
    ] {
        check(
            "small_device",
            Case::new(conf, cap, Completion::Eager, 2),
            base,
            10,
            Gen::new(Sizes::Mixed, 200),
        );
    }
}

/// A reservation of a tenth of the device: several segments per stream and pool, each with
/// its own frontier, so a frontier block can come before the merged block by address.
#[test]
fn several_segments_per_stream() {
    for (conf, base) in [
        (
            "expandable_segments:True,expandable_segments_page_mb:2,expandable_segments_reserve:0.1",
            1100,
        ),
        (
            "expandable_segments:True,expandable_segments_page_mb:2,expandable_segments_reserve:0.1,expandable_segments_reclaim:True",
            1130,
        ),
    ] {
        let hit = check(
            "several_segments",
            Case::new(conf, 64 * MIB, Completion::Eager, 1),
            base,
            20,
            Gen::new(Sizes::Even, 220),
        );
        assert!(hit > 0);
    }
}

/// Expandable segments switched off and on often: ordinary and expandable blocks share the
/// free lists, and the walk passes expandable frontier blocks for ordinary blocks (whose
/// `inactive_split` figures the credit must keep), with peaks reset now and then.
#[test]
fn mixed_ordinary_and_expandable_lists() {
    let g = Gen {
        toggles: &[
            "expandable_segments:False",
            "expandable_segments:True",
            "expandable_segments:False",
            "expandable_segments:True,expandable_segments_reclaim:True",
            "expandable_segments:True",
        ],
        ..Gen::new(Sizes::Even, 250)
    };
    for (conf, cap, base) in [
        (PLAIN20, 80 * MIB, 1200),
        (PLAIN2, 256 * MIB, 1230),
        (RECOMMENDED, 128 * MIB, 1260),
    ] {
        check(
            "mixed_lists",
            Case::new(conf, cap, Completion::Eager, 1),
            base,
            15,
            g,
        );
    }
}

/// Holes and frees during driver calls, often: `empty_cache` leaves unmapped ranges between
/// mapped blocks (room to grow by PyTorch's rule, not by reclaim's), and another thread
/// frees blocks while a request maps pages, so the list a credit's free would leave differs
/// from the one the request searched. Reclaim's rule and PyTorch's side by side.
#[test]
fn holes_and_frees_during_growth() {
    for (conf, cap, base) in [
        (RECLAIM2, 40 * MIB, 1300),
        (RECOMMENDED, 64 * MIB, 1330),
        (PLAIN2, 40 * MIB, 1360),
        (RECLAIM20, 160 * MIB, 1390),
    ] {
        let g = Gen::new(Sizes::Even, 200);
        let hit = check_seeds(
            "holes",
            &Case::new(conf, cap, Completion::Eager, 1),
            seeds(base, 15),
            |seed| seed % 4 == 3,
            |seed| {
                let mut r = Rng::new(seed ^ 0x0004_01E5);
                (0..g.len)
                    .map(|_| match r.below(100) {
                        0..=7 => Op::EmptyCache,
                        8..=17 => Op::GrowWithFree {
                            bytes: size(&mut r, g.sizes),
                            stream: 0,
                            pick: r.next() as usize,
                            k: 1 + r.below(3) as u8,
                            call: 0,
                            churn: if r.pct(30) { size(&mut r, g.sizes) } else { 0 },
                        },
                        18..=35 => Op::GrowWithFreeBeforeHole {
                            bytes: size(&mut r, g.sizes),
                            stream: 0,
                            pick: r.next() as usize,
                            k: 1 + r.below(3) as u8,
                            churn: if r.pct(20) { size(&mut r, g.sizes) } else { 0 },
                        },
                        _ => gen_op(&mut r, &g),
                    })
                    .collect()
            },
        );
        hit.report("holes");
    }
}
