//! The `ferrocuda` command and its library: replays of real PyTorch traces against PyTorch's
//! figures ([`replay`]) and against the figures before the timed loop changed
//! ([`replay_unchanged`]), the replay's options ([`replay_options`], [`catch_up`]), traces
//! with many streams ([`many_streams`], over [`synthetic`] traces), real snapshots through
//! every command ([`snapshots`]), hostile input ([`hostile`]), and the GPU bundle's replay
//! comparison run without a GPU ([`bundle_replay`]), and `plan` from warm-up snapshots against
//! real captures ([`graph_plan`]).
#![forbid(unsafe_code)]
mod bundle_replay;
mod catch_up;
mod graph_plan;
mod hostile;
mod many_streams;
mod replay;
mod replay_options;
mod replay_unchanged;
mod snapshots;
mod synthetic;
