//! One thread: which block a free releases, and which frees are refused.
use crate::common::{D0, LEGACY, MIB, Rng};
use crate::{CONFIGS, allocated, device, invalid, refuse, release};
use ferrocuda_alloc::{Caching, CachingAllocator};
use ferrocuda_driver::FakeDriver;
use ferrocuda_driver::fake::{AddressPlan, WhenUnusable};
use ferrocuda_types::{AllocatorConfig, DevicePtr};
use std::collections::HashMap;
use std::sync::Arc;

/// `count` allocations of `bytes` on the legacy stream: their addresses.
fn take(a: &CachingAllocator, count: usize, bytes: u64) -> Vec<u64> {
    let one = |_| a.allocate(bytes, LEGACY).unwrap().ptr.0;
    (0..count).map(one).collect()
}

/// PyTorch's `free` (`get_allocated_block(ptr, true)`, else "invalid device pointer"):
/// with thousands of blocks live (more than the table of recent frees has entries, so its
/// entries collide and go stale), every free releases exactly the block allocated at that
/// address; a double free (also at once, while the thread cache may hold the block), a
/// free of an address since merged into a neighbour or released, and an interior address
/// are refused and change nothing. Allocated blocks always match a model of the program.
#[test]
fn thousands_of_live_blocks_free_exactly_and_refuse_stale_pointers() {
    for config in CONFIGS {
        let (_fake, a) = device(config);
        let mut rng = Rng::new(0xF4EE ^ config.len() as u64);
        let (mut live, mut at, mut gone) = (Vec::new(), HashMap::new(), Vec::new());
        let (mut bytes, mut frees, mut most) = (0i64, 0, 0);
        for step in 0..12_000 {
            let roll = rng.below(100);
            let what = format!("{config:?} step {step}");
            if live.is_empty() || roll < if live.len() < 2500 { 55 } else { 42 } {
                let n = match rng.below(100) {
                    0..=4 => MIB + rng.below(8 * MIB),
                    5 => 12 * MIB + rng.below(20 * MIB),
                    _ => 1 + rng.below(64 << 10),
                };
                let x = a.allocate(n, LEGACY).unwrap();
                assert!(at.insert(x.ptr.0, x.size).is_none(), "{what}: given twice");
                live.push((x.ptr.0, x.size));
                bytes += x.size as i64;
                most = most.max(live.len());
            } else if roll < 84 {
                let (p, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                at.remove(&p);
                assert_eq!(a.free(DevicePtr(p)), Ok(()), "{what}");
                (bytes, frees) = (bytes - size as i64, frees + 1);
                gone.push(p);
                // At once, nothing having settled the thread cache: the same pointer again.
                if rng.pct(30) {
                    assert_eq!(a.free(DevicePtr(p)), invalid(p), "{what}: at once");
                }
            } else if roll < 91 {
                let p = gone[rng.below(gone.len() as u64) as usize];
                if !at.contains_key(&p) {
                    refuse(&a, p, &format!("{what}: stale"));
                }
            } else if roll < 97 {
                let (p, size) = live[rng.below(live.len() as u64) as usize];
                if size > 512 {
                    let q = p + 512 * (1 + rng.below(size / 512 - 1));
                    refuse(&a, q, &format!("{what}: interior"));
                }
            } else if roll < 98 {
                a.empty_cache();
            } else {
                let stats = a.stats();
                assert_eq!(stats.allocated_bytes.all.current, bytes, "{what}");
                assert_eq!(stats.allocation.all.current, live.len() as i64, "{what}");
                live.sort_unstable();
                assert!(allocated(&a) == live, "{what}: allocated blocks");
            }
        }
        for (p, size) in std::mem::take(&mut live) {
            release(&a, p, size, config);
        }
        let busy = most > 2000 && frees > 3000;
        assert!(busy, "{config}: {most} live, {frees}");
        a.check_invariants().unwrap();
    }
}

/// PyTorch's `free_block` merges a freed block into its free neighbours, and a later
/// allocation may start at a merged-away address with another size (a new split): a free
/// of that address releases the new block's bytes; merged-away addresses are refused.
#[test]
fn an_address_handed_out_again_by_a_new_split_frees_the_new_block() {
    for config in CONFIGS {
        let (_fake, a) = device(config);
        let p = take(&a, 4, 4096);
        let next = p.windows(2).all(|w| w[1] == w[0] + 4096);
        assert!(next, "{config}: {p:x?}");
        release(&a, p[1], 4096, config);
        release(&a, p[2], 4096, config);
        refuse(&a, p[2], "merged into its predecessor");
        refuse(&a, p[1], "freed twice");
        // The merged 8 KiB are cut anew: 6 KiB at x1's address, 2 KiB after them.
        let (y, z) = (take(&a, 1, 6144)[0], take(&a, 1, 2048)[0]);
        assert_eq!((y, z), (p[1], p[1] + 6144), "{config}");
        refuse(&a, p[2], "inside the new block");
        release(&a, z, 2048, "the new 2 KiB");
        release(&a, y, 6144, "the new 6 KiB at x1's address");
        // Merging backwards: x0 takes the 8 KiB in, and 12 KiB go out again at x0.
        release(&a, p[0], 4096, config);
        assert_eq!(take(&a, 1, 12288), [p[0]], "{config}");
        refuse(&a, p[1], "merged into x0, inside w");
        release(&a, p[0], 12288, "w at x0's address");
        refuse(&a, p[0], "w freed twice");
        release(&a, p[3], 4096, config);
        assert!(allocated(&a).is_empty(), "{config}");
    }
}

/// PyTorch's `empty_cache` hands a free segment back (`cudaFree`), and the driver's next
/// `cudaMalloc` may give the same address to a new segment (here the fake device's address
/// plan does, twice). The old blocks' addresses are then free space or another block's
/// inside: freeing them is refused; a free of the old address releases the new block.
#[test]
fn a_segment_address_reissued_by_the_driver_frees_only_the_new_block() {
    const RECORDED: u64 = 0x7f00_0000_0000;
    for config in ["", "thread_cache:False"] {
        let plan = AddressPlan::new(vec![RECORDED; 3], WhenUnusable::Fail).unwrap();
        let base = plan.device_address(D0, RECORDED).0;
        let fake = FakeDriver::builder()
            .capacity(80 << 30)
            .address_plan(D0, plan);
        let parsed = AllocatorConfig::parse(config).unwrap();
        let a = CachingAllocator::new(Arc::new(fake.build()), D0, parsed, Caching::On).unwrap();
        let x = take(&a, 3, 8192);
        assert_eq!(x[0], base, "{config}: the plan's first address");
        x.iter()
            .for_each(|&p| release(&a, p, 8192, "the first segment's"));
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes.all.current, 0, "{config}");
        x.iter()
            .for_each(|&p| refuse(&a, p, "its segment released"));
        let y = a.allocate(3 * MIB, LEGACY).unwrap();
        assert_eq!(y.ptr.0, base, "{config}: the driver gave the address again");
        refuse(&a, x[1], "an old block's address inside the new one");
        release(&a, base, y.size, "the new large block at the old address");
        refuse(&a, base, "the new block freed twice");
        a.empty_cache();
        let z = [take(&a, 1, 4096)[0], take(&a, 1, 12288)[0]];
        assert_eq!(z, [base, base + 4096], "{config}: a third segment");
        refuse(&a, x[1], "inside z1");
        refuse(&a, x[2], "the start of the free rest");
        release(&a, z[1], 12288, "z1");
        release(&a, base, 4096, "z0 at the address of x0 and y");
    }
}

/// PyTorch's expandable segments: `empty_cache` unmaps the free pages of a segment a live
/// block keeps (a wholly free one is released), and later blocks are mapped at the
/// addresses earlier ones had, with other sizes. Each free releases the block now there;
/// old addresses inside it, or in unmapped space, are refused.
#[test]
fn expandable_pages_remapped_at_the_same_addresses_free_the_new_blocks() {
    for config in CONFIGS.into_iter().filter(|c| c.contains("expandable")) {
        let (_fake, a) = device(config);
        let anchor = take(&a, 1, 30 * MIB)[0];
        let p = take(&a, 3, 30 * MIB);
        assert_eq!(p, [1, 2, 3].map(|i| anchor + i * 30 * MIB), "{config}");
        p.iter()
            .for_each(|&q| release(&a, q, 30 * MIB, "the first mapping"));
        a.empty_cache();
        // (Pages of 20 MiB: the anchor's two stay mapped.)
        assert_eq!(a.stats().reserved_bytes.all.current, 40 << 20, "{config}");
        p.iter().for_each(|&q| refuse(&a, q, "unmapped"));
        let y = take(&a, 1, 50 * MIB)[0];
        assert_eq!(y, p[0], "{config}: mapped again after the anchor");
        refuse(&a, p[1], "x1's address inside y");
        let (z, w) = (take(&a, 1, 10 * MIB)[0], take(&a, 1, 30 * MIB)[0]);
        assert_eq!((z, w), (p[0] + 50 * MIB, p[2]), "{config}");
        release(&a, p[2], 30 * MIB, "w at x2's address");
        refuse(&a, p[2], "w freed twice");
        release(&a, p[0], 50 * MIB, "y at x0's address");
        refuse(&a, p[1], "free space after the merge");
        a.empty_cache();
        refuse(&a, p[0], "unmapped again");
        release(&a, z, 10 * MIB, "z, its neighbours unmapped");
        a.empty_cache();
        assert_eq!(take(&a, 3, 30 * MIB), p, "{config}: the same again");
        for &q in p.iter().rev() {
            release(&a, q, 30 * MIB, "the third mapping");
            refuse(&a, q, "the third mapping, twice");
        }
        release(&a, anchor, 30 * MIB, "the anchor");
        a.empty_cache();
        let reserved = a.stats().reserved_bytes.all.current;
        assert_eq!(reserved, 0, "{config}: released");
        refuse(&a, anchor, "its segment released");
        a.check_invariants().unwrap();
    }
}
