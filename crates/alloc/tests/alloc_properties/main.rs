//! Random programs against the allocators on the fake device, checked after every step: the
//! caching allocator's invariants and books ([`properties`]), the `backend:cudaMallocAsync`
//! allocator's ([`async_properties`]), and the pinned host allocator against a model of
//! PyTorch's ([`host_model`]). Persisted failing seeds: `../proptest-regressions/<module>.txt`.
#![forbid(unsafe_code)]
mod async_properties;
mod host_model;
mod properties;
