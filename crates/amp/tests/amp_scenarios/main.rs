//! Mixed precision through the public API, on the host and the fake device: autocast
//! ([`autocast`], [`autocast_state`]), the precision flags as data ([`precision`]; the one
//! test that writes the process-wide flags is `precision_process.rs`, a binary of its own),
//! bad input to the scaler and the optimizers ([`bad_input`]), the library's kernels with
//! nothing registered ([`library_kernels`]), the audit's regression tests ([`audit`]), and the
//! generated op-policy page ([`op_policy_page`]).
#![forbid(unsafe_code)]
mod audit;
mod autocast;
mod autocast_state;
mod bad_input;
mod library_kernels;
mod op_policy_page;
mod precision;
