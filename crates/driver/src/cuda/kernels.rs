//! Kernels on the real driver: CUDA C++ compiled with NVRTC for the device's architecture,
//! modules loaded and unloaded, functions looked up and launched (`nvrtcCompileProgram`,
//! `cuModuleLoadData`, `cuModuleGetFunction`, `cuLaunchKernel`).
use super::{CudaDriver, Function, MAX_KERNEL_ARGS, check};
use crate::{CompileError, DriverError};
use cudarc::driver::sys;
use ferrocuda_types::{
    DeviceIndex, DevicePtr, FunctionHandle, KernelArg, LaunchConfig, ModuleHandle, StreamHandle,
};
use std::ffi::{CString, c_void};

pub(super) fn compile_source(
    driver: &CudaDriver,
    dev: DeviceIndex,
    source: &str,
    name: &str,
) -> Result<Vec<u8>, CompileError> {
    use cudarc::nvrtc::result as nvrtc;
    driver.nvrtc_version()?;
    let arch = format!("--gpu-architecture={}", driver.arch(dev)?);
    let nul = |s: &str| {
        CString::new(s).map_err(|_| CompileError::Rejected {
            log: "source or name contains a NUL byte".into(),
        })
    };
    let (src, cname) = (nul(source)?, nul(name)?);
    let nvrtc_err = |_| CompileError::Driver(DriverError::NVRTC_NOT_FOUND);
    let prog = nvrtc::create_program(&src, Some(&cname)).map_err(nvrtc_err)?;
    // SAFETY: `prog` is a live program; options are valid strings.
    let compiled = unsafe { nvrtc::compile_program(prog, &[arch, "--std=c++17".into()]) };
    let result = match compiled {
        // SAFETY: `prog` compiled; the PTX is copied out before the program is destroyed.
        Ok(()) => unsafe { nvrtc::get_ptx(prog) }
            .map(|ptx| ptx.into_iter().map(|c| c as u8).collect())
            .map_err(nvrtc_err),
        Err(_) => {
            // SAFETY: `prog` is live; the log is copied out.
            let log = unsafe { nvrtc::get_program_log(prog) }.unwrap_or_default();
            let bytes: Vec<u8> = log
                .into_iter()
                .map(|c| c as u8)
                .take_while(|&c| c != 0)
                .collect();
            Err(CompileError::Rejected {
                log: String::from_utf8_lossy(&bytes).into_owned(),
            })
        }
    };
    // SAFETY: destroyed once, after its outputs were copied.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

pub(super) fn module_load(
    driver: &CudaDriver,
    dev: DeviceIndex,
    image: &[u8],
) -> Result<ModuleHandle, DriverError> {
    let l = driver.bind(dev)?;
    let mut owned;
    let image = if image.last() == Some(&0) {
        image
    } else {
        owned = image.to_vec();
        owned.push(0);
        &owned
    };
    let mut m = std::ptr::null_mut();
    // SAFETY: `image` is a NUL-terminated buffer that outlives the call; the driver
    // validates its contents.
    check(unsafe { sys::cuModuleLoadData(&mut m, image.as_ptr().cast()) })?;
    let entries = super::ptx::entry_param_counts(image);
    l.registry
        .write()
        .modules
        .insert(m as u64, (dev.0, entries));
    Ok(ModuleHandle {
        device: dev,
        raw: m as u64,
    })
}

pub(super) fn module_unload(driver: &CudaDriver, module: ModuleHandle) -> Result<(), DriverError> {
    let l = driver.bind(module.device)?;
    let mut reg = l.registry.write();
    if reg.modules.remove(&module.raw).is_none() {
        return Err(DriverError::INVALID_HANDLE);
    }
    reg.functions.retain(|_, f| f.module != module.raw);
    drop(reg);
    // SAFETY: the module was live (registry) and is unloaded once.
    check(unsafe { sys::cuModuleUnload(module.raw as sys::CUmodule) })
}

pub(super) fn module_function(
    driver: &CudaDriver,
    module: ModuleHandle,
    name: &str,
) -> Result<FunctionHandle, DriverError> {
    let l = driver.bind(module.device)?;
    let params = match l.registry.read().modules.get(&module.raw) {
        Some((device, entries)) if *device == module.device.0 => entries.get(name).copied(),
        _ => return Err(DriverError::INVALID_HANDLE),
    };
    let cname = CString::new(name).map_err(|_| DriverError::INVALID_VALUE)?;
    let mut f = std::ptr::null_mut();
    // SAFETY: the module is live; `cname` is NUL-terminated.
    check(unsafe {
        sys::cuModuleGetFunction(&mut f, module.raw as sys::CUmodule, cname.as_ptr())
    })?;
    let function = Function {
        device: module.device.0,
        module: module.raw,
        params,
    };
    l.registry.write().functions.insert(f as u64, function);
    Ok(FunctionHandle {
        device: module.device,
        raw: f as u64,
    })
}

pub(super) fn launch(
    driver: &CudaDriver,
    function: FunctionHandle,
    config: &LaunchConfig,
    args: &[KernelArg<'_>],
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let l = driver.bind(stream.device)?;
    {
        let reg = l.registry.read();
        let f_ok = reg
            .functions
            .get(&function.raw)
            .is_some_and(|f| f.device == function.device.0);
        let s_ok = reg.knows_stream(stream.device.0, stream.raw);
        if !f_ok || !s_ok || function.device != stream.device {
            return Err(DriverError::INVALID_HANDLE);
        }
    }
    if args.len() > MAX_KERNEL_ARGS {
        return Err(DriverError::INVALID_VALUE);
    }
    let param = |arg: &KernelArg<'_>| match arg {
        KernelArg::Value(bytes) => bytes.as_ptr() as *mut c_void,
        KernelArg::Ptr { ptr, .. } => ptr as *const DevicePtr as *mut c_void,
    };
    // Most kernels take a handful of arguments: fill only what is used.
    let mut params = [std::ptr::null_mut::<c_void>(); MAX_KERNEL_ARGS];
    let used = &mut params[..args.len()];
    for (slot, arg) in used.iter_mut().zip(args) {
        *slot = param(arg);
    }
    let (g, b) = (config.grid, config.block);
    // SAFETY: handles are live (registry); each parameter points at its argument's bytes,
    // borrowed for this call, and cuLaunchKernel copies them before returning.
    check(unsafe {
        sys::cuLaunchKernel(
            function.raw as sys::CUfunction,
            g.0,
            g.1,
            g.2,
            b.0,
            b.1,
            b.2,
            config.shared_mem_bytes,
            stream.raw as sys::CUstream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

pub(super) fn compile_target(
    driver: &CudaDriver,
    dev: DeviceIndex,
) -> Result<Option<String>, DriverError> {
    let (major, minor) = driver.nvrtc_version()?;
    Ok(Some(format!("nvrtc{major}.{minor}-{}", driver.arch(dev)?)))
}
