//! [`DeviceMemory`]: which caching allocator the math libraries take their workspaces and
//! work areas from — one made for them, or a device's allocator among those installed as
//! the runtime's memory (then CUDA graphs captured through the same allocators route a
//! capture's workspaces into the graph's private pool).
use ferrocuda_alloc::{AllocError, CachingAllocator, DeviceAllocators};
use ferrocuda_types::DeviceIndex;
use std::sync::Arc;

/// The caching allocator of one device, however it is held.
#[derive(Clone, Debug)]
pub enum DeviceMemory {
    /// An allocator of its own.
    Allocator(Arc<CachingAllocator>),
    /// `device`'s allocator among `allocators` (what `DeviceAllocators::install` gives the
    /// runtime and what a `CudaGraph` captures through).
    Installed {
        /// The allocators.
        allocators: Arc<DeviceAllocators>,
        /// The device.
        device: DeviceIndex,
    },
}

impl DeviceMemory {
    /// The allocator (made now if it is an installed one not used yet).
    pub fn allocator(&self) -> Result<&CachingAllocator, AllocError> {
        match self {
            DeviceMemory::Allocator(a) => Ok(a),
            DeviceMemory::Installed { allocators, device } => allocators.device(*device),
        }
    }
}

impl From<Arc<CachingAllocator>> for DeviceMemory {
    fn from(allocator: Arc<CachingAllocator>) -> DeviceMemory {
        DeviceMemory::Allocator(allocator)
    }
}

impl From<(Arc<DeviceAllocators>, DeviceIndex)> for DeviceMemory {
    fn from((allocators, device): (Arc<DeviceAllocators>, DeviceIndex)) -> DeviceMemory {
        DeviceMemory::Installed { allocators, device }
    }
}
