//! `round_size` with `roundup_power2_divisions` set, changed at run time, and set back.
use crate::common::{LEGACY, MIB, Rng};
use crate::{device, release};
use ferrocuda_alloc::CachingAllocator;
use ferrocuda_types::AllocatorConfig;

/// PyTorch's `round_size` (c10/cuda/CUDACachingAllocator.cpp) with the divisions `table`
/// (`CUDAAllocatorConfig::roundup_power2_divisions`: the interval of `floor(log2(n)) - 20`,
/// clamped to 0..=15): at least 512; above `512 * divisions` (divisions > 1),
/// `roundup_power2_next_division` (steps of the power of two below, cut in `divisions`);
/// else 512-byte steps.
fn torch_round(n: u64, table: &[u64; 16]) -> u64 {
    let log = n.max(1).ilog2();
    let divisions = table[(log.saturating_sub(20) as usize).min(15)];
    if divisions > 1 && n > 512 * divisions {
        let step = (1u64 << log) >> divisions.ilog2();
        return n.div_ceil(step) * step;
    }
    n.max(1).div_ceil(512) * 512
}

/// The block PyTorch hands out for `n` bytes from a new segment (2 MiB, 20 MiB, or the
/// rounded size in 2 MiB steps from 10 MiB): the rounded size, or the whole segment where
/// the rest is at most 1 MiB (`should_split`, large pool).
fn torch_block(n: u64, table: &[u64; 16]) -> u64 {
    let r = torch_round(n, table);
    let segment = r.div_ceil(2 * MIB) * 2 * MIB;
    let split = r < 10 * MIB || segment - r > MIB;
    if split { r } else { segment }
}

/// Sizes around every power of two and 512-byte step that rounding could get wrong.
fn sizes() -> Vec<u64> {
    let mut v = vec![
        1, 511, 512, 513, 2047, 2049, 3000, 5000, 9000, 65_537, 700_001,
    ];
    for mib in [1, 2, 3, 5, 8, 9, 12, 17, 33, 65, 129, 300, 513, 1100] {
        v.extend([mib * MIB - 1, mib * MIB, mib * MIB + 1, mib * MIB + 12_345]);
    }
    let mut rng = Rng::new(7);
    for _ in 0..40 {
        let bits = 10 + rng.below(21);
        v.push(1 + rng.below(1 << bits));
    }
    v
}

/// The divisions table a settings string gives (`update_config` resets it first, as
/// PyTorch's re-parse does, so a string that does not name it means plain rounding).
fn table(settings: &str) -> [u64; 16] {
    let config = AllocatorConfig::parse(settings).unwrap();
    config.sizes.roundup_power2_divisions
}

/// Requests repeated across a settings change (the last of one stage, parked in the
/// thread cache, is the first of the next): small and 1–10 MiB, whose block is the rounded
/// size whatever is cached.
const REPEATED: [u64; 4] = [9000, 5000, 300_001, 3 * MIB + 1];

/// Every size is PyTorch's block for `settings`' table (from a new segment, but the
/// repeated requests first and last); returns how many sizes the divisions changed.
fn check_every_size(a: &CachingAllocator, settings: &str) -> usize {
    let t = table(settings);
    assert_eq!(a.config().sizes.roundup_power2_divisions, t, "{settings}");
    let mut rounded = 0;
    let (first, last) = (REPEATED.iter().rev(), REPEATED.iter());
    for (i, &n) in first.chain(&sizes()).chain(last).enumerate() {
        let repeated = i < REPEATED.len() || i >= sizes().len() + REPEATED.len();
        if !repeated {
            a.empty_cache();
        }
        let x = a.allocate(n, LEGACY).unwrap();
        assert_eq!(x.size, torch_block(n, &t), "{settings}: {n} bytes");
        rounded += usize::from(torch_round(n, &t) != n.div_ceil(512).max(1) * 512);
        release(a, x.ptr.0, x.size, settings);
    }
    rounded
}

/// PyTorch's `round_size` under `roundup_power2_divisions` set at creation, changed with
/// `update_config` (`_set_allocator_settings`) to other tables, to settings that reset it
/// (plain rounding), to tables of 0, 1 and 2, back again, and kept by updates that fail.
#[test]
fn sizes_round_as_pytorch_across_update_config() {
    let stages = [
        "roundup_power2_divisions:[2:1,4:8,>:2]",
        "garbage_collection_threshold:0.9",
        "roundup_power2_divisions:4",
        "roundup_power2_divisions:[256:0,>:1]",
        "roundup_power2_divisions:[256:2,>:1]",
        "roundup_power2_divisions:[1:16,64:4,128:0,>:8]",
        "",
        "roundup_power2_divisions:2",
        "roundup_power2_divisions:1",
        "roundup_power2_divisions:8",
    ];
    for config in ["roundup_power2_divisions:8", "thread_cache:False"] {
        let (_fake, a) = device(config);
        let start = config.strip_prefix("thread_cache:False").unwrap_or(config);
        let mut rounded = check_every_size(&a, start);
        for settings in stages {
            a.update_config(settings).unwrap();
            let n = check_every_size(&a, settings);
            let plain = table(settings).iter().all(|&d| d <= 1);
            assert_eq!(n == 0, plain, "{settings}");
            rounded += n;
        }
        // Refused updates change nothing: divisions 8 stay.
        for bad in ["roundup_power2_divisions:3", "backend:cudaMallocAsync"] {
            assert!(a.update_config(bad).is_err(), "{bad}");
            check_every_size(&a, "roundup_power2_divisions:8");
        }
        assert!(rounded > 100, "{config}: {rounded} rounded by divisions");
    }
}
