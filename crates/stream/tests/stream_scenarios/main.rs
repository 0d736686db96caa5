//! Streams, events, devices and runtimes on the fake device: `torch.cuda`'s behaviours as an
//! independent audit wrote them ([`audit`]), what only the fake device can show
//! deterministically or needs more devices than a GPU machine has ([`fake_device`]), two
//! runtimes in one process ([`runtimes`]), and peer access and copies between devices
//! ([`peers`]).
#![forbid(unsafe_code)]
mod audit;
mod fake_device;
mod peers;
mod runtimes;
