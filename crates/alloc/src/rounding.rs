//! Size rounding and segment sizes (allocator spec §1).
use ferrocuda_types::{AllocatorConfig, PoolKind, ROUNDUP_INTERVALS};

/// Every block is a multiple of this, and no smaller.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Requests of at most this go to the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Size of every small-pool segment.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Large requests below this get a whole large segment.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Larger requests get a segment rounded up to a multiple of this.
pub const ROUND_LARGE: u64 = 2 << 20;
/// Requests of this size or more fail at once.
pub const ONE_EXABYTE: u64 = 1 << 60;

/// `round_size`: the size a request is stored and searched with.
pub fn round_size(n: u64, config: &AllocatorConfig) -> u64 {
    // (Below 512 bytes both ways give 512; `| 1` keeps `ilog2` defined at 0.)
    let index = ((n | 1).ilog2().saturating_sub(20) as usize).min(ROUNDUP_INTERVALS - 1);
    let divisions = config.sizes.roundup_power2_divisions[index];
    if divisions > 1 && n > MIN_BLOCK_SIZE * divisions {
        return next_power2_division(n, divisions);
    }
    round_plain(n)
}

/// Whether [`round_size`] under `config` is [`round_plain`] for every size: no
/// `roundup_power2_divisions` entry above 1 (PyTorch's default). The allocator keeps the
/// answer beside its configuration, and its hot path skips the table.
pub fn rounds_plainly(config: &AllocatorConfig) -> bool {
    config
        .sizes
        .roundup_power2_divisions
        .iter()
        .all(|&d| d <= 1)
}

/// `round_size` without `roundup_power2_divisions`: `n.div_ceil(512) * 512`, at least 512,
/// by a mask (the same overflow above `u64::MAX - 511`; the allocators refuse such requests
/// first).
#[inline]
pub fn round_plain(n: u64) -> u64 {
    (n.max(1) + (MIN_BLOCK_SIZE - 1)) & !(MIN_BLOCK_SIZE - 1)
}

fn next_power2_division(n: u64, divisions: u64) -> u64 {
    if n.is_power_of_two() {
        return n;
    }
    let low = 1u64 << n.ilog2();
    let step = low / divisions;
    if step == 0 {
        return 2 * low;
    }
    n.div_ceil(step) * step
}

/// Which pool a rounded size belongs to.
pub fn pool_kind(rounded: u64) -> PoolKind {
    if rounded <= SMALL_SIZE {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// `allocation_size`: how big a new segment for a rounded request is.
pub fn allocation_size(rounded: u64, config: &AllocatorConfig) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        config.sizes.large_segment_size
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn plain_rounding() {
        let c = AllocatorConfig::default();
        assert_eq!(round_size(0, &c), 512);
        assert_eq!(round_size(1, &c), 512);
        assert_eq!(round_size(513, &c), 1024);
        assert_eq!(round_size(MIB + 1, &c), MIB + 512);
        // The mask gives PyTorch's `512 * ceil(n / 512)` everywhere, edges included.
        let mut n = 3u64;
        for _ in 0..100_000 {
            n = n
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            for size in [
                n >> (n % 60),
                (n >> 40) / 512 * 512,
                (n >> 40) / 512 * 512 + 1,
            ] {
                let size = size.min(ONE_EXABYTE - 1);
                assert_eq!(round_size(size, &c), size.div_ceil(512).max(1) * 512);
                assert_eq!(round_plain(size), round_size(size, &c));
            }
        }
        assert_eq!(
            (allocation_size(512, &c), allocation_size(MIB, &c)),
            (2 * MIB, 2 * MIB)
        );
        assert_eq!(allocation_size(MIB + 512, &c), 20 * MIB);
        assert_eq!(allocation_size(10 * MIB, &c), 10 * MIB);
        assert_eq!(allocation_size(10 * MIB + 512, &c), 12 * MIB);
        assert_eq!(
            (pool_kind(MIB), pool_kind(MIB + 512)),
            (PoolKind::Small, PoolKind::Large)
        );
    }

    /// PyTorch's reference for the tests below (`power2_div` in test_cuda.py).
    fn power2_div(size: u64, divisions: u64) -> u64 {
        let pow2 = size.next_power_of_two();
        if pow2 == size {
            return pow2;
        }
        let step = pow2 / 2 / divisions;
        let mut ret = pow2 / 2;
        while ret < size {
            ret += step;
        }
        ret
    }

    /// The exact sizes of PyTorch's `test_allocator_settings` and
    /// `test_roundup_power2_divisions_{0,1}`.
    #[test]
    fn test_allocator_settings_sizes() {
        let parse = |s: &str| AllocatorConfig::parse(s).expect("a valid config");
        let nbytes = 4 * 21 * MIB; // torch.rand(21 Mi floats)
        let nbytes_big = 4 * 100 * MIB;
        assert_eq!(round_size(nbytes, &parse("")), nbytes);
        let c = parse("roundup_power2_divisions:4");
        assert_eq!(round_size(nbytes, &c), power2_div(nbytes, 4));
        assert_eq!(round_size(nbytes, &c), 96 * MIB);
        let c = parse(
            "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]",
        );
        assert_eq!(round_size(nbytes, &c), power2_div(nbytes, 8));
        assert_eq!(round_size(nbytes_big, &c), power2_div(nbytes_big, 2));
        let c = parse("roundup_power2_divisions:[128:1,256:0,512:4]");
        assert_eq!(
            round_size(4 * 67 * MIB, &c),
            4 * 67 * MIB,
            "0 disables rounding"
        );
        assert_eq!(round_size(4 * 130 * MIB, &c), power2_div(4 * 130 * MIB, 4));
        let small = 4 * 21 * 125 * 125;
        assert_eq!(
            round_size(small, &parse("roundup_power2_divisions:1")),
            small.div_ceil(512) * 512,
            "1 is plain rounding (#161139)"
        );
        // Up to 512 * divisions bytes keep 512-byte rounding.
        let c = parse("roundup_power2_divisions:4");
        assert_eq!((round_size(1200, &c), round_size(9000, &c)), (1536, 10240));
        assert_eq!(next_power2_division(1200, 4), 1280);
    }

    /// The allocator skips the table exactly when no entry rounds (0 and 1 do not).
    #[test]
    fn plain_configurations_are_the_ones_without_divisions() {
        let plainly = |s: &str| rounds_plainly(&AllocatorConfig::parse(s).expect("valid"));
        assert!(plainly(""));
        assert!(plainly("roundup_power2_divisions:1"));
        assert!(plainly("roundup_power2_divisions:[128:1,256:0,>:1]"));
        assert!(!plainly("roundup_power2_divisions:4"));
        assert!(!plainly("roundup_power2_divisions:[128:1,256:0,512:4]"));
    }
}
