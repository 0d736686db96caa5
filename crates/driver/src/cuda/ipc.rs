//! Sharing device memory and events with other processes on the real driver: CUDA IPC
//! handles of `cuMemAlloc` allocations and events (`cuIpcGetMemHandle`,
//! `cuIpcOpenMemHandle`, `cuIpcGetEventHandle`, `cuIpcOpenEventHandle`), and POSIX file
//! descriptors of virtual-memory chunks (`cuMemExportToShareableHandle`, fetched from the
//! exporting process with `pidfd_getfd`, `cuMemImportFromShareableHandle`), what PyTorch's
//! `ExpandableSegment::share` and `fromShared` use.
use super::{CudaDriver, check};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, DevicePtr, EventFlags, EventHandle, IpcHandle, PhysHandle};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// What the driver writes into a handle, as our bytes.
fn to_handle(reserved: [std::ffi::c_char; 64]) -> IpcHandle {
    IpcHandle(reserved.map(|c| c as u8))
}

fn from_handle(handle: &IpcHandle) -> [std::ffi::c_char; 64] {
    handle.0.map(|b| b as std::ffi::c_char)
}

pub(super) fn ipc_mem_handle(
    driver: &CudaDriver,
    dev: DeviceIndex,
    ptr: DevicePtr,
) -> Result<IpcHandle, DriverError> {
    driver.bind(dev)?;
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: a context is current; writes through a valid pointer; the driver checks `ptr`.
    check(unsafe { sys::cuIpcGetMemHandle(&mut h, ptr.0) })?;
    Ok(to_handle(h.reserved))
}

pub(super) fn ipc_open_mem(
    driver: &CudaDriver,
    dev: DeviceIndex,
    handle: &IpcHandle,
) -> Result<DevicePtr, DriverError> {
    let l = driver.bind(dev)?;
    let h = sys::CUipcMemHandle_st {
        reserved: from_handle(handle),
    };
    let lazy = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    let mut ptr = 0;
    // SAFETY: a context is current; writes through a valid pointer; the driver checks the
    // handle's bytes.
    check(unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, lazy) })?;
    l.registry.write().ipc_opened.insert((dev.0, ptr));
    Ok(DevicePtr(ptr))
}

pub(super) fn ipc_close_mem(
    driver: &CudaDriver,
    dev: DeviceIndex,
    ptr: DevicePtr,
) -> Result<(), DriverError> {
    let l = driver.bind(dev)?;
    if !l.registry.write().ipc_opened.remove(&(dev.0, ptr.0)) {
        return Err(DriverError::INVALID_VALUE);
    }
    // SAFETY: `ptr` was opened by cuIpcOpenMemHandle in this context (registry), closed once.
    check(unsafe { sys::cuIpcCloseMemHandle(ptr.0) })
}

pub(super) fn ipc_event_handle(
    driver: &CudaDriver,
    event: EventHandle,
) -> Result<IpcHandle, DriverError> {
    let (e, flags) = driver.event(event)?;
    if !flags.interprocess {
        return Err(DriverError::INVALID_VALUE);
    }
    let mut h = sys::CUipcEventHandle_st { reserved: [0; 64] };
    // SAFETY: `e` is a live event (registry); writes through a valid pointer.
    check(unsafe { sys::cuIpcGetEventHandle(&mut h, e) })?;
    Ok(to_handle(h.reserved))
}

pub(super) fn ipc_open_event(
    driver: &CudaDriver,
    dev: DeviceIndex,
    handle: &IpcHandle,
) -> Result<EventHandle, DriverError> {
    let l = driver.bind(dev)?;
    let h = sys::CUipcEventHandle_st {
        reserved: from_handle(handle),
    };
    let mut e = std::ptr::null_mut();
    // SAFETY: a context is current; writes through a valid pointer; the driver checks the
    // handle's bytes.
    check(unsafe { sys::cuIpcOpenEventHandle(&mut e, h) })?;
    let flags = EventFlags {
        timing: false,
        blocking: false,
        interprocess: true,
    };
    l.registry.write().events.insert(e as u64, (dev.0, flags));
    Ok(EventHandle {
        device: dev,
        raw: e as u64,
    })
}

pub(super) fn vm_export(driver: &CudaDriver, handle: PhysHandle) -> Result<i32, DriverError> {
    let l = driver.bind(handle.device)?;
    let mut registry = l.registry.write();
    match registry.phys.get(&handle.raw) {
        Some(&(d, _)) if d == handle.device.0 => {}
        _ => return Err(DriverError::INVALID_HANDLE),
    }
    if let Some(fd) = registry.exports.get(&handle.raw) {
        return Ok(fd.as_raw_fd());
    }
    let mut fd: i32 = -1;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: the chunk is live (registry); the driver writes an `int` through the pointer.
    check(unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut i32).cast::<c_void>(),
            handle.raw,
            kind,
            0,
        )
    })?;
    // SAFETY: the driver just made this descriptor for us; nothing else owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    registry.exports.insert(handle.raw, owned);
    Ok(fd)
}

pub(super) fn vm_import(
    driver: &CudaDriver,
    dev: DeviceIndex,
    pid: u32,
    fd: i32,
    bytes: u64,
) -> Result<PhysHandle, DriverError> {
    let local = crate::shared_counters::descriptor_of_process(pid, fd)?;
    let l = driver.bind(dev)?;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let mut h = 0;
    // SAFETY: `local` is an open descriptor of ours for the call's duration; the driver
    // takes the descriptor's number as the pointer-sized handle and writes through a valid
    // pointer.
    check(unsafe {
        sys::cuMemImportFromShareableHandle(&mut h, local.as_raw_fd() as usize as *mut c_void, kind)
    })?;
    l.registry.write().phys.insert(h, (dev.0, bytes));
    Ok(PhysHandle {
        device: dev,
        raw: h,
    })
}
