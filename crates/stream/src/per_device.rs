//! State kept per device and made at the first use, which is when CUDA is initialised.
use crate::{Result, StreamError};
use ferrocuda_driver::{Driver, DriverError};
use ferrocuda_types::DeviceIndex;
use std::sync::OnceLock;

/// One `T` per device of a driver, made at the first [`PerDevice::get_or_init`] from the
/// driver's device count (for CUDA, `cuInit`): the lazy initialisation of a layer (the
/// [`Runtime`](crate::Runtime)'s device states, the caching allocators' slots).
#[derive(Debug)]
pub struct PerDevice<T>(OnceLock<std::result::Result<Vec<T>, DriverError>>);

impl<T> Default for PerDevice<T> {
    fn default() -> Self {
        PerDevice(OnceLock::new())
    }
}

impl<T> PerDevice<T> {
    /// Each device's `T`, made by `make` at the first call. Without a usable device,
    /// [`StreamError::NotAvailable`] (now and at every later call); in a child forked after
    /// CUDA was initialised, [`StreamError::BadFork`], as every lazy initialisation in
    /// PyTorch raises there.
    pub fn get_or_init(
        &self,
        driver: &dyn Driver,
        make: impl FnMut(DeviceIndex) -> T,
    ) -> Result<&[T]> {
        if ferrocuda_driver::fork::in_bad_fork() {
            return Err(StreamError::BadFork);
        }
        let made = self.0.get_or_init(|| match driver.device_count()? {
            0 => Err(DriverError::NO_DEVICE),
            n => Ok((0..n.min(usize::from(u16::MAX)) as u16)
                .map(DeviceIndex)
                .map(make)
                .collect()),
        });
        match made {
            Ok(states) => Ok(states),
            Err(reason) => Err(StreamError::NotAvailable { reason: *reason }),
        }
    }

    /// What the first [`PerDevice::get_or_init`] made (or why it made nothing); `None`
    /// before it. Inherited by a forked child as it was.
    pub fn made(&self) -> Option<std::result::Result<&[T], DriverError>> {
        self.0.get().map(|r| r.as_deref().map_err(|e| *e))
    }
}
