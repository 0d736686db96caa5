//! Private memory pools (a CUDA graph's pool, PyTorch's `PrivatePool` and
//! `beginAllocateToPool`/`endAllocateToPool`/`releasePool` in
//! c10/cuda/CUDACachingAllocator.cpp): which allocations are routed to which pool, how
//! many users keep each pool, and so the one rule of which pools a release may touch.
use crate::error::AllocError;
use crate::pluggable::PluggableAllocator;
use ferrocuda_types::{PoolId, StreamHandle};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::thread::ThreadId;

/// Whose allocations a pool being recorded to takes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// Allocations on any stream taking part in this stream capture (forked side streams
    /// included): what a graph capture uses.
    Capture(u64),
    /// Allocations on this stream.
    Stream(StreamHandle),
    /// Allocations made by this thread.
    Thread(std::thread::ThreadId),
    /// The stream capture about to begin, not yet known: until a capture binds it, the
    /// allocations of the thread that began routing (as [`Route::Thread`]); the first
    /// allocation made in a capture that no route takes binds it to that capture (the newest
    /// unbound route begun by the allocating thread, else the newest unbound route), and from
    /// then on it is [`Route::Capture`] of that capture. For callers told of the pool before
    /// the capture that fills it begins, with no way to name that capture: PyTorch's
    /// pluggable-allocator hook `beginAllocateToPool`, whose filter (`capture_id ==
    /// this->capture_id_`) is a C++ closure a C function cannot call. Counts as a capture
    /// underway from the start (no event work, no driver frees), as PyTorch's
    /// `captures_underway` does from `beginAllocateToPool` on.
    NextCapture,
}

impl Route {
    /// Whether this route, begun by thread `began`, takes an allocation on `stream`, in
    /// capture `capture` (if the stream is capturing), made by thread `thread`.
    pub(crate) fn takes(
        &self,
        stream: StreamHandle,
        capture: Option<u64>,
        thread: std::thread::ThreadId,
        began: std::thread::ThreadId,
    ) -> bool {
        match *self {
            Route::Capture(id) => capture == Some(id),
            Route::Stream(s) => s == stream,
            Route::Thread(t) => t == thread,
            Route::NextCapture => capture.is_none() && began == thread,
        }
    }
}

/// Where a pool's segments come from and go back to.
#[derive(Clone, Debug, Default)]
pub(crate) enum SegmentSource {
    /// The driver's `cudaMalloc` and `cudaFree`.
    #[default]
    Driver,
    /// The pool's pluggable allocator (`MemPool(allocator=…)`).
    Pluggable(Arc<PluggableAllocator>),
    /// The driver's virtual memory API, one physical allocation per segment, so that the
    /// pages can be released and mapped again at the same addresses (`sleep`, `wake`).
    Sleepable,
}

/// Whether a sleepable pool's pages are there.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum Wakefulness {
    #[default]
    Awake,
    /// Being put to sleep or woken (outside the allocator's lock): nothing of it may be
    /// allocated or given back.
    Changing,
    Asleep,
}

/// A graph's private pool.
#[derive(Debug, Default)]
struct PrivatePool {
    /// Graphs (or handles) holding it; at 0 it is freeable.
    use_count: u32,
    /// Device segments it holds.
    segments: u32,
    /// Where its segments come from and go back to.
    source: SegmentSource,
    wakefulness: Wakefulness,
}

#[derive(Debug, Default)]
pub(crate) struct PrivatePools {
    pools: FxHashMap<PoolId, PrivatePool>,
    /// Pools being recorded to, newest last, with whose allocations they take and the
    /// thread that began routing.
    routes: Routes,
}

impl PrivatePools {
    /// The pool an allocation on `stream` (in capture `capture`, if any) is served from:
    /// the newest route that takes it, else the default pool. An allocation in a capture no
    /// route names first binds a [`Route::NextCapture`] to it.
    #[inline(always)]
    pub(crate) fn route(&mut self, stream: StreamHandle, capture: Option<u64>) -> PoolId {
        if self.routes.is_empty() {
            return PoolId::DEFAULT;
        }
        self.route_routed(stream, capture)
    }

    /// [`PrivatePools::route`] with some pool routed to.
    #[cold]
    fn route_routed(&mut self, stream: StreamHandle, capture: Option<u64>) -> PoolId {
        let me = std::thread::current().id();
        if let Some(id) = capture {
            self.bind_next_capture(id, me);
        }
        self.routes
            .iter()
            .rev()
            .find(|(_, route, began)| route.takes(stream, capture, me, *began))
            .map_or(PoolId::DEFAULT, |(pool, _, _)| *pool)
    }

    /// Binds an unbound [`Route::NextCapture`] to capture `id` when no route names `id` yet:
    /// the newest one `me` began, else the newest one.
    fn bind_next_capture(&mut self, id: u64, me: ThreadId) {
        if self.routes.iter().any(|(_, r, _)| *r == Route::Capture(id)) {
            return;
        }
        let unbound = |began: Option<ThreadId>| {
            move |(_, r, t): &(PoolId, Route, ThreadId)| {
                *r == Route::NextCapture && began.is_none_or(|b| b == *t)
            }
        };
        let newest = self.routes.iter().rposition(unbound(Some(me)));
        if let Some(i) = newest.or_else(|| self.routes.iter().rposition(unbound(None))) {
            self.routes[i].1 = Route::Capture(id);
        }
    }

    /// Whether any pool is being recorded to.
    pub(crate) fn routing(&self) -> bool {
        !self.routes.is_empty()
    }

    /// Whether any stream capture records into a pool now (or is about to: an unbound
    /// [`Route::NextCapture`]).
    pub(crate) fn capturing(&self) -> bool {
        self.routes
            .iter()
            .any(|(_, r, _)| matches!(r, Route::Capture(_) | Route::NextCapture))
    }

    /// Whether the calling thread began routing a stream capture (it is the capturing
    /// thread, whose current stream PyTorch's `cudaMallocMaybeCapturing` finds capturing).
    pub(crate) fn captured_by_this_thread(&self) -> bool {
        let me = std::thread::current().id();
        self.routes
            .iter()
            .any(|(_, r, t)| matches!(r, Route::Capture(_) | Route::NextCapture) && *t == me)
    }

    /// Whether the blocks of `pool` may be given back to the driver: the default pool's,
    /// and those of a private pool nobody holds. Garbage collection and the oversize
    /// release go further and touch the default pool only (as PyTorch's do).
    /// A sleepable pool being put to sleep or woken is not.
    pub(crate) fn releasable(&self, pool: PoolId) -> bool {
        pool.is_default()
            || self
                .pools
                .get(&pool)
                .is_some_and(|p| p.use_count == 0 && p.wakefulness != Wakefulness::Changing)
    }

    /// A segment was allocated for `pool`.
    pub(crate) fn segment_added(&mut self, pool: PoolId) {
        if let Some(p) = self.pools.get_mut(&pool) {
            p.segments += 1;
        }
    }

    /// A segment of `pool` went back to the driver; an unheld pool with none left ends.
    pub(crate) fn segment_released(&mut self, pool: PoolId) {
        if let Some(p) = self.pools.get_mut(&pool) {
            p.segments -= 1;
            if p.segments == 0 && p.use_count == 0 {
                self.pools.remove(&pool);
            }
        }
    }

    /// Where the segments of `pool` come from.
    pub(crate) fn source(&self, pool: PoolId) -> SegmentSource {
        self.pools
            .get(&pool)
            .map_or(SegmentSource::Driver, |p| p.source.clone())
    }

    /// A new pool with one user whose segments come from `source`
    /// (`create_or_incref_pool(mempool_id, allocator)` with an allocator: PyTorch asserts
    /// `!allocator` for an existing pool).
    pub(crate) fn create_with_source(
        &mut self,
        pool: PoolId,
        source: SegmentSource,
    ) -> Result<(), AllocError> {
        if pool.is_default() || self.pools.contains_key(&pool) {
            return Err(AllocError::Pool(format!(
                "createOrIncrefPool: pool {pool} exists; an allocator is given only to a new pool"
            )));
        }
        self.pools.insert(
            pool,
            PrivatePool {
                use_count: 1,
                source,
                ..PrivatePool::default()
            },
        );
        Ok(())
    }

    /// Whether `pool`'s pages are there (a pool that does not exist, or is not sleepable,
    /// is awake).
    pub(crate) fn wakefulness(&self, pool: PoolId) -> Wakefulness {
        self.pools
            .get(&pool)
            .map_or(Wakefulness::Awake, |p| p.wakefulness)
    }

    /// How many pools are not awake.
    pub(crate) fn not_awake(&self) -> usize {
        self.pools
            .values()
            .filter(|p| p.wakefulness != Wakefulness::Awake)
            .count()
    }

    /// Sets `pool`'s wakefulness (a pool that exists).
    pub(crate) fn set_wakefulness(&mut self, pool: PoolId, to: Wakefulness) {
        if let Some(p) = self.pools.get_mut(&pool) {
            p.wakefulness = to;
        }
    }

    /// `create_or_incref`.
    pub(crate) fn retain(&mut self, pool: PoolId) {
        if !pool.is_default() {
            self.pools.entry(pool).or_default().use_count += 1;
        }
    }

    /// `releasePool`: one user fewer.
    pub(crate) fn release(&mut self, pool: PoolId) -> Result<(), AllocError> {
        let p = self.pools.get_mut(&pool).filter(|p| p.use_count > 0);
        let p =
            p.ok_or_else(|| AllocError::Pool(format!("releasePool: pool {pool} is not in use")))?;
        p.use_count -= 1;
        if p.use_count == 0 && p.segments == 0 {
            self.pools.remove(&pool);
        }
        Ok(())
    }

    /// `getPoolUseCount`, if the pool exists.
    pub(crate) fn use_count(&self, pool: PoolId) -> Option<u32> {
        self.pools.get(&pool).map(|p| p.use_count)
    }

    /// `beginAllocateToPool`: routes what `route` takes into `pool`, which gains a user.
    pub(crate) fn begin(&mut self, pool: PoolId, route: Route) -> Result<(), AllocError> {
        begin_route(&mut self.routes, pool, route)?;
        self.retain(pool);
        Ok(())
    }

    /// `endAllocateToPool`: stops routing into `pool`, which keeps its user.
    pub(crate) fn end(&mut self, pool: PoolId) -> Result<(), AllocError> {
        end_route(&mut self.routes, pool)
    }

    /// The allocator is going: no route stays and no pool keeps users.
    pub(crate) fn forget_users(&mut self) {
        self.pools.values_mut().for_each(|p| p.use_count = 0);
        self.routes.clear();
    }
}

/// Pools being allocated to, newest last, each with the route it takes and the thread that
/// began it: the device allocator's and the host allocator's lists.
pub(crate) type Routes = Vec<(PoolId, Route, ThreadId)>;

/// `beginAllocateToPool`'s checks, then the route (the caller gives the pool its user).
pub(crate) fn begin_route(
    routes: &mut Routes,
    pool: PoolId,
    route: Route,
) -> Result<(), AllocError> {
    if pool.is_default() {
        return Err(AllocError::Pool(
            "beginAllocateToPool: the default pool cannot be recorded to".into(),
        ));
    }
    if routes.iter().any(|(p, _, _)| *p == pool) {
        return Err(AllocError::Pool(format!(
            "beginAllocateToPool: already recording to mempool_id {pool}"
        )));
    }
    routes.push((pool, route, std::thread::current().id()));
    Ok(())
}

/// `endAllocateToPool`: the route into `pool` goes; the pool keeps its user.
pub(crate) fn end_route(routes: &mut Routes, pool: PoolId) -> Result<(), AllocError> {
    let i = routes.iter().position(|(p, _, _)| *p == pool);
    let i = i.ok_or_else(|| {
        AllocError::Pool(format!(
            "endAllocatePool: not currently recording to mempool_id {pool}"
        ))
    })?;
    routes.remove(i);
    Ok(())
}
