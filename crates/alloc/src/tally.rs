//! The allocator's live statistics, kept in a form the hot path changes with few stores;
//! [`Tally::snapshot`] turns them into PyTorch's [`DeviceStats`] when someone reads them.
//!
//! Every allocation and free moves a dozen statistics, each with its `all` and pool entry,
//! each with `current`, `peak`, `allocated` and `freed`. Stored as such, that is about 50
//! memory writes per allocate/free pair, and the lock's atomic operations wait for pending
//! writes to drain. Two identities remove most of them:
//! - `freed = base + allocated - current`, where `base` is `current` at the last reset of
//!   the accumulated totals: a decrease writes `current` only;
//! - `all` is the sum of the two pools for `current`, `allocated` and `freed`: only its
//!   `peak` (the peak of the sum, not the sum of the peaks) is kept, written when it moves;
//! - `active` and `active_bytes` equal `allocation` and `allocated_bytes` in every field
//!   until a freed block waits for another stream's work (`record_stream`): a block is
//!   active from its allocation until it is back in a pool, which without such waits is
//!   its free. While they are equal ([`Tally::active_apart`] false) only the latter are
//!   written, and the two copies are made once a wait begins.
use ferrocuda_types::{DeviceStats, PoolKind, Stat, StatArray};

/// One statistic without its `freed` total (derived).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counter {
    current: i64,
    peak: i64,
    allocated: i64,
    /// `current` when the accumulated totals were last reset.
    base: i64,
}

impl Counter {
    #[inline]
    pub(crate) fn increase(&mut self, n: i64) {
        self.current += n;
        self.allocated += n;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    #[inline]
    pub(crate) fn decrease(&mut self, n: i64) {
        self.current -= n;
        debug_assert!(self.current >= 0, "stat went negative");
    }

    /// Moves by the signed `delta` without a branch on its sign: a decrease leaves
    /// `allocated` (its `freed` is derived) and `peak` (`current` fell) as they were, so
    /// this is [`increase`](Self::increase) or [`decrease`](Self::decrease) (neither at 0).
    #[inline]
    pub(crate) fn change(&mut self, delta: i64) {
        self.current += delta;
        debug_assert!(self.current >= 0, "stat went negative");
        self.allocated += delta.max(0);
        self.peak = self.peak.max(self.current);
    }

    /// Counts `n` that rose and fell again (current and peak unchanged).
    #[inline]
    pub(crate) fn cycle(&mut self, n: i64) {
        self.allocated += n;
    }

    fn freed(&self) -> i64 {
        self.base + self.allocated - self.current
    }

    fn stat(&self) -> Stat {
        Stat {
            current: self.current,
            peak: self.peak,
            allocated: self.allocated,
            freed: self.freed(),
        }
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    fn reset_accumulated(&mut self) {
        self.allocated = 0;
        self.base = self.current;
    }
}

/// One statistic per pool; `all` is their sum, with its own peak.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PoolCounters {
    pools: [Counter; 2],
    all_peak: i64,
}

impl PoolCounters {
    /// Adds `n` to `pool` (and so to `all`).
    #[inline]
    pub(crate) fn increase(&mut self, pool: PoolKind, n: i64) {
        self.pools[pool.index()].increase(n);
        let all = self.current();
        if all > self.all_peak {
            self.all_peak = all;
        }
    }

    /// Subtracts `n` from `pool` (and so from `all`).
    #[inline]
    pub(crate) fn decrease(&mut self, pool: PoolKind, n: i64) {
        self.pools[pool.index()].decrease(n);
    }

    /// Moves `pool` by the signed `delta`: one increase or one decrease (none at 0), as
    /// PyTorch applies a net change, without a branch on the sign ([`Counter::change`]),
    /// which is random to the branch predictor where a free merges.
    #[inline(always)]
    pub(crate) fn change(&mut self, pool: PoolKind, delta: i64) {
        self.pools[pool.index()].change(delta);
        self.all_peak = self.all_peak.max(self.current());
    }

    /// Counts `n` that rose and fell again in `pool` (and so in `all`).
    #[inline]
    pub(crate) fn cycle(&mut self, pool: PoolKind, n: i64) {
        self.pools[pool.index()].cycle(n);
    }

    /// `all.current`.
    pub(crate) fn current(&self) -> i64 {
        self.pools[0].current + self.pools[1].current
    }

    /// Whether rising by `rise` would set a new peak for `pool` or for `all`.
    pub(crate) fn would_peak(&self, pool: PoolKind, rise: i64) -> bool {
        let p = &self.pools[pool.index()];
        p.current + rise > p.peak || self.current() + rise > self.all_peak
    }

    fn array(&self) -> StatArray {
        let [small, large] = self.pools.map(|c| c.stat());
        StatArray {
            all: Stat {
                current: small.current + large.current,
                peak: self.all_peak,
                allocated: small.allocated + large.allocated,
                freed: small.freed + large.freed,
            },
            small_pool: small,
            large_pool: large,
        }
    }

    fn reset_peak(&mut self) {
        self.pools.iter_mut().for_each(Counter::reset_peak);
        self.all_peak = self.current();
    }

    fn reset_accumulated(&mut self) {
        self.pools.iter_mut().for_each(Counter::reset_accumulated);
    }
}

/// Everything `torch.cuda.memory_stats` reports, as the allocator keeps it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tally {
    /// Moved only by [`Tally::allocate`], [`Tally::release`] and
    /// [`Tally::cycle_allocations`], which keep `active` in step.
    allocation: PoolCounters,
    pub segment: PoolCounters,
    /// Written only while `active_apart`: read it through [`Tally::active`].
    active: PoolCounters,
    pub inactive_split: PoolCounters,
    /// As `allocation`: read it through [`Tally::allocated_bytes`].
    allocated_bytes: PoolCounters,
    pub reserved_bytes: PoolCounters,
    /// As `active`: read it through [`Tally::active_bytes`].
    active_bytes: PoolCounters,
    pub inactive_split_bytes: PoolCounters,
    pub requested_bytes: PoolCounters,
    pub oversize_allocations: Counter,
    pub oversize_segments: Counter,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    pub num_oom_rejections: i64,
    pub max_split_size: i64,
    /// `active` and `active_bytes` are kept (false: they equal `allocation` and
    /// `allocated_bytes` in every field, and only those are kept up to date).
    active_apart: bool,
}

impl Tally {
    /// Empty statistics reporting `max_split_size` (-1: none).
    pub(crate) fn new(max_split_size: i64) -> Tally {
        Tally {
            max_split_size,
            ..Tally::default()
        }
    }

    /// `allocated_bytes`.
    pub(crate) fn allocated_bytes(&self) -> &PoolCounters {
        &self.allocated_bytes
    }

    /// `active`.
    pub(crate) fn active(&self) -> &PoolCounters {
        if self.active_apart {
            &self.active
        } else {
            &self.allocation
        }
    }

    /// `active_bytes`.
    pub(crate) fn active_bytes(&self) -> &PoolCounters {
        if self.active_apart {
            &self.active_bytes
        } else {
            &self.allocated_bytes
        }
    }

    /// A block of `size` bytes in `kind` is handed out: `allocation`, `allocated_bytes`,
    /// `active` and `active_bytes` rise.
    #[inline(always)]
    pub(crate) fn allocate(&mut self, kind: PoolKind, size: i64) {
        self.allocation.increase(kind, 1);
        self.allocated_bytes.increase(kind, size);
        if self.active_apart {
            self.active.increase(kind, 1);
            self.active_bytes.increase(kind, size);
        }
    }

    /// A live block of `size` bytes is freed by its user: `allocation` and
    /// `allocated_bytes` fall. `waits` (it waits for other streams before going back to
    /// its pool): `active` stays as it is until [`Tally::deactivate`].
    #[inline(always)]
    pub(crate) fn release(&mut self, kind: PoolKind, size: i64, waits: bool) {
        if waits && !self.active_apart {
            self.active = self.allocation;
            self.active_bytes = self.allocated_bytes;
            self.active_apart = true;
        }
        self.allocation.decrease(kind, 1);
        self.allocated_bytes.decrease(kind, size);
    }

    /// A block of `size` bytes is back in its pool: `active` and `active_bytes` fall
    /// (with `allocation` already, unless it waited).
    #[inline(always)]
    pub(crate) fn deactivate(&mut self, kind: PoolKind, size: i64) {
        if self.active_apart {
            self.active.decrease(kind, 1);
            self.active_bytes.decrease(kind, size);
            self.active_apart =
                self.active != self.allocation || self.active_bytes != self.allocated_bytes;
        }
    }

    /// `n` allocations of `size` bytes made and freed again (a thread-cache credit's
    /// reuses).
    pub(crate) fn cycle_allocations(&mut self, kind: PoolKind, n: i64, size: i64) {
        self.allocation.cycle(kind, n);
        self.allocated_bytes.cycle(kind, n * size);
        if self.active_apart {
            self.active.cycle(kind, n);
            self.active_bytes.cycle(kind, n * size);
        }
    }

    fn arrays_mut(&mut self) -> [&mut PoolCounters; 9] {
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

    /// The statistics with PyTorch's keys.
    pub(crate) fn snapshot(&self) -> DeviceStats {
        DeviceStats {
            allocation: self.allocation.array(),
            segment: self.segment.array(),
            active: self.active().array(),
            inactive_split: self.inactive_split.array(),
            allocated_bytes: self.allocated_bytes.array(),
            reserved_bytes: self.reserved_bytes.array(),
            active_bytes: self.active_bytes().array(),
            inactive_split_bytes: self.inactive_split_bytes.array(),
            requested_bytes: self.requested_bytes.array(),
            oversize_allocations: self.oversize_allocations.stat(),
            oversize_segments: self.oversize_segments.stat(),
            num_alloc_retries: self.num_alloc_retries,
            num_ooms: self.num_ooms,
            num_sync_all_streams: self.num_sync_all_streams,
            num_device_alloc: self.num_device_alloc,
            num_device_free: self.num_device_free,
            num_oom_rejections: self.num_oom_rejections,
            max_split_size: self.max_split_size,
        }
    }

    /// `torch.cuda.reset_peak_memory_stats`.
    pub(crate) fn reset_peak(&mut self) {
        self.arrays_mut()
            .into_iter()
            .for_each(PoolCounters::reset_peak);
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// `torch.cuda.reset_accumulated_memory_stats`.
    pub(crate) fn reset_accumulated(&mut self) {
        self.arrays_mut()
            .into_iter()
            .for_each(PoolCounters::reset_accumulated);
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_oom_rejections = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The generator of both tests.
    fn next(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed
    }

    fn pool_of(seed: u64) -> PoolKind {
        if seed >> 63 == 0 {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// Both resets, alternately.
    fn reset(lean: &mut Tally, plain: &mut DeviceStats, step: usize) {
        if step.is_multiple_of(2) {
            lean.reset_peak();
            plain.reset_peak();
        } else {
            lean.reset_accumulated();
            plain.reset_accumulated();
        }
    }

    /// The lean form reports what `DeviceStats`' own arithmetic gives for the same moves
    /// (a net change without a branch among them, against one increase or one decrease),
    /// across both resets.
    #[test]
    fn snapshot_equals_the_plain_statistics() {
        let mut lean = Tally::default();
        let mut plain = DeviceStats::default();
        let mut seed = 11u64;
        for step in 0..20_000 {
            let seed = next(&mut seed);
            let pool = pool_of(seed);
            let n = ((seed >> 20) % 1000) as i64;
            let live = plain.requested_bytes.pair(pool)[1].current;
            match (seed >> 40) % 8 {
                0..=2 => {
                    lean.requested_bytes.increase(pool, n);
                    plain.requested_bytes.increase(pool, n);
                    lean.oversize_allocations.increase(n);
                    plain.oversize_allocations.increase(n);
                }
                3 | 4 => {
                    lean.requested_bytes.decrease(pool, n.min(live));
                    plain.requested_bytes.decrease(pool, n.min(live));
                    let n = n.min(plain.oversize_allocations.current);
                    lean.oversize_allocations.decrease(n);
                    plain.oversize_allocations.decrease(n);
                }
                5 => {
                    lean.requested_bytes.cycle(pool, n);
                    plain.requested_bytes.cycle(pool, n);
                    lean.oversize_allocations.cycle(n);
                    plain.oversize_allocations.cycle(n);
                }
                6 => {
                    // A net change of either sign, or none, as a free's merges give.
                    let delta = n - live.min(n) * ((seed >> 50) % 3) as i64;
                    lean.requested_bytes.change(pool, delta);
                    if delta > 0 {
                        plain.requested_bytes.increase(pool, delta);
                    } else if delta < 0 {
                        plain.requested_bytes.decrease(pool, -delta);
                    }
                }
                _ => reset(&mut lean, &mut plain, step),
            }
            let rise = n;
            let pair = plain.requested_bytes.pair(pool);
            assert_eq!(
                lean.requested_bytes.would_peak(pool, rise),
                pair.iter().any(|s| s.current + rise > s.peak)
            );
            assert_eq!(lean.snapshot(), plain, "step {step}");
        }
    }

    /// `active` kept apart from `allocation` only while a block waits reports what the
    /// four statistics moved one by one give: blocks allocated, freed straight back,
    /// freed to wait and back later, reused by a credit, across both resets.
    #[test]
    fn active_follows_allocation_until_a_block_waits() {
        let mut lean = Tally::default();
        let mut plain = DeviceStats::default();
        // (pool, bytes) of the live blocks and of those waiting for other streams.
        let (mut live, mut waiting) = (Vec::new(), Vec::new());
        let mut seed = 5u64;
        let (mut apart, mut rejoined) = (false, 0u32);
        for step in 0..40_000 {
            let seed = next(&mut seed);
            let (pool, n) = (pool_of(seed), ((seed >> 20) % 1000) as i64 + 1);
            let pick = (seed >> 8) as usize;
            // Waits are rare and short in the first half, frequent in the second.
            let wait_odds = if step < 20_000 { 61 } else { 3 };
            match (seed >> 40) % 8 {
                0..=2 => {
                    lean.allocate(pool, n);
                    for s in [&mut plain.allocation, &mut plain.active] {
                        s.increase(pool, 1);
                    }
                    for s in [&mut plain.allocated_bytes, &mut plain.active_bytes] {
                        s.increase(pool, n);
                    }
                    live.push((pool, n));
                }
                3 | 4 if !live.is_empty() => {
                    let (pool, n) = live.swap_remove(pick % live.len());
                    let waits = (seed >> 30).is_multiple_of(wait_odds);
                    lean.release(pool, n, waits);
                    plain.allocation.decrease(pool, 1);
                    plain.allocated_bytes.decrease(pool, n);
                    if waits {
                        waiting.push((pool, n));
                    } else {
                        lean.deactivate(pool, n);
                        plain.active.decrease(pool, 1);
                        plain.active_bytes.decrease(pool, n);
                    }
                }
                5 if !waiting.is_empty() => {
                    let (pool, n) = waiting.swap_remove(pick % waiting.len());
                    lean.deactivate(pool, n);
                    plain.active.decrease(pool, 1);
                    plain.active_bytes.decrease(pool, n);
                }
                6 => {
                    let reuses = (seed >> 50) as i64 % 4;
                    lean.cycle_allocations(pool, reuses, n);
                    plain.allocation.cycle(pool, reuses);
                    plain.active.cycle(pool, reuses);
                    plain.allocated_bytes.cycle(pool, reuses * n);
                    plain.active_bytes.cycle(pool, reuses * n);
                }
                7 if seed.is_multiple_of(16) => reset(&mut lean, &mut plain, step),
                _ => {}
            }
            rejoined += u32::from(apart && !lean.active_apart);
            apart = lean.active_apart;
            assert_eq!(lean.snapshot(), plain, "step {step}");
        }
        // The fast form came back after waits (once every field agreed again), many times.
        assert!(rejoined > 10, "active rejoined allocation {rejoined} times");
    }
}
