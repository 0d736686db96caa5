//! Allocator statistics with PyTorch's exact keys (allocator spec §6) and its
//! `memory_summary` table.
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One statistic: `current`, `peak`, and the totals `allocated` and `freed`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    /// The value now.
    pub current: i64,
    /// The highest `current` since the last peak reset.
    pub peak: i64,
    /// Sum of increases since the last accumulated reset.
    pub allocated: i64,
    /// Sum of decreases since the last accumulated reset.
    pub freed: i64,
}

impl Stat {
    /// Adds `n`.
    #[inline]
    pub fn increase(&mut self, n: i64) {
        self.current += n;
        self.peak = self.peak.max(self.current);
        self.allocated += n;
    }

    /// Subtracts `n`.
    #[inline]
    pub fn decrease(&mut self, n: i64) {
        self.current -= n;
        debug_assert!(self.current >= 0, "stat went negative");
        self.freed += n;
    }

    /// Counts `n` that rose and fell again (current and peak unchanged).
    #[inline]
    pub fn cycle(&mut self, n: i64) {
        self.allocated += n;
        self.freed += n;
    }

    /// `reset_peak`: the peak becomes the current value.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// `reset_accumulated`: the totals go back to zero.
    pub fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.freed = 0;
    }
}

/// Which pool a statistic entry counts: PyTorch's `StatType`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PoolKind {
    /// Blocks of at most 1 MiB, carved from 2 MiB segments.
    Small,
    /// Everything larger.
    Large,
}

impl PoolKind {
    /// 0 for the small pool, 1 for the large: an index into per-pool tables.
    #[inline]
    pub const fn index(self) -> usize {
        match self {
            PoolKind::Small => 0,
            PoolKind::Large => 1,
        }
    }
}

/// A statistic for all pools, the small pool and the large pool.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatArray {
    /// All pools (`all`).
    pub all: Stat,
    /// The small pool (`small_pool`).
    pub small_pool: Stat,
    /// The large pool (`large_pool`).
    pub large_pool: Stat,
}

impl StatArray {
    /// Adds `n` to `all` and to `pool`.
    #[inline]
    pub fn increase(&mut self, pool: PoolKind, n: i64) {
        self.all.increase(n);
        self.pool_mut(pool).increase(n);
    }

    /// Subtracts `n` from `all` and from `pool`.
    #[inline]
    pub fn decrease(&mut self, pool: PoolKind, n: i64) {
        self.all.decrease(n);
        self.pool_mut(pool).decrease(n);
    }

    /// Counts `n` that rose and fell again in `all` and `pool`.
    #[inline]
    pub fn cycle(&mut self, pool: PoolKind, n: i64) {
        self.all.cycle(n);
        self.pool_mut(pool).cycle(n);
    }

    /// `all` and `pool`.
    pub fn pair(&self, pool: PoolKind) -> [&Stat; 2] {
        [
            &self.all,
            match pool {
                PoolKind::Small => &self.small_pool,
                PoolKind::Large => &self.large_pool,
            },
        ]
    }

    fn pool_mut(&mut self, pool: PoolKind) -> &mut Stat {
        match pool {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

    fn each(&mut self) -> [&mut Stat; 3] {
        [&mut self.all, &mut self.small_pool, &mut self.large_pool]
    }
}

/// Everything `torch.cuda.memory_stats` reports for one device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStats {
    /// Live allocated blocks (`allocation`).
    pub allocation: StatArray,
    /// Live device segments (`segment`).
    pub segment: StatArray,
    /// Allocated blocks plus freed blocks waiting for their streams (`active`).
    pub active: StatArray,
    /// Free pieces of partly used segments (`inactive_split`).
    pub inactive_split: StatArray,
    /// Bytes of allocated blocks (`allocated_bytes`).
    pub allocated_bytes: StatArray,
    /// Bytes held from the driver (`reserved_bytes`).
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks (`active_bytes`).
    pub active_bytes: StatArray,
    /// Bytes of inactive split blocks: "non-releasable" (`inactive_split_bytes`).
    pub inactive_split_bytes: StatArray,
    /// Un-rounded requested bytes of active blocks (`requested_bytes`).
    pub requested_bytes: StatArray,
    /// Allocated blocks of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Allocations that succeeded only after freeing the whole cache.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors raised.
    pub num_ooms: i64,
    /// Times every outstanding event was synchronized.
    pub num_sync_all_streams: i64,
    /// Device allocations (`cudaMalloc` and expandable maps).
    pub num_device_alloc: i64,
    /// Device frees.
    pub num_device_free: i64,
    /// Allocations refused up front by `throw_on_cudamalloc_oom`.
    pub num_oom_rejections: i64,
    /// `max_split_size` in bytes, or -1 when unlimited.
    pub max_split_size: i64,
}

impl DeviceStats {
    /// The stat arrays with their key names, in PyTorch's order.
    pub fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// `torch.cuda.reset_peak_memory_stats`.
    pub fn reset_peak(&mut self) {
        self.arrays_mut()
            .into_iter()
            .flat_map(StatArray::each)
            .for_each(Stat::reset_peak);
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// `torch.cuda.reset_accumulated_memory_stats`.
    pub fn reset_accumulated(&mut self) {
        self.arrays_mut()
            .into_iter()
            .flat_map(StatArray::each)
            .for_each(Stat::reset_accumulated);
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_oom_rejections = 0;
    }

    /// The flat, sorted dictionary of `torch.cuda.memory_stats()`.
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        let mut put_stat = |prefix: String, s: &Stat| {
            for (k, v) in [
                ("current", s.current),
                ("peak", s.peak),
                ("allocated", s.allocated),
                ("freed", s.freed),
            ] {
                m.insert(format!("{prefix}.{k}"), v);
            }
        };
        for (name, a) in self.arrays() {
            for (pool, s) in [
                ("all", &a.all),
                ("small_pool", &a.small_pool),
                ("large_pool", &a.large_pool),
            ] {
                put_stat(format!("{name}.{pool}"), s);
            }
        }
        put_stat("oversize_allocations".into(), &self.oversize_allocations);
        put_stat("oversize_segments".into(), &self.oversize_segments);
        for (k, v) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("num_oom_rejections", self.num_oom_rejections),
            ("max_split_size", self.max_split_size),
        ] {
            m.insert(k.to_owned(), v);
        }
        m
    }

    /// `torch.cuda.memory_summary(device, abbreviated)`: PyTorch's 75-wide table.
    pub fn summary(&self, device: u16, abbreviated: bool) -> String {
        let rule = |c: char| c.to_string().repeat(75);
        let mut lines = vec![
            rule('='),
            format!(
                " {:16} PyTorch CUDA memory summary, device ID {:<17} ",
                "", device
            ),
            rule('-'),
            format!(
                "  {:9} CUDA OOMs: {:<12} | {:6} cudaMalloc retries: {:<8}  ",
                "", self.num_ooms, "", self.num_alloc_retries
            ),
            rule('='),
            "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "
                .to_owned(),
        ];
        let blocks: [(&str, &StatArray, bool); 9] = [
            ("Allocated memory", &self.allocated_bytes, true),
            ("Active memory", &self.active_bytes, true),
            ("Requested memory", &self.requested_bytes, true),
            ("GPU reserved memory", &self.reserved_bytes, true),
            ("Non-releasable memory", &self.inactive_split_bytes, true),
            ("Allocations", &self.allocation, false),
            ("Active allocs", &self.active, false),
            ("GPU reserved segments", &self.segment, false),
            ("Non-releasable allocs", &self.inactive_split, false),
        ];
        for (name, a, bytes) in blocks {
            lines.push(rule('-'));
            let fmt = |v: i64, reference: i64| {
                if bytes {
                    format_bytes(v, reference)
                } else {
                    format_count(v, reference)
                }
            };
            let rows: &[(&str, &Stat)] = if abbreviated {
                &[("", &a.all)]
            } else {
                &[
                    ("", &a.all),
                    ("      from large pool", &a.large_pool),
                    ("      from small pool", &a.small_pool),
                ]
            };
            for (label, s) in rows {
                let label = if label.is_empty() { name } else { label };
                lines.push(summary_row(label, s, &a.all, fmt));
            }
        }
        // A rule above each oversize row (torch/cuda/memory.py, `memory_summary`).
        for (name, s) in [
            ("Oversize allocations", &self.oversize_allocations),
            ("Oversize GPU segments", &self.oversize_segments),
        ] {
            lines.push(rule('-'));
            lines.push(summary_row(name, s, s, format_count));
        }
        lines.push(rule('='));
        let mut out = String::new();
        for l in lines {
            out.push('|');
            out.push_str(&l);
            out.push_str("|\n");
        }
        out
    }
}

/// `"{n:6d} {unit}"`, dividing by 1024 while the reference is at least 768 KiB-equivalent.
fn format_bytes(mut n: i64, mut reference: i64) -> String {
    let units = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    while unit + 1 < units.len() && reference >= 768 * 1024 {
        reference /= 1024;
        n /= 1024;
        unit += 1;
    }
    format!("{n:6} {}", units[unit])
}

/// `"{n:7d} {p} "`, dividing by 1000 while the reference is at least 750 000.
fn format_count(mut n: i64, mut reference: i64) -> String {
    let prefixes = [' ', 'K', 'M'];
    let mut p = 0;
    while p + 1 < prefixes.len() && reference >= 750_000 {
        reference /= 1000;
        n /= 1000;
        p += 1;
    }
    format!("{n:7} {} ", prefixes[p])
}

/// PyTorch's `format_size`: bytes up to 1 KiB, then KiB, MiB, GiB with two decimals.
pub fn format_size(n: u64) -> String {
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    const GIB: u64 = 1024 * MIB;
    match n {
        n if n <= KIB => format!("{n} bytes"),
        n if n <= MIB => format!("{:.2} KiB", n as f64 / KIB as f64),
        n if n <= GIB => format!("{:.2} MiB", n as f64 / MIB as f64),
        n => format!("{:.2} GiB", n as f64 / GIB as f64),
    }
}

/// One row of `memory_summary`: `label`, then current, peak, allocated and freed of `s`,
/// each formatted by `fmt` against the same field of `reference` (which picks the unit).
fn summary_row(
    label: &str,
    s: &Stat,
    reference: &Stat,
    fmt: impl Fn(i64, i64) -> String,
) -> String {
    format!(
        " {:<21} | {} | {} | {} | {} ",
        label,
        fmt(s.current, reference.current),
        fmt(s.peak, reference.peak),
        fmt(s.allocated, reference.allocated),
        fmt(s.freed, reference.freed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_pytorch() {
        let m = DeviceStats {
            max_split_size: -1,
            ..DeviceStats::default()
        }
        .to_map();
        assert_eq!(m.len(), 9 * 3 * 4 + 2 * 4 + 7);
        for k in [
            "allocation.all.current",
            "requested_bytes.small_pool.freed",
            "oversize_segments.peak",
            "num_device_free",
            "max_split_size",
        ] {
            assert!(m.contains_key(k), "{k}");
        }
        assert_eq!(m["max_split_size"], -1);
    }

    #[test]
    fn stats_and_resets() {
        let mut s = DeviceStats::default();
        s.allocated_bytes.increase(PoolKind::Large, 100);
        s.allocated_bytes.decrease(PoolKind::Large, 60);
        let a = s.allocated_bytes;
        assert_eq!(
            (a.all.current, a.all.peak, a.all.allocated, a.all.freed),
            (40, 100, 100, 60)
        );
        assert_eq!(a.small_pool, Stat::default());
        s.reset_peak();
        assert_eq!(s.allocated_bytes.large_pool.peak, 40);
        s.reset_accumulated();
        assert_eq!(
            (s.allocated_bytes.all.allocated, s.allocated_bytes.all.freed),
            (0, 0)
        );
    }

    #[test]
    fn summary_layout() {
        let mut s = DeviceStats::default();
        s.allocated_bytes.increase(PoolKind::Large, 1177 << 20);
        s.allocation.increase(PoolKind::Small, 3);
        s.num_ooms = 1;
        s.num_alloc_retries = 3;
        let text = s.summary(0, false);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines.iter().all(|l| l.chars().count() == 77),
            "77 wide with the borders"
        );
        assert_eq!(
            lines[1],
            "|                  PyTorch CUDA memory summary, device ID 0                 |"
        );
        assert_eq!(
            lines[3],
            "|            CUDA OOMs: 1            |        cudaMalloc retries: 3         |"
        );
        assert!(
            text.contains(
                "| Allocated memory      |   1177 MiB |   1177 MiB |   1177 MiB |      0 B   |"
            ),
            "{text}"
        );
        assert!(text.contains("|       from small pool |      0 B   |"));
        assert_eq!(s.summary(0, true).lines().count(), lines.len() - 18);
        // torch/cuda/memory.py puts a rule above each oversize row, then the closing one.
        let rule = format!("|{}|", "-".repeat(75));
        let n = lines.len();
        assert_eq!(
            [
                lines[n - 5],
                &lines[n - 4][..23],
                lines[n - 3],
                &lines[n - 2][..23]
            ],
            [
                rule.as_str(),
                "| Oversize allocations ",
                rule.as_str(),
                "| Oversize GPU segments"
            ]
        );
        assert_eq!(lines[n - 1], format!("|{}|", "=".repeat(75)));
    }

    #[test]
    fn format_size_matches_pytorch() {
        assert_eq!(format_size(1024), "1024 bytes");
        assert_eq!(format_size(2 << 20), "2.00 MiB");
        assert_eq!(format_size(800_000_000 << 30), "800000000.00 GiB");
    }
}
