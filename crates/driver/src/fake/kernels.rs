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
use super::work::Work;
use super::{Call, FAKE_IMAGE_MAGIC, FakeFunction, FakeModule};
use super::{FakeDriver, KernelContext};
use crate::{CompileError, DriverError};
use ferrocuda_types::{
    DeviceIndex, FunctionHandle, KernelArg, LaunchConfig, ModuleHandle, StreamHandle,
};
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

pub(super) fn compile_target(
    driver: &FakeDriver,
    dev: DeviceIndex,
) -> Result<Option<String>, DriverError> {
    driver.enter(Call::CompileTarget)?.check_device(dev)?;
    Ok(Some("fake-compute_90".into()))
}

pub(super) fn compile_source(
    driver: &FakeDriver,
    dev: DeviceIndex,
    source: &str,
    name: &str,
) -> Result<Vec<u8>, CompileError> {
    driver.enter(Call::CompileSource)?.check_device(dev)?;
    if let Some((line, text)) = source
        .lines()
        .enumerate()
        .find(|(_, l)| l.trim_start().starts_with("#error"))
    {
        return Err(CompileError::Rejected {
            log: format!("{name}({}): catastrophic error: {}", line + 1, text.trim()),
        });
    }
    Ok([FAKE_IMAGE_MAGIC, source.as_bytes()].concat())
}

pub(super) fn module_load(
    driver: &FakeDriver,
    dev: DeviceIndex,
    image: &[u8],
) -> Result<ModuleHandle, DriverError> {
    let mut st = driver.enter(Call::ModuleLoad)?;
    st.check_device(dev)?;
    st.check_unsafe_call()?;
    let source = image
        .strip_prefix(FAKE_IMAGE_MAGIC)
        .ok_or(DriverError::INVALID_IMAGE)?;
    let source = String::from_utf8(source.to_vec()).map_err(|_| DriverError::INVALID_IMAGE)?;
    let raw = st.id();
    st.modules.insert(
        raw,
        FakeModule {
            device: dev,
            source,
        },
    );
    Ok(ModuleHandle { device: dev, raw })
}

pub(super) fn module_unload(driver: &FakeDriver, module: ModuleHandle) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::ModuleUnload)?;
    st.modules
        .remove(&module.raw)
        .ok_or(DriverError::INVALID_HANDLE)?;
    st.functions.retain(|_, f| f.module != module.raw);
    // cuModuleUnload waits for the device's running kernels (seen on an H100).
    let _ = st.drain_device(module.device);
    Ok(())
}

pub(super) fn module_function(
    driver: &FakeDriver,
    module: ModuleHandle,
    name: &str,
) -> Result<FunctionHandle, DriverError> {
    let mut st = driver.enter(Call::ModuleFunction)?;
    let m = st
        .modules
        .get(&module.raw)
        .filter(|m| m.device == module.device);
    let m = m.ok_or(DriverError::INVALID_HANDLE)?;
    if !defines(&m.source, name) {
        return Err(DriverError::NOT_FOUND);
    }
    let device = m.device;
    let kernel = st
        .kernels
        .get(name)
        .cloned()
        .ok_or(DriverError::KERNEL_NOT_REGISTERED)?;
    let raw = st.id();
    st.functions.insert(
        raw,
        FakeFunction {
            device,
            module: module.raw,
            name: name.into(),
            kernel,
        },
    );
    Ok(FunctionHandle { device, raw })
}

pub(super) fn launch(
    driver: &FakeDriver,
    function: FunctionHandle,
    config: &LaunchConfig,
    args: &[KernelArg<'_>],
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let mut st = driver.enter(Call::Launch)?;
    let key = st.stream_key(stream)?;
    let f = st
        .functions
        .get(&function.raw)
        .filter(|f| f.device == function.device);
    let f = f.ok_or(DriverError::INVALID_HANDLE)?;
    if f.device != stream.device {
        return Err(DriverError::INVALID_HANDLE);
    }
    if config.total_threads() == 0 || config.block.0 * config.block.1 * config.block.2 > 1024 {
        return Err(DriverError::INVALID_VALUE);
    }
    let work = Work::Kernel {
        name: f.name.clone(),
        kernel: f.kernel.clone(),
        config: *config,
        device: f.device,
        args: args.iter().map(|a| a.bytes().to_vec()).collect(),
    };
    st.enqueue(key, work)?;
    let capturing = st.streams.get(&key).is_some_and(|s| s.capture.is_some());
    if driver.launch_blocking && !capturing {
        st.drain(key)?;
    }
    Ok(())
}

/// Whether the source defines `name` as an identifier (not as part of a longer one).
fn defines(source: &str, name: &str) -> bool {
    source.match_indices(name).any(|(i, _)| {
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let before = source[..i].chars().next_back().is_none_or(|c| !ident(c));
        let after = source[i + name.len()..]
            .chars()
            .next()
            .is_none_or(|c| !ident(c));
        before && after && source[..i].contains("__global__")
    })
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
