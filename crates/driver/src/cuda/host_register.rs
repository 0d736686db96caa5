//! Pageable host memory and its registration on the real driver: `malloc`, the pre-fault,
//! `cuMemHostRegister` / `cuMemHostUnregister`, `free` (the register path of the pinned host
//! allocator, PyTorch's `allocWithCudaHostRegister`).
use super::{CudaDriver, Loaded, check};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, HostPtr};
use std::ffi::c_void;

/// Makes current a device whose primary context is already retained, else device 0: pinned
/// memory is usable from every device (unified addressing), and this avoids creating a
/// context on a device the program does not use (PyTorch's
/// `getDeviceIndexWithPrimaryContext`).
fn bind_any(d: &CudaDriver) -> Result<&Loaded, DriverError> {
    let l = d.loaded()?;
    let with_context = l
        .devices
        .iter()
        .position(|slot| matches!(slot.context.get(), Some(Ok(_))))
        .unwrap_or(0);
    d.bind(DeviceIndex(with_context as u16))
}

pub(super) fn malloc(d: &CudaDriver, bytes: u64) -> Result<HostPtr, DriverError> {
    let l = d.loaded()?;
    let len = usize::try_from(bytes.max(1)).map_err(|_| DriverError::OUT_OF_MEMORY)?;
    // SAFETY: plain libc allocation of a non-zero size; a null result is handled below.
    let p = unsafe { libc::malloc(len) };
    if p.is_null() {
        return Err(DriverError::OUT_OF_MEMORY);
    }
    l.registry.write().mallocs.insert(p as u64, (bytes, false));
    Ok(HostPtr {
        raw: p as u64,
        bytes,
    })
}

pub(super) fn prefault(
    d: &CudaDriver,
    ptr: HostPtr,
    offset: u64,
    bytes: u64,
    page: u64,
) -> Result<(), DriverError> {
    let l = d.loaded()?;
    if !page.is_power_of_two() {
        return Err(DriverError::INVALID_VALUE);
    }
    // The read lock is held while writing, so `mfree` (which takes the write lock) cannot
    // free the memory under the loop; other pre-fault threads run alongside.
    let registry = l.registry.read();
    let inside = registry.mallocs.get(&ptr.raw).is_some_and(|&(len, _)| {
        offset
            .checked_add(bytes)
            .is_some_and(|end| end <= len.max(1))
    });
    if !inside {
        return Err(DriverError::INVALID_VALUE);
    }
    let start = (ptr.raw + offset).next_multiple_of(page);
    let end = ptr.raw + offset + bytes;
    for at in (start..end).step_by(page as usize) {
        // SAFETY: `at` lies inside a live allocation from `malloc` (checked above, kept
        // alive by the read lock); a volatile byte write is what faults the page in.
        unsafe { std::ptr::write_volatile(at as *mut u8, 0) };
    }
    Ok(())
}

pub(super) fn register(d: &CudaDriver, ptr: HostPtr) -> Result<(), DriverError> {
    set_registered(d, ptr, true)
}

pub(super) fn unregister(d: &CudaDriver, ptr: HostPtr) -> Result<(), DriverError> {
    set_registered(d, ptr, false)
}

/// Page-locks (`cuMemHostRegister`) or unlocks (`cuMemHostUnregister`) an allocation from
/// `malloc`, under the registry's write lock so that `mfree` stays out meanwhile.
fn set_registered(d: &CudaDriver, ptr: HostPtr, register: bool) -> Result<(), DriverError> {
    let l = bind_any(d)?;
    let mut registry = l.registry.write();
    let entry = registry
        .mallocs
        .get_mut(&ptr.raw)
        .ok_or(DriverError::INVALID_VALUE)?;
    match (register, entry.1) {
        (true, true) => return Err(DriverError::HOST_MEMORY_ALREADY_REGISTERED),
        (false, false) => return Err(DriverError::HOST_MEMORY_NOT_REGISTERED),
        _ => {}
    }
    let raw = ptr.raw as *mut c_void;
    if register {
        let len = entry.0.max(1) as usize;
        // SAFETY: `ptr` is a live allocation of `len` bytes from `malloc` (registry), not
        // yet registered; a context is current.
        check(unsafe { sys::cuMemHostRegister_v2(raw, len, 0) })?;
    } else {
        // SAFETY: `ptr` was registered by `register` (registry) and is still allocated.
        check(unsafe { sys::cuMemHostUnregister(raw) })?;
    }
    entry.1 = register;
    Ok(())
}

pub(super) fn mfree(d: &CudaDriver, ptr: HostPtr) -> Result<(), DriverError> {
    let l = d.loaded()?;
    let mut registry = l.registry.write();
    match registry.mallocs.get(&ptr.raw) {
        Some(&(_, false)) => {
            registry.mallocs.remove(&ptr.raw);
            // SAFETY: `ptr` came from `malloc` (registry), is unregistered, and is freed
            // once: its entry is gone.
            unsafe { libc::free(ptr.raw as *mut c_void) };
            Ok(())
        }
        // Registered memory must be unregistered first; anything else is not ours.
        _ => Err(DriverError::INVALID_VALUE),
    }
}
