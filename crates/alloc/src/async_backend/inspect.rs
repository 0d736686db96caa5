//! What the `backend:cudaMallocAsync` allocator reports and controls besides allocation:
//! statistics from the pool's attributes (`getDeviceStats`), peak resets, the memory
//! fraction, `emptyCache`, and PyTorch's errors for what it has no form of.
use super::AsyncAllocator;
use crate::AllocError;
use ferrocuda_driver::Driver;
use ferrocuda_stream::{MemoryResource, StreamError};
use ferrocuda_types::{
    AllocatorBackend, AllocatorConfig, DeviceIndex, DevicePtr, DeviceStats, StreamHandle,
};
use std::sync::Arc;

/// PyTorch's warning for options `backend:cudaMallocAsync` ignores, word for word (the
/// missing space after the first comma is PyTorch's: two adjacent literals):
/// `CUDAAllocatorConfig::parseArgs` in c10/cuda/CUDAAllocatorConfig.cpp (`TORCH_WARN`, once
/// per string parsed).
pub const ASYNC_IGNORES_WARNING: &str = "backend:cudaMallocAsync ignores max_split_size_mb,roundup_power2_divisions, and garbage_collect_threshold.";

impl AsyncAllocator {
    /// The allocator for a configuration that selects it (`backend:cudaMallocAsync`):
    /// another backend is PyTorch's backend assertion. PyTorch's keys of the caching
    /// allocator are accepted and ignored with PyTorch's warning, kept for
    /// [`AsyncAllocator::take_warnings`] (see [`ferrocuda_types::AsyncBackendKeys`] for which keys warn); a
    /// key of ferrocuda's own is an error, as it does nothing here.
    pub fn from_config(
        driver: Arc<dyn Driver>,
        config: &AllocatorConfig,
    ) -> Result<Arc<AsyncAllocator>, AllocError> {
        let warns = Self::check_config(config)?;
        let a = AsyncAllocator::new(driver);
        if warns {
            a.state.lock().warn(ASYNC_IGNORES_WARNING.into());
        }
        Ok(a)
    }

    /// Whether PyTorch's warning is due for `config`, or why the backend refuses it.
    fn check_config(config: &AllocatorConfig) -> Result<bool, AllocError> {
        if config.backend != AllocatorBackend::CudaMallocAsync {
            return Err(AllocError::WrongBackend);
        }
        let keys = config.async_backend_keys();
        if let Some(key) = keys.ferrocuda_only.first() {
            return Err(AllocError::AsyncFerrocudaOnly { key: key.clone() });
        }
        Ok(keys.warns())
    }

    /// `_set_allocator_settings` under this backend: the string must keep the backend;
    /// PyTorch's other keys are accepted and ignored, with PyTorch's warning (as
    /// [`AsyncAllocator::from_config`]). The pinned host allocator's keys are for the host
    /// allocator (the facade passes the string to it too).
    pub fn update_config(&self, s: &str) -> Result<(), AllocError> {
        let mut config = AllocatorConfig {
            backend: AllocatorBackend::CudaMallocAsync,
            ..AllocatorConfig::default()
        };
        config.update(s)?;
        if Self::check_config(&config)? {
            self.state.lock().warn(ASYNC_IGNORES_WARNING.into());
        }
        Ok(())
    }

    /// `getDeviceStats`: the pool's used memory as `allocated_bytes` and `active_bytes`,
    /// its reserved memory as `reserved_bytes` (current and peak of `all`); every other
    /// statistic zero. A device not used yet reports zeros without touching the driver.
    pub fn stats(&self, dev: DeviceIndex) -> Result<DeviceStats, AllocError> {
        self.check_device(dev)?;
        let st = self.state.lock();
        let mut stats = DeviceStats::default();
        if st.devices.get(dev.as_usize()).is_some_and(Option::is_some) {
            let u = self.driver.mem_pool_usage(dev)?;
            let (used, used_peak) = (u.used as i64, u.used_high as i64);
            stats.allocated_bytes.all.current = used;
            stats.allocated_bytes.all.peak = used_peak;
            stats.active_bytes.all.current = used;
            stats.active_bytes.all.peak = used_peak;
            stats.reserved_bytes.all.current = u.reserved as i64;
            stats.reserved_bytes.all.peak = u.reserved_high as i64;
        }
        Ok(stats)
    }

    /// `resetPeakStats`: the pool's high-water marks go back to the current values.
    pub fn reset_peak_stats(&self, dev: DeviceIndex) -> Result<(), AllocError> {
        self.check_device(dev)?;
        Ok(self.driver.mem_pool_reset_peaks(dev)?)
    }

    /// `resetAccumulatedStats`: no effect, with PyTorch's warning (once).
    pub fn reset_accumulated_stats(&self, dev: DeviceIndex) -> Result<(), AllocError> {
        self.check_device(dev)?;
        let mut st = self.state.lock();
        if !st.warned_reset_accumulated {
            st.warned_reset_accumulated = true;
            st.warn("For backend:cudaMallocAsync, resetAccumulatedStats has no effect.".into());
        }
        Ok(())
    }

    /// `setMemoryFraction`: from now on, allocations that would take this allocator's bytes
    /// in use on `dev` past `fraction × total` fail (no other user of the pool counts).
    pub fn set_memory_fraction(&self, fraction: f64, dev: DeviceIndex) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidFraction(fraction));
        }
        let mut st = self.state.lock();
        self.device_state(&mut st, dev)?;
        let (_, total) = self.driver.mem_get_info(dev)?;
        self.device_state(&mut st, dev)?.limit = (fraction * total as f64) as u64;
        Ok(())
    }

    /// `emptyCache`: on every device in use, synchronize and trim the pool to nothing.
    pub fn empty_cache(&self) -> Result<(), AllocError> {
        let used: Vec<DeviceIndex> = {
            let st = self.state.lock();
            (0..st.devices.len())
                .filter(|&d| st.devices[d].is_some())
                .map(|d| DeviceIndex(d as u16))
                .collect()
        };
        for dev in used {
            self.driver.device_synchronize(dev)?;
            self.driver.mem_pool_trim_to(dev, 0)?;
        }
        Ok(())
    }

    /// `snapshot`: not meaningful for this backend (PyTorch's error).
    pub fn snapshot(&self) -> Result<ferrocuda_types::Snapshot, AllocError> {
        Err(AllocError::AsyncSnapshot)
    }

    /// PyTorch's error for what this backend has no form of, naming its C++ function
    /// (`recordHistory`, `getCheckpointState`, `getIpcDevPtr`, …).
    pub fn unsupported(function: &'static str) -> AllocError {
        AllocError::AsyncUnsupported(function)
    }
}

/// The allocator as the memory of a runtime's buffers.
impl MemoryResource for AsyncAllocator {
    fn allocate(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr, StreamError> {
        Ok(AsyncAllocator::allocate(self, dev, bytes, stream)?)
    }

    fn free(&self, _dev: DeviceIndex, ptr: DevicePtr) -> Result<(), StreamError> {
        Ok(AsyncAllocator::free(self, ptr)?)
    }

    fn record_stream(
        &self,
        _dev: DeviceIndex,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), StreamError> {
        Ok(AsyncAllocator::record_stream(self, ptr, stream)?)
    }
}
