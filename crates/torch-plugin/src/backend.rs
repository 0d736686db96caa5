//! [`TorchBackend`]: what each PyTorch hook does with ferrocuda's allocators.
use crate::PluginError;
use ferrocuda::alloc::history::{HistoryOptions, SkipFrames};
use ferrocuda::alloc::{AllocError, CachingAllocator, DeviceAllocators, Route, SleepMode};
use ferrocuda::driver::c_export::{BackendError, SleepRequest, TorchAllocator};
use ferrocuda::driver::{Driver, ForeignStream};
use ferrocuda::types::{AllocatorConfig, DeviceIndex, DevicePtr, PoolId, StreamHandle};
use rustc_hash::FxHashSet;
use std::cell::RefCell;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

thread_local! {
    /// Streams this thread has already adopted, as (backend, device, raw stream).
    static ADOPTED: RefCell<FxHashSet<(u64, u16, u64)>> = RefCell::default();
}

/// ferrocuda's caching allocators serving PyTorch's hooks.
#[derive(Debug)]
pub struct TorchBackend {
    driver: Arc<dyn Driver>,
    allocators: Arc<DeviceAllocators>,
    /// The environment variable the configuration came from, and its value.
    source: Option<(&'static str, String)>,
    /// Tells this backend's entries of [`ADOPTED`] from another's.
    id: u64,
}

impl TorchBackend {
    /// A backend over `allocators`, which allocate through `driver`.
    pub fn new(driver: Arc<dyn Driver>, allocators: Arc<DeviceAllocators>) -> TorchBackend {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        TorchBackend {
            driver,
            allocators,
            source: None,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The global runtime's allocators (`ferrocuda::memory`): the real driver unless
    /// `FERROCUDA_BACKEND=fake`, configured from `FERROCUDA_ALLOC_CONF` (else
    /// `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`); a malformed configuration is
    /// this error, and so is a variable set to a value that is not valid UTF-8
    /// ([`PluginError::Env`], naming it).
    pub fn from_env() -> Result<TorchBackend, PluginError> {
        let driver = ferrocuda::try_runtime()?.driver().clone();
        let allocators = ferrocuda::memory::allocators()?.clone();
        Ok(TorchBackend {
            source: AllocatorConfig::source(|k| std::env::var(k))?,
            ..TorchBackend::new(driver, allocators)
        })
    }

    /// The allocators served.
    pub fn allocators(&self) -> &Arc<DeviceAllocators> {
        &self.allocators
    }

    fn allocator(&self, dev: DeviceIndex) -> Result<&CachingAllocator, PluginError> {
        Ok(self.allocators.device(dev)?)
    }

    /// Every device's allocator, made now if need be: each device's CUDA context is created,
    /// so only an explicit diagnostic call does this (recording history).
    fn every_allocator(&self) -> Result<Vec<&CachingAllocator>, PluginError> {
        let count = self.driver.device_count()?;
        (0..count)
            .map(|d| self.allocator(device_index(d)))
            .collect()
    }

    /// The driver's handle of PyTorch's stream on `dev`, adopting it the first time this
    /// thread sees it (PyTorch's streams live as long as the process: never forgotten).
    fn stream(
        &self,
        dev: DeviceIndex,
        stream: &ForeignStream,
    ) -> Result<StreamHandle, PluginError> {
        let key = (self.id, dev.0, stream.raw());
        let known = || ADOPTED.try_with(|a| a.borrow().contains(&key)) == Ok(true);
        if stream.raw() == 0 || known() {
            return Ok(StreamHandle {
                device: dev,
                raw: stream.raw(),
            });
        }
        let handle = if stream.device() == dev {
            self.driver.stream_adopt(stream)?
        } else {
            self.driver.stream_adopt(&stream.for_device(dev))?
        };
        // A thread past its thread-locals (freeing in its own exit) adopts every time.
        let _ = ADOPTED.try_with(|a| a.borrow_mut().insert(key));
        Ok(handle)
    }
}

impl TorchAllocator for TorchBackend {
    /// Checks PyTorch's device count against the driver's. Allocators are still made at
    /// each device's first use: making one asks the device for its memory, which would
    /// create a CUDA context on every GPU of the machine.
    fn init(&self, device_count: usize) -> Result<(), BackendError> {
        let driver = self.driver.device_count().map_err(PluginError::from)?;
        if driver != device_count {
            return Err(PluginError::DeviceCount {
                torch: device_count,
                driver,
            }
            .into());
        }
        Ok(())
    }

    fn allocate(
        &self,
        bytes: u64,
        device: DeviceIndex,
        stream: &ForeignStream,
    ) -> Result<DevicePtr, BackendError> {
        let stream = self.stream(device, stream)?;
        let a = self.allocator(device)?;
        Ok(a.allocate(bytes, stream).map_err(PluginError::from)?.ptr)
    }

    /// The allocator knows each block's stream: PyTorch's copy of it is not needed.
    fn free(
        &self,
        ptr: DevicePtr,
        _bytes: u64,
        device: DeviceIndex,
        _stream: &ForeignStream,
    ) -> Result<(), BackendError> {
        match self.allocator(device)?.free(ptr) {
            Err(AllocError::InvalidPointer(p)) => Err(PluginError::NotAllocatedHere(p).into()),
            other => Ok(other.map_err(PluginError::from)?),
        }
    }

    /// The device is the one whose allocator handed `ptr` out.
    fn record_stream(&self, ptr: DevicePtr, stream: &ForeignStream) -> Result<(), BackendError> {
        let mut refused = PluginError::NotAllocatedHere(ptr);
        for a in self.allocators.created() {
            let handle = match self.stream(a.device(), stream) {
                Ok(h) => h,
                Err(e) => {
                    refused = e;
                    continue;
                }
            };
            match a.record_stream(ptr, handle) {
                Err(AllocError::InvalidPointer(_)) => continue,
                other => return Ok(other.map_err(PluginError::from)?),
            }
        }
        Err(refused.into())
    }

    /// On every device in use (PyTorch's `emptyCache` also counts a `num_sync_all_streams`
    /// on devices never used; their allocators do not exist here, see `init`).
    fn empty_cache(&self) -> Result<(), BackendError> {
        for a in self.allocators.created() {
            a.empty_cache();
        }
        Ok(())
    }

    fn set_memory_fraction(&self, fraction: f64, device: DeviceIndex) -> Result<(), BackendError> {
        let a = self.allocator(device)?;
        Ok(a.set_memory_fraction(fraction).map_err(PluginError::from)?)
    }

    /// PyTorch's `getBaseAllocation`: the first block of the segment and the sum of its
    /// blocks (a rare call, for sharing a tensor between processes: it walks the blocks).
    fn base_allocation(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64), BackendError> {
        for a in self.allocators.created() {
            let blocks = a.blocks();
            let Some(b) = blocks.iter().find(|b| b.allocated && b.ptr == ptr) else {
                continue;
            };
            if b.expandable {
                return Err(PluginError::ExpandableNotShareable.into());
            }
            let size = blocks
                .iter()
                .filter(|x| x.segment == b.segment)
                .map(|x| x.size)
                .sum();
            return Ok((b.segment, size));
        }
        Err(PluginError::NotAllocatedHere(ptr).into())
    }

    fn begin_allocate_to_pool(
        &self,
        device: DeviceIndex,
        pool: PoolId,
    ) -> Result<(), BackendError> {
        let a = self.allocator(device)?;
        Ok(a.begin_allocate_to_pool(pool, Route::NextCapture)
            .map_err(PluginError::from)?)
    }

    fn end_allocate_to_pool(&self, device: DeviceIndex, pool: PoolId) -> Result<(), BackendError> {
        let a = self.allocator(device)?;
        Ok(a.end_allocate_to_pool(pool).map_err(PluginError::from)?)
    }

    fn release_pool(&self, device: DeviceIndex, pool: PoolId) -> Result<(), BackendError> {
        let a = self.allocator(device)?;
        Ok(a.release_pool(pool).map_err(PluginError::from)?)
    }

    fn memory_stats_json(&self, device: DeviceIndex) -> Result<String, BackendError> {
        let stats = self.allocator(device)?.stats().to_map();
        Ok(serde_json::to_string(&stats).map_err(PluginError::from)?)
    }

    fn reset_peak_memory_stats(&self, device: DeviceIndex) -> Result<(), BackendError> {
        self.allocator(device)?.reset_peak_stats();
        Ok(())
    }

    /// Where the configuration came from (`FERROCUDA_ALLOC_CONF=...`), then device 0's
    /// settings in force (every device has the same): PyTorch's keys, and ferrocuda's own
    /// where they differ from their defaults.
    fn allocator_settings(&self) -> Result<String, BackendError> {
        let effective = self.allocator(DeviceIndex(0))?.config();
        Ok(match &self.source {
            Some((var, value)) => format!("{var}={value} (in force: {effective})"),
            None => effective.to_string(),
        })
    }

    /// `_record_memory_history(enabled="all" | None, context=None, max_entries)` on every
    /// device, making the allocators of devices not yet used (and their CUDA contexts):
    /// trace entries without stacks (a stack here would be this library's frames, not the
    /// Python program's).
    fn record_memory_history(&self, enabled: bool, max_entries: usize) -> Result<(), BackendError> {
        let options = HistoryOptions::parse(enabled.then_some("all"), None, max_entries)
            .map_err(PluginError::History)?;
        let options = HistoryOptions {
            skip_frames: SkipFrames::new(
                &["ferrocuda_torch::", "ferrocuda_driver::c_export::"],
                &[],
            ),
            ..options
        };
        for a in self.every_allocator()? {
            a.record_memory_history(options.clone());
        }
        Ok(())
    }

    fn create_sleepable_pool(&self, device: DeviceIndex, pool: PoolId) -> Result<(), BackendError> {
        let a = self.allocator(device)?;
        Ok(a.create_sleepable_pool(pool).map_err(PluginError::from)?)
    }

    fn sleep(
        &self,
        device: DeviceIndex,
        pool: PoolId,
        mode: SleepRequest,
    ) -> Result<(), BackendError> {
        let mode = match mode {
            SleepRequest::Discard => SleepMode::Discard,
            SleepRequest::Offload { checksum } => SleepMode::Offload { checksum },
        };
        let a = self.allocator(device)?;
        a.sleep(pool, mode).map_err(PluginError::from)?;
        Ok(())
    }

    fn wake(&self, device: DeviceIndex, pool: PoolId) -> Result<(), BackendError> {
        let a = self.allocator(device)?;
        a.wake(pool).map_err(PluginError::from)?;
        Ok(())
    }

    fn dump_snapshot(&self, path: &Path) -> Result<(), BackendError> {
        let bytes = self
            .allocators
            .snapshot()
            .map_err(PluginError::from)?
            .to_pickle()
            .map_err(PluginError::Snapshot)?;
        std::fs::write(path, bytes).map_err(|source| PluginError::Io {
            path: path.to_owned(),
            source,
        })?;
        Ok(())
    }
}

/// Device `i` of a count the driver gave (which fits a `u16`).
fn device_index(i: usize) -> DeviceIndex {
    DeviceIndex(u16::try_from(i).unwrap_or(u16::MAX))
}
