//! The device arrays the scaler and the optimizers work on.
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_types::{DType, DeviceIndex, DevicePtr, Element};

/// A contiguous device array seen without its element type: where it starts, on which
/// device, how many elements and of which dtype. Gradients and parameters of mixed dtypes
/// travel as these so that one multi-tensor launch can take them all.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TensorView {
    /// The device that owns the memory.
    pub device: DeviceIndex,
    /// The first element.
    pub ptr: DevicePtr,
    /// The number of elements.
    pub len: u64,
    /// The element type.
    pub dtype: DType,
}

impl TensorView {
    /// A view of a whole buffer.
    pub fn of<T: Element>(buffer: &DeviceBuffer<T>) -> TensorView {
        TensorView {
            device: buffer.device(),
            ptr: buffer.ptr(),
            len: buffer.len() as u64,
            dtype: T::DTYPE,
        }
    }

    /// The size in bytes (saturating: a view that does not fit is refused by
    /// [`TensorView::check_range`] before any kernel sees it).
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(self.dtype.size() as u64)
    }

    /// The view itself when its bytes fit in the address space (`ptr + bytes` does not
    /// overflow), else [`ViewOutOfRange`].
    pub fn check_range(&self) -> Result<&TensorView, ViewOutOfRange> {
        self.len
            .checked_mul(self.dtype.size() as u64)
            .and_then(|bytes| self.ptr.0.checked_add(bytes))
            .map(|_| self)
            .ok_or(ViewOutOfRange {
                ptr: self.ptr,
                len: self.len,
                dtype: self.dtype,
            })
    }
}

/// A [`TensorView`] whose bytes run past the end of the address space (a wrong length or
/// pointer): refused before it reaches a kernel's table.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a view of {len} elements of {dtype:?} at {ptr:?} runs past the end of the address space")]
pub struct ViewOutOfRange {
    /// The view's first element.
    pub ptr: DevicePtr,
    /// Its length.
    pub len: u64,
    /// Its element type.
    pub dtype: DType,
}
