//! The `ferrocuda` command's library: reading PyTorch memory snapshots and replaying their
//! allocation traces through ferrocuda's caching allocator on the fake device, so allocator
//! settings can be compared on a real workload without a GPU.
//!
//! # Design choices
//! - A replay allocates on the trace's streams, frees at `free_completed` (a block whose
//!   free was only requested is still in use), and ignores PyTorch's own `segment_*` events:
//!   the segments are ours to decide.
//! - The fake device keeps no bytes (`backing(false)`): a 60 GiB trace costs no host memory.
//! - After every replay the allocator's books are checked against a recount of its blocks.
#![forbid(unsafe_code)]

pub mod options;
pub mod pickle;
pub mod pytorch;
pub mod replay;
pub mod report;
pub mod trace;
