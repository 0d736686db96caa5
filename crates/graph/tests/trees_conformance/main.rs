//! CUDA-graph trees, written once over a backend: the fake device in CI, the real driver in
//! the GPU bundle (`#[ignore]`d without a GPU). PyTorch's `test_cudagraph_trees.py` cases in
//! spirit: warm-up then record then replay, outputs equal eager, a forward and backward in
//! one tree, branch switching with checkpoint restore, stale outputs, steps, static input
//! moves, mutation skips, shapes (cap, eviction, buckets), a panicking function, and
//! non-static inputs copied or patched.
#![forbid(unsafe_code)]
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_graph::CallableError;
use ferrocuda_graph::trees::{Arg, Ctx, Out, Served, TreeConfig, TreeTensor, Trees, WrapOptions};
use ferrocuda_stream::{DeviceBuffer, Function, Stream};
use ferrocuda_testkit::Harness;
use ferrocuda_types::{
    AllocatorConfig, DType, DeviceIndex, DevicePtr, KernelArg, LaunchConfig, PoolId,
};
use std::sync::Arc;

mod basics;
mod branches;
mod failures;
mod fuzz;
mod guards;
mod inputs;
mod plan;
mod shapes;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TestResult = Result<(), BoxError>;
const D0: DeviceIndex = DeviceIndex(0);
const N: usize = 1024;

/// The test kernels, launchable from wrapped functions.
#[derive(Clone, Debug)]
struct Kernels {
    scale: Function,
    add: Function,
    add_one: Function,
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n.max(1), 256)
}

impl Kernels {
    /// `y = a * x` over `n` elements.
    fn scale(
        &self,
        s: &Stream,
        y: &Out,
        x: KernelArg<'_>,
        a: f32,
        n: usize,
    ) -> Result<(), CallableError> {
        let n32 = n as u32;
        let args = [y.arg(), x, KernelArg::value(&a), KernelArg::value(&n32)];
        Ok(s.launch(&self.scale, &grid(n), &args)?)
    }
    /// `z = x + y`.
    fn add(
        &self,
        s: &Stream,
        z: &Out,
        x: KernelArg<'_>,
        y: KernelArg<'_>,
        n: usize,
    ) -> Result<(), CallableError> {
        let n32 = n as u32;
        let args = [z.arg(), x, y, KernelArg::value(&n32)];
        Ok(s.launch(&self.add, &grid(n), &args)?)
    }
    /// `x += 1` in place.
    fn add_one(&self, s: &Stream, x: KernelArg<'_>, n: usize) -> Result<(), CallableError> {
        let n32 = n as u32;
        Ok(s.launch(&self.add_one, &grid(n), &[x, KernelArg::value(&n32)])?)
    }

    /// `a * x` as a new output of the function.
    fn scaled(&self, ctx: &Ctx<'_>, x: &Arg, a: f32) -> Result<Out, CallableError> {
        let y = ctx.alloc_shape(DType::F32, x.shape())?;
        self.scale(ctx.stream(), &y, x.arg(), a, x.numel())?;
        Ok(y)
    }

    /// `x + y` as a new output of the function.
    fn sum(&self, ctx: &Ctx<'_>, x: &Arg, y: &Arg) -> Result<Out, CallableError> {
        let z = ctx.alloc_shape(DType::F32, x.shape())?;
        self.add(ctx.stream(), &z, x.arg(), y.arg(), x.numel())?;
        Ok(z)
    }
}

/// A harness with a caching allocator installed and the test kernels loaded.
struct Setup<'h> {
    h: &'h Harness,
    allocators: Arc<DeviceAllocators>,
    k: Kernels,
}

impl Setup<'_> {
    fn new(h: &Harness) -> Result<Setup<'_>, BoxError> {
        let allocators = DeviceAllocators::new(
            h.rt.driver().clone(),
            AllocatorConfig::default(),
            Caching::On,
        );
        allocators.install(&h.rt);
        // testkit's kernels: compiled by NVRTC on the real driver, their host twins
        // registered by the fake harness.
        let module = h.module()?;
        Ok(Setup {
            k: Kernels {
                scale: module.function("scale_f32")?,
                add: module.function("add_f32")?,
                add_one: module.function("add_one_f32")?,
            },
            h,
            allocators,
        })
    }

    fn trees(&self, config: TreeConfig) -> Result<Arc<Trees>, BoxError> {
        Ok(Trees::new(
            self.h.rt.clone(),
            self.allocators.clone(),
            D0,
            config,
        )?)
    }

    fn buffer(&self, values: &[f32]) -> Result<DeviceBuffer<f32>, BoxError> {
        Ok(DeviceBuffer::from_slice(&self.h.rt, D0, values)?)
    }

    /// Users of `pool` (the manager and each recorded graph).
    fn pool_users(&self, pool: PoolId) -> Result<Option<u32>, BoxError> {
        Ok(self.allocators.device(D0)?.pool_use_count(pool))
    }

    /// Bytes of the pool's segments, and the addresses of its allocated blocks.
    fn pool_state(&self, pool: PoolId) -> Result<(u64, Vec<DevicePtr>), BoxError> {
        let blocks = self.allocators.device(D0)?.pool_blocks(pool);
        let reserved = blocks.iter().map(|b| b.size).sum();
        let mut live: Vec<DevicePtr> = blocks
            .iter()
            .filter(|b| b.allocated)
            .map(|b| b.ptr)
            .collect();
        live.sort_unstable_by_key(|p| p.0);
        Ok((reserved, live))
    }
}

/// Deterministic pseudo-random values in [-4, 4) (xorshift).
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

/// Checks an output against host values.
fn expect(t: &TreeTensor, expected: &[f32], what: &str) -> TestResult {
    let got = t.to_host::<f32>()?;
    match got.iter().zip(expected).position(|(a, b)| a != b) {
        None if got.len() == expected.len() => Ok(()),
        None => Err(format!("{what}: {} values, expected {}", got.len(), expected.len()).into()),
        Some(i) => Err(format!(
            "{what}: element {i} is {}, expected {}",
            got[i], expected[i]
        )
        .into()),
    }
}

fn named(name: &str) -> WrapOptions {
    WrapOptions {
        name: name.into(),
        ..WrapOptions::default()
    }
}

fn served_kinds(calls: &[Served]) -> Vec<&'static str> {
    calls
        .iter()
        .map(|s| match s {
            Served::Warmup => "warmup",
            Served::Recorded => "recorded",
            Served::Replayed => "replayed",
            Served::Eager(_) => "eager",
        })
        .collect()
}

use basics::{
    an_output_passed_into_the_next_step_is_stale, forward_backward_share_one_tree,
    heuristic_generations_follow_pending_backwards, stale_outputs_are_errors,
    warmup_record_replay_matches_eager,
};
use branches::{branch_switching_restores_the_checkpoint, static_input_move_rerecords};
use failures::{
    a_shape_past_its_buffer_is_refused, incompatible_op_and_uncached_allocator_skip,
    mutating_a_copied_input_skips, mutating_a_warmup_output_is_graphed,
    panic_or_error_leaves_the_tree_usable,
};
use fuzz::random_tree_programs_never_give_wrong_data;
use guards::{
    guards_follow_the_autocast_state, guards_recompile_limit_runs_eagerly,
    guards_recompile_once_then_go_dynamic, refused_calls_leave_no_trace,
};
use inputs::{
    an_unpatchable_recording_copies_from_then_on, auto_feed_patches_large_and_reused_inputs,
    copied_inputs_are_copied_by_the_graph, kept_instances_serve_inputs_that_come_back,
    patched_inputs_match_copied_inputs_and_eager,
};
use plan::{
    a_plan_without_a_warm_up_is_a_typed_error, the_plan_equals_the_trees_pool_after_each_recording,
};
use shapes::{
    buckets_pad_to_few_recordings, evicting_a_sibling_keeps_the_live_branch,
    only_capture_sizes_are_graphed, shapes_record_per_size_and_the_cap_evicts,
};

ferrocuda_testkit::both_backends!(
    warmup_record_replay_matches_eager,
    forward_backward_share_one_tree,
    stale_outputs_are_errors,
    heuristic_generations_follow_pending_backwards,
    branch_switching_restores_the_checkpoint,
    static_input_move_rerecords,
    mutating_a_copied_input_skips,
    panic_or_error_leaves_the_tree_usable,
    incompatible_op_and_uncached_allocator_skip,
    a_shape_past_its_buffer_is_refused,
    shapes_record_per_size_and_the_cap_evicts,
    buckets_pad_to_few_recordings,
    only_capture_sizes_are_graphed,
    guards_recompile_once_then_go_dynamic,
    guards_follow_the_autocast_state,
    guards_recompile_limit_runs_eagerly,
    patched_inputs_match_copied_inputs_and_eager,
    auto_feed_patches_large_and_reused_inputs,
    an_unpatchable_recording_copies_from_then_on,
    kept_instances_serve_inputs_that_come_back,
    copied_inputs_are_copied_by_the_graph,
    an_output_passed_into_the_next_step_is_stale,
    mutating_a_warmup_output_is_graphed,
    refused_calls_leave_no_trace,
    random_tree_programs_never_give_wrong_data,
    evicting_a_sibling_keeps_the_live_branch,
    the_plan_equals_the_trees_pool_after_each_recording,
    a_plan_without_a_warm_up_is_a_typed_error,
);
