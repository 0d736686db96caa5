//! `torch.cuda.MemPool` and `torch.cuda.use_mem_pool` for the global runtime: a private
//! pool of one device's caching allocator that a thread's allocations can be routed to, fed
//! by a pluggable allocator's `alloc`/`free` when made with one (`MemPool(allocator=…)`),
//! or sleepable ([`MemPool::sleepable`], ferrocuda's own).
use super::native;
use crate::alloc::{
    AllocError, CachingAllocator, PluggableAllocator, Route, SleepMode, SleepReport, WakeReport,
};
use crate::types::{DeviceIndex, PoolId};
use std::marker::PhantomData;
use std::sync::Arc;

/// A private memory pool (`torch.cuda.MemPool`) on the device that was current when it was
/// made. Dropping it releases its own use of the pool and gives the pool's free segments
/// back (to its allocator, if it has one) once nobody else uses it (`~MemPool`:
/// `releasePool`, then `emptyCache(id)`).
#[derive(Debug)]
pub struct MemPool {
    id: PoolId,
    device: DeviceIndex,
    allocator: Option<Arc<PluggableAllocator>>,
}

impl MemPool {
    /// A new pool with a fresh id `(0, n)` on the current device (`MemPool(allocator)`):
    /// with an allocator, its segments come from it and go back to it, while the caching
    /// allocator still splits, caches and counts them. With a pluggable allocator current,
    /// PyTorch's "does not yet support createOrIncrefPool".
    pub fn new(allocator: Option<Arc<PluggableAllocator>>) -> Result<MemPool, AllocError> {
        let device = crate::runtime().current_device();
        let caching = native("createOrIncrefPool")?.device(device)?;
        let id = PoolId::handle();
        match &allocator {
            Some(a) => caching.create_pool_with_allocator(id, a.clone())?,
            None => caching.retain_pool(id),
        }
        Ok(MemPool {
            id,
            device,
            allocator,
        })
    }

    /// A new pool on the current device whose memory can sleep (ferrocuda's own): its
    /// segments come from the driver's virtual memory API, so [`MemPool::sleep`] can give
    /// their physical pages back while pointers into the pool, and CUDA graphs captured into
    /// it (`pool: Some(mem_pool.id())`), stay valid for after [`MemPool::wake`].
    pub fn sleepable() -> Result<MemPool, AllocError> {
        let device = crate::runtime().current_device();
        let caching = native("createOrIncrefPool")?.device(device)?;
        let id = PoolId::handle();
        caching.create_sleepable_pool(id)?;
        Ok(MemPool {
            id,
            device,
            allocator: None,
        })
    }

    /// Releases the pool's physical memory, keeping its addresses, its contents discarded
    /// or offloaded to pinned host memory ([`CachingAllocator::sleep`]).
    pub fn sleep(&self, mode: SleepMode) -> Result<SleepReport, AllocError> {
        native("sleep")?.device(self.device)?.sleep(self.id, mode)
    }

    /// Maps the pool's memory again at the same addresses, restoring offloaded contents
    /// ([`CachingAllocator::wake`]).
    pub fn wake(&self) -> Result<WakeReport, AllocError> {
        native("wake")?.device(self.device)?.wake(self.id)
    }

    /// `MemPool.id`.
    pub fn id(&self) -> PoolId {
        self.id
    }

    /// The device it lives on.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// The allocator its segments come from, if it has one.
    pub fn allocator(&self) -> Option<&Arc<PluggableAllocator>> {
        self.allocator.as_ref()
    }

    /// `MemPool.use_count()`: this pool object, each `use_mem_pool` under way and each
    /// graph that holds the pool.
    pub fn use_count(&self) -> Result<u32, AllocError> {
        Ok(self.caching()?.pool_use_count(self.id).unwrap_or(0))
    }

    fn caching(&self) -> Result<&'static CachingAllocator, AllocError> {
        native("getPoolUseCount")?.device(self.device)
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        // Nothing to report a failure to: the pool then stays until the allocator goes.
        if let Ok(a) = self.caching()
            && a.release_pool(self.id).is_ok()
        {
            a.empty_cache_pool(self.id);
        }
    }
}

/// Routes this thread's allocations on the pool's device to the pool until dropped
/// ([`use_mem_pool`]). Not `Send`: routing belongs to the thread that began it.
#[derive(Debug)]
#[must_use = "allocations go to the pool only while the guard lives"]
pub struct MemPoolGuard<'a> {
    pool: &'a MemPool,
    allocator: &'static CachingAllocator,
    _not_send: PhantomData<*const ()>,
}

impl Drop for MemPoolGuard<'_> {
    fn drop(&mut self) {
        // `use_mem_pool`'s `finally`: `_cuda_endAllocateToPool`, `_cuda_releasePool`.
        let _ = self.allocator.end_allocate_to_pool(self.pool.id);
        let _ = self.allocator.release_pool(self.pool.id);
    }
}

/// `torch.cuda.use_mem_pool(pool)`: this thread's allocations on the pool's device go to
/// `pool` while the guard lives (`_cuda_beginAllocateCurrentThreadToPool`; the pool gains
/// a user until then). Other threads' allocations are not routed.
pub fn use_mem_pool(pool: &MemPool) -> Result<MemPoolGuard<'_>, AllocError> {
    let allocator = native("beginAllocateToPool")?.device(pool.device)?;
    allocator.begin_allocate_to_pool(pool.id, Route::Thread(std::thread::current().id()))?;
    Ok(MemPoolGuard {
        pool,
        allocator,
        _not_send: PhantomData,
    })
}
