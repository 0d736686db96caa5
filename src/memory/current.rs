//! Which allocator serves the global runtime's buffers: the caching allocators (PyTorch's
//! `"native"` backend), or a pluggable allocator put in their place before they are
//! initialised (`torch.cuda.memory.change_current_allocator`,
//! torch/csrc/cuda/CUDAPluggableAllocator.cpp `changeCurrentAllocator`).
use crate::alloc::{AllocError, PluggableAllocator};
use crate::stream::{MemoryResource, StreamError};
use crate::types::{DeviceIndex, DevicePtr, StreamHandle};
use std::sync::{Arc, Once, OnceLock};

/// The pluggable allocator installed as the global runtime's memory, once swapped in.
static CURRENT: OnceLock<Arc<Installed>> = OnceLock::new();

/// A pluggable allocator serving the global runtime, initialised (its `init` hook run with
/// the device count) when CUDA's lazy initialisation reaches it: at [`crate::init`] or the
/// first allocation, whichever comes first.
#[derive(Debug)]
struct Installed {
    allocator: Arc<PluggableAllocator>,
    init: Once,
}

impl Installed {
    fn ensure_init(&self) {
        self.init
            .call_once(|| self.allocator.init(crate::runtime().device_count()));
    }
}

impl MemoryResource for Installed {
    fn allocate(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr, StreamError> {
        self.ensure_init();
        self.allocator.allocate(dev, bytes, stream)
    }

    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), StreamError> {
        MemoryResource::free(&*self.allocator, dev, ptr)
    }

    fn record_stream(
        &self,
        dev: DeviceIndex,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), StreamError> {
        MemoryResource::record_stream(&*self.allocator, dev, ptr, stream)
    }
}

/// The pluggable allocator swapped in, if one was.
pub(crate) fn pluggable() -> Option<&'static Arc<PluggableAllocator>> {
    CURRENT.get().map(|i| &i.allocator)
}

/// The pluggable allocator swapped in, if one was, initialised first (its `init` hook runs
/// once): for the functions that run CUDA's lazy initialisation in PyTorch before they
/// reach the allocator (`caching_allocator_alloc`, `set_per_process_memory_fraction`).
pub(crate) fn pluggable_initialized() -> Option<&'static Arc<PluggableAllocator>> {
    CURRENT.get().map(|i| {
        i.ensure_init();
        &i.allocator
    })
}

/// `torch.cuda.memory.change_current_allocator(allocator)`: from now on the global
/// runtime's buffers (and the functions of [`crate::memory`]) use `allocator`. Allowed only
/// while the current allocator is not initialised, else [`AllocError::AlreadyInitialized`]
/// ("Can't swap an already initialized allocator"): the caching allocators are initialised
/// by [`crate::init`] or their first use (an allocation; a statistic read after CUDA is
/// initialised; before it, statistics are empty and initialise nothing); a pluggable
/// allocator is initialised when made, so it is never swapped out. Buffers made before keep
/// the allocator that made them.
pub fn change_current_allocator(allocator: &Arc<PluggableAllocator>) -> Result<(), AllocError> {
    let native_initialized = match super::allocators_for(crate::runtime()) {
        Ok(a) => a.is_initialized(),
        Err(_) => false,
    };
    if native_initialized || CURRENT.get().is_some() {
        return Err(AllocError::AlreadyInitialized);
    }
    let installed = Arc::new(Installed {
        allocator: allocator.clone(),
        init: Once::new(),
    });
    CURRENT
        .set(installed.clone())
        .map_err(|_| AllocError::AlreadyInitialized)?;
    crate::runtime().set_memory(installed);
    Ok(())
}

/// `torch.cuda.memory.get_allocator_backend()`: `"native"` or `"cudaMallocAsync"` as the
/// configuration selects, or the pluggable allocator's name, `"pluggable"`, once one is
/// current.
pub fn get_allocator_backend() -> &'static str {
    match (pluggable(), super::async_allocator()) {
        (Some(p), _) => p.name(),
        (None, Some(a)) => a.name(),
        (None, None) => "native",
    }
}

/// What CUDA's lazy initialisation does to the current allocator ([`crate::init`]): the
/// caching allocators' `init` (ignoring a configuration error, which every allocation
/// reports), or the pluggable allocator's `init` hook.
pub(crate) fn init_current() {
    match CURRENT.get() {
        Some(installed) => installed.ensure_init(),
        None => {
            if let Ok(a) = super::allocators_for(crate::runtime()) {
                // Without devices the runtime's own initialisation has failed already.
                let _ = a.init();
            }
        }
    }
}
