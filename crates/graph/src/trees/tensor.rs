//! What goes into a wrapped function and what comes out: inputs described by plain metadata
//! ([`Input`], seen by the function as [`Arg`]s), outputs the function allocates through its
//! context ([`Out`]), and the handles a call returns ([`TreeTensor`]).
//!
//! Stale outputs are always detected (beyond PyTorch, which detects them only for outputs
//! of warm-ups and recordings: graphs spec §10 item 1). Each output of a node has a run
//! clock; a handle remembers the clock value of the run that produced it. A later run of
//! the node, or the node's memory being handed to another recording, advances the clock,
//! so reading through an old handle is one atomic load and compare away from a
//! [`TreeError::StaleOutput`]. Liveness (whether a later call may reuse an output's memory)
//! is whether a handle of the latest run is still held.
use super::errors::TreeError;
use ferrocuda_stream::{DeviceBuffer, MemoryResource, Runtime};
use ferrocuda_types::{DType, DeviceIndex, DevicePtr, Element, KernelArg};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Dimensions a tree tensor may have.
pub const MAX_RANK: usize = 8;

/// A contiguous shape of up to [`MAX_RANK`] dimensions, kept inline (no allocation per
/// call, one comparison per signature).
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: [usize; MAX_RANK],
    rank: u8,
}

impl Shape {
    /// `dims`, or [`TreeError::Rank`] beyond [`MAX_RANK`].
    pub fn new(dims: &[usize]) -> Result<Shape, TreeError> {
        if dims.len() > MAX_RANK {
            return Err(TreeError::Rank {
                max: MAX_RANK,
                found: dims.len(),
            });
        }
        let mut s = Shape {
            dims: [0; MAX_RANK],
            rank: dims.len() as u8,
        };
        s.dims[..dims.len()].copy_from_slice(dims);
        Ok(s)
    }

    /// One dimension of `n`.
    pub fn vector(n: usize) -> Shape {
        let mut dims = [0; MAX_RANK];
        dims[0] = n;
        Shape { dims, rank: 1 }
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.rank as usize]
    }

    /// The number of elements (saturating: a shape past `usize` can only be refused, as
    /// larger than its buffer).
    pub fn numel(&self) -> usize {
        self.dims().iter().fold(1, |n, &d| n.saturating_mul(d))
    }

    /// The bytes of this shape's elements of `dtype` (saturating, as [`Shape::numel`]).
    pub fn bytes(&self, dtype: DType) -> u64 {
        self.numel().saturating_mul(dtype.size()) as u64
    }

    /// This shape with its leading dimension set to `n` (a scalar shape stays).
    pub(crate) fn with_leading(mut self, n: usize) -> Shape {
        if self.rank > 0 {
            self.dims[0] = n;
        }
        self
    }
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.dims()).finish()
    }
}

/// One input of a call: a device buffer (or a tree output) seen as `dtype` × `shape`, and
/// whether it is static (a parameter or buffer whose address the recording may keep: never
/// copied; a new address records anew).
#[derive(Copy, Clone, Debug)]
pub struct Input<'a> {
    pub(crate) ptr: DevicePtr,
    pub(crate) device: DeviceIndex,
    pub(crate) bytes: u64,
    pub(crate) dtype: DType,
    pub(crate) shape: Shape,
    pub(crate) is_static: bool,
    pub(crate) tree: Option<&'a TreeTensor>,
}

impl<'a> Input<'a> {
    /// `buffer` as a vector of all its elements.
    pub fn buffer<T: Element>(buffer: &'a DeviceBuffer<T>) -> Input<'a> {
        Input {
            ptr: buffer.ptr(),
            device: buffer.device(),
            bytes: buffer.bytes(),
            dtype: T::DTYPE,
            shape: Shape::vector(buffer.len()),
            is_static: false,
            tree: None,
        }
    }

    /// `buffer` seen with `dims` (its first elements, contiguous).
    pub fn shaped<T: Element>(
        buffer: &'a DeviceBuffer<T>,
        dims: &[usize],
    ) -> Result<Input<'a>, TreeError> {
        Ok(Input {
            shape: Shape::new(dims)?,
            ..Input::buffer(buffer)
        })
    }

    /// An output of an earlier call passed back in: used in place while it is a live
    /// output of the current path (PyTorch's cudagraph-managed inputs), copied otherwise.
    pub fn output(tensor: &'a TreeTensor) -> Input<'a> {
        let slot = &tensor.inner.slot;
        Input {
            ptr: slot.ptr,
            device: slot.device,
            bytes: slot.shape.bytes(slot.dtype),
            dtype: slot.dtype,
            shape: slot.shape,
            is_static: false,
            tree: Some(tensor),
        }
    }

    /// Marks the input static (`mark_static_address`; parameters and buffers).
    pub fn mark_static(mut self) -> Input<'a> {
        self.is_static = true;
        self
    }

    /// Bytes its shape covers.
    pub(crate) fn used_bytes(&self) -> u64 {
        self.shape.bytes(self.dtype)
    }
}

/// An input as the wrapped function sees it: the address to use (the caller's buffer, or
/// the recording's copy of it), its dtype and shape.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Arg {
    pub(crate) ptr: DevicePtr,
    pub(crate) device: DeviceIndex,
    pub(crate) dtype: DType,
    pub(crate) shape: Shape,
}

impl Arg {
    /// The address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    /// As a kernel argument.
    pub fn arg(&self) -> KernelArg<'static> {
        KernelArg::Ptr {
            device: self.device,
            ptr: self.ptr,
        }
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }
    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }
}

/// Memory a wrapped function allocated through its [`Ctx`](super::Ctx): an output when
/// returned, a temporary (freed when dropped) otherwise.
#[derive(Debug)]
pub struct Out {
    memory: Arc<dyn MemoryResource>,
    arg: Arg,
    /// Freed on drop unless the tree took it over.
    owned: bool,
}

impl Out {
    pub(crate) fn new(memory: Arc<dyn MemoryResource>, arg: Arg) -> Out {
        Out {
            memory,
            arg,
            owned: true,
        }
    }
    /// The address, dtype and shape, as an argument of a kernel or another function.
    pub fn as_arg(&self) -> Arg {
        self.arg
    }
    /// The address.
    pub fn ptr(&self) -> DevicePtr {
        self.arg.ptr
    }
    /// As a kernel argument.
    pub fn arg(&self) -> KernelArg<'static> {
        self.arg.arg()
    }
    /// The tree takes the memory over: it is no longer freed on drop.
    pub(crate) fn take(mut self) -> Arg {
        self.owned = false;
        self.arg
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        if self.owned && self.arg.ptr.0 != 0 {
            // Nothing to report to in a destructor; the allocator keeps its books.
            let _ = self.memory.free(self.arg.device, self.arg.ptr);
        }
    }
}

/// What every handle of one output shares: where it is, and its run clock.
#[derive(Debug)]
pub(crate) struct SlotShared {
    clock: AtomicU64,
    ptr: DevicePtr,
    device: DeviceIndex,
    dtype: DType,
    shape: Shape,
    runtime: Arc<Runtime>,
    /// Who produced it, for messages: the function's name and the output's index.
    function: Arc<str>,
    index: usize,
    /// The memory, when the handle owns it (an eager output, a copy moved out).
    _owned: Option<Out>,
}

/// One run's handle: the clock value it was produced at.
#[derive(Debug)]
struct Issued {
    slot: Arc<SlotShared>,
    run: u64,
}

/// An output of a wrapped-function call. Clones share it. Reading it (its address, its
/// values, a copy) after a later run overwrote its memory is [`TreeError::StaleOutput`];
/// [`TreeTensor::copy_out`] moves it out of the tree's pool to keep it.
#[derive(Clone, Debug)]
pub struct TreeTensor {
    inner: Arc<Issued>,
}

impl TreeTensor {
    /// Whether it can still be read (no later run overwrote it).
    pub fn is_valid(&self) -> bool {
        self.inner.slot.clock.load(Ordering::Acquire) == self.inner.run
    }

    fn check(&self) -> Result<&SlotShared, TreeError> {
        let slot = &self.inner.slot;
        if slot.clock.load(Ordering::Acquire) != self.inner.run {
            return Err(TreeError::StaleOutput {
                function: slot.function.to_string(),
                index: slot.index,
            });
        }
        Ok(slot)
    }

    /// Its address, while valid.
    pub fn ptr(&self) -> Result<DevicePtr, TreeError> {
        Ok(self.check()?.ptr)
    }

    /// As a kernel argument, while valid.
    pub fn arg(&self) -> Result<KernelArg<'static>, TreeError> {
        let slot = self.check()?;
        Ok(KernelArg::Ptr {
            device: slot.device,
            ptr: slot.ptr,
        })
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.inner.slot.dtype
    }

    /// Its shape.
    pub fn shape(&self) -> Shape {
        self.inner.slot.shape
    }

    /// Its device.
    pub fn device(&self) -> DeviceIndex {
        self.inner.slot.device
    }

    /// Its values, after the work enqueued on its device's current stream.
    pub fn to_host<T: Element>(&self) -> Result<Vec<T>, TreeError> {
        let slot = self.check()?;
        if T::DTYPE != slot.dtype {
            return Err(TreeError::DType {
                expected: T::DTYPE,
                found: slot.dtype,
            });
        }
        let mut out = vec![T::zeroed(); slot.shape.numel()];
        if !out.is_empty() {
            let stream = slot.runtime.current_stream(slot.device)?;
            slot.runtime.driver().memcpy_dtoh(
                bytemuck::cast_slice_mut(&mut out),
                slot.ptr,
                stream.handle(),
            )?;
        }
        // A run may have overwritten it while it was copied out.
        self.check()?;
        Ok(out)
    }

    /// A copy outside the tree's pool (on the current stream), which no later run touches:
    /// how an output is kept across steps.
    pub fn copy_out(&self) -> Result<TreeTensor, TreeError> {
        let slot = self.check()?;
        let bytes = slot.shape.bytes(slot.dtype);
        let stream = slot.runtime.current_stream(slot.device)?;
        let memory = slot.runtime.memory();
        let ptr = if bytes == 0 {
            DevicePtr(0)
        } else {
            memory.allocate(slot.device, bytes, stream.handle())?
        };
        let arg = Arg {
            ptr,
            device: slot.device,
            dtype: slot.dtype,
            shape: slot.shape,
        };
        let out = Out::new(memory, arg);
        if bytes > 0 {
            slot.runtime
                .driver()
                .memcpy_dtod_async(arg.ptr, slot.ptr, bytes, stream.handle())?;
        }
        self.check()?;
        Ok(TreeTensor::owning(
            &slot.runtime,
            out,
            slot.function.clone(),
            slot.index,
        ))
    }

    /// A handle that owns its memory and is never stale (eager outputs, copies).
    pub(crate) fn owning(
        runtime: &Arc<Runtime>,
        out: Out,
        function: Arc<str>,
        index: usize,
    ) -> TreeTensor {
        let arg = out.as_arg();
        let slot = Arc::new(SlotShared {
            clock: AtomicU64::new(0),
            ptr: arg.ptr,
            device: arg.device,
            dtype: arg.dtype,
            shape: arg.shape,
            runtime: runtime.clone(),
            function,
            index,
            _owned: Some(out),
        });
        TreeTensor {
            inner: Arc::new(Issued { slot, run: 0 }),
        }
    }
}

/// One output of a node, as the manager keeps it: its memory, and the latest handle given
/// out (whose being held is the output's liveness).
#[derive(Debug)]
pub(crate) struct OutputSlot {
    shared: Arc<SlotShared>,
    latest: Option<Arc<Issued>>,
}

impl OutputSlot {
    /// A slot over pool memory at `arg` that the manager owns.
    pub(crate) fn new(runtime: &Arc<Runtime>, arg: Arg, function: Arc<str>, index: usize) -> Self {
        OutputSlot {
            shared: Arc::new(SlotShared {
                clock: AtomicU64::new(0),
                ptr: arg.ptr,
                device: arg.device,
                dtype: arg.dtype,
                shape: arg.shape,
                runtime: runtime.clone(),
                function,
                index,
                _owned: None,
            }),
            latest: None,
        }
    }

    pub(crate) fn ptr(&self) -> DevicePtr {
        self.shared.ptr
    }

    /// Whether a handle of the latest run is held.
    pub(crate) fn is_live(&self) -> bool {
        self.latest
            .as_ref()
            .is_some_and(|i| Arc::strong_count(i) > 1)
    }

    /// A handle for a new run: older handles become stale.
    pub(crate) fn issue(&mut self) -> TreeTensor {
        let run = self.shared.clock.fetch_add(1, Ordering::AcqRel) + 1;
        let issued = Arc::new(Issued {
            slot: self.shared.clone(),
            run,
        });
        self.latest = Some(issued.clone());
        TreeTensor { inner: issued }
    }

    /// Every handle given out becomes stale (its memory is about to be reused or freed).
    pub(crate) fn invalidate(&mut self) {
        self.shared.clock.fetch_add(1, Ordering::AcqRel);
        self.latest = None;
    }
}
