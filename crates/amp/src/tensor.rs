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

    /// The size in bytes.
    pub fn bytes(&self) -> u64 {
        self.len * self.dtype.size() as u64
    }
}
