//! Regression tests for the defects an audit of the crate found, one module per defect,
//! each written to fail before its fix (fake device):
//! - [`guards`]: autocast guards dropped in any order leave the thread's state as it was;
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

#[path = "audit/guards.rs"]
mod guards;


pub type TestResult = Result<(), Box<dyn std::error::Error>>;
