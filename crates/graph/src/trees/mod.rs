//! CUDA-graph trees: `torch.compile(mode="reduce-overhead")`'s runtime
//! (`torch/_inductor/cudagraph_trees.py`) for closures over device buffers, without a
//! compiler.
//!
//! # The contract
//! - [`Trees::new`] makes the manager of one device: one private pool and one stream, shared
//!   by every function wrapped through it. [`Trees::wrap`] wraps a [`TreeFn`]: a closure
//!   that gets a [`Ctx`] and its inputs as [`Arg`]s, enqueues kernels on
//!   [`Ctx::stream`], allocates its outputs with [`Ctx::alloc`] and returns them.
//! - [`Wrapped::call`] takes [`Input`]s: device buffers (or earlier outputs) described by
//!   dtype and shape, some marked static ([`Input::mark_static`]: parameters and buffers,
//!   never copied). Per distinct input signature the function is warmed up eagerly
//!   ([`TreeConfig::warmup_runs`], in the pool), then recorded into a graph, then replayed.
//!   Non-static inputs reach a replay by copy into the recording's pool-resident inputs,
//!   or by patching the graph to read the caller's buffer where that is cheaper
//!   ([`TreeConfig::input_feed`], [`InputFeed`]); outputs are the same either way.
//! - Functions chain into one tree: a function called while outputs of the current path are
//!   held is recorded as a child, allocating next to them in the same pool (a forward then
//!   its backward; the layers of a decode step). Passing such an output back in
//!   ([`Input::output`]) uses it in place. Siblings record alternative continuations; before
//!   a new branch is recorded after a replay, the pool's allocator state is returned to the
//!   branch point's checkpoint (PyTorch's `apply_checkpoint_execution_state_in_allocator`)
//!   and the blocks of outputs that died since are freed.
//! - **Steps**: [`Trees::mark_step_begin`] starts a step (the primary contract,
//!   [`GenerationPolicy::Explicit`]). The next call ends the current path (outputs of
//!   earlier steps still held then become stale) unless it replays a child of the path's
//!   last node, recorded after it in an earlier step: that replay continues the path and
//!   writes only its own outputs, as PyTorch's `_run` looks at the current node's children
//!   before it ends an execution. [`GenerationPolicy::Heuristic`] is
//!   PyTorch's heuristic (each call a new generation unless a forward awaits its backward),
//!   available and documented as a heuristic.
//! - **Stale outputs are always detected**: a [`TreeTensor`] knows the run that produced it;
//!   reading it ([`TreeTensor::ptr`], [`TreeTensor::arg`], [`TreeTensor::to_host`],
//!   [`TreeTensor::copy_out`]) after a later run overwrote (or may have overwritten) its
//!   memory is [`TreeError::StaleOutput`], for one atomic load and compare. Keep an output
//!   across steps by moving it out: [`TreeTensor::copy_out`]. An output passed to the call
//!   that ends its path (the first call of a new step) is stale before anything reads it,
//!   as PyTorch's `dealloc_current_path_weakrefs` runs before the function reads its
//!   inputs: that call is [`TreeError::StaleOutput`], never a read of a freed block.
//! - **Refused calls** leave no trace: a wrong number of inputs
//!   ([`TreeError::InputCount`], [`WrapOptions::num_inputs`]), an input shape past its
//!   buffer, a stale input, a size above every bucket are refused before the guards, so
//!   they compile nothing, use no recompile slot and make no dim dynamic.
//! - **Skips**: a call that cannot be graphed runs eagerly, outside the pool, and says why
//!   in [`Call::served`] ([`Served::Eager`] with a [`SkipReason`] whose `Display` is
//!   PyTorch's "skipping cudagraphs due to …" line); with [`TreeConfig::cudagraph_or_error`]
//!   it is [`TreeError::Skipped`] instead. Writing a non-static input that is not a live
//!   tree output, of a recording or of a warm-up ([`WrapOptions::mutated_inputs`]), is
//!   such a case.
//! - **Static inputs** keep their recorded address; a new address records a sibling, up to
//!   [`TreeConfig::rerecord_limit`] (128) per node and function, then the function runs
//!   eagerly there ("exceeding max re-recording limit").
//! - **Shapes**: one recording per signature; [`WrapOptions::max_recorded_shapes`] caps them
//!   (least recently used evicted: its graphs destroyed, its outputs made stale, the pool
//!   blocks the tree held for it freed for reuse by other recordings; the pool's segments
//!   stay reserved, as every private pool's do while it is held); [`WrapOptions::buckets`]
//!   pads leading dimensions to a few sizes.
//! - **Failure**: an error or a panic in a wrapped function leaves the tree as before the
//!   call: a capture under way is discarded with its pool use, input copies and outputs
//!   allocated so far are freed, no state changes. Dropping the manager (with every
//!   [`Wrapped`]) frees every block it held and gives its pool back.
//!
//! # Not here (PyTorch features without a counterpart in closures over buffers)
//! Output aliasing (outputs are fresh allocations made through [`Ctx`]), outputs dying
//! during a call (inputs are borrowed), expanded inputs, and the compile-time skip reasons
//! about graphs (`non-Tensor inputs`, `complex memory overlap`, `cpu device`, `control flow
//! operator`, `sparsity`, `input storage mutation`).
//!
//! # Locks
//! A call holds its wrapped function's lock, then the manager's; the function runs under
//! both, so a wrapped function must not call another function of the same tree.
mod config;
mod context;
mod errors;
mod feed;
mod liveness;
mod manager;
mod nodes;
mod path;
mod plan;
mod run;
mod tensor;
mod warmed;
mod wrapped;

pub use config::{
    Buckets, FunctionMode, GenerationPolicy, InputFeed, PATCH_MIN_BYTES, TreeConfig, WrapOptions,
};
pub use context::{Call, Ctx, RunKind, Served, TreeFn};
pub use errors::{CheckStatus, SkipReason, TreeError, TreeEvent};
pub use manager::{NodeInfo, TreeStats, Trees};
pub use nodes::FunctionId;
pub use tensor::{Arg, Input, MAX_RANK, Out, Shape, TreeTensor};
pub use wrapped::Wrapped;
