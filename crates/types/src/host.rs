//! Pinned host memory as the layers pass it around ([`HostRange`]), and the pinned host
//! allocator's statistics with PyTorch's keys (allocator spec §6.5):
//! `torch.cuda.host_memory_stats()`.
use crate::{HostPtr, Stat};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A range of page-locked host memory: `bytes` at `offset` into a driver allocation. A
/// caching host allocator hands these out (its reserve segment serves many ranges from one
/// allocation); the driver's pinned copies take `(base, offset)`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HostRange {
    /// The driver allocation it lies in.
    pub base: HostPtr,
    /// Where it starts in `base`.
    pub offset: u64,
    /// Its length.
    pub bytes: u64,
}

impl HostRange {
    /// The whole of a driver allocation.
    pub fn whole(base: HostPtr) -> HostRange {
        HostRange {
            base,
            offset: 0,
            bytes: base.bytes,
        }
    }

    /// Its host address (`data_ptr()`).
    pub fn addr(&self) -> u64 {
        self.base.raw + self.offset
    }
}

/// A timing statistic in microseconds: PyTorch's `DurationStat`
/// (c10/core/CachingDeviceAllocator.h).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurationStat {
    /// Sum of the recorded durations.
    pub total: i64,
    /// The longest one since the last peak reset.
    pub max: i64,
    /// The shortest one since the last peak reset (0: none yet).
    pub min: i64,
    /// How many were recorded since the last accumulated reset.
    pub count: i64,
}

impl DurationStat {
    /// Records one duration (as PyTorch: a `min` of 0 means "none yet", so a 0 µs call is
    /// forgotten by the next one).
    pub fn increase(&mut self, amount: i64) {
        self.total += amount;
        self.count += 1;
        self.max = self.max.max(amount);
        self.min = if self.min == 0 {
            amount
        } else {
            self.min.min(amount)
        };
    }

    /// `reset_accumulated`: total and count go back to zero.
    pub fn reset_accumulated(&mut self) {
        self.total = 0;
        self.count = 0;
    }

    /// `reset_peak`: min and max go back to zero.
    pub fn reset_peak(&mut self) {
        self.min = 0;
        self.max = 0;
    }

    /// `total / count`, 0 before any call (the `avg` key).
    pub fn avg(&self) -> i64 {
        if self.count == 0 {
            0
        } else {
            self.total / self.count
        }
    }
}

/// Everything `torch.cuda.host_memory_stats()` reports (PyTorch's `HostStats`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostStats {
    /// Blocks handed out and not freed yet (`active_requests`). Its peak is the sum of
    /// per-bucket peaks, an approximation, as PyTorch's.
    pub active_requests: Stat,
    /// Bytes of those blocks (`active_bytes`), peak summed per bucket likewise.
    pub active_bytes: Stat,
    /// Blocks owned, handed out or cached (`allocations`).
    pub allocations: Stat,
    /// Bytes of those blocks (`allocated_bytes`).
    pub allocated_bytes: Stat,
    /// Time in `cudaHostAlloc` / `cudaHostRegister` (and the pre-fault), µs.
    pub host_alloc_time: DurationStat,
    /// Time in `cudaFreeHost` / `cudaHostUnregister` + `free`, µs.
    pub host_free_time: DurationStat,
    /// Blocks obtained from the driver: `allocations.allocated`.
    pub num_host_alloc: i64,
    /// Blocks given back to the driver: `allocations.freed`.
    pub num_host_free: i64,
}

impl HostStats {
    /// The flat dictionary of `torch.cuda.host_memory_stats()`: `allocations.*`,
    /// `allocated_bytes.*`, `active_requests.*`, `active_bytes.*` (each `current`, `peak`,
    /// `allocated`, `freed`), `num_host_alloc`, `num_host_free`, and
    /// `host_alloc_time.*` / `host_free_time.*` (`total`, `max`, `min`, `count`, `avg`).
    pub fn to_map(&self) -> BTreeMap<String, i64> {
        let mut m = BTreeMap::new();
        for (name, s) in [
            ("allocations", &self.allocations),
            ("allocated_bytes", &self.allocated_bytes),
            ("active_requests", &self.active_requests),
            ("active_bytes", &self.active_bytes),
        ] {
            for (field, v) in [
                ("current", s.current),
                ("peak", s.peak),
                ("allocated", s.allocated),
                ("freed", s.freed),
            ] {
                m.insert(format!("{name}.{field}"), v);
            }
        }
        for (name, d) in [
            ("host_alloc_time", &self.host_alloc_time),
            ("host_free_time", &self.host_free_time),
        ] {
            for (field, v) in [
                ("total", d.total),
                ("max", d.max),
                ("min", d.min),
                ("count", d.count),
                ("avg", d.avg()),
            ] {
                m.insert(format!("{name}.{field}"), v);
            }
        }
        m.insert("num_host_alloc".into(), self.num_host_alloc);
        m.insert("num_host_free".into(), self.num_host_free);
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_stat_follows_pytorch() {
        let mut d = DurationStat::default();
        d.increase(5);
        d.increase(3);
        d.increase(9);
        assert_eq!((d.total, d.max, d.min, d.count, d.avg()), (17, 9, 3, 3, 5));
        d.reset_peak();
        assert_eq!((d.min, d.max), (0, 0));
        d.increase(4);
        assert_eq!((d.min, d.max), (4, 4));
        d.reset_accumulated();
        assert_eq!((d.total, d.count, d.avg()), (0, 0, 0));
    }

    #[test]
    fn keys_are_pytorchs() {
        let keys: Vec<String> = HostStats::default().to_map().into_keys().collect();
        assert_eq!(keys.len(), 4 * 4 + 2 * 5 + 2);
        for k in [
            "active_bytes.peak",
            "active_requests.current",
            "allocated_bytes.freed",
            "allocations.allocated",
            "host_alloc_time.avg",
            "host_free_time.count",
            "num_host_alloc",
            "num_host_free",
        ] {
            assert!(keys.iter().any(|x| x == k), "{k}");
        }
    }
}
