//! Working beside `cudarc`'s safe API: its streams adopted by a driver
//! ([`ForeignStream`], [`Driver::stream_adopt`](crate::Driver::stream_adopt)), and device
//! memory lent to it ([`CudarcSlice`], which implements cudarc's `DevicePtr`,
//! `DevicePtrMut` and launch-argument traits, so `LaunchArgs::arg`, the cuBLAS wrappers and
//! the stream's copies take it without a copy).
//!
//! ferrocuda uses the devices' primary contexts, as `cudarc::driver::CudaContext::new` does,
//! so a cudarc stream of a primary context and ferrocuda's own work share one context.
//! [`cudarc`] is re-exported: name its types through it to get the version ferrocuda
//! was built with.
pub use cudarc;

use crate::DriverError;
use cudarc::driver::{
    CudaStream, DevicePtr as CudarcDevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg,
    SyncOnDrop, sys,
};
use ferrocuda_types::{DeviceIndex, DevicePtr};
use std::marker::PhantomData;
use std::sync::Arc;

/// A stream made by another library, to be adopted by a driver
/// ([`Driver::stream_adopt`](crate::Driver::stream_adopt)). It keeps the stream alive (for a
/// cudarc stream, a clone of its `Arc`) for as long as it lives, so a handle adopted from it
/// never outlives the stream while it is held.
#[derive(Clone, Debug)]
pub struct ForeignStream {
    device: DeviceIndex,
    raw: u64,
    origin: Origin,
}

/// Who made a foreign stream.
#[derive(Clone, Debug)]
pub(crate) enum Origin {
    /// cudarc, whose stream is kept alive here.
    Cudarc(Arc<CudaStream>),
    /// The fake device's stand-in for another library
    /// ([`FakeDriver::foreign_stream`](crate::FakeDriver::foreign_stream)).
    Fake,
    /// A raw handle whose caller vouched that it is live ([`ForeignStream::from_raw`]):
    /// PyTorch's `cudaStream_t`, given to the C functions of `libferrocuda_torch.so`.
    Raw,
}

impl ForeignStream {
    /// A cudarc stream (its device is its context's ordinal). A device index past
    /// `u16::MAX` is [`DriverError::INVALID_DEVICE`].
    pub fn cudarc(stream: &Arc<CudaStream>) -> Result<ForeignStream, DriverError> {
        let device =
            u16::try_from(stream.context().ordinal()).map_err(|_| DriverError::INVALID_DEVICE)?;
        Ok(ForeignStream {
            device: DeviceIndex(device),
            raw: stream.cu_stream() as u64,
            origin: Origin::Cudarc(stream.clone()),
        })
    }

    /// The legacy default stream of `device` (a null `cudaStream_t`), which every context
    /// has: adopting it gives [`StreamHandle::legacy`](ferrocuda_types::StreamHandle::legacy).
    pub fn legacy(device: DeviceIndex) -> ForeignStream {
        ForeignStream {
            device,
            raw: 0,
            origin: Origin::Raw,
        }
    }

    /// A raw `cudaStream_t` / `CUstream` of `device` that another library (PyTorch) passed
    /// in. Nothing keeps it alive: its maker does.
    ///
    /// # Safety
    /// `raw` is null (the legacy default stream) or a stream handle of the CUDA driver loaded
    /// in this process that is live now and stays live while ferrocuda may use it: until
    /// every allocation made or recorded on it has been freed and the work it was used by
    /// has completed (what PyTorch's own allocator assumes of the streams it is given). The
    /// driver checks that it belongs to `device`'s primary context before using it.
    pub unsafe fn from_raw(device: DeviceIndex, raw: *mut std::ffi::c_void) -> ForeignStream {
        ForeignStream {
            device,
            raw: raw.addr() as u64,
            origin: Origin::Raw,
        }
    }

    pub(crate) fn fake(device: DeviceIndex, raw: u64) -> ForeignStream {
        ForeignStream {
            device,
            raw,
            origin: Origin::Fake,
        }
    }

    /// Its device.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// The same stream, said to be of `device`: for a caller that is not told the device
    /// (PyTorch's `record_stream` hook). Adopting it checks the claim (a stream of another
    /// device is refused), so nothing is trusted that was not vouched for before.
    pub fn for_device(&self, device: DeviceIndex) -> ForeignStream {
        ForeignStream {
            device,
            ..self.clone()
        }
    }

    /// The stream as its maker names it: a `CUstream` (0 for the legacy default stream).
    pub fn raw(&self) -> u64 {
        self.raw
    }

    pub(crate) fn origin(&self) -> &Origin {
        &self.origin
    }
}

/// `len` elements of `T` at a device address, lent to cudarc for work on `stream`: cudarc's
/// `DevicePtr`/`DevicePtrMut` (cuBLAS, copies) and `LaunchArgs::arg` take it. `K` is kept
/// alive with it and dropped after it (the layer above keeps its buffer borrowed and orders
/// its own streams there).
///
/// Work on `stream` needs no synchronisation. Handed to cudarc for another stream
/// (`device_ptr(other)`), that stream first waits for `stream`, and the host waits for it
/// when the pointer's guard drops (cudarc's `SyncOnDrop::Sync`), so the memory is never used
/// on two streams at once. The launch builder cannot say which stream it launches on: launch
/// on `stream`.
pub struct CudarcSlice<'a, T, K> {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    _keep: K,
    _element: PhantomData<&'a T>,
}

impl<T, K> std::fmt::Debug for CudarcSlice<'_, T, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudarcSlice")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl<'a, T, K> CudarcSlice<'a, T, K> {
    /// `len` elements at `ptr`, for work on `stream`, keeping `keep`. Like every device
    /// address in ferrocuda, `ptr` is data: libcuda checks it where it is used.
    pub fn new(ptr: DevicePtr, len: usize, stream: &'a Arc<CudaStream>, keep: K) -> Self {
        CudarcSlice {
            ptr: ptr.0,
            len,
            stream,
            _keep: keep,
            _element: PhantomData,
        }
    }

    /// The device address handed to cudarc.
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.ptr)
    }

    /// Orders `other` after this slice's stream; the guard makes the host wait for `other`
    /// (see the type's docs). Nothing to do on the slice's own stream.
    fn guard<'b>(&self, other: &'b CudaStream) -> SyncOnDrop<'b> {
        if other == &**self.stream {
            return SyncOnDrop::Sync(None);
        }
        other.context().record_err(other.join(self.stream));
        SyncOnDrop::sync_stream(other)
    }
}

impl<T, K> DeviceSlice<T> for CudarcSlice<'_, T, K> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T, K> CudarcDevicePtr<T> for CudarcSlice<'_, T, K> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.guard(stream))
    }
}

impl<T, K> DevicePtrMut<T> for CudarcSlice<'_, T, K> {
    fn device_ptr_mut<'b>(
        &'b mut self,
        stream: &'b CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        (self.ptr, self.guard(stream))
    }
}

// SAFETY: what cudarc's own impl for `&CudaSlice` pushes: the address of a `CUdeviceptr`
// inside the argument, which is borrowed for `'b`, longer than the builder (`'a`); the kernel
// receives the device address by value.
unsafe impl<'a, 'b: 'a, T, K> PushKernelArg<&'b CudarcSlice<'_, T, K>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b CudarcSlice<'_, T, K>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
    }
}

// SAFETY: as for `&CudarcSlice` above; the mutable borrow keeps the slice exclusive while the
// builder lives.
unsafe impl<'a, 'b: 'a, T, K> PushKernelArg<&'b mut CudarcSlice<'_, T, K>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut CudarcSlice<'_, T, K>) -> &mut Self {
        <Self as PushKernelArg<&'b sys::CUdeviceptr>>::arg(self, &arg.ptr)
    }
}
