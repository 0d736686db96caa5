//! Buffers lent to work another library enqueues ([`DeviceBuffer::lend`]), and to cudarc in
//! particular ([`DeviceBuffer::cudarc`]): no copy, the order between the streams kept.
use crate::{DeviceBuffer, Result, Stream, StreamError};
use ferrocuda_driver::ForeignStream;
use ferrocuda_driver::interop::CudarcSlice;
use ferrocuda_driver::interop::cudarc::driver::CudaStream;
use ferrocuda_types::Element;
use std::sync::Arc;

/// A buffer lent to work on another stream ([`DeviceBuffer::lend`]).
///
/// When lent, the borrowing stream waits for the work already enqueued on the current stream
/// of the buffer's device (where ferrocuda's operations on the buffer run). When given back
/// ([`Lent::give_back`], or dropped), that current stream waits for the work enqueued on the
/// borrowing stream so far, so ferrocuda's later work on the buffer, and the reuse of its
/// memory once it is freed, come after. Lent to the current stream itself, nothing is
/// ordered: nothing needs to be.
#[derive(Debug)]
#[must_use = "dropping it gives the buffer back at once"]
pub struct Lent<'a, T: Element> {
    buffer: &'a DeviceBuffer<T>,
    /// The borrowing stream, until given back.
    to: Option<Stream>,
    /// The current stream of the buffer's device when lent.
    home: Stream,
}

impl<T: Element> Lent<'_, T> {
    /// The buffer.
    pub fn buffer(&self) -> &DeviceBuffer<T> {
        self.buffer
    }

    /// The stream it is lent to.
    pub fn stream(&self) -> Option<&Stream> {
        self.to.as_ref()
    }

    /// Gives the buffer back, reporting an error of the ordering (dropping it ignores one).
    pub fn give_back(mut self) -> Result<()> {
        self.join()
    }

    fn join(&mut self) -> Result<()> {
        match self.to.take() {
            Some(to) => self.home.wait_stream(&to),
            None => Ok(()),
        }
    }
}

impl<T: Element> Drop for Lent<'_, T> {
    fn drop(&mut self) {
        // No one to report to: `give_back` does.
        let _ = self.join();
    }
}

impl<T: Element> DeviceBuffer<T> {
    /// Lends the buffer to work on `to` (a stream of its device), without a copy: see
    /// [`Lent`] for the order kept between `to` and ferrocuda's current stream.
    pub fn lend(&self, to: &Stream) -> Result<Lent<'_, T>> {
        self.runtime().check_stream(to)?;
        if to.device() != self.device() {
            return Err(StreamError::DeviceMismatch {
                expected: self.device(),
                found: to.device(),
                what: "the borrowing stream",
            });
        }
        let home = self.runtime().current_stream(self.device())?;
        to.wait_stream(&home)?;
        Ok(Lent {
            buffer: self,
            to: Some(to.clone()),
            home,
        })
    }

    /// The buffer as cudarc device memory for work on `stream`, without a copy: cudarc's
    /// `LaunchArgs::arg`, its copies and its cuBLAS wrappers (`DevicePtr`, `DevicePtrMut`)
    /// take it. The stream is adopted ([`Runtime::adopt_stream`]) and the buffer lent to it
    /// ([`DeviceBuffer::lend`]) until the slice drops; launch on `stream` (see
    /// [`CudarcSlice`]). A stream of another device is [`StreamError::DeviceMismatch`]; a
    /// runtime not over the real driver cannot adopt a cudarc stream
    /// (`CUDA_ERROR_INVALID_HANDLE`).
    ///
    /// A cudarc program switching its allocations to ferrocuda's caching allocator (only the
    /// allocation changes; cudarc's copies, memsets, launch builder and cuBLAS wrappers take
    /// the view through the same `DevicePtr` / `DevicePtrMut` traits):
    /// ```no_run
    /// # use ferrocuda_driver::{CudaDriver, interop::cudarc};
    /// # use ferrocuda_stream::{DeviceBuffer, Runtime};
    /// # use ferrocuda_types::DeviceIndex;
    /// # use std::sync::Arc;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use cudarc::driver::CudaContext;
    /// let ctx = CudaContext::new(0)?;
    /// let stream = ctx.default_stream();
    ///
    /// // Before: let mut x = stream.clone_htod(&[1.0f32; 1024])?;
    /// let rt = Runtime::new(Arc::new(CudaDriver::new())); // or ferrocuda::runtime()
    /// let x = DeviceBuffer::from_slice(&rt, DeviceIndex(0), &[1.0f32; 1024])?;
    /// let mut view = x.cudarc(&stream)?;
    ///
    /// stream.memcpy_htod(&[2.0f32; 1024], &mut view)?;
    /// assert_eq!(stream.clone_dtoh(&view)?, vec![2.0f32; 1024]);
    /// drop(view); // ferrocuda's current stream now waits for cudarc's work
    /// assert_eq!(x.to_host()?, vec![2.0f32; 1024]);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// [`Runtime::adopt_stream`]: crate::Runtime::adopt_stream
    pub fn cudarc<'a>(
        &'a self,
        stream: &'a Arc<CudaStream>,
    ) -> Result<CudarcSlice<'a, T, Lent<'a, T>>> {
        let foreign = ForeignStream::cudarc(stream)?;
        if foreign.device() != self.device() {
            return Err(StreamError::DeviceMismatch {
                expected: self.device(),
                found: foreign.device(),
                what: "the cudarc stream",
            });
        }
        let adopted = self.runtime().adopt_stream(foreign)?;
        let lent = self.lend(&adopted)?;
        Ok(CudarcSlice::new(self.ptr(), self.len(), stream, lent))
    }
}
