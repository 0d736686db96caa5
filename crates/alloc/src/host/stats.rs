//! The host allocator's statistics as PyTorch stages them (`HostStatsStaged`): blocks owned
//! counted once, blocks handed out counted per bucket (PyTorch keeps those under the
//! bucket locks), and `host_memory_stats` summing the buckets, peaks included, so the
//! active peaks are the same approximation as PyTorch's.
use super::BUCKETS;
use ferrocuda_types::{DurationStat, HostStats, Stat};

#[derive(Debug)]
pub(crate) struct Stats {
    /// Blocks owned, handed out or cached.
    allocations: Stat,
    allocated_bytes: Stat,
    /// Blocks handed out and not yet available again, per bucket.
    active: Vec<Stat>,
    active_bytes: Vec<Stat>,
    pub(crate) host_alloc_time: DurationStat,
    pub(crate) host_free_time: DurationStat,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            allocations: Stat::default(),
            allocated_bytes: Stat::default(),
            active: vec![Stat::default(); BUCKETS],
            active_bytes: vec![Stat::default(); BUCKETS],
            host_alloc_time: DurationStat::default(),
            host_free_time: DurationStat::default(),
        }
    }
}

fn sum(stats: &[Stat]) -> Stat {
    stats.iter().fold(Stat::default(), |a, s| Stat {
        current: a.current + s.current,
        peak: a.peak + s.peak,
        allocated: a.allocated + s.allocated,
        freed: a.freed + s.freed,
    })
}

impl Stats {
    /// A new block, handed out.
    pub(crate) fn add(&mut self, index: usize, size: u64) {
        self.allocations.increase(1);
        self.allocated_bytes.increase(size as i64);
        self.activate(index, size);
    }

    /// A cached block handed out again (its bytes: PyTorch #192722).
    pub(crate) fn activate(&mut self, index: usize, size: u64) {
        self.active[index].increase(1);
        self.active_bytes[index].increase(size as i64);
    }

    /// A block no longer in use: cached, or about to be released. PyTorch decrements these
    /// on both paths since #169561 (before, a free without events left them up, and an
    /// event-driven free took -1 bytes off).
    pub(crate) fn deactivate(&mut self, index: usize, size: u64) {
        self.active[index].decrease(1);
        self.active_bytes[index].decrease(size as i64);
    }

    /// A block given back to the driver.
    pub(crate) fn remove(&mut self, size: u64) {
        self.allocations.decrease(1);
        self.allocated_bytes.decrease(size as i64);
    }

    /// `getStats`.
    pub(crate) fn snapshot(&self) -> HostStats {
        HostStats {
            active_requests: sum(&self.active),
            active_bytes: sum(&self.active_bytes),
            allocations: self.allocations,
            allocated_bytes: self.allocated_bytes,
            host_alloc_time: self.host_alloc_time,
            host_free_time: self.host_free_time,
            num_host_alloc: self.allocations.allocated,
            num_host_free: self.allocations.freed,
        }
    }

    fn each(&mut self) -> impl Iterator<Item = &mut Stat> {
        [&mut self.allocations, &mut self.allocated_bytes]
            .into_iter()
            .chain(self.active.iter_mut())
            .chain(self.active_bytes.iter_mut())
    }

    /// `resetAccumulatedStats`.
    pub(crate) fn reset_accumulated(&mut self) {
        self.each().for_each(Stat::reset_accumulated);
        self.host_alloc_time.reset_accumulated();
        self.host_free_time.reset_accumulated();
    }

    /// `resetPeakStats`.
    pub(crate) fn reset_peak(&mut self) {
        self.each().for_each(Stat::reset_peak);
        self.host_alloc_time.reset_peak();
        self.host_free_time.reset_peak();
    }

    /// Whether the current values equal a recount: `owned` the sizes of every block,
    /// `live` those handed out or waiting for events.
    pub(crate) fn check(
        &self,
        owned: impl Iterator<Item = u64>,
        live: impl Iterator<Item = u64>,
    ) -> Result<(), String> {
        let count = |it: &mut dyn Iterator<Item = u64>| {
            it.fold((0i64, 0i64), |(n, b), s| (n + 1, b + s as i64))
        };
        let (owned, live) = (count(&mut { owned }), count(&mut { live }));
        let snap = self.snapshot();
        let seen = (
            (snap.allocations.current, snap.allocated_bytes.current),
            (snap.active_requests.current, snap.active_bytes.current),
        );
        if seen == (owned, live) {
            Ok(())
        } else {
            Err(format!(
                "statistics {seen:?} differ from the recount {:?}",
                (owned, live)
            ))
        }
    }
}
