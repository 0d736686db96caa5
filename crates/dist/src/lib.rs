//! Several GPUs: collectives on ferrocuda streams and buffers (`torch.distributed` with the
//! NCCL backend, for the parts a runtime owns) and DDP's bucketed gradient all-reduce.
//!
//! A [`ProcessGroup`] runs one rank's collectives through a [`Collective`] backend: NCCL's
//! communicator ([`NcclComm`](ferrocuda_driver::nccl::NcclComm), loaded at run time; a
//! missing libnccl is [`NcclError::Unavailable`](ferrocuda_driver::nccl::NcclError)) on the
//! GPU, or the in-process [`FakeGroup`] over the fake device's devices in CI. A
//! [`Reducer`] buckets gradients as DDP does and all-reduces each bucket as soon as it is
//! full, overlapping the backward pass.
//!
//! # Example
//! Two ranks on a fake device with two devices, one thread each:
//! ```
//! use ferrocuda_dist::{DistError, FakeGroup, ProcessGroup, ReduceOp};
//! use ferrocuda_driver::FakeDriver;
//! use ferrocuda_stream::{DeviceBuffer, Runtime};
//! use ferrocuda_types::DeviceIndex;
//! use std::sync::Arc;
//!
//! let fake = Arc::new(FakeDriver::builder().devices(2).build());
//! let rt = Runtime::new(fake.clone());
//! let ranks = FakeGroup::ranks(fake, &[DeviceIndex(0), DeviceIndex(1)])?;
//! let sums = std::thread::scope(|s| {
//!     let threads: Vec<_> = (ranks.into_iter().enumerate())
//!         .map(|(r, rank)| {
//!             let rt = rt.clone();
//!             s.spawn(move || -> Result<Vec<f32>, DistError> {
//!                 let group = ProcessGroup::new(rt.clone(), Box::new(rank))?;
//!                 let x = DeviceBuffer::from_slice(&rt, group.device(), &[r as f32 + 1.0; 2])?;
//!                 group.all_reduce(&x, ReduceOp::Sum)?.wait()?; // a stream wait, as NCCL's
//!                 Ok(x.to_host()?)
//!             })
//!         })
//!         .collect();
//!     let panicked = || Err(DistError::Reducer("a rank panicked".into()));
//!     (threads.into_iter())
//!         .map(|t| t.join().unwrap_or_else(|_| panicked()))
//!         .collect::<Result<Vec<_>, _>>()
//! })?;
//! assert_eq!(sums, [[3.0; 2], [3.0; 2]]);
//! # Ok::<(), DistError>(())
//! ```
//!
//! # Design choices
//! - **One seam for collectives** ([`Collective`]): the process group's stream order,
//!   `record_stream` and `Work` semantics, and the reducer's bucketing, are tested on the
//!   fake device with the same code that drives NCCL.
//! - **PyTorch's stream protocol** (`ProcessGroupNCCL::collective`): the communication
//!   stream waits for the current stream, buffers are recorded on it, `Work::wait` is a
//!   stream wait. Nothing here synchronises the host.
//! - **The fake moves data in stream order** on a group stream of its own, so manual
//!   completion shows what waits for what; send and receive meet in pairs.
//! - `#![forbid(unsafe_code)]`: NCCL's FFI is in `ferrocuda-driver`.
//!
//! # What the layer above must do
//! - Pass the same calls in the same order on every rank (NCCL's rule; the fake reports a
//!   mismatch as [`DistError::Mismatched`]).
//! - Create communicators one thread (or process) per device, and share the unique id.
#![forbid(unsafe_code)]

mod collective;
mod error;
mod fake;
mod group;
mod reducer;
mod rendezvous;
pub mod store;
mod store_group;
mod watchdog;

pub use collective::Collective;
pub use error::{DistError, Result};
pub use fake::{FakeGroup, FakeRank};
pub use ferrocuda_driver::nccl::{CollectiveCall, CollectiveOp, ReduceOp};
pub use group::{ProcessGroup, Work};
pub use reducer::{BucketCaps, Reducer, assign_buckets, reduce_found_inf};
pub use rendezvous::{DistEnv, pytorch_unique_id_key, rendezvous};
pub use store::{StoreError, TcpStore, TcpStoreServer};
pub use store_group::StoreRank;
