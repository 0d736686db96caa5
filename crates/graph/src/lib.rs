//! CUDA graphs with private memory pools (`torch.cuda.CUDAGraph`, `torch.cuda.graph`).
//!
//! A [`CudaGraph`] captures the work enqueued on one stream (and the streams forked from
//! it) into a graph, instantiates it, and replays it. While it captures, the caching
//! allocator serves every allocation made on the capture's streams from the graph's private
//! pool, so replays touch the same addresses; a pool can be shared between graphs that
//! replay in capture order. Under `backend:cudaMallocAsync` ([`CaptureMemory::Async`]) the
//! driver makes what the capture allocates the graph's own memory instead.
//!
//! [`make_graphed_callables`] captures closures in order into one shared pool;
//! [`LazyGraphs`] captures a graph per key (a batch size) on first use within a byte
//! budget, planned before capturing, dropping the least recently used graphs to fit;
//! [`PhiloxGenerator`] draws random numbers that replays advance like eager calls;
//! [`CudaGraph::update_inputs`] repoints a captured graph at new buffers without copying
//! ([`CudaGraph::update_input_ptrs`] by raw address).
//! - [`trees`]: CUDA-graph trees (`mode="reduce-overhead"` without a compiler): wrapped
//!   functions warmed up, recorded per input signature into one shared pool, and replayed,
//!   with explicit steps and stale outputs always detected.
//!
//! - [`guards`]: guarded specialisations per wrapped function (TorchDynamo's guards,
//!   MRU cache entries, recompile limits, automatic dynamic shapes), generic over the
//!   cached value.
//!
//! # Example
//! ```
//! use ferrocuda_alloc::{Caching, DeviceAllocators};
//! use ferrocuda_driver::FakeDriver;
//! use ferrocuda_graph::{CaptureMode, CudaGraph, PhiloxGenerator};
//! use ferrocuda_stream::{DeviceBuffer, Runtime};
//! use ferrocuda_types::{AllocatorConfig, DeviceIndex};
//! use std::sync::Arc;
//!
//! let fake = Arc::new(FakeDriver::default());
//! let rt = Runtime::new(fake.clone());
//! let allocators = DeviceAllocators::new(fake, AllocatorConfig::default(), Caching::On);
//! allocators.install(&rt);
//! let dev = DeviceIndex(0);
//! let rng = PhiloxGenerator::new(&rt, dev, 42)?;
//! let out = DeviceBuffer::<f32>::uninit(&rt, dev, 4)?;
//! let graph = CudaGraph::new(rt.clone(), &allocators, dev)?;
//! graph.register_generator(&rng)?; // each replay draws fresh numbers
//! let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?; // with torch.cuda.graph(g):
//! rng.uniform(&out, capture.stream())?; // recorded, not run
//! capture.end()?;
//! graph.replay(&rt.current_stream(dev)?)?;
//! let first = out.to_host()?;
//! graph.replay(&rt.current_stream(dev)?)?;
//! assert_ne!(out.to_host()?, first);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Design choices
//! - **Graph-memory policy lives here.** The allocator only offers "allocate in pool P",
//!   "retain / release pool P", "blocks of pool P"; which pool, for whom, and when it is
//!   released is decided by this crate.
//! - **A failed capture never leaks its pool, and leaves no half graph.** [`CaptureGuard`]
//!   ends the capture and stops the allocator's routing on every exit path; only
//!   [`CaptureGuard::end`] keeps the graph. A guard dropped without it (an early return, a
//!   `?`, a panic) destroys what was recorded and releases the pool, leaving the graph empty
//!   and ready to capture again (PyTorch leaks the pool: #190348, #190308).
//! - **Typed errors for the capture rules**: the legacy default stream, nesting, replay
//!   before capture, an empty capture, an unjoined fork and an invalidated capture are each
//!   a [`GraphError`] variant, not undefined behaviour.
//! - **One host-to-device copy per replay for RNG state**, not PyTorch's two fill kernels
//!   per generator (graphs spec §10 item 9).
//! - Library captures default to [`CaptureMode::ThreadLocal`] (graphs spec §10 item 8):
//!   other threads' allocations do not break them.
//!
//! # What the layer above must do
//! - Keep the static inputs and outputs alive while the graph may replay.
//! - Replay graphs that share a pool in the order they were captured, never concurrently.
#![forbid(unsafe_code)]

mod callables;
mod capture_memory;
mod graph;
pub mod guards;
mod instances;
mod lazy;
mod repoint;
mod rng;
pub mod trees;

pub use callables::{
    Callable, CallableError, GraphedCallables, GraphedOptions, make_graphed_callables,
};
pub use capture_memory::CaptureMemory;
pub use ferrocuda_types::{CaptureMode, PoolId};
pub use graph::{CaptureGuard, CudaGraph, GraphError, InputMove, InputUpdate};
pub use lazy::{LazyGraphs, LazyStats};
pub use rng::{PHILOX_KERNELS, PhiloxGenerator, register_fake_philox};
pub use trees::{Trees, Wrapped};
