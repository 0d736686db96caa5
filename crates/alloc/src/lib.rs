//! PyTorch's CUDA caching allocator, over any [`Driver`](ferrocuda_driver::Driver), and its
//! pinned host caching allocator ([`host`], [`HostAllocator`]).
//!
//! Device memory comes from the driver in segments (2 MiB for the small pool, 20 MiB or
//! a 2 MiB multiple for the large pool) and is cut into blocks. Freed blocks are cached per
//! (pool, stream) and found again by best fit; neighbours merge on free. Everything a
//! PyTorch user sees is reproduced exactly (allocator spec §1–3, §5, §6): rounding
//! (`roundup_power2_divisions`), the oversize rules of `max_split_size_mb`, the slow path's
//! order, statistics and their keys, the OOM message.
//!
//! # Example
//! ```
//! use ferrocuda_alloc::{Caching, DeviceAllocators};
//! use ferrocuda_driver::FakeDriver;
//! use ferrocuda_types::{AllocatorConfig, DeviceIndex, StreamHandle};
//! use std::sync::Arc;
//!
//! let config = AllocatorConfig::parse("max_split_size_mb:64")?; // PYTORCH_CUDA_ALLOC_CONF
//! let allocators = DeviceAllocators::new(Arc::new(FakeDriver::default()), config, Caching::On);
//! // (`allocators.install(&runtime)` puts them behind a runtime's buffers.)
//! let (dev, stream) = (DeviceIndex(0), StreamHandle::legacy(DeviceIndex(0)));
//! let alloc = allocators.device(dev)?; // this device's caching allocator
//! let block = alloc.allocate(1000, stream)?; // 1024 bytes of a new 2 MiB segment
//! alloc.free(block.ptr)?;
//! let again = alloc.allocate(1000, stream)?; // the cached block: no driver call
//! assert_eq!(again.ptr, block.ptr);
//! let stats = alloc.stats(); // torch.cuda.memory_stats()
//! assert_eq!(stats.allocated_bytes.all.current, 1024);
//! assert_eq!(stats.reserved_bytes.all.current, 2 << 20);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Design choices
//! - **Exact by default, better by choice**: with PyTorch's keys only, every pointer,
//!   statistic, snapshot and out-of-memory outcome is PyTorch's; each improvement is a
//!   ferrocuda-only key, off by default (`cross_stream_reuse`, `oom_search_after_sync`,
//!   `oom_release_partial`, `garbage_collection_without_fraction`,
//!   `expandable_segments_reclaim`, `large_segment_size_mb`).
//! - **No lock across blocking driver calls**: `malloc`, `free` and synchronizations run
//!   with the allocator's mutex released (segments being allocated are counted in advance
//!   so the memory fraction holds). Event record and query, which do not block, run under it.
//! - **Page reclaim never synchronizes** (`expandable_segments_reclaim`): PyTorch waits for
//!   the stream before it unmaps; here a page moves only once an event mark recorded after
//!   its last free has completed (or the stream is idle), and growth creates new pages
//!   for the rest, so a training step is not drained in its middle.
//! - **One type per part of the state, calls going one way.** `block` (the slab of block
//!   records, links, split and merge; `address_map` finds them by address), `free_pools` (free lists per pool and stream, best
//!   fit, the oversize rule), `stream_order` (events that hold freed blocks back),
//!   `expandable` (address ranges, pages, unmapped pieces), `reclaim_clock` (when a free
//!   page may move without a synchronization), `private_pools` (routes, users,
//!   which pools a release may touch) are composed by `state`, which does the block-level
//!   steps. `engine` holds the lock and the steps every path shares (`combining` serves
//!   requests published while it is held); `slow_path` calls
//!   `release`, which calls `expandable_mapping`, which calls `engine`; `allocator` is the
//!   public face, `inspect` reads and `checkpoint` saves and restores a private pool's
//!   layout (for CUDAGraph trees). No two modules import each other.
//! - **Contended requests served by the lock holder** (`combining`, under the
//!   `thread_cache` key): a thread whose cached allocation or plain free finds the lock
//!   taken publishes it in its slot; the thread that takes the lock next serves every
//!   published request before its own, with the same steps, so results are the single
//!   lock's for the order served. Waiters look at the lock rarely, which keeps the
//!   allocator's state on one core: 8 threads of 1 MiB pairs on one stream about 6x faster
//!   on an H200, every latency percentile lower.
//! - Block storage is a slab with 32-bit indices for the address-ordered neighbour links;
//!   what allocation and free touch of a block fills one cache line, the rest (stream uses,
//!   stacks, events, pool id) the next. Free blocks are kept per (pool, stream) in (size,
//!   address) order, as PyTorch's `std::set`, binned by size (`free_list`). A block is
//!   found by its address through a hash table of its 4-byte index, the address read
//!   from the record itself (`address_map`): a quarter of the table a map of (address,
//!   index) pairs takes, and the record is what a free reads next anyway.
//! - **A per-thread front end** (`thread_cache`, on by default, the whole protocol in that
//!   file): the block a thread just freed comes back to it without the lock when PyTorch's
//!   free-then-best-fit would return that very block; every locked operation of any thread
//!   settles every parked block first, so results are PyTorch's for any interleaving
//!   consistent with happens-before.
//! - **Checkpoints checked before they change anything**: `restore_pool` (PyTorch's
//!   `setCheckpointPoolState`) moves statistics and history through PyTorch's own steps,
//!   but works out first whether the checkpoint fits the pool; where PyTorch fails
//!   half-way, it fails with the same message and leaves the pool as it was.
//! - **Pluggable allocators** ([`PluggableAllocator`], PyTorch's `CUDAPluggableAllocator`):
//!   a shared library's `alloc`/`free` either replace this allocator for a runtime's buffers
//!   (it is a `MemoryResource` too) or feed one private pool with segments
//!   ([`CachingAllocator::create_pool_with_allocator`], `MemPool(allocator=…)`), the
//!   caching, splitting and statistics staying this allocator's.
//! - **The pinned host allocator is its own module** ([`host`]): PyTorch's
//!   `CachingHostAllocator` (power-of-two blocks never split, events per using stream,
//!   private pools for captures); it shares only [`Route`] and [`AllocError`] with the
//!   device allocator, and [`DeviceAllocators`] holds one beside the device allocators.
//! - **`backend:cudaMallocAsync`** ([`AsyncAllocator`], PyTorch's `CudaMallocAsyncAllocator`):
//!   a second allocator behind the same [`MemoryResource`](ferrocuda_stream::MemoryResource)
//!   interface that caches nothing itself: the driver's stream-ordered pools do, and it keeps
//!   PyTorch's pointer table, usage streams, memory-fraction count and capture rules.
//! - **Graph memory planned by the same rules** ([`plan_pool`]): the bytes a capture's
//!   private pool will reserve come from replaying its requests (a warm-up's trace)
//!   through this allocator over a fake device that keeps no bytes, one capture or a set
//!   sharing a pool, so the plan is what the real capture takes, not an estimate.
//! - **Typed errors**: [`AllocError`] has its own cases (no such device with PyTorch's
//!   `assertValidDevice` text, CUDA not available, ...); the out-of-memory report lives in
//!   `ferrocuda_types` (re-exported here) so that, serving buffers, it reaches the user
//!   intact in `ferrocuda_stream::MemoryError::OutOfMemory`.
//!
//! # What the layer above must do
//! - Pick the stream: an allocation is tied to the stream it was made on.
//! - Call `record_stream` for every other stream that uses a block before freeing it.
//! - Keep one allocator per device (the facade's `memory` module does).
//! - Name its own allocation plumbing in [`history::HistoryOptions::skip_frames`] (the
//!   facade passes the stream layer's buffer and memory-resource frames and its own): this
//!   crate skips only its own frames at the top of a recorded stack.
#![forbid(unsafe_code)]

mod address_map;
mod allocator;
mod async_backend;
mod block;
mod capture_plan;
mod checkpoint;
mod combining;
mod devices;
mod engine;
mod error;
mod expandable;
mod expandable_mapping;
mod free_list;
mod free_pools;
pub mod history;
pub mod host;
mod inspect;
pub mod ipc;
mod oom_forensics;
mod peer_access;
mod pluggable;
mod private_pools;
mod reclaim_clock;
mod release;
pub mod rounding;
mod sleep;
mod slow_path;
mod state;
mod stream_order;
mod tally;
mod thread_cache;

pub use allocator::{Caching, CachingAllocator};
pub use async_backend::{ASYNC_IGNORES_WARNING, AsyncAllocator};
pub use block::{Allocation, BlockInfo};
pub use capture_plan::{
    AfterCapture, CaptureRequests, PlanError, PlannedRequest, PoolPlan, UnknownBlock, plan_pool,
    plan_pool_from,
};
pub use devices::{DeviceAllocators, caching_from_env};
pub use engine::OomObserver;
pub use error::{AllocError, OutOfMemory};
pub use host::HostAllocator;
pub use ipc::{IpcError, IpcStats, ReceivedBlock, ShareableHandle, SharedMessage};
pub use pluggable::PluggableAllocator;
pub use private_pools::Route;
pub use sleep::{SleepError, SleepMode, SleepReport, SleepStats, WakeReport};
