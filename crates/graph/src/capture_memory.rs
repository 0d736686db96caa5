//! Where a graph's captures allocate: a private pool of the native caching allocator, or,
//! under `backend:cudaMallocAsync`, the driver's graph memory.
//!
//! PyTorch's `CUDAGraph` (aten/src/ATen/cuda/CUDAGraph.cpp) talks to whichever allocator is
//! current through the same calls: `beginAllocateToPool` before `cudaStreamBeginCapture`,
//! `endAllocateToPool` after `cudaStreamEndCapture`, `releasePool` when the graph lets its
//! pool go, and `torch.cuda.graph`'s `__enter__` empties the cache first. The native
//! allocator routes the capture's allocations to a private pool; the cudaMallocAsync one
//! (c10/cuda/CUDAMallocAsyncAllocator.cpp) allows one capture per process, lets the driver
//! turn captured `cudaMallocAsync`/`cudaFreeAsync` into graph memory nodes, defers frees of
//! memory allocated outside the capture until it ends, and joins every stream freed on
//! during the capture into the capture stream in `endAllocateToPool`.
use ferrocuda_alloc::{
    AllocError, AsyncAllocator, CachingAllocator, DeviceAllocators, HostAllocator, Route,
};
use ferrocuda_types::{DeviceIndex, PoolId, StreamHandle};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The allocators a [`CudaGraph`](crate::CudaGraph)'s captures go through: the device
/// allocator of the configured backend and the pinned host allocator (whose captures use a
/// private pool under either backend, as PyTorch's `CachingHostAllocator`).
#[derive(Clone, Debug)]
pub enum CaptureMemory {
    /// `backend:native`: each capture allocates from a private pool of the device's caching
    /// allocator.
    Native(Arc<DeviceAllocators>),
    /// `backend:cudaMallocAsync`: captured allocations are the graph's memory (freed by the
    /// graph, by their owner after it, or again by the next launch); one capture at a time.
    Async {
        /// The device backend.
        device: Arc<AsyncAllocator>,
        /// The pinned host allocator.
        host: Arc<HostAllocator>,
    },
}

impl From<Arc<DeviceAllocators>> for CaptureMemory {
    fn from(allocators: Arc<DeviceAllocators>) -> CaptureMemory {
        CaptureMemory::Native(allocators)
    }
}

impl From<&Arc<DeviceAllocators>> for CaptureMemory {
    fn from(allocators: &Arc<DeviceAllocators>) -> CaptureMemory {
        CaptureMemory::Native(allocators.clone())
    }
}

impl CaptureMemory {
    /// The pinned host allocator.
    pub fn host(&self) -> &Arc<HostAllocator> {
        match self {
            CaptureMemory::Native(a) => a.host(),
            CaptureMemory::Async { host, .. } => host,
        }
    }

    /// Whether `pool` of device `dev` sleeps (a sleepable pool of the caching allocator): a
    /// replay over it would touch memory with no pages.
    pub(crate) fn pool_asleep(&self, dev: DeviceIndex, pool: PoolId) -> Result<bool, AllocError> {
        match self {
            CaptureMemory::Native(a) => Ok(a.device(dev)?.pool_asleep(pool)),
            CaptureMemory::Async { .. } => Ok(false),
        }
    }

    /// `torch.cuda.empty_cache()`, as `torch.cuda.graph` runs it before a capture.
    pub(crate) fn empty_cache(&self, dev: DeviceIndex) -> Result<(), AllocError> {
        match self {
            CaptureMemory::Native(a) => {
                a.device(dev)?.empty_cache();
                Ok(())
            }
            CaptureMemory::Async { device, .. } => device.empty_cache(),
        }
    }

    /// Tells the device allocator that a capture on `stream` is about to begin, before the
    /// driver begins it, so that a free racing in from another thread is deferred rather
    /// than recorded into the capture. Dropping the announcement without
    /// [`Announcement::keep`] takes it back.
    pub(crate) fn announce(
        &self,
        dev: DeviceIndex,
        stream: StreamHandle,
    ) -> Result<Announcement<'_>, AllocError> {
        Ok(match self {
            // The pool's route needs the capture id, known only once the capture began: a
            // fence stands in until then.
            CaptureMemory::Native(a) => Announcement::Fence {
                _fence: CaptureFence::raise(a.device(dev)?)?,
            },
            CaptureMemory::Async { device, .. } => {
                device.begin_allocate_to_pool(dev)?;
                Announcement::Async {
                    allocator: device,
                    stream,
                    kept: false,
                }
            }
        })
    }

    /// Routes the capture `id`'s allocations to `pool` (`beginAllocateToPool` with the
    /// capture's stream filter), on the device and the host; all or nothing.
    pub(crate) fn route(&self, dev: DeviceIndex, pool: PoolId, id: u64) -> Result<(), AllocError> {
        let route = Route::Capture(id);
        let device = match self {
            CaptureMemory::Native(a) => {
                let allocator = a.device(dev)?;
                allocator.begin_allocate_to_pool(pool, route)?;
                Some(allocator)
            }
            CaptureMemory::Async { .. } => None,
        };
        let routed = self.host().begin_allocate_to_pool(pool, route);
        if routed.is_err()
            && let Some(allocator) = device
        {
            let _ = allocator.end_allocate_to_pool(pool);
            let _ = allocator.release_pool(pool);
        }
        routed
    }

    /// `endAllocateToPool` on the device and the host, after the capture on `stream` ended
    /// (both are told even when the first fails).
    pub(crate) fn end(
        &self,
        dev: DeviceIndex,
        pool: PoolId,
        stream: StreamHandle,
    ) -> Result<(), AllocError> {
        let device = match self {
            CaptureMemory::Native(a) => a.device(dev).and_then(|a| a.end_allocate_to_pool(pool)),
            CaptureMemory::Async { device, .. } => device.end_allocate_to_pool(stream),
        };
        let host = self.host().end_allocate_to_pool(pool);
        device.and(host)
    }

    /// `releasePool` on the device and the host (both are told even when the first fails).
    pub(crate) fn release(&self, dev: DeviceIndex, pool: PoolId) -> Result<(), AllocError> {
        let device = match self {
            CaptureMemory::Native(a) => a.device(dev).and_then(|a| a.release_pool(pool)),
            CaptureMemory::Async { device, .. } => {
                device.release_pool();
                Ok(())
            }
        };
        let host = self.host().release_pool(pool);
        device.and(host)
    }
}

/// A capture announced to the device allocator ([`CaptureMemory::announce`]).
pub(crate) enum Announcement<'a> {
    /// The native allocator's fence, lowered once the pool's route is in place.
    Fence { _fence: CaptureFence<'a> },
    /// The cudaMallocAsync allocator's capture, ended on drop unless kept.
    Async {
        allocator: &'a AsyncAllocator,
        stream: StreamHandle,
        kept: bool,
    },
}

impl Announcement<'_> {
    /// The capture began and is routed: the announcement stands.
    pub(crate) fn keep(mut self) {
        if let Announcement::Async { kept, .. } = &mut self {
            *kept = true;
        }
    }
}

impl Drop for Announcement<'_> {
    fn drop(&mut self) {
        if let Announcement::Async {
            allocator,
            stream,
            kept: false,
        } = self
        {
            let _ = allocator.end_allocate_to_pool(*stream);
        }
    }
}

/// Tells the allocator a capture is underway before the capture's own route can be set:
/// a route for a capture id no stream has (0, which CUDA never gives a capture) into a pool
/// of its own, which nothing is ever allocated from. While it stands the allocator defers
/// `record_stream` frees and frees nothing to the driver, as for any capture. Dropping it
/// ends the route and releases its pool.
pub(crate) struct CaptureFence<'a> {
    allocator: &'a CachingAllocator,
    pool: PoolId,
}

impl<'a> CaptureFence<'a> {
    fn raise(allocator: &'a CachingAllocator) -> Result<CaptureFence<'a>, AllocError> {
        // Outside the spaces of capture pools `(n, 0)` and handles `(0, n)`, and unique, so
        // that two captures starting at once each raise their own.
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let pool = PoolId(u64::MAX, NEXT.fetch_add(1, Ordering::Relaxed));
        allocator.begin_allocate_to_pool(pool, Route::Capture(0))?;
        Ok(CaptureFence { allocator, pool })
    }
}

impl Drop for CaptureFence<'_> {
    fn drop(&mut self) {
        let _ = self.allocator.end_allocate_to_pool(self.pool);
        let _ = self.allocator.release_pool(self.pool);
    }
}
