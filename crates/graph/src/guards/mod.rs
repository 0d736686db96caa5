//! Guarded specialisations: a cache of compiled entries per wrapped function, each valid
//! for the inputs and global state it was made for (TorchDynamo's guards and cache-entry
//! list, `torch/csrc/dynamo/guards.cpp` and `torch/_dynamo/convert_frame.py`, without the
//! Python-frame machinery).
//!
//! A wrapped function's inputs are described by plain data ([`TensorMeta`]: dtype, device
//! index, `requires_grad`, sizes, strides), the global state by a small `Copy` snapshot
//! ([`GlobalState`]: autocast and precision flags read from `ferrocuda-amp`, the rest from
//! the caller's tensor library). A [`GuardedCache`] finds the entry whose guards pass,
//! most recent first, and compiles a new one on a miss, within Dynamo's recompile limits
//! and with its automatic dynamic shapes. The cached value is a type parameter: the graph
//! tree manager stores recorded graphs in it.
//!
//! # Design choices
//! - **Hot path first.** Each entry's guards are flattened into one array compared in a
//!   single pass ([`GuardSet`]); a lookup allocates nothing and returns an index. Failure
//!   texts ([`TensorMismatch`], [`GlobalStateDiff`], [`GuardFailure`]) are computed only on a
//!   miss that compiles, or when asked ([`GuardedCache::miss_reasons`]).
//! - **PyTorch's texts and order.** `TensorCheck`'s field order and verbose strings, the
//!   global-state guard's `reason()`, the `TORCH_LOGS="recompiles"` log ([`Recompile`]) and
//!   the limit warning ([`LimitHit`]) are reproduced, returned as typed values for the
//!   caller to print (this crate does no logging).
//! - **Left out**, because they guard Python objects: the Python type and dispatch-key set
//!   of a tensor, torch-function state, `ID_MATCH` and the other Python guards. So the
//!   recompile limit counts every entry, as Dynamo does for a frame without `ID_MATCH`
//!   guards. Inputs are values, not objects: aliasing between them is not guarded (Dynamo's
//!   "Duplicate tensor found where not expected!"), nor are layouts (all dense).
//! - **Dynamic dims stop at guards.** A dynamic dim is simply unguarded; there is no shape
//!   environment, so Dynamo's symbolic guards (the 0/1 specialisation `2 <= x.size()[0]`,
//!   relations between dims) are not produced. What a dynamic dim means for the cached
//!   value is the caller's business: the [`Specialization`] handed to the compile step says
//!   which dims are dynamic.
//!
//! # What the layer above must do
//! - Refuse, before [`GuardedCache::call`], a call PyTorch refuses before Dynamo looks at
//!   its cache (a wrong number of arguments: Python's `TypeError` at binding; an input
//!   view past its storage): every call that reaches the cache counts, a miss being a
//!   compile attempt (`_compile` in `torch/_dynamo/convert_frame.py`) that uses a
//!   recompile slot and merges its inputs into the automatic-dynamic records. The graph
//!   trees do so in `Wrapped::call`.
//! - Read [`GlobalState::current`] once per call and describe the inputs.
//! - Print or record the [`Recompile`] and [`LimitHit`] values it is given, and run the
//!   function eagerly on [`Call::Eager`].
//! - Invalidate entries whose guarded objects died ([`GuardedCache::invalidate`]).
mod cache;
mod dynamic;
mod entry;
mod global;
mod tensor;

pub use cache::{
    CacheConfig, CacheError, CacheStats, Call, CompileId, EntryId, FunctionInfo, GuardedCache,
    Limit, LimitHit, Recompile,
};
pub use entry::{GuardFailure, GuardSet, Specialization};
pub use global::{GlobalState, GlobalStateDiff, LibraryState};
pub use tensor::{ScalarTypeName, TensorFailure, TensorGuard, TensorMeta, TensorMismatch};

/// What describing an input can get wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GuardError {
    /// Sizes and strides of different lengths (or a rank beyond `u32`).
    #[error("an input has {sizes} sizes but {strides} strides")]
    StrideRank {
        /// How many sizes.
        sizes: usize,
        /// How many strides.
        strides: usize,
    },
}
