//! The cuFFT plan cache's bookkeeping: PyTorch's `CuFFTParamsLRUCache`
//! (`aten/src/ATen/native/cuda/CuFFTPlanCache.h`) — least recently used first out, at most
//! `max_size` plans (4 096 by default) — plus ferrocuda's byte budget on the plans' work
//! areas (`max_work_bytes`): plans are evicted, least recently used first, until the work
//! areas of those kept fit in it, and a plan whose work area alone is larger is not kept.
//! Generic over the key and the plan, so that it is tested without a library.
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::hash::Hash;

/// PyTorch's `CUFFT_DEFAULT_CACHE_SIZE`.
pub const DEFAULT_MAX_SIZE: usize = 4096;

/// A kept plan and when it was last used.
#[derive(Debug)]
struct Entry<P> {
    plan: P,
    work: u64,
    used: u64,
}

/// Plans by key, with their work-area sizes, least recently used first out.
#[derive(Debug)]
pub(crate) struct PlanCache<K, P> {
    entries: FxHashMap<K, Entry<P>>,
    /// Last use → key: the oldest first.
    order: BTreeMap<u64, K>,
    clock: u64,
    max_size: usize,
    max_work_bytes: Option<u64>,
    work_bytes: u64,
}

/// What a lookup found: a kept plan, or the key's new plan and whether it was kept.
#[derive(Debug)]
pub(crate) enum Lookup<'a, P> {
    /// Kept (found, or made and kept).
    Kept(&'a P),
    /// Made and not kept (the cache holds nothing, or its work area alone is over the
    /// budget): the caller uses it once and drops it.
    Once(P),
}

impl<K: Hash + Eq + Clone, P> PlanCache<K, P> {
    pub(crate) fn new() -> PlanCache<K, P> {
        PlanCache {
            entries: FxHashMap::default(),
            order: BTreeMap::new(),
            clock: 0,
            max_size: DEFAULT_MAX_SIZE,
            max_work_bytes: None,
            work_bytes: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn max_size(&self) -> usize {
        self.max_size
    }

    pub(crate) fn max_work_bytes(&self) -> Option<u64> {
        self.max_work_bytes
    }

    pub(crate) fn work_bytes(&self) -> u64 {
        self.work_bytes
    }

    /// The keys, most recently used first.
    pub(crate) fn keys(&self) -> Vec<K> {
        self.order.values().rev().cloned().collect()
    }

    /// The plan for `key`: the kept one (now the most recently used), else `make`'s, kept
    /// if the limits allow (evicting the least recently used to make room). Evicted plans
    /// are returned for the caller to drop outside its lock.
    pub(crate) fn lookup<E>(
        &mut self,
        key: &K,
        make: impl FnOnce() -> Result<(P, u64), E>,
        evicted: &mut Vec<P>,
    ) -> Result<Lookup<'_, P>, E> {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(key) {
            self.order.remove(&e.used);
            e.used = self.clock;
            self.order.insert(self.clock, key.clone());
            return Ok(Lookup::Kept(&self.entries[key].plan));
        }
        let (plan, work) = make()?;
        let over_budget = self.max_work_bytes.is_some_and(|b| work > b);
        if self.max_size == 0 || over_budget {
            return Ok(Lookup::Once(plan));
        }
        self.evict_until(
            self.max_size - 1,
            self.max_work_bytes.map(|b| b - work),
            evicted,
        );
        self.work_bytes = self.work_bytes.saturating_add(work);
        self.order.insert(self.clock, key.clone());
        self.entries.insert(
            key.clone(),
            Entry {
                plan,
                work,
                used: self.clock,
            },
        );
        Ok(Lookup::Kept(&self.entries[key].plan))
    }

    /// `cufft_set_plan_cache_max_size`: evicts the least recently used beyond `max_size`.
    pub(crate) fn set_max_size(&mut self, max_size: usize, evicted: &mut Vec<P>) {
        self.max_size = max_size;
        self.evict_until(max_size, self.max_work_bytes, evicted);
    }

    /// ferrocuda's budget on the kept plans' work areas (`None`: no limit).
    pub(crate) fn set_max_work_bytes(&mut self, bytes: Option<u64>, evicted: &mut Vec<P>) {
        self.max_work_bytes = bytes;
        self.evict_until(self.max_size, bytes, evicted);
    }

    /// `cufft_clear_plan_cache`.
    pub(crate) fn clear(&mut self, evicted: &mut Vec<P>) {
        self.evict_until(0, Some(0), evicted);
    }

    /// Evicts the least recently used until at most `plans` are kept with at most `bytes`
    /// of work area.
    fn evict_until(&mut self, plans: usize, bytes: Option<u64>, evicted: &mut Vec<P>) {
        while self.entries.len() > plans || bytes.is_some_and(|b| self.work_bytes > b) {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&key) {
                self.work_bytes = self.work_bytes.saturating_sub(e.work);
                evicted.push(e.plan);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(c: &mut PlanCache<u32, u32>, key: u32, work: u64, made: &mut Vec<u32>) -> bool {
        let mut evicted = Vec::new();
        let found = c.lookup::<()>(
            &key,
            || {
                made.push(key);
                Ok((key, work))
            },
            &mut evicted,
        );
        matches!(found, Ok(Lookup::Kept(_)))
    }

    #[test]
    fn least_recently_used_goes_first() {
        let (mut c, mut made) = (PlanCache::new(), Vec::new());
        let mut ev = Vec::new();
        c.set_max_size(3, &mut ev);
        for k in [1, 2, 3, 1, 4] {
            get(&mut c, k, 0, &mut made);
        }
        assert_eq!(made, [1, 2, 3, 4], "1 was a hit");
        assert_eq!(c.keys(), [4, 1, 3], "2 was the least recently used");
        c.set_max_size(1, &mut ev);
        assert_eq!(c.keys(), [4]);
        assert_eq!(ev.len(), 2);
        c.set_max_size(0, &mut ev);
        assert!(!get(&mut c, 5, 0, &mut made), "max_size 0 keeps nothing");
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn work_area_budget_evicts_and_refuses() {
        let (mut c, mut made) = (PlanCache::new(), Vec::new());
        let mut ev = Vec::new();
        c.set_max_work_bytes(Some(100), &mut ev);
        assert!(get(&mut c, 1, 60, &mut made));
        assert!(get(&mut c, 2, 30, &mut made));
        assert!(get(&mut c, 3, 30, &mut made), "1 is evicted to make room");
        assert_eq!(c.keys(), [3, 2]);
        assert_eq!(c.work_bytes(), 60);
        assert!(
            !get(&mut c, 4, 101, &mut made),
            "alone over the budget: used once"
        );
        assert_eq!(c.keys(), [3, 2]);
        c.set_max_work_bytes(Some(40), &mut ev);
        assert_eq!(c.keys(), [3]);
        c.clear(&mut ev);
        assert_eq!((c.len(), c.work_bytes()), (0, 0));
        assert_eq!(ev.len(), 2, "2 by the smaller budget, 3 by clear");
    }
}
