//! What a wrapped function is given (its [`Ctx`]: the stream to enqueue on, where to
//! allocate) and what a call returns ([`Call`]: the outputs, and how the call was served).
use super::errors::{SkipReason, TreeError};
use super::tensor::{Arg, Out, Shape, TreeTensor};
use crate::CallableError;
use ferrocuda_stream::{MemoryResource, Stream};
use ferrocuda_types::DType;
use std::sync::Arc;

/// How a wrapped function is being run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RunKind {
    /// Eagerly, inside the tree's pool, before recording (a warm-up node).
    Warmup,
    /// Under capture, inside the tree's pool: the work is recorded, not run.
    Record,
    /// Eagerly, outside the pool, because graphs were skipped.
    Eager,
}

/// The context of one run of a wrapped function.
#[derive(Debug)]
pub struct Ctx<'a> {
    stream: &'a Stream,
    memory: Arc<dyn MemoryResource>,
    kind: RunKind,
    incompatible: Option<String>,
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(stream: &'a Stream, memory: Arc<dyn MemoryResource>, kind: RunKind) -> Self {
        Ctx {
            stream,
            memory,
            kind,
            incompatible: None,
        }
    }

    /// The stream to enqueue the function's work on (it is also the current stream).
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// How the function is being run.
    pub fn kind(&self) -> RunKind {
        self.kind
    }

    /// Memory for `dtype` × `dims` on the stream: in the tree's pool while warming up or
    /// recording. Return it as an output, or drop it (a temporary).
    pub fn alloc(&self, dtype: DType, dims: &[usize]) -> Result<Out, TreeError> {
        self.alloc_shape(dtype, Shape::new(dims)?)
    }

    /// [`Ctx::alloc`] with a [`Shape`] (an input's, say).
    pub fn alloc_shape(&self, dtype: DType, shape: Shape) -> Result<Out, TreeError> {
        let bytes = shape.bytes(dtype);
        let device = self.stream.device();
        let ptr = if bytes == 0 {
            ferrocuda_types::DevicePtr(0)
        } else {
            self.memory.allocate(device, bytes, self.stream.handle())?
        };
        Ok(Out::new(
            self.memory.clone(),
            Arg {
                ptr,
                device,
                dtype,
                shape,
            },
        ))
    }

    /// Declares that the function does something a graph cannot hold (a host read, a
    /// data-dependent size), named `op`: the call's results stand, and the function runs
    /// eagerly from then on ("incompatible op").
    pub fn incompatible_op(&mut self, op: &str) {
        self.incompatible.get_or_insert_with(|| op.to_string());
    }

    pub(crate) fn incompatible(&mut self) -> Option<String> {
        self.incompatible.take()
    }
}

/// A function a tree can warm up, record and replay: it reads its [`Arg`]s, enqueues work on
/// [`Ctx::stream`], and returns the outputs it allocated through the context.
pub trait TreeFn: FnMut(&mut Ctx<'_>, &[Arg]) -> Result<Vec<Out>, CallableError> + Send {}

impl<F> TreeFn for F where F: FnMut(&mut Ctx<'_>, &[Arg]) -> Result<Vec<Out>, CallableError> + Send {}

/// How a call was served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Served {
    /// Run eagerly in the pool (a warm-up).
    Warmup,
    /// Recorded into a new graph (then replayed once).
    Recorded,
    /// A recorded graph was replayed.
    Replayed,
    /// Run eagerly without graphs, for this reason.
    Eager(SkipReason),
}

/// What a call returns.
#[derive(Debug)]
pub struct Call {
    /// The function's outputs.
    pub outputs: Vec<TreeTensor>,
    /// How the call was served.
    pub served: Served,
}
