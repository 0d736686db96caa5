//! What can go wrong in a tree, why a call ran without graphs, and what the manager
//! reports on the way, with PyTorch's texts where PyTorch has one
//! (`torch/_inductor/cudagraph_utils.py`: `format_default_skip_message`,
//! `CheckInvariantStatus`, `log_data_ptr_mismatch`; `torch/_inductor/cudagraph_trees.py`).
use crate::GraphError;
use ferrocuda_alloc::AllocError;
use ferrocuda_stream::StreamError;
use ferrocuda_types::{DType, DeviceIndex, DevicePtr, PoolId};
use std::fmt;

/// Why a call ran eagerly instead of through a graph. `Display` gives PyTorch's log line,
/// "skipping cudagraphs due to …".
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SkipReason {
    /// The function writes inputs that are neither static nor outputs of the tree
    /// (`get_mutation_stack_trace`); `found_from` names them.
    MutatedInputs {
        /// How many such inputs.
        count: usize,
        /// Where they are: `"<function>: input <i>"`, one per line.
        found_from: String,
    },
    /// An input lives on another device than the tree's
    /// (`check_multiple_devices_or_any_cpu_nodes`).
    MultipleDevices {
        /// The devices seen, the tree's first.
        devices: Vec<DeviceIndex>,
    },
    /// The function sees more than one input shape and
    /// [`TreeConfig::skip_dynamic_graphs`](super::TreeConfig::skip_dynamic_graphs) is on.
    DynamicShapes,
    /// The function declared an operation that cannot be captured (a host read, a
    /// data-dependent size) through [`Ctx::incompatible_op`](super::Ctx::incompatible_op).
    IncompatibleOp {
        /// The operation, as the function named it.
        op: String,
    },
    /// The allocator does not cache (`PYTORCH_NO_CUDA_MEMORY_CACHING`): no private pools.
    UncachedAllocator,
    /// The call's sizes are not among [`WrapOptions::capture_sizes`](super::WrapOptions)
    /// (`cudagraph_capture_sizes`, which PyTorch applies without a message; the text is
    /// this crate's).
    CaptureSize {
        /// The leading dimensions of the non-static inputs.
        key: Vec<usize>,
    },
    /// The wrapped function's guards missed with its recompile limit reached (Dynamo's
    /// `recompile_limit`, `accumulated_recompile_limit`): it runs eagerly from then on
    /// for inputs no entry accepts. The text is Dynamo's warning.
    RecompileLimit {
        /// The warning ([`LimitHit`](crate::guards::LimitHit)'s text).
        warning: String,
    },
    /// Re-recorded too often under one node (`cudagraph_unexpected_rerecord_limit`).
    RerecordLimit {
        /// The function's id.
        function: u32,
        /// The limit.
        limit: u32,
        /// The node's graph id; `None` at the roots.
        node: Option<u64>,
        /// The mismatch that forced the re-recordings.
        status: CheckStatus,
    },
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::MutatedInputs { count, found_from } => {
                write!(
                    f,
                    "skipping cudagraphs due to mutated inputs ({count} instances)"
                )?;
                if !found_from.is_empty() {
                    write!(f, ". Found from : \n {found_from}")?;
                }
                Ok(())
            }
            SkipReason::MultipleDevices { devices } => {
                let devices: Vec<String> = devices
                    .iter()
                    .map(|d| format!("device(type='cuda', index={})", d.0))
                    .collect();
                write!(
                    f,
                    "skipping cudagraphs due to multiple devices: {}",
                    devices.join(", ")
                )
            }
            SkipReason::DynamicShapes => f.write_str(
                "skipping cudagraphs due to graph with symbolic shapes inputs and config.triton.cudagraph_skip_dynamic_graphs=True.",
            ),
            SkipReason::IncompatibleOp { op } => {
                write!(f, "skipping cudagraphs due to incompatible op {op}")
            }
            SkipReason::UncachedAllocator => f.write_str(
                "skipping cudagraphs due to cudagraph capture requires the caching allocator; current allocator is uncached",
            ),
            SkipReason::RecompileLimit { warning } => f.write_str(warning),
            SkipReason::CaptureSize { key } => write!(
                f,
                "skipping cudagraphs due to input sizes {key:?} not in cudagraph_capture_sizes"
            ),
            SkipReason::RerecordLimit {
                function,
                limit,
                node,
                status,
            } => {
                let node = node.map_or("None".to_string(), |n| n.to_string());
                write!(
                    f,
                    "skipping cudagraph due to function {function} exceeding max re-recording limit (={limit}) on cudagraph node {node} due to {status}."
                )
            }
        }
    }
}

/// The result of checking whether a recorded node can serve a call
/// (`CheckInvariantStatus`); `Display` gives PyTorch's text.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CheckStatus {
    /// The node serves the call.
    Success,
    /// An input that was an output of the tree at recording moved.
    CudagraphManagedIdxMismatch,
    /// A static input moved.
    StaticInputIdxMismatch,
    /// An output of the path that was dead when the node was recorded (so the node may
    /// reuse its memory) is alive now.
    ExpectedDeadIndicesBeforeGraphMismatch,
}

impl fmt::Display for CheckStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CheckStatus::Success => "SUCCESS: 1",
            CheckStatus::CudagraphManagedIdxMismatch => {
                "cudagraph managed tensor data pointer changed"
            }
            CheckStatus::StaticInputIdxMismatch => "static input data pointer changed",
            CheckStatus::ExpectedDeadIndicesBeforeGraphMismatch => {
                "expected dead indices before graph are live"
            }
        })
    }
}

/// What the manager reports on the way (PyTorch logs these); drained with
/// [`Trees::take_events`](super::Trees::take_events).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TreeEvent {
    /// A function ran eagerly; reported once per function and reason kind.
    Skipped(SkipReason),
    /// No recorded node served the call and a new one is recorded beside them
    /// (`log_data_ptr_mismatch`'s text in `detail`).
    Rerecord {
        /// The function's id.
        function: u32,
        /// Why the siblings did not serve.
        status: CheckStatus,
        /// `"<status>.\ninput name: arg<i>. data pointer changed from <old> to <new>. …"`.
        detail: String,
    },
    /// The allocator was returned to a node's checkpoint before recording or warming up
    /// after a replay ("Checkpointing cuda caching allocator state").
    Checkpointed {
        /// The node's graph id.
        node: u64,
    },
    /// A wrapped function met a new input shape ("Recording cudagraph tree for symint key").
    NewShape {
        /// The new function id serving it.
        function: u32,
        /// The shape key, as `[dtype shape, …]`.
        key: String,
    },
    /// A recording was evicted (the shape cap), its graphs destroyed and its blocks freed.
    Evicted {
        /// The evicted function id.
        function: u32,
        /// Nodes removed (its recordings and their descendants).
        nodes: usize,
    },
    /// A recording's graph cannot be patched to read callers' buffers
    /// ([`InputFeed`](super::InputFeed)): its non-static inputs are copied from now on.
    CopyingInputs {
        /// The recording's graph id.
        node: u64,
        /// Why (the `update_input_ptrs` refusal, naming the graph node).
        reason: String,
    },
    /// A warning, once per function: the text says what to change.
    Warning(String),
    /// The function's guards missed and a new specialisation was made: Dynamo's
    /// `TORCH_LOGS="recompiles"` text (which guard of each entry failed).
    Recompile(String),
}

/// Errors of the tree runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TreeError {
    /// An output was read after a later run overwrote its memory. PyTorch's message, with
    /// this crate's remedies.
    #[error(
        "Error: accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run. Output {index} of {function}. To prevent overwriting, move it out with TreeTensor::copy_out before the next step, or call Trees::mark_step_begin only once its outputs are no longer needed."
    )]
    StaleOutput {
        /// The function that produced it.
        function: String,
        /// Which of its outputs.
        index: usize,
    },
    /// The call ran (or would have run) eagerly, and [`super::TreeConfig::cudagraph_or_error`]
    /// asks for an error.
    #[error("{0}")]
    Skipped(SkipReason),
    /// The wrapped function failed (its error); the tree is left as before the call.
    #[error("wrapped function {function} failed: {message}")]
    Function {
        /// Its name.
        function: String,
        /// Its error.
        message: String,
    },
    /// An input is described by more elements than its buffer holds.
    #[error(
        "input {index}: shape {shape:?} of {dtype:?} needs {needed} bytes, the buffer has {bytes}"
    )]
    InputTooSmall {
        /// Which input.
        index: usize,
        /// Its shape.
        shape: Vec<usize>,
        /// Its dtype.
        dtype: DType,
        /// Bytes the shape needs.
        needed: u64,
        /// Bytes the buffer has.
        bytes: u64,
    },
    /// A call with another number of inputs than the wrapped function takes
    /// ([`WrapOptions::num_inputs`](super::WrapOptions::num_inputs), else its first call's):
    /// Python's `TypeError` for a wrong argument count, raised before Dynamo sees the call.
    /// Refused before the guards: the call compiles nothing and uses no recompile slot.
    #[error("{function}() takes {expected} inputs but {found} were given")]
    InputCount {
        /// The wrapped function's name.
        function: String,
        /// The number it takes.
        expected: usize,
        /// The number given.
        found: usize,
    },
    /// A shape with more dimensions than a tree tensor holds.
    #[error("shapes have at most {max} dimensions, got {found}")]
    Rank {
        /// The most supported.
        max: usize,
        /// Asked for.
        found: usize,
    },
    /// A leading dimension larger than every bucket.
    #[error("input {index}: leading dimension {n} is larger than the largest bucket")]
    NoBucket {
        /// Which input.
        index: usize,
        /// Its leading dimension.
        n: usize,
    },
    /// An output read as another element type than its own.
    #[error("the output holds {found:?}, read as {expected:?}")]
    DType {
        /// Asked for.
        expected: DType,
        /// Held.
        found: DType,
    },
    /// The pool's live blocks differ from the outputs the tree holds (PyTorch's
    /// `check_memory_pool`).
    #[error(
        "These storage data ptrs are not allocated in pool {pool:?} but should be: {missing:?}; blocks allocated there and not tracked as outputs: {untracked:?}"
    )]
    PoolMismatch {
        /// The pool.
        pool: PoolId,
        /// Tracked outputs not allocated in the pool.
        missing: Vec<DevicePtr>,
        /// Allocated blocks no output tracks.
        untracked: Vec<DevicePtr>,
    },
    /// A plan ([`Trees::plan`](super::Trees::plan)) names a function that has not been
    /// warmed up: its requests are not known yet.
    #[error(
        "function {function} ({name}) has not been warmed up: a plan needs the requests of its warm-up"
    )]
    NotWarmedUp {
        /// The function id.
        function: u32,
        /// The wrapped function's name.
        name: String,
    },
    /// A bad setting.
    #[error("tree configuration: {0}")]
    Config(String),
    /// A capture or replay failed.
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// A device or stream error.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// The allocator refused.
    #[error(transparent)]
    Alloc(#[from] AllocError),
}

impl From<ferrocuda_driver::DriverError> for TreeError {
    fn from(e: ferrocuda_driver::DriverError) -> TreeError {
        TreeError::Graph(GraphError::Driver(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_texts_are_pytorchs() {
        let mutated = SkipReason::MutatedInputs {
            count: 1,
            found_from: "f: input 0".into(),
        };
        assert_eq!(
            mutated.to_string(),
            "skipping cudagraphs due to mutated inputs (1 instances). Found from : \n f: input 0"
        );
        let limit = SkipReason::RerecordLimit {
            function: 0,
            limit: 0,
            node: None,
            status: CheckStatus::StaticInputIdxMismatch,
        };
        assert_eq!(
            limit.to_string(),
            "skipping cudagraph due to function 0 exceeding max re-recording limit (=0) on cudagraph node None due to static input data pointer changed."
        );
        let devices = SkipReason::MultipleDevices {
            devices: vec![DeviceIndex(0), DeviceIndex(1)],
        };
        assert_eq!(
            devices.to_string(),
            "skipping cudagraphs due to multiple devices: device(type='cuda', index=0), device(type='cuda', index=1)"
        );
    }
}
