//! What the backend can refuse.
use ferrocuda::alloc::AllocError;
use ferrocuda::driver::DriverError;
use ferrocuda::types::{DevicePtr, EnvError};

/// Why a call of the PyTorch allocator library failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PluginError {
    /// The allocator refused (out of memory, a pointer it did not hand out, a bad pool...).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A configuration variable of the environment is set but cannot be read (not UTF-8):
    /// `FERROCUDA_BACKEND` or one of the allocator configuration's.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// The driver refused (a stream of another device, a stream it does not know...).
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    /// No device's allocator handed out this pointer (PyTorch's wording).
    #[error("Trying to free a pointer not allocated here: {0}")]
    NotAllocatedHere(DevicePtr),
    /// PyTorch's `getBaseAllocation` refuses expandable segments (they cannot be shared
    /// between processes); PyTorch's message.
    #[error(
        "Tensors allocated with expandable_segments:True cannot be shared between processes. \
         Consider using expandable_segments:False in data loading workers via \
         torch.cuda.memory._set_allocator_settings('expandable_segments:False')"
    )]
    ExpandableNotShareable,
    /// PyTorch's device count differs from the driver's.
    #[error("PyTorch counts {torch} devices, the driver {driver}")]
    DeviceCount {
        /// What `init` was given.
        torch: usize,
        /// What the driver reports.
        driver: usize,
    },
    /// Recording history was refused.
    #[error("memory history: {0}")]
    History(String),
    /// The snapshot could not be made.
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// The snapshot file could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The statistics could not be written as JSON.
    #[error("statistics as JSON: {0}")]
    Json(#[from] serde_json::Error),
}
