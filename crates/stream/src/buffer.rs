//! A minimal typed device buffer. It allocates from the runtime's memory resource: the
//! caching allocator once the layer above installed it, the driver before.
use crate::{MemoryResource, Result, Runtime, Stream, StreamError};
use ferrocuda_types::{DeviceIndex, DevicePtr, Element, KernelArg, MemsetValue};
use std::marker::PhantomData;
use std::sync::Arc;

/// `len` elements of `T` on one device. Operations run on the current stream of the
/// buffer's device, as PyTorch's tensor operations do.
#[derive(Debug)]
pub struct DeviceBuffer<T: Element> {
    runtime: Arc<Runtime>,
    memory: Arc<dyn MemoryResource>,
    device: DeviceIndex,
    ptr: DevicePtr,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: Element> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.len > 0 {
            // Nothing to report a failed free to; the allocator keeps its books straight.
            let _ = self.memory.free(self.device, self.ptr);
        }
    }
}

/// The bytes of `len` elements of `T` (`what` names the buffer in the error): a count that
/// does not fit 64 bits is refused before anything is asked of an allocator.
pub(crate) fn byte_len<T>(len: usize, what: &str) -> Result<u64> {
    (len as u64)
        .checked_mul(size_of::<T>() as u64)
        .ok_or_else(|| StreamError::Memory {
            source: crate::MemoryError::Other(format!(
                "{what} of {len} elements of {} bytes is larger than memory",
                size_of::<T>()
            )),
        })
}

impl<T: Element> DeviceBuffer<T> {
    /// Uninitialized memory for `len` elements on `dev`.
    pub fn uninit(runtime: &Arc<Runtime>, dev: DeviceIndex, len: usize) -> Result<DeviceBuffer<T>> {
        runtime.check_device(dev)?;
        let bytes = byte_len::<T>(len, "a device buffer")?;
        let memory = runtime.memory();
        let ptr = if len == 0 {
            DevicePtr(0)
        } else {
            memory.allocate(dev, bytes, runtime.current_stream(dev)?.handle())?
        };
        Ok(DeviceBuffer {
            runtime: runtime.clone(),
            memory,
            device: dev,
            ptr,
            len,
            _element: PhantomData,
        })
    }

    /// A copy of `values` on `dev`.
    pub fn from_slice(
        runtime: &Arc<Runtime>,
        dev: DeviceIndex,
        values: &[T],
    ) -> Result<DeviceBuffer<T>> {
        let buf = DeviceBuffer::uninit(runtime, dev, values.len())?;
        buf.copy_from_host(values)?;
        Ok(buf)
    }

    /// `len` copies of `value` on `dev`.
    pub fn filled(
        runtime: &Arc<Runtime>,
        dev: DeviceIndex,
        len: usize,
        value: T,
    ) -> Result<DeviceBuffer<T>> {
        let buf = DeviceBuffer::uninit(runtime, dev, len)?;
        buf.fill(value)?;
        Ok(buf)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device it lives on.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }
    /// The runtime it was made on.
    pub(crate) fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }
    /// Its device address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        // Checked at construction (`byte_len`).
        self.len as u64 * size_of::<T>() as u64
    }
    /// The buffer as a kernel argument (a device pointer that knows its device).
    pub fn arg(&self) -> KernelArg<'static> {
        KernelArg::Ptr {
            device: self.device,
            ptr: self.ptr,
        }
    }

    /// Marks the buffer as used by `stream` (`Tensor.record_stream`): after it is dropped,
    /// its memory is not reused before the work enqueued on `stream` so far completes. A
    /// stream of another runtime is [`StreamError::OtherRuntime`].
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        self.runtime.check_stream(stream)?;
        if self.len == 0 {
            return Ok(());
        }
        self.memory
            .record_stream(self.device, self.ptr, stream.handle())
    }

    fn stream(&self) -> Result<Stream> {
        self.runtime.current_stream(self.device)
    }

    /// Sets every element to `value`.
    pub fn fill(&self, value: T) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let bytes = bytemuck::bytes_of(&value);
        let pattern = match bytes.len() {
            1 => Some(MemsetValue::U8(bytes[0])),
            2 => Some(MemsetValue::U16(u16::from_le_bytes([bytes[0], bytes[1]]))),
            4 => Some(MemsetValue::U32(u32::from_le_bytes([
                bytes[0], bytes[1], bytes[2], bytes[3],
            ]))),
            _ => None,
        };
        match pattern {
            Some(p) => Ok(self.runtime.driver().memset_async(
                self.ptr,
                p,
                self.len as u64,
                self.stream()?.handle(),
            )?),
            // No 8-byte memset in the driver API: stage the pattern from the host.
            None => self.copy_from_host(&vec![value; self.len]),
        }
    }

    /// Copies `values` (exactly `len` of them) into the buffer, in stream order on the
    /// current stream of its device; `values` may be reused when this returns. A copy of
    /// at least [`STAGED_MIN`](crate::STAGED_MIN) bytes is staged by threads when the host
    /// memory resource asks for it (`pageable_copy_threads`), with the same results as the
    /// driver's copy (`crates/stream/src/pageable_copy/`).
    pub fn copy_from_host(&self, values: &[T]) -> Result<()> {
        if values.len() != self.len {
            return Err(StreamError::LengthMismatch {
                expected: self.len,
                found: values.len(),
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        let stream = self.stream()?;
        self.runtime
            .copy_from_pageable(self.ptr, bytemuck::cast_slice(values), &stream)
    }

    /// Copies the buffer into `out` (exactly `len` elements: `Tensor.copy_` into a CPU
    /// tensor), after the work enqueued on the current stream of its device, and waits for
    /// it. A copy of at least [`STAGED_READ_MIN`](crate::STAGED_READ_MIN) bytes is staged by
    /// threads when the host memory resource asks for at least
    /// [`READ_MIN_THREADS`](crate::READ_MIN_THREADS) (`pageable_copy_threads`), as
    /// [`copy_from_host`](Self::copy_from_host) is, with the same results as the driver's
    /// copy.
    pub fn copy_to_host(&self, out: &mut [T]) -> Result<()> {
        if out.len() != self.len {
            return Err(StreamError::LengthMismatch {
                expected: self.len,
                found: out.len(),
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        let stream = self.stream()?;
        self.runtime
            .copy_to_pageable(bytemuck::cast_slice_mut(out), self.ptr, &stream)
    }

    /// The buffer's contents in a new `Vec` (`Tensor.cpu()`), copied as
    /// [`copy_to_host`](Self::copy_to_host) copies.
    pub fn to_host(&self) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Copies `src` into this buffer (`Tensor.copy_`): on one device, on its current
    /// stream; across devices as PyTorch does ([`Runtime::copy_between_devices`]: on the
    /// source device's current stream, ordered after and before the destination device's
    /// current stream, over peer access when it can be enabled).
    pub fn copy_from(&self, src: &DeviceBuffer<T>) -> Result<()> {
        self.runtime.check_buffer(src, "the source buffer")?;
        if src.len != self.len {
            return Err(StreamError::LengthMismatch {
                expected: self.len,
                found: src.len,
            });
        }
        if self.len == 0 {
            return Ok(());
        }
        self.runtime
            .copy_between_devices((self.device, self.ptr), (src.device, src.ptr), self.bytes())
            .map(drop)
    }
}
