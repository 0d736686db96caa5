//! Which host functions the fake device runs for kernels, by name.
//!
//! A module loaded on the fake device is CUDA source; looking up one of its kernels
//! ([`Driver::module_function`](crate::Driver::module_function)) finds the host function
//! registered under the kernel's name, or fails with
//! [`DriverError::KERNEL_NOT_REGISTERED`](crate::DriverError::KERNEL_NOT_REGISTERED) (the
//! stream layer names the kernel in its error). Two ways in:
//! - [`FakeDriver::register_kernel`]: a program's or a test's own kernel; replaces.
//! - [`FakeDriver::provide_kernel`]: a library's host twin, registered by the crate that
//!   owns the kernel when it loads its module on a fake device; never replaces, so a twin a
//!   test registered itself (to inject a failure, say) stays.
use super::{FakeDriver, KernelContext};
use std::sync::Arc;

impl FakeDriver {
    /// Registers `kernel` as the host function of the kernel called `name` unless one is
    /// registered already; returns whether it was registered. For libraries shipping
    /// kernels: call it for each host twin when loading their module on a fake device
    /// ([`Driver::as_fake`](crate::Driver::as_fake)), so that no user has to.
    pub fn provide_kernel<F>(&self, name: &str, kernel: F) -> bool
    where
        F: Fn(&mut KernelContext<'_>) -> Result<(), String> + Send + Sync + 'static,
    {
        let mut st = self.state.lock();
        if st.kernels.contains_key(name) {
            return false;
        }
        st.kernels.insert(name.to_owned(), Arc::new(kernel));
        true
    }

    /// Whether a host function is registered for the kernel called `name`.
    pub fn has_kernel(&self, name: &str) -> bool {
        self.state.lock().kernels.contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Driver, DriverError, FakeDriver};
    use ferrocuda_types::DeviceIndex;

    const D0: DeviceIndex = DeviceIndex(0);

    fn function(fake: &FakeDriver, name: &str) -> Result<(), DriverError> {
        let source = format!("extern \"C\" __global__ void {name}() {{}}");
        let image = fake
            .compile_source(D0, &source, name)
            .map_err(|e| match e {
                crate::CompileError::Driver(d) => d,
                _ => DriverError::INVALID_IMAGE,
            })?;
        let module = fake.module_load(D0, &image)?;
        fake.module_function(module, name).map(drop)
    }

    #[test]
    fn a_provided_kernel_never_replaces_a_registered_one() {
        let fake = FakeDriver::default();
        assert!(!fake.has_kernel("k"));
        assert_eq!(
            function(&fake, "k"),
            Err(DriverError::KERNEL_NOT_REGISTERED)
        );
        fake.register_kernel("k", |_| Err("the test's own".into()));
        assert!(!fake.provide_kernel("k", |_| Ok(())));
        assert!(fake.provide_kernel("other", |_| Ok(())));
        assert!(fake.has_kernel("k") && fake.has_kernel("other"));
        assert_eq!(function(&fake, "k"), Ok(()));
    }

    #[test]
    fn the_fake_is_reachable_through_the_driver_trait() {
        let fake = FakeDriver::default();
        let driver: &dyn Driver = &fake;
        assert!(driver.as_fake().is_some_and(|f| std::ptr::eq(f, &fake)));
        assert!(crate::CudaDriver::new().as_fake().is_none());
    }
}
