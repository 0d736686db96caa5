//! The thread cache's credit check against PyTorch's best-fit walk over expandable segments
//! (`get_free_block`: on from a candidate that can grow to the next one while that one
//! could grow to less), tried from outside, through the public API only. Written by a
//! helper asked to break the change that made the credit simulate the walk over the free
//! list as the free leaves it (commit 74b7ff2) instead of refusing whenever a free block
//! came first by (size, address).
//!
//! Every test compares the allocator with its thread cache (`thread_cache:True`) against
//! the single-lock path (`thread_cache:False`, PyTorch's behaviour): the pointer of every
//! allocation (and every error), and `stats()` / `blocks()` where a program reads them and
//! at its end.
//!
//! - `random_single`: random single-threaded programs over many configurations (expandable
//!   segments with 2 and 20 MiB pages, reclaim, small blocks kept inside their pages,
//!   `ferrocuda_recommended`, small reservations that make several segments per stream,
//!   `max_split_size_mb`, `roundup_power2_divisions`, `garbage_collection_threshold`, small
//!   devices that run out of memory, lagging devices, run-time `update_config` toggles),
//!   biased toward free+allocate of the same bytes (a credit's case). A failure is shrunk to a short program and printed with its seed.
//! - `random_threads`: the same kind of programs run by 2-4 worker threads, one step at a
//!   time handed over through channels (so the order is determined), each thread's own
//!   free+allocate pairs in between; the reference replays the steps in that order.
//! - `concurrent`: threads at once (no order), each on a stream of its own, so that what
//!   each is handed (as an offset into its own segments) is determined whatever the
//!   interleaving: against the single-lock path running the programs one after another,
//!   with lock contention (requests served by the lock holder, slots settled while their
//!   owners reuse parked blocks).
//! - `walk_cases`: hand-made layouts around the walk: the block before a segment's unmapped
//!   tail (the frontier) equal in size to the merged block, smaller, larger; the merged block
//!   itself the frontier; holes left by `empty_cache` (which count as room to grow without
//!   reclaim and not with it); two streams; several segments of one stream; small and
//!   large pools; blocks freed by another thread while a request maps pages.
//!
//! `harness` models best fit from `blocks()` on the reference, to count how often a test
//! met the new case (the walk passing at least one candidate to reach the merged block): a
//! credit is not observable through the public API, only its exactness is.
//!
//! `PROBE_SCALE=N` runs N times as many random programs.
#![forbid(unsafe_code)]
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod concurrent;
mod harness;
mod random_single;
mod random_threads;
mod walk_cases;
