//! Streams, events, devices and runtimes on the fake device: `torch.cuda`'s behaviours as an
//! independent audit wrote them ([`audit`]), what only the fake device can show
//! deterministically or needs more devices than a GPU machine has ([`fake_device`]), two
//! runtimes in one process ([`runtimes`]), peer access and copies between devices
//! ([`peers`]), and copies from pageable memory staged by threads ([`pageable_copies`]).
#![forbid(unsafe_code)]
mod audit;
mod fake_device;
mod pageable_copies;
mod peers;
mod runtimes;
