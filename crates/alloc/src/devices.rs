//! One caching allocator per device, created on first use, and the pinned host allocator,
//! serving a runtime's buffers.
use crate::{AllocError, Caching, CachingAllocator, HostAllocator};
use ferrocuda_driver::Driver;
use ferrocuda_stream::{MemoryResource, PerDevice, Runtime, StreamError};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, DevicePtr, EnvError, StreamHandle, env_value};
use parking_lot::RwLock;
use std::sync::{Arc, OnceLock};

/// [`Caching::Off`] when `FERROCUDA_NO_CUDA_MEMORY_CACHING` or, when that one is unset,
/// `PYTORCH_NO_CUDA_MEMORY_CACHING` is `1`, read through `var` (`std::env::var` in
/// [`DeviceAllocators::from_env`]); else [`Caching::On`]. The first one set decides; one set
/// to a value that is not valid UTF-8 is an error naming it.
pub fn caching_from_env(
    var: impl Fn(&str) -> Result<String, std::env::VarError>,
) -> Result<Caching, EnvError> {
    for name in [
        "FERROCUDA_NO_CUDA_MEMORY_CACHING",
        "PYTORCH_NO_CUDA_MEMORY_CACHING",
    ] {
        if let Some(v) = env_value(name, var(name))? {
            return Ok(if v.trim() == "1" {
                Caching::Off
            } else {
                Caching::On
            });
        }
    }
    Ok(Caching::On)
}

/// The allocators of every device of one driver, and its pinned host allocator. It holds
/// the driver, not a runtime: the
/// runtime holds it (as its memory resource), and the other way round would be a cycle.
/// Making it initialises nothing: the driver is asked for its devices at the first use.
#[derive(Debug)]
pub struct DeviceAllocators {
    driver: Arc<dyn Driver>,
    config: RwLock<AllocatorConfig>,
    caching: Caching,
    /// One slot per device, made at the first use.
    devices: PerDevice<OnceLock<CachingAllocator>>,
    /// Pinned host memory, for every device (its configuration follows `config`).
    host: Arc<HostAllocator>,
}

impl DeviceAllocators {
    /// Allocators for the devices of `driver` with `config`.
    pub fn new(
        driver: Arc<dyn Driver>,
        config: AllocatorConfig,
        caching: Caching,
    ) -> Arc<DeviceAllocators> {
        Arc::new(DeviceAllocators {
            host: HostAllocator::new(driver.clone(), config.pinned.clone()),
            driver,
            config: RwLock::new(config),
            caching,
            devices: PerDevice::default(),
        })
    }

    /// The device slots, asking the driver for its devices at the first call (in a bad fork,
    /// [`StreamError::BadFork`]).
    fn slots(&self) -> Result<&[OnceLock<CachingAllocator>], StreamError> {
        self.devices.get_or_init(&*self.driver, |_| OnceLock::new())
    }

    /// Allocators configured from the environment: `FERROCUDA_ALLOC_CONF`, else
    /// `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`; caching off with
    /// `FERROCUDA_NO_CUDA_MEMORY_CACHING=1` or `PYTORCH_NO_CUDA_MEMORY_CACHING=1`. A variable
    /// that is set but not valid UTF-8 is [`AllocError::Env`], naming it.
    pub fn from_env(driver: Arc<dyn Driver>) -> Result<Arc<DeviceAllocators>, AllocError> {
        let config = AllocatorConfig::from_env()?;
        let caching = caching_from_env(|k| std::env::var(k))?;
        Ok(DeviceAllocators::new(driver, config, caching))
    }

    /// Makes these the memory resources of `runtime`'s device buffers and pinned buffers (a
    /// runtime over the same driver).
    pub fn install(self: &Arc<Self>, runtime: &Runtime) {
        runtime.set_memory(self.clone());
        runtime.set_host_memory(self.host.clone());
    }

    /// The pinned host allocator.
    pub fn host(&self) -> &Arc<HostAllocator> {
        &self.host
    }

    /// The device slots, made now if need be, or why there are none.
    fn available_slots(&self) -> Result<&[OnceLock<CachingAllocator>], AllocError> {
        self.slots().map_err(|e| match e {
            StreamError::NotAvailable { reason } => AllocError::NotAvailable { reason },
            e => AllocError::Stream(e),
        })
    }

    /// PyTorch's allocator `init(device_count)`, which CUDA's lazy initialisation runs: asks
    /// the driver for its devices and makes a slot for each (the allocators themselves are
    /// made at their first use). The first allocation does it too.
    pub fn init(&self) -> Result<(), AllocError> {
        self.available_slots().map(drop)
    }

    /// `initialized()`: whether [`DeviceAllocators::init`] (or a first use) has run, with
    /// devices found.
    pub fn is_initialized(&self) -> bool {
        matches!(self.devices.made(), Some(Ok(_)))
    }

    /// The allocator of `dev`, created on first use.
    pub fn device(&self, dev: DeviceIndex) -> Result<&CachingAllocator, AllocError> {
        let slots = self.available_slots()?;
        let slot = slots.get(dev.as_usize()).ok_or(AllocError::NoSuchDevice {
            device: dev.0,
            count: slots.len(),
        })?;
        if let Some(a) = slot.get() {
            return Ok(a);
        }
        let made = CachingAllocator::new(
            self.driver.clone(),
            dev,
            self.config.read().clone(),
            self.caching,
        )?;
        Ok(slot.get_or_init(|| made))
    }

    /// Allocators created so far (none in a bad fork: the child must not use them).
    pub fn created(&self) -> impl Iterator<Item = &CachingAllocator> {
        let made = match self.devices.made() {
            Some(Ok(slots)) if !ferrocuda_driver::fork::in_bad_fork() => slots,
            _ => &[],
        };
        made.iter().filter_map(OnceLock::get)
    }

    /// Applies a configuration string to every device, now and later
    /// (`torch.cuda.memory._set_allocator_settings`). All or nothing.
    pub fn set_settings(&self, s: &str) -> Result<(), AllocError> {
        let mut config = self.config.write();
        let mut next = config.clone();
        next.update(s)?;
        for a in self.created() {
            a.update_config(s)?;
        }
        self.host.update_config(s)?;
        *config = next;
        Ok(())
    }

    /// A snapshot of every device in use: segments by address, history per device.
    pub fn snapshot(&self) -> Result<ferrocuda_types::Snapshot, AllocError> {
        let slots = self.slots()?;
        let mut segments = Vec::new();
        let mut device_traces = vec![Vec::new(); slots.len()];
        for (dev, slot) in slots.iter().enumerate() {
            if let Some(a) = slot.get() {
                let (s, trace) = a.snapshot();
                segments.extend(s);
                device_traces[dev] = trace;
            }
        }
        segments.sort_by_key(|s| (s.device, s.address));
        let allocator_settings = self.device(DeviceIndex(0))?.allocator_settings();
        Ok(ferrocuda_types::Snapshot {
            segments,
            device_traces,
            allocator_settings,
            external_annotations: Vec::new(),
        })
    }

    /// The allocator that handed out `ptr`, searching every device (for frees without a
    /// device, as `caching_allocator_delete`).
    pub fn free_anywhere(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        for a in self.created() {
            match a.free(ptr) {
                Err(AllocError::InvalidPointer(_)) => continue,
                other => return other,
            }
        }
        Err(AllocError::InvalidPointer(ptr))
    }
}

impl MemoryResource for DeviceAllocators {
    fn allocate(
        &self,
        dev: DeviceIndex,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<DevicePtr, StreamError> {
        Ok(self.device(dev)?.allocate(bytes, stream)?.ptr)
    }

    fn free(&self, dev: DeviceIndex, ptr: DevicePtr) -> Result<(), StreamError> {
        Ok(self.device(dev)?.free(ptr)?)
    }

    fn record_stream(
        &self,
        dev: DeviceIndex,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), StreamError> {
        Ok(self.device(dev)?.record_stream(ptr, stream)?)
    }

    /// PyTorch's `NativeCachingAllocator::enablePeerAccess` after the driver's part:
    /// `dev_to_access`'s allocator (made now if need be) opens its expandable segments to
    /// `dev`.
    fn add_peer_access(
        &self,
        dev: DeviceIndex,
        dev_to_access: DeviceIndex,
    ) -> Result<(), StreamError> {
        Ok(self.device(dev_to_access)?.add_peer_access(dev)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::env::VarError;

    fn vars(
        set: &'static [(&'static str, &'static str)],
    ) -> impl Fn(&str) -> Result<String, VarError> {
        move |k: &str| {
            set.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
                .ok_or(VarError::NotPresent)
        }
    }

    #[test]
    fn the_first_caching_variable_set_decides() {
        assert_eq!(caching_from_env(vars(&[])), Ok(Caching::On));
        assert_eq!(
            caching_from_env(vars(&[("PYTORCH_NO_CUDA_MEMORY_CACHING", " 1 ")])),
            Ok(Caching::Off)
        );
        assert_eq!(
            caching_from_env(vars(&[
                ("FERROCUDA_NO_CUDA_MEMORY_CACHING", "0"),
                ("PYTORCH_NO_CUDA_MEMORY_CACHING", "1"),
            ])),
            Ok(Caching::On)
        );
    }

    /// A caching variable that is not UTF-8 is an error naming it, not an unset one that
    /// lets the next variable decide.
    #[cfg(unix)]
    #[test]
    fn a_caching_variable_that_is_not_utf8_is_an_error() {
        use std::os::unix::ffi::OsStringExt;
        let var = |k: &str| match k {
            "FERROCUDA_NO_CUDA_MEMORY_CACHING" => {
                Err(VarError::NotUnicode(std::ffi::OsString::from_vec(vec![
                    b'1', 0xff,
                ])))
            }
            _ => Ok("1".to_owned()),
        };
        match caching_from_env(var) {
            Err(EnvError::NotUnicode { name, .. }) => {
                assert_eq!(name, "FERROCUDA_NO_CUDA_MEMORY_CACHING")
            }
            other => panic!("{other:?}"),
        }
    }
}
