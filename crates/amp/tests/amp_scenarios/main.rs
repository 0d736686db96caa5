//! Mixed precision through the public API, on the host and the fake device: autocast
//! ([`autocast`], [`autocast_state`]), the precision flags as data ([`precision`]; the one
//! test that writes the process-wide flags is `precision_process.rs`, a binary of its own),
//! bad input to the scaler and the optimizers ([`bad_input`]), the library's kernels with
//! nothing registered ([`library_kernels`]), the audit's regression tests ([`audit`]), the
//! generated op-policy page ([`op_policy_page`]), and PyTorch 2.11's autocast lists against
//! what 2.11 registers ([`tables_2_11`]; selecting them is `autocast_tables_process.rs`).
#![forbid(unsafe_code)]
mod audit;
mod autocast;
mod autocast_state;
mod bad_input;
mod library_kernels;
mod op_policy_page;
mod precision;
mod tables_2_11;
