//! The PyTorch allocator library: the exported functions' safe halves over a `TorchBackend`
//! on the fake device ([`backend`]), and the built library loaded as PyTorch loads it, through
//! Python's `ctypes` ([`library`]).
#![forbid(unsafe_code)]
mod backend;
mod library;
