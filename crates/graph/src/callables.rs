//! Graphed callables (`torch.cuda.make_graphed_callables`) for closures over device buffers.
use crate::{CaptureMemory, CudaGraph, GraphError};
use ferrocuda_stream::{DeviceBuffer, Runtime, StreamError};
use ferrocuda_types::{CaptureMode, DeviceIndex, Element, PoolId};
use parking_lot::Mutex;
use std::sync::Arc;

/// What a graphed closure returns when it fails.
pub type CallableError = Box<dyn std::error::Error + Send + Sync>;

/// A closure to graph: it reads its inputs, enqueues work on the current stream, and returns
/// its outputs (allocated inside it, so that in the capture they come from the shared pool).
pub type Callable<'a, T> =
    Box<dyn FnMut(&[DeviceBuffer<T>]) -> Result<Vec<DeviceBuffer<T>>, CallableError> + 'a>;

/// How [`make_graphed_callables`] warms up and captures.
#[derive(Clone, Copy, Debug)]
pub struct GraphedOptions {
    /// Eager iterations of each callable on the side stream before capturing (PyTorch's
    /// `num_warmup_iters`, 3): lazy initialisation stays out of the graph.
    pub warmup_iters: usize,
    /// The pool all the graphs share; `None` makes a new one (`graph_pool_handle()`).
    pub pool: Option<PoolId>,
    /// The capture mode.
    pub mode: CaptureMode,
}

impl Default for GraphedOptions {
    fn default() -> GraphedOptions {
        GraphedOptions {
            warmup_iters: 3,
            pool: None,
            mode: CaptureMode::ThreadLocal,
        }
    }
}

/// One captured callable: its graph and its static inputs and outputs.
#[derive(Debug)]
struct Graphed<T: Element> {
    graph: CudaGraph,
    inputs: Vec<DeviceBuffer<T>>,
    outputs: Vec<DeviceBuffer<T>>,
}

/// Callables captured, in order, into one shared pool. Call them in that order (0, 1, …,
/// n−1, then 0 again): a later graph may reuse memory an earlier one freed, so out-of-order
/// replays corrupt each other's buffers. Debug builds check the order and return
/// [`GraphError::ReplayOrder`].
#[derive(Debug)]
pub struct GraphedCallables<T: Element> {
    graphed: Vec<Graphed<T>>,
    pool: PoolId,
    next: Mutex<usize>,
}

/// Captures `callables` into graphs sharing one pool (`make_graphed_callables`). Each
/// callable's `sample_inputs` become its static inputs. The device is synchronized, each
/// callable runs `warmup_iters` times eagerly on a side stream, then each is captured, in
/// order, on that stream.
pub fn make_graphed_callables<T: Element>(
    runtime: &Arc<Runtime>,
    memory: impl Into<CaptureMemory>,
    device: DeviceIndex,
    mut callables: Vec<Callable<'_, T>>,
    sample_inputs: Vec<Vec<DeviceBuffer<T>>>,
    options: GraphedOptions,
) -> Result<GraphedCallables<T>, GraphError> {
    let memory = memory.into();
    if callables.len() != sample_inputs.len() {
        return Err(GraphError::SampleCount {
            callables: callables.len(),
            samples: sample_inputs.len(),
        });
    }
    let callable_failed = |index: usize| {
        move |e: CallableError| GraphError::Callable {
            index,
            message: e.to_string(),
        }
    };
    runtime.synchronize(device)?;
    let side = runtime.stream_from_pool(device, false)?;
    {
        let _on_side = runtime.stream_guard(&side)?;
        for (i, (f, inputs)) in callables.iter_mut().zip(&sample_inputs).enumerate() {
            for _ in 0..options.warmup_iters {
                drop(f(inputs).map_err(callable_failed(i))?);
            }
        }
    }
    runtime.synchronize(device)?;
    let pool = options.pool.unwrap_or_else(PoolId::handle);
    let mut graphed = Vec::with_capacity(callables.len());
    for (i, (f, inputs)) in callables.iter_mut().zip(sample_inputs).enumerate() {
        let graph = CudaGraph::new(runtime.clone(), memory.clone(), device)?;
        let capture = graph.capture(Some(&side), Some(pool), options.mode)?;
        let outputs = f(&inputs).map_err(callable_failed(i))?;
        capture.end()?;
        graphed.push(Graphed {
            graph,
            inputs,
            outputs,
        });
    }
    Ok(GraphedCallables {
        graphed,
        pool,
        next: Mutex::new(0),
    })
}

impl<T: Element> GraphedCallables<T> {
    /// Number of callables.
    pub fn len(&self) -> usize {
        self.graphed.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.graphed.is_empty()
    }

    /// The pool the graphs share.
    pub fn pool(&self) -> PoolId {
        self.pool
    }

    /// The static inputs of callable `index` (write them in place to avoid the copy).
    pub fn inputs(&self, index: usize) -> Result<&[DeviceBuffer<T>], GraphError> {
        Ok(&self.get(index)?.inputs)
    }

    /// Runs callable `index` on the current stream, as PyTorch does: copies each of `inputs`
    /// that is not already the static input into it, replays the graph, and returns the
    /// static outputs (the same buffers every call: copy them out before the next call if
    /// they must be kept). A refused call (wrong count or length of inputs, out of order)
    /// changes nothing: no input is copied and the replay order does not advance.
    pub fn call(
        &self,
        index: usize,
        inputs: &[&DeviceBuffer<T>],
    ) -> Result<&[DeviceBuffer<T>], GraphError> {
        let g = self.get(index)?;
        if inputs.len() != g.inputs.len() {
            return Err(GraphError::InputCount {
                expected: g.inputs.len(),
                found: inputs.len(),
            });
        }
        if let Some((static_input, input)) = g
            .inputs
            .iter()
            .zip(inputs)
            .find(|(s, i)| s.len() != i.len())
        {
            return Err(StreamError::LengthMismatch {
                expected: static_input.len(),
                found: input.len(),
            }
            .into());
        }
        // Held until the replay is enqueued: the order advances only for a call that ran.
        let mut next = cfg!(debug_assertions).then(|| self.next.lock());
        if let Some(expected) = next.as_deref().copied()
            && expected != index
        {
            return Err(GraphError::ReplayOrder {
                expected,
                found: index,
            });
        }
        let stream = g.graph.runtime().current_stream(g.graph.device())?;
        for (static_input, input) in g.inputs.iter().zip(inputs) {
            if static_input.ptr() != input.ptr() {
                static_input.copy_from(input)?;
            }
        }
        g.graph.replay(&stream)?;
        if let Some(next) = next.as_deref_mut() {
            *next = (index + 1) % self.graphed.len();
        }
        Ok(&g.outputs)
    }

    fn get(&self, index: usize) -> Result<&Graphed<T>, GraphError> {
        self.graphed.get(index).ok_or(GraphError::NoSuchCallable {
            index,
            count: self.graphed.len(),
        })
    }
}
