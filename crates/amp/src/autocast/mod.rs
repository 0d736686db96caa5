//! Autocast as a library: which dtype each argument of an op call must have under the
//! current thread's autocast state, decided by PyTorch 2.15's policy tables (or 2.11's,
//! selected with [`select_op_tables`]).
//!
//! PyTorch implements autocast as a dispatcher layer wrapped around every registered op
//! (`aten/src/ATen/autocast_mode.{h,cpp}`). A Rust tensor crate has no such dispatcher, so
//! here the tensor crate asks: it implements [`AutocastArg`] for its tensor, calls
//! [`cast_inputs`] before running an op on a device, casts what the returned [`CastPlan`]
//! says (through the weight-cast cache with [`CastPlan::cast_arg`]) and runs the op under a
//! [`RedispatchGuard`]. Regions are scopes: [`Autocast::enter`] and [`AmpState::enter`]
//! return guards that own what they restore.
//!
//! - [`tables`]: the one declarative source of every op's policy per device ([`CastPolicy`]);
//!   `tables_2_11`: PyTorch 2.11's lists as changes to them.
//! - `device_string`: PyTorch device strings parsed into a [`DeviceKind`].
//! - [`policy`](mod@policy): the compiled lookup ([`OpId`], [`CastPolicy`]).
//! - [`cast`](mod@cast): eligibility and cast rules ([`cast_inputs`]).
//! - [`state`](mod@state): the state as values ([`AmpState`] snapshots, [`Autocast`] regions).
//! - [`guards`](mod@guards): the scopes that change a thread's state and the queries.
//! - `thread_state`: where the state lives and how guards dropped in any order restore it.
//! - [`cache`](mod@cache): the version-checked weight-cast cache.
//! - [`docs_lists`] / [`docs_page`](mod@docs_page): PyTorch's doc lists, their drift, and the
//!   generated op-policy page.
pub mod cache;
pub mod cast;
pub mod device;
mod device_string;
pub mod docs_lists;
pub mod docs_page;
pub mod error;
pub mod guards;
pub mod policy;
pub mod state;
pub mod tables;
mod tables_2_11;
mod thread_state;

pub use cache::{WeightCastCache, clear_thread_caches, thread_cache_len};
pub use cast::{AutocastArg, CastPlan, cast_inputs, cast_inputs_by_name, is_eligible};
pub use device::DeviceKind;
pub use docs_lists::{DocsClass, DocsDrift, docs_drift};
pub use docs_page::op_policy_page;
pub use error::AutocastError;
pub use guards::{
    AutocastGuard, InferenceModeGuard, RedispatchGuard, StateGuard, dtype, is_cache_enabled,
    is_enabled, is_inference_mode, nesting,
};
pub use policy::{
    CastPolicy, OpId, OpTables, all_listed_ops, listed_ops, listed_ops_in, op_tables, policy,
    policy_by_name, policy_in, select_op_tables,
};
pub use state::{AmpState, Autocast};
pub use tables::BINARY_CROSS_ENTROPY_BANNED;
pub use thread_state::thread_state_version;
