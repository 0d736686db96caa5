//! Graphs on the fake device: scenarios only it can stage (a small device, a free racing a
//! capture's start or end, re-capturing in a loop in manual completion: [`fake_device`]), the
//! library's kernels with nothing registered ([`library_kernels`]), and the guarded cache in
//! front of wrapped functions ([`guards`]; the one test that writes the process-wide precision
//! flags is `guards_process.rs`, a binary of its own).
#![forbid(unsafe_code)]
mod fake_device;
mod guards;
mod lazy_adv;
mod library_kernels;
mod trees_plan_adv;
