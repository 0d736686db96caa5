//! `expandable_segments_small_page_bound` (in `ferrocuda_recommended`): a small block of an
//! expandable segment merges only with free neighbours inside its own 2 MiB page, and the
//! small pool grows by a page of its own instead of from the free block before its
//! unmapped tail. Each case runs with the key and without it (PyTorch's expandable rules),
//! and checks where the two differ.
#![allow(clippy::unwrap_used)]
use crate::common;
use common::{GIB, LEGACY, MIB, TestResult, setup};
use ferrocuda_alloc::CachingAllocator;
use ferrocuda_driver::fake::Completion;

const PLAIN: &str = "expandable_segments:True";
const BOUND: &str = "expandable_segments:True,expandable_segments_small_page_bound:True";

/// The sizes of the small pool's expandable blocks, in address order, and whether each is
/// free.
fn small_blocks(a: &CachingAllocator) -> Vec<(u64, bool)> {
    let (segments, _) = a.snapshot();
    segments
        .iter()
        .filter(|s| s.is_expandable && s.segment_type == "small")
        .flat_map(|s| s.blocks.iter())
        .map(|b| (b.size, b.state == "inactive"))
        .collect()
}

/// Four 1 MiB blocks fill two pages; the second and third are freed. They meet at the
/// pages' boundary: with the key they stay two blocks, without it they merge. Either way
/// the next 1 MiB request takes the lowest free 1 MiB (with the key) or splits the merged
/// run (without), and gets the same address.
#[test]
fn frees_do_not_merge_across_a_page_boundary() -> TestResult {
    for (config, merged) in [(BOUND, false), (PLAIN, true)] {
        let (_fake, a) = setup(8 * GIB, config, Completion::Eager);
        let p: Vec<_> = (0..4)
            .map(|_| a.allocate(MIB, LEGACY).map(|b| b.ptr.0))
            .collect::<Result<_, _>>()?;
        assert_eq!(
            p[2],
            p[0] + 2 * MIB,
            "{config}: the second page follows the first"
        );
        a.free(ferrocuda_types::DevicePtr(p[1]))?;
        a.free(ferrocuda_types::DevicePtr(p[2]))?;
        let want: Vec<(u64, bool)> = if merged {
            vec![(MIB, false), (2 * MIB, true), (MIB, false)]
        } else {
            vec![(MIB, false), (MIB, true), (MIB, true), (MIB, false)]
        };
        assert_eq!(small_blocks(&a), want, "{config}");
        let again = a.allocate(MIB, LEGACY)?.ptr.0;
        assert_eq!(again, p[1], "{config}");
        a.check_invariants()?;
    }
    Ok(())
}

/// Inside one page both neighbours merge as before: a page whose blocks are all free is one
/// free 2 MiB block.
#[test]
fn frees_merge_inside_a_page() -> TestResult {
    let (_fake, a) = setup(8 * GIB, BOUND, Completion::Eager);
    let p: Vec<_> = (0..4)
        .map(|_| a.allocate(512 * 1024, LEGACY).map(|b| b.ptr.0))
        .collect::<Result<_, _>>()?;
    for &x in &[p[0], p[2], p[1]] {
        a.free(ferrocuda_types::DevicePtr(x))?;
    }
    assert_eq!(
        small_blocks(&a),
        vec![(3 * 512 * 1024, true), (512 * 1024, false)]
    );
    a.free(ferrocuda_types::DevicePtr(p[3]))?;
    assert_eq!(small_blocks(&a), vec![(2 * MIB, true)]);
    a.check_invariants()?;
    Ok(())
}

/// A page holds 1.5 MiB in use and 512 KiB free; a 1 MiB request fits nowhere. PyTorch's
/// rule grows from the free 512 KiB before the unmapped tail (the block lands across the
/// boundary); with the key the new page is the block's own and the 512 KiB stays where it
/// is. Both map one page.
#[test]
fn growth_takes_a_page_of_its_own() -> TestResult {
    for (config, offset) in [(BOUND, 2 * MIB), (PLAIN, 3 * MIB / 2)] {
        let (_fake, a) = setup(8 * GIB, config, Completion::Eager);
        let base = a.allocate(MIB, LEGACY)?.ptr.0;
        a.allocate(512 * 1024, LEGACY)?;
        let grown = a.allocate(MIB, LEGACY)?.ptr.0;
        assert_eq!(grown, base + offset, "{config}");
        assert_eq!(
            common::stat(&a, "reserved_bytes.small_pool.current"),
            4 * MIB as i64,
            "{config}"
        );
        a.check_invariants()?;
    }
    Ok(())
}

/// The thread cache credits a block at a page's end whose page neighbour is in use even
/// when the next page starts with a free block (the free would not merge it): its pairs
/// reuse it and the figures are the single-lock path's.
#[test]
fn a_block_before_a_free_page_start_is_reused_as_on_the_single_lock_path() -> TestResult {
    let run = |config: &str| -> Result<(Vec<u64>, _), Box<dyn std::error::Error>> {
        let (_fake, a) = setup(8 * GIB, config, Completion::Eager);
        let p: Vec<_> = (0..4)
            .map(|_| a.allocate(MIB, LEGACY).map(|b| b.ptr.0))
            .collect::<Result<_, _>>()?;
        a.free(ferrocuda_types::DevicePtr(p[2]))?;
        let mut seen = Vec::new();
        for _ in 0..3 {
            a.free(ferrocuda_types::DevicePtr(p[1]))?;
            let again = a.allocate(MIB, LEGACY)?.ptr.0;
            seen.push(again);
            assert_eq!(again, p[1]);
        }
        a.check_invariants()?;
        Ok((seen, a.stats().to_map()))
    };
    let (cached, cached_stats) = run(BOUND)?;
    let (locked, locked_stats) = run(&format!("{BOUND},thread_cache:False"))?;
    assert_eq!(cached, locked);
    assert_eq!(cached_stats, locked_stats);
    Ok(())
}
