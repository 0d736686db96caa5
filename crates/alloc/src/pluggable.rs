//! PyTorch's `CUDAPluggableAllocator` (torch/csrc/cuda/CUDAPluggableAllocator.cpp) over a
//! loaded library ([`PluggableLibrary`]): the table of live allocations that gives `free`
//! its size, device and stream, the error for a pointer it did not hand out, which hook
//! each allocator function calls, and PyTorch's error for every function it has none for.
//!
//! It serves two ways, as in PyTorch: as the process's allocator (a [`MemoryResource`]
//! installed in the caching allocator's place, the facade's `change_current_allocator`), and
//! as the segment source of a private pool of a caching allocator
//! ([`CachingAllocator::create_pool_with_allocator`], PyTorch's `MemPool(allocator=…)`),
//! where the caching allocator still splits, caches and counts, and only asks it for whole
//! segments and gives them back.
//!
//! [`CachingAllocator::create_pool_with_allocator`]: crate::CachingAllocator::create_pool_with_allocator
use crate::AllocError;
use ferrocuda_driver::{Hook, PluggableLibrary};
use ferrocuda_stream::{MemoryResource, StreamError};
use ferrocuda_types::{DeviceIndex, DevicePtr, PoolId, StreamHandle};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// What `free` is called with for an allocation (`_AllocationMetadata`).
#[derive(Copy, Clone, Debug)]
struct Metadata {
    size: u64,
    device: DeviceIndex,
    stream: StreamHandle,
}

/// A pluggable allocator: PyTorch's `CUDAPluggableAllocator`, as `createCustomAllocator`
/// makes it: the current allocator of a runtime (it is a [`MemoryResource`]) or the segment
/// source of a private pool ([`CachingAllocator::create_pool_with_allocator`]).
///
/// [`CachingAllocator::create_pool_with_allocator`]: crate::CachingAllocator::create_pool_with_allocator
#[derive(Debug)]
pub struct PluggableAllocator {
    library: PluggableLibrary,
    /// `allocation_metadata_`: every live allocation, by address.
    metadata: Mutex<FxHashMap<u64, Metadata>>,
    initialized: AtomicBool,
}

impl PluggableAllocator {
    /// The allocator over `library`, initialised: PyTorch's `createCustomAllocator` calls
    /// `init(device_count)` at once, with its `device_count` of 0 and before any hook can be
    /// set, so no hook runs and the allocator counts as initialised from then on (it can be
    /// made the current allocator, and never swapped out).
    pub fn new(library: PluggableLibrary) -> Arc<PluggableAllocator> {
        Arc::new(PluggableAllocator {
            library,
            metadata: Mutex::new(FxHashMap::default()),
            initialized: AtomicBool::new(true),
        })
    }

    /// Loads `path` and makes the allocator over its `alloc_fn_name` and `free_fn_name`
    /// (Python's `CUDAPluggableAllocator(path, alloc_fn_name, free_fn_name)`); hooks are
    /// added to the library first ([`PluggableLibrary::with_hook`]) when wanted.
    pub fn load(
        path: impl AsRef<std::path::Path>,
        alloc_fn_name: &str,
        free_fn_name: &str,
    ) -> Result<Arc<PluggableAllocator>, AllocError> {
        Ok(PluggableAllocator::new(PluggableLibrary::load(
            path,
            alloc_fn_name,
            free_fn_name,
        )?))
    }

    /// The library.
    pub fn library(&self) -> &PluggableLibrary {
        &self.library
    }

    /// `name()`: `"pluggable"` (what `get_allocator_backend` reports for it).
    pub fn name(&self) -> &'static str {
        "pluggable"
    }

    /// `malloc(size, device, stream)`: the library's allocation. A null result is
    /// returned as address 0 and not recorded (PyTorch records it; only a free of 0 could
    /// tell).
    pub fn malloc(&self, size: u64, device: DeviceIndex, stream: StreamHandle) -> DevicePtr {
        let ptr = self.library.alloc(size, device, stream);
        if ptr != 0 {
            // `emplace`: an address handed out twice keeps its first record.
            self.metadata.lock().entry(ptr).or_insert(Metadata {
                size,
                device,
                stream,
            });
        }
        DevicePtr(ptr)
    }

    /// `raw_delete(ptr)`: the library's free, with the size, device and stream the
    /// allocation was made with. An address not handed out (or already freed) is
    /// [`AllocError::NotAllocatedHere`] and the library is not called.
    pub fn raw_delete(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let m = self
            .metadata
            .lock()
            .remove(&ptr.0)
            .ok_or(AllocError::NotAllocatedHere(ptr))?;
        self.library.free(ptr.0, m.size, m.device, m.stream);
        Ok(())
    }

    /// `init(device_count)`: the init hook, if given; the allocator is initialised after.
    /// The facade calls it when CUDA is initialised with this allocator current.
    pub fn init(&self, device_count: usize) {
        self.library.init(device_count);
        self.initialized.store(true, Ordering::Release);
    }

    /// `initialized()`.
    pub fn initialized(&self) -> bool {
        self.initialized.load(Ordering::Acquire)
    }

    /// `setMemoryFraction`: the memory-fraction hook, if given.
    pub fn set_memory_fraction(&self, fraction: f64, device: DeviceIndex) {
        self.library.memory_fraction(fraction, device);
    }

    /// `emptyCache`: the reset hook, if given.
    pub fn empty_cache(&self) {
        self.library.reset();
    }

    /// `getBaseAllocation(ptr, size)`: the base-allocation hook's answer, or `(ptr, size)`
    /// unchanged without it.
    pub fn base_allocation(&self, ptr: DevicePtr, size: u64) -> (DevicePtr, u64) {
        match self.library.base_alloc(ptr.0, size) {
            Some((base, size)) => (DevicePtr(base), size),
            None => (ptr, size),
        }
    }

    /// `recordStream`: the record-stream hook, if given.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamHandle) {
        self.library.record_stream(ptr.0, stream);
    }

    /// `beginAllocateToPool`: the hook, if given (without PyTorch's stream filter, a C++
    /// closure the C interface cannot pass).
    pub fn begin_allocate_to_pool(&self, device: DeviceIndex, pool: PoolId) {
        self.library
            .pool_hook(Hook::BeginAllocateToPool, device, pool);
    }

    /// `endAllocateToPool`: the hook, if given.
    pub fn end_allocate_to_pool(&self, device: DeviceIndex, pool: PoolId) {
        self.library
            .pool_hook(Hook::EndAllocateToPool, device, pool);
    }

    /// `releasePool`: the hook, if given.
    pub fn release_pool(&self, device: DeviceIndex, pool: PoolId) {
        self.library.pool_hook(Hook::ReleasePool, device, pool);
    }

    /// PyTorch's error for what the allocator has no form of, naming its C++ function
    /// (`getDeviceStats`, `snapshot`, `recordHistory`, …).
    pub fn unsupported(function: &'static str) -> AllocError {
        AllocError::PluggableUnsupported(function)
    }

    /// Allocations handed out and not freed.
    pub fn live(&self) -> usize {
        self.metadata.lock().len()
    }
}

/// The allocator as the memory of a runtime's buffers (PyTorch's `allocate`, with the
/// buffer's device and stream). A null allocation is [`AllocError::PluggableOutOfMemory`].
impl MemoryResource for PluggableAllocator {
    fn allocate(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr, StreamError> {
        match self.malloc(bytes, dev, stream) {
            DevicePtr(0) => Err(AllocError::PluggableOutOfMemory {
                bytes,
                device: dev.0,
            }
            .into()),
            ptr => Ok(ptr),
        }
    }

    fn free(&self, _dev: DeviceIndex, ptr: DevicePtr) -> Result<(), StreamError> {
        Ok(self.raw_delete(ptr)?)
    }

    fn record_stream(
        &self,
        _dev: DeviceIndex,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), StreamError> {
        PluggableAllocator::record_stream(self, ptr, stream);
        Ok(())
    }
}
