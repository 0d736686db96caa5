//! Device and page-locked host memory on the real driver, and the copies and memsets between
//! them (`cuMemAlloc`, `cuMemHostAlloc`, `cuMemsetD8Async`..., `cuMemcpy*Async`): the memory
//! section of [`Driver`](crate::Driver).
use super::{CudaDriver, check};
use crate::DriverError;
use cudarc::driver::sys;
use ferrocuda_types::{DeviceIndex, DevicePtr, HostPtr, MemsetValue, StreamHandle};
use std::ffi::c_void;

pub(super) fn malloc(
    driver: &CudaDriver,
    dev: DeviceIndex,
    bytes: u64,
) -> Result<DevicePtr, DriverError> {
    driver.bind(dev)?;
    let mut ptr = 0;
    // SAFETY: a context is current; writes through a valid pointer.
    check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes as usize) })?;
    driver.mallocs.note(dev, DevicePtr(ptr));
    Ok(DevicePtr(ptr))
}

pub(super) fn host_alloc(driver: &CudaDriver, bytes: u64) -> Result<HostPtr, DriverError> {
    let l = driver.bind(DeviceIndex(0))?;
    let mut p = std::ptr::null_mut();
    // SAFETY: a context is current; writes through a valid pointer.
    check(unsafe { sys::cuMemHostAlloc(&mut p, bytes.max(1) as usize, 0) })?;
    l.registry.write().hosts.insert(p as u64, bytes);
    Ok(HostPtr {
        raw: p as u64,
        bytes,
    })
}

pub(super) fn host_free(driver: &CudaDriver, ptr: HostPtr) -> Result<(), DriverError> {
    let l = driver.bind(DeviceIndex(0))?;
    l.registry
        .write()
        .hosts
        .remove(&ptr.raw)
        .ok_or(DriverError::INVALID_VALUE)?;
    // SAFETY: `ptr` came from cuMemHostAlloc (registry) and is freed once.
    check(unsafe { sys::cuMemFreeHost(ptr.raw as *mut c_void) })
}

pub(super) fn host_read(
    driver: &CudaDriver,
    src: HostPtr,
    offset: u64,
    dst: &mut [u8],
) -> Result<(), DriverError> {
    let p = driver.host(src, offset, dst.len() as u64)?;
    // SAFETY: the range lies inside a live pinned allocation (checked by `host`) and
    // does not overlap `dst`, a Rust borrow.
    unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), dst.len()) };
    Ok(())
}

pub(super) fn host_write(
    driver: &CudaDriver,
    dst: HostPtr,
    offset: u64,
    src: &[u8],
) -> Result<(), DriverError> {
    let p = driver.host(dst, offset, src.len() as u64)?;
    // SAFETY: as in `host_read`, with the roles swapped.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
    Ok(())
}

pub(super) fn memset_async(
    driver: &CudaDriver,
    dst: DevicePtr,
    value: MemsetValue,
    count: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    let n = count as usize;
    // SAFETY: `s` is a live stream; the driver validates the device range.
    check(unsafe {
        match value {
            MemsetValue::U8(v) => sys::cuMemsetD8Async(dst.0, v, n, s),
            MemsetValue::U16(v) => sys::cuMemsetD16Async(dst.0, v, n, s),
            MemsetValue::U32(v) => sys::cuMemsetD32Async(dst.0, v, n, s),
        }
    })
}

pub(super) fn memcpy_htod_async(
    driver: &CudaDriver,
    dst: DevicePtr,
    src: &[u8],
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    // A captured copy would read `src` at every replay, long after this borrow ends.
    if driver.is_capturing(s)? {
        return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
    }
    let pinned = driver_known(src.as_ptr() as u64)?;
    // SAFETY: `src` is valid for reads of its length for this call; from pageable memory
    // the driver has staged it before returning.
    check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr().cast(), src.len(), s) })?;
    if pinned {
        // From pinned memory the copy is truly asynchronous: wait before the borrow ends.
        // SAFETY: `s` is a live stream.
        check(unsafe { sys::cuStreamSynchronize(s) })?;
    }
    Ok(())
}

/// Whether host address `ptr` is memory the driver knows (page-locked by `cuMemHostAlloc` or
/// `cuMemHostRegister`, or managed), so that a copy from it is truly asynchronous. Asked with
/// `cuPointerGetAttributes`, which answers memory type 0 for pageable memory where
/// `cuPointerGetAttribute` fails with `CUDA_ERROR_INVALID_VALUE`: no failing driver call on
/// the copy path (compute-sanitizer reports every one).
fn driver_known(ptr: u64) -> Result<bool, DriverError> {
    let mut attribute = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    let mut memory_type = 0u32;
    let mut data = [(&mut memory_type as *mut u32).cast::<std::ffi::c_void>()];
    // SAFETY: one attribute, whose value (a u32 memory type) is written through the one
    // data pointer, which points at `memory_type`.
    check(unsafe { sys::cuPointerGetAttributes(1, &mut attribute, data.as_mut_ptr(), ptr) })?;
    Ok(memory_type != 0)
}

pub(super) fn memcpy_dtoh(
    driver: &CudaDriver,
    dst: &mut [u8],
    src: DevicePtr,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    if driver.is_capturing(s)? {
        // Refuse as a synchronize would (this also breaks the capture, as CUDA does).
        // SAFETY: `s` is a live stream.
        check(unsafe { sys::cuStreamSynchronize(s) })?;
        return Err(DriverError::STREAM_CAPTURE_UNSUPPORTED);
    }
    // SAFETY: `dst` is valid for writes of its length; we wait for the copy before the
    // borrow ends.
    check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src.0, dst.len(), s) })?;
    // SAFETY: `s` is a live stream.
    check(unsafe { sys::cuStreamSynchronize(s) })
}

pub(super) fn memcpy_peer_async(
    driver: &CudaDriver,
    dst: (DeviceIndex, DevicePtr),
    src: (DeviceIndex, DevicePtr),
    bytes: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    let (dst_ctx, src_ctx) = (
        driver.primary_context(dst.0)?,
        driver.primary_context(src.0)?,
    );
    driver.bind(stream.device)?;
    // SAFETY: both contexts are retained primary contexts; addresses validated by the driver.
    check(unsafe { sys::cuMemcpyPeerAsync(dst.1.0, dst_ctx, src.1.0, src_ctx, bytes as usize, s) })
}

pub(super) fn memcpy_htod_pinned_async(
    driver: &CudaDriver,
    dst: DevicePtr,
    src: (HostPtr, u64),
    bytes: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    let p = driver.host(src.0, src.1, bytes)?;
    // SAFETY: the host range is inside a live pinned allocation owned by the caller.
    check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst.0, p.cast(), bytes as usize, s) })
}

pub(super) fn memcpy_dtoh_pinned_async(
    driver: &CudaDriver,
    dst: (HostPtr, u64),
    src: DevicePtr,
    bytes: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    let p = driver.host(dst.0, dst.1, bytes)?;
    // SAFETY: the host range is inside a live pinned allocation owned by the caller.
    check(unsafe { sys::cuMemcpyDtoHAsync_v2(p.cast(), src.0, bytes as usize, s) })
}

pub(super) fn free(
    driver: &CudaDriver,
    dev: DeviceIndex,
    ptr: DevicePtr,
) -> Result<(), DriverError> {
    driver.bind(dev)?;
    // SAFETY: the driver checks that `ptr` is an allocation base and fails otherwise.
    check(unsafe { sys::cuMemFree_v2(ptr.0) })
}

pub(super) fn memcpy_dtod_async(
    driver: &CudaDriver,
    dst: DevicePtr,
    src: DevicePtr,
    bytes: u64,
    stream: StreamHandle,
) -> Result<(), DriverError> {
    let s = driver.stream(stream)?;
    // SAFETY: device addresses are validated by the driver.
    check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes as usize, s) })
}
