//! The pinned host caching allocator on the fake device: its behaviour with exact figures
//! ([`host`]), and PyTorch's `CachingHostAllocator` rules as an independent audit wrote them
//! ([`audit`]).
#![forbid(unsafe_code)]
mod audit;
mod host;
