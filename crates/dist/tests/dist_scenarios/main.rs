//! Several devices on the fake device: collectives, process groups and the bucketed reducer,
//! one thread per rank ([`collectives`]), collectives captured into a CUDA graph
//! ([`graphs`]), and PyTorch's multi-device rules as an independent audit wrote them: peers,
//! copies, guards, per-device allocators, the fake group, the reducer ([`multi_device`]).
#![forbid(unsafe_code)]
mod adv_store;
mod collectives;
mod graphs;
mod multi_device;
mod rendezvous;
mod store;
mod watchdog;
