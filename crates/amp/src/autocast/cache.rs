//! The weight-cast cache: one cast of an fp32 parameter per autocast region, reused by
//! every op that reads the parameter.
//!
//! PyTorch (`cached_cast` in `aten/src/ATen/autocast_mode.cpp`) keys one process-wide map by
//! `TensorImpl*`, so an in-place update of the weight inside a long region (an optimizer
//! step, an EMA swap) keeps serving the stale cast, and any thread's outermost exit clears
//! every thread's entries. Here entries are keyed by (identity, target dtype), remember the
//! source's version counter and are recast when it moved; each thread has its own cache,
//! cleared when that thread's outermost scope exits. The cache is generic over the cast
//! value so a tensor crate stores its own tensors.
use std::any::{Any, TypeId};
use std::cell::RefCell;

use ferrocuda_types::DType;
use rustc_hash::FxHashMap;

/// Cast values keyed by (source identity, target dtype), each stamped with the source's
/// version at cast time.
#[derive(Debug)]
pub struct WeightCastCache<V> {
    entries: FxHashMap<(u64, DType), (u64, V)>,
}

impl<V> Default for WeightCastCache<V> {
    fn default() -> Self {
        WeightCastCache {
            entries: FxHashMap::default(),
        }
    }
}

impl<V: Clone> WeightCastCache<V> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The cast of source `identity` at `version` to `target`, if cached at that version.
    pub fn get(&self, identity: u64, version: u64, target: DType) -> Option<V> {
        match self.entries.get(&(identity, target)) {
            Some((v, value)) if *v == version => Some(value.clone()),
            _ => None,
        }
    }

    /// Stores a cast made at `version`, replacing any older one of the same source and target.
    pub fn insert(&mut self, identity: u64, version: u64, target: DType, value: V) {
        self.entries.insert((identity, target), (version, value));
    }

    /// The cached cast at this version, or `cast()` stored and returned.
    pub fn get_or_cast<E>(
        &mut self,
        identity: u64,
        version: u64,
        target: DType,
        cast: impl FnOnce() -> Result<V, E>,
    ) -> Result<V, E> {
        if let Some(hit) = self.get(identity, version, target) {
            return Ok(hit);
        }
        let value = cast()?;
        self.insert(identity, version, target, value.clone());
        Ok(value)
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

thread_local! {
    /// One cache per value type, per thread.
    static CACHES: RefCell<FxHashMap<TypeId, Box<dyn Any>>> = RefCell::new(FxHashMap::default());
}

/// This thread's cached cast of (identity, version) to `target`, or `cast()` stored in this
/// thread's cache. `cast` runs with no cache borrowed, so it may itself use autocast.
pub(crate) fn thread_cached_cast<V: Clone + 'static, E>(
    identity: u64,
    version: u64,
    target: DType,
    cast: impl FnOnce() -> Result<V, E>,
) -> Result<V, E> {
    let hit = CACHES.with(|c| {
        c.borrow()
            .get(&TypeId::of::<V>())
            .and_then(|any| any.downcast_ref::<WeightCastCache<V>>())
            .and_then(|cache| cache.get(identity, version, target))
    });
    if let Some(hit) = hit {
        return Ok(hit);
    }
    let value = cast()?;
    CACHES.with(|c| {
        let mut map = c.borrow_mut();
        let entry = map
            .entry(TypeId::of::<V>())
            .or_insert_with(|| Box::new(WeightCastCache::<V>::new()));
        if let Some(cache) = entry.downcast_mut::<WeightCastCache<V>>() {
            cache.insert(identity, version, target, value.clone());
        }
    });
    Ok(value)
}

/// How many casts of value type `V` this thread's cache holds.
pub fn thread_cache_len<V: Clone + 'static>() -> usize {
    CACHES.with(|c| {
        c.borrow()
            .get(&TypeId::of::<V>())
            .and_then(|any| any.downcast_ref::<WeightCastCache<V>>())
            .map_or(0, WeightCastCache::len)
    })
}

/// Drops this thread's cached casts (`torch.clear_autocast_cache`, for this thread). Runs
/// by itself when the thread's outermost autocast scope exits. The values are dropped
/// after the cache is released, so their destructors may use autocast.
pub fn clear_thread_caches() {
    // `try_with`: a guard dropped while its thread is torn down may come here after the
    // caches are gone, and then there is nothing left to clear.
    let taken = CACHES.try_with(|c| std::mem::take(&mut *c.borrow_mut()));
    drop(taken);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_version_misses_and_replaces() {
        let mut c = WeightCastCache::<u32>::new();
        let mut casts = 0;
        let mut cast = |v| {
            casts += 1;
            Ok::<u32, ()>(v)
        };
        assert_eq!(c.get_or_cast(7, 0, DType::F16, || cast(1)), Ok(1));
        assert_eq!(c.get_or_cast(7, 0, DType::F16, || cast(99)), Ok(1));
        assert_eq!(c.get_or_cast(7, 1, DType::F16, || cast(2)), Ok(2));
        assert_eq!(c.get_or_cast(7, 1, DType::BF16, || cast(3)), Ok(3));
        assert_eq!(c.len(), 2);
        assert_eq!(c.get(7, 0, DType::F16), None);
        assert_eq!(casts, 3);
    }

    #[test]
    fn a_failed_cast_stores_nothing() {
        let mut c = WeightCastCache::<u32>::new();
        assert_eq!(c.get_or_cast(1, 0, DType::F16, || Err("no")), Err("no"));
        assert!(c.is_empty());
    }
}
