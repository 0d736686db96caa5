//! How a tree manager and each wrapped function behave: the knobs of PyTorch's
//! `torch._inductor.config.triton.cudagraph_*` that apply to closures over device buffers,
//! with PyTorch's defaults, plus the choices PyTorch does not offer (explicit steps, a cap
//! on recorded shapes, bucketing).
use super::errors::TreeError;
use crate::guards::CacheConfig;

/// When a new generation (step) may start, ending the current path and invalidating the
/// outputs still held from it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum GenerationPolicy {
    /// Only [`Trees::mark_step_begin`](super::Trees::mark_step_begin) starts a new step:
    /// the contract this crate recommends (PyTorch's `cudagraph_mark_step_begin`).
    #[default]
    Explicit,
    /// PyTorch's heuristic (`torch/_inductor/cudagraph_trees.py`,
    /// `can_start_new_generation`): every call of a wrapped function is a new generation,
    /// except while a [`FunctionMode::Forward`] call waits for its
    /// [`FunctionMode::Backward`]; `mark_step_begin` still forces a step. A heuristic: it
    /// misfires for inference with pending backwards, recursion, or a backward that never
    /// runs.
    Heuristic,
}

/// What a wrapped function is, for the generation heuristic (`CompilationMode`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum FunctionMode {
    /// Neither: its calls neither open nor close a pending backward.
    #[default]
    Inference,
    /// A forward whose backward will follow: until it runs, no new generation starts
    /// under [`GenerationPolicy::Heuristic`].
    Forward,
    /// The backward of a [`FunctionMode::Forward`].
    Backward,
}

/// Inputs below this size are copied before a replay rather than patched into the graph,
/// unless they come at the address the graph reads already or at the previous call's
/// ([`InputFeed::Auto`]'s default). Measured on an H100 (`crates/graph/benches/trees.rs`,
/// `docs/measurements/bundle_h100_2026-11-23f.log`): one graph update costs 48 to 59 us of
/// CPU time whatever the size, while a copy costs 9 to 10 us of CPU time from 4 KiB to
/// 4 MiB (it is asynchronous) plus its GPU time, about 45 us for 64 MiB at the 3 TB/s a
/// device-to-device copy reaches there. So a moving input is worth patching from about
/// 64 MiB; below that the copy is cheaper (on the fake device, whose copies run on the
/// host, the two cross near 16 KiB instead).
pub const PATCH_MIN_BYTES: u64 = 64 << 20;

/// How a replay feeds a non-static input (one that is not a live tree output used in
/// place) to its recording. Outputs and semantics are the same either way: see
/// `docs/graphs.md`, "Trees".
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum InputFeed {
    /// Copy it into the recording's static input at each replay (PyTorch's way). Unless
    /// the function's inputs are padded to buckets, the copy is the recording graph's own
    /// first node, pointed at the caller's buffer when that moves: a replay with the same
    /// buffer enqueues only the launch.
    Copy,
    /// Repoint the recording's graph at the caller's buffer
    /// ([`CudaGraph::update_input_ptrs`](crate::CudaGraph::update_input_ptrs)) whenever
    /// it can be; a call with the buffer the graph reads already costs nothing.
    Patch,
    /// Patch an input of at least `min_bytes`, or one at the address the graph reads
    /// already or at the previous call's (a reused buffer: one update, then nothing);
    /// copy the others.
    Auto {
        /// The size from which an input that moves is patched rather than copied.
        min_bytes: u64,
    },
}

impl Default for InputFeed {
    fn default() -> InputFeed {
        InputFeed::Auto {
            min_bytes: PATCH_MIN_BYTES,
        }
    }
}

/// Per-device settings of a tree manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeConfig {
    /// Eager runs of each (function, shape) before it is recorded (PyTorch warms up once).
    pub warmup_runs: u32,
    /// When steps begin.
    pub generations: GenerationPolicy,
    /// Re-recordings of one function under one node for a changed static or managed input
    /// address before the function runs eagerly there
    /// (`triton.cudagraph_unexpected_rerecord_limit`, 128; enforced always, as on
    /// PyTorch's main branch).
    pub rerecord_limit: u32,
    /// Raise a skip as [`TreeError::Skipped`] instead of running eagerly
    /// (`triton.cudagraph_or_error`).
    pub cudagraph_or_error: bool,
    /// After each checkpoint restore, check that the pool's live blocks are exactly the
    /// outputs the tree holds (`triton.slow_path_cudagraph_asserts`, on).
    pub slow_path_asserts: bool,
    /// Functions whose inputs come in more than one shape run eagerly
    /// (`triton.cudagraph_skip_dynamic_graphs`, off).
    pub skip_dynamic_graphs: bool,
    /// Warn once a wrapped function has seen more distinct shapes than this
    /// (`triton.cudagraph_dynamic_shape_warn_limit`, 8; `None` silences it).
    pub dynamic_shape_warn_limit: Option<usize>,
    /// How replays feed non-static inputs: copied, or patched into the graph (beyond
    /// PyTorch, which copies); [`InputFeed::Auto`] by default.
    pub input_feed: InputFeed,
    /// Instances of each recording's graph kept, each holding the input addresses last
    /// patched into it ([`CudaGraph::keep_instances`](crate::CudaGraph::keep_instances)):
    /// with 2, inputs patched from two buffers in turn cost no graph update once each was
    /// seen. Beyond PyTorch; 2 by default (1: one instance, updated at every move).
    pub kept_instances: usize,
}

impl Default for TreeConfig {
    fn default() -> TreeConfig {
        TreeConfig {
            warmup_runs: 1,
            generations: GenerationPolicy::Explicit,
            rerecord_limit: 128,
            cudagraph_or_error: false,
            slow_path_asserts: true,
            skip_dynamic_graphs: false,
            dynamic_shape_warn_limit: Some(8),
            input_feed: InputFeed::default(),
            kept_instances: 2,
        }
    }
}

/// Pads the leading dimension of non-static inputs up to the next of a few sizes, so that
/// a function sees (and records for) only those sizes (beyond PyTorch, whose users pad by
/// hand: #105064). The padding rows are zero; outputs have the padded size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buckets {
    sizes: Vec<usize>,
}

impl Buckets {
    /// Buckets at `sizes` (any order; at least one, none zero).
    pub fn new(sizes: &[usize]) -> Result<Buckets, TreeError> {
        let mut sizes = sizes.to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.first().is_none_or(|&s| s == 0) {
            return Err(TreeError::Config(
                "buckets need at least one size, and no size 0".into(),
            ));
        }
        Ok(Buckets { sizes })
    }

    /// The bucket a leading dimension of `n` pads to, if one is large enough.
    pub fn bucket(&self, n: usize) -> Option<usize> {
        self.sizes.iter().copied().find(|&s| s >= n)
    }
}

/// How one wrapped function is treated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WrapOptions {
    /// A name for messages (PyTorch names functions by id: `function 0`).
    pub name: String,
    /// For the generation heuristic.
    pub mode: FunctionMode,
    /// Indices of the inputs the function writes (`mutated_input_idxs`). Writing a static
    /// or tree-managed input is recorded in place; writing any other input would be lost
    /// on the copy, so the call runs eagerly ("mutated inputs").
    pub mutated_inputs: Vec<usize>,
    /// Recordings kept per wrapped function, one per input shape; the least recently used
    /// is evicted beyond it (`None`: unbounded, as PyTorch).
    pub max_recorded_shapes: Option<usize>,
    /// Pad the leading dimension of non-static inputs to these sizes.
    pub buckets: Option<Buckets>,
    /// The guarded specialisations in front of the shape cache: Dynamo's recompile limits
    /// and automatic dynamic shapes ([`crate::guards`]).
    pub guards: CacheConfig,
    /// Only these sizes are graphed (`triton.cudagraph_capture_sizes`): each entry lists
    /// the leading dimension (after bucketing) of every non-static input, in order; calls
    /// of other sizes run eagerly ([`SkipReason::CaptureSize`](super::SkipReason)).
    /// `None`: every size is graphed.
    pub capture_sizes: Option<Vec<Vec<usize>>>,
    /// The number of inputs every call passes (a Python function's arity); `None`: the
    /// number of the first call that is not refused. A call with another number is
    /// [`TreeError::InputCount`], refused before the guards as Python refuses a wrong
    /// argument count before Dynamo sees the frame.
    pub num_inputs: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_pad_to_the_next_size_and_refuse_empty_lists() {
        let b = Buckets::new(&[8, 2, 4, 4]).unwrap();
        let got: Vec<_> = [1, 2, 3, 8, 9].iter().map(|&n| b.bucket(n)).collect();
        assert_eq!(got, [Some(2), Some(2), Some(4), Some(8), None]);
        assert!(Buckets::new(&[]).is_err());
        assert!(Buckets::new(&[0, 4]).is_err());
    }
}
