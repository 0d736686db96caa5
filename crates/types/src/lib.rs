//! Plain data shared by every ferrocuda layer.
//!
//! This crate holds the values that cross layer boundaries: device indices, the opaque handles
//! a [`Driver`](https://docs.rs/ferrocuda-driver) hands out, element types, launch and capture
//! descriptions, the nodes of captured graphs, allocator configuration, statistics,
//! snapshots and private-pool checkpoints, and the out-of-memory report ([`OutOfMemory`]:
//! the allocator fills it in, and it reaches a buffer user through the stream layer, which
//! sits below the allocator). It has no behaviour beyond parsing and formatting, so every
//! layer (and a user's own tools, through serde) can depend on it without pulling in CUDA.
//!
//! # Example
//! ```
//! use ferrocuda_types::{AllocatorConfig, Device, DeviceIndex, LaunchConfig, format_size};
//!
//! let dev: Device = "cuda:1".parse()?; // torch.device("cuda:1")
//! assert_eq!(dev.index, Some(DeviceIndex(1)));
//! // A PYTORCH_CUDA_ALLOC_CONF string, read with PyTorch's grammar.
//! let config = AllocatorConfig::parse("expandable_segments:True,max_split_size_mb:64")?;
//! assert!(config.expandable.enabled);
//! assert_eq!(config.sizes.max_split_size, Some(64 << 20));
//! // A 1-D launch over 1000 elements: 4 blocks of 256 threads.
//! assert_eq!(LaunchConfig::for_elements(1000, 256).grid, (4, 1, 1));
//! assert_eq!(format_size(3 << 20), "3.00 MiB"); // as memory_summary prints sizes
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Design choices
//! - Handles are `Copy` values that carry their device next to the backend's raw `u64`. The
//!   real driver stores the CUDA pointer there, the fake driver a table index: no lookup
//!   on the launch path, and a handle always knows which context it belongs to.
//! - [`DevicePtr`] is a transparent `u64` and [`bytemuck::Pod`], so it can be passed to a
//!   kernel as an argument without conversion.
//! - Nothing here validates handles; the layers above own lifetimes and validation.
//!
//! # What the layers above must do
//! Keep handles alive only as long as the object they name: a handle is a name, not an owner.
#![forbid(unsafe_code)]

mod checkpoint;
mod config;
mod device;
mod dtype;
mod env;
mod graph_node;
mod handles;
mod host;
mod launch;
mod oom;
mod snapshot;
mod stats;

pub use checkpoint::{BlockCheckpoint, PoolCheckpoint, RestoreResult, SegmentCheckpoint};
pub use config::{
    AllocatorConfig, AsyncBackendKeys, Backend as AllocatorBackend, ConfigError, ConfigSourceError,
    ExpandableConfig, MAX_PAGEABLE_COPY_THREADS, PinnedConfig, ROUNDUP_INTERVALS, ReleaseConfig,
    ReserveSize, ReuseConfig, SettingsText, SizeConfig,
};
pub use device::{Device, DeviceKind, DeviceParseError, DeviceProperties};
pub use dtype::{DType, Element};
pub use env::{EnvError, env_value, env_var};
pub use graph_node::{CopyEnd, GraphNode};
pub use handles::{
    DeviceIndex, DevicePtr, EventHandle, FunctionHandle, GraphExecHandle, GraphHandle, HostPtr,
    IpcHandle, ModuleHandle, PhysHandle, PoolId, StreamHandle, VaRange,
};
pub use host::{DurationStat, HostRange, HostStats};
pub use launch::{
    CaptureMode, CaptureStatus, EventFlags, KernelArg, LaunchConfig, MemsetValue, StreamFlags,
};
pub use oom::{FreeCache, LiveBlock, OomForensics, OutOfMemory, PoolOutOfMemory, ProcessMemory};
pub use snapshot::{
    AllocatorSettings, ExternalAnnotation, Frame, IntervalMib, Snapshot, SnapshotBlock,
    SnapshotSegment, TraceEntry,
};
pub use stats::{DeviceStats, PoolKind, Stat, StatArray, format_size};
