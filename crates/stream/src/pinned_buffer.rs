//! A typed buffer of page-locked host memory with non-blocking copies to and from device
//! buffers: what `torch.empty(..., pin_memory=True)`, `tensor.pin_memory()` and
//! `copy_(..., non_blocking=True)` give a PyTorch user. It allocates from the runtime's host
//! memory resource: the caching host allocator once the layer above installed it, the
//! driver before.
use crate::{DeviceBuffer, HostMemoryResource, Result, Runtime, Stream, StreamError};
use ferrocuda_types::{Element, HostRange};
use std::marker::PhantomData;
use std::sync::Arc;

/// `len` elements of `T` in page-locked host memory.
///
/// Copies between it and a [`DeviceBuffer`] run on the current stream of the device
/// buffer's device, as PyTorch's `copy_` does. A non-blocking copy returns at once and
/// records its stream with the memory resource (PyTorch's
/// `CachingHostAllocator_recordEvent`): dropping the buffer then does not let the memory be
/// reused before the copy completes. Reading the buffer on the host while a copy into it
/// is pending gives unspecified bytes: synchronize the stream first, as in PyTorch.
#[derive(Debug)]
pub struct PinnedBuffer<T: Element> {
    runtime: Arc<Runtime>,
    memory: Arc<dyn HostMemoryResource>,
    /// `None` for an empty buffer (PyTorch's null pointer for 0 bytes).
    range: Option<HostRange>,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: Element> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if let Some(range) = self.range {
            // Nothing to report a failed free to; the allocator keeps its books straight.
            let _ = self.memory.free_host(range);
        }
    }
}

impl<T: Element> PinnedBuffer<T> {
    /// Uninitialized pinned memory for `len` elements (`torch.empty(len, pin_memory=True)`),
    /// asked for on the current stream of the current device.
    pub fn uninit(runtime: &Arc<Runtime>, len: usize) -> Result<PinnedBuffer<T>> {
        let memory = runtime.host_memory();
        let bytes = crate::buffer::byte_len::<T>(len, "a pinned buffer")?;
        let range = if bytes == 0 {
            None
        } else {
            let stream = runtime.current_stream(runtime.current_device())?;
            Some(memory.allocate_host(bytes, stream.handle())?)
        };
        Ok(PinnedBuffer {
            runtime: runtime.clone(),
            memory,
            range,
            len,
            _element: PhantomData,
        })
    }

    /// A pinned copy of `values` (`tensor.pin_memory()`).
    pub fn from_slice(runtime: &Arc<Runtime>, values: &[T]) -> Result<PinnedBuffer<T>> {
        let buf = PinnedBuffer::uninit(runtime, values.len())?;
        buf.write(values)?;
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
    /// Its size in bytes.
    pub fn bytes(&self) -> u64 {
        // Checked at construction (`byte_len`).
        self.len as u64 * size_of::<T>() as u64
    }
    /// The host memory it occupies (`None` when empty). The range may be longer than
    /// [`PinnedBuffer::bytes`]: the caching host allocator rounds sizes up.
    pub fn range(&self) -> Option<HostRange> {
        self.range
    }

    fn check_len(&self, found: usize) -> Result<()> {
        if found == self.len {
            Ok(())
        } else {
            Err(StreamError::LengthMismatch {
                expected: self.len,
                found,
            })
        }
    }

    /// Writes `values` (exactly `len` of them) into the buffer, on the host, now.
    pub fn write(&self, values: &[T]) -> Result<()> {
        self.check_len(values.len())?;
        match self.range {
            None => Ok(()),
            Some(r) => Ok(self.runtime.driver().host_write(
                r.base,
                r.offset,
                bytemuck::cast_slice(values),
            )?),
        }
    }

    /// The buffer's contents, read on the host now (pending copies into it are not waited
    /// for).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        if let Some(r) = self.range {
            self.runtime.driver().host_read(
                r.base,
                r.offset,
                bytemuck::cast_slice_mut(&mut out),
            )?;
        }
        Ok(out)
    }

    /// Notes that the work enqueued on `stream` so far uses this buffer, so that its memory
    /// is not reused before that work completes (`CachingHostAllocator_recordEvent`).
    pub fn record_event(&self, stream: &Stream) -> Result<()> {
        self.runtime.check_stream(stream)?;
        match self.range {
            None => Ok(()),
            Some(r) => self.memory.record_host_use(r, stream.handle()),
        }
    }

    /// Copies this buffer into `dst` (`dst.copy_(self, non_blocking)`) on the current
    /// stream of `dst`'s device. Non-blocking, it returns once the copy is enqueued and
    /// records the stream; blocking, it waits for the stream.
    pub fn copy_to_device(&self, dst: &DeviceBuffer<T>, non_blocking: bool) -> Result<()> {
        self.runtime.check_buffer(dst, "the destination buffer")?;
        self.check_len(dst.len())?;
        let Some(r) = self.range else {
            return Ok(());
        };
        let stream = self.runtime.current_stream(dst.device())?;
        self.runtime.driver().memcpy_htod_pinned_async(
            dst.ptr(),
            (r.base, r.offset),
            self.bytes(),
            stream.handle(),
        )?;
        self.finish_copy(r, &stream, non_blocking)
    }

    /// Copies `src` into this buffer (`self.copy_(src, non_blocking)`) on the current stream
    /// of `src`'s device; as [`PinnedBuffer::copy_to_device`] otherwise.
    pub fn copy_from_device(&self, src: &DeviceBuffer<T>, non_blocking: bool) -> Result<()> {
        self.runtime.check_buffer(src, "the source buffer")?;
        self.check_len(src.len())?;
        let Some(r) = self.range else {
            return Ok(());
        };
        let stream = self.runtime.current_stream(src.device())?;
        self.runtime.driver().memcpy_dtoh_pinned_async(
            (r.base, r.offset),
            src.ptr(),
            self.bytes(),
            stream.handle(),
        )?;
        self.finish_copy(r, &stream, non_blocking)
    }

    fn finish_copy(&self, r: HostRange, stream: &Stream, non_blocking: bool) -> Result<()> {
        if non_blocking {
            self.memory.record_host_use(r, stream.handle())
        } else {
            stream.synchronize()
        }
    }
}
