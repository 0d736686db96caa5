//! The examples and the README's example, on the fake device (CI has no GPU): each example
//! runs and says where it ran ([`examples`]), and the README shows the example that
//! `cargo test` runs ([`readme`]).
#![forbid(unsafe_code)]
mod examples;
mod readme;
