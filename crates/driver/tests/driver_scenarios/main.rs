//! The driver crate through its public API, on the fake device and without libnccl: streams
//! another library made ([`foreign_streams`]), walks over a device's streams that follow the
//! work pending ([`many_streams`]), peer access and copies between devices ([`peer_access`]),
//! a pluggable allocator library loaded and called ([`pluggable`]), and NCCL missing
//! ([`nccl_unavailable`]).
mod foreign_streams;
mod many_streams;
mod nccl_unavailable;
mod peer_access;
mod pluggable;
