//! The caching allocator's scenarios on the fake device, with exact figures: its behaviour
//! ([`behaviour`]), PyTorch's rules as an audit found them ([`pytorch_rules`]), a full device
//! or memory fraction ([`memory_pressure`]), frees racing a capture ([`capture_race`]),
//! `Route::NextCapture` ([`next_capture`]), the graph-memory planner ([`capture_plan`]), peers ([`peer_access`]), a pluggable library as
//! the segment source ([`pluggable`]), the `backend:cudaMallocAsync` allocator
//! ([`async_backend`]), checkpoints of a private pool ([`checkpoint`]), page reclaim
//! ([`reclaim_without_sync`], [`reclaim_adversarial`], [`reclaim_switch`], [`reclaim_dormancy`]), and the output formats against
//! PyTorch's ([`formats`]).
#![forbid(unsafe_code)]
#[path = "../common/mod.rs"]
mod common;

mod async_backend;
mod behaviour;
mod capture_plan;
mod capture_plan_adv;
mod capture_plan_from;
mod capture_race;
mod checkpoint;
mod formats;
mod ipc;
mod ipc_adv;
mod legacy_stream_captures;
mod memory_pressure;
mod next_capture;
mod oom_forensics;
mod oom_forensics_adv;
mod peer_access;
mod pluggable;
mod pytorch_rules;
mod reclaim_adversarial;
mod reclaim_dormancy;
mod reclaim_switch;
mod reclaim_without_sync;
mod sleep;
mod sleep_adv;
mod small_page_bound;
mod small_page_bound_adv;

pub(crate) use common::Rng;
