//! CUDA graphs with private pools, written once over a backend: the fake device in CI, the
//! real driver in the GPU bundle (`#[ignore]`d without a GPU: skipped, with the reason).
//! The `torch.cuda.graph` example, pool routing and lifetime, the capture rules as typed
//! errors, a capture left by a panic or a `?`, pool sharing, fork/join, THREAD_LOCAL
//! captures, graphed callables, exact memory statistics, graph-safe Philox RNG, the
//! driver's view of graph nodes and `update_inputs` (typed and by raw address), and
//! captures under `backend:cudaMallocAsync`, a graph over a sleepable pool, and the
//! graph-memory planner against a decode loop's captures, and lazy capture under a budget.
#![forbid(unsafe_code)]
use ferrocuda_alloc::{Caching, DeviceAllocators};
use ferrocuda_graph::{CudaGraph, GraphError, PoolId, register_fake_philox};
use ferrocuda_stream::{DeviceBuffer, Function, Module, Stream};
use ferrocuda_testkit::{Harness, KERNELS};
use ferrocuda_types::{AllocatorConfig, DeviceIndex, KernelArg, LaunchConfig};
use std::sync::Arc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type TestResult = Result<(), BoxError>;
const D0: DeviceIndex = DeviceIndex(0);
const N: usize = 1024;

/// A harness with a caching allocator installed, and a graph over it.
struct Setup<'h> {
    h: &'h Harness,
    allocators: Arc<DeviceAllocators>,
    scale: Function,
    add_one: Function,
}

impl Setup<'_> {
    fn new(h: &Harness) -> Result<Setup<'_>, BoxError> {
        if let Some(fake) = &h.fake {
            register_fake_philox(fake);
        }
        let allocators = DeviceAllocators::new(
            h.rt.driver().clone(),
            AllocatorConfig::default(),
            Caching::On,
        );
        allocators.install(&h.rt);
        let module = Module::from_cuda_source(&h.rt, D0, "graph_conformance", KERNELS)?;
        Ok(Setup {
            scale: module.function("scale_f32")?,
            add_one: module.function("add_one_f32")?,
            h,
            allocators,
        })
    }

    fn graph(&self) -> Result<CudaGraph, GraphError> {
        CudaGraph::new(self.h.rt.clone(), self.allocators.clone(), D0)
    }

    fn buffer(&self, value: f32) -> Result<DeviceBuffer<f32>, BoxError> {
        Ok(DeviceBuffer::filled(&self.h.rt, D0, N, value)?)
    }

    /// `y = a * x` on `stream`.
    fn scale(
        &self,
        stream: &Stream,
        y: &DeviceBuffer<f32>,
        x: &DeviceBuffer<f32>,
        a: f32,
    ) -> TestResult {
        let n = N as u32;
        let args = [y.arg(), x.arg(), KernelArg::value(&a), KernelArg::value(&n)];
        Ok(stream.launch(&self.scale, &LaunchConfig::for_elements(N, 256), &args)?)
    }

    /// `x += 1` on `stream`.
    fn add_one(&self, stream: &Stream, x: &DeviceBuffer<f32>) -> TestResult {
        let n = N as u32;
        let args = [x.arg(), KernelArg::value(&n)];
        Ok(stream.launch(&self.add_one, &LaunchConfig::for_elements(N, 256), &args)?)
    }

    fn pool_users(&self, pool: PoolId) -> Result<Option<u32>, BoxError> {
        Ok(self.allocators.device(D0)?.pool_use_count(pool))
    }

    fn in_pool(&self, pool: PoolId, buf: &DeviceBuffer<f32>) -> Result<bool, BoxError> {
        let blocks = self.allocators.device(D0)?.pool_blocks(pool);
        Ok(blocks.iter().any(|b| b.allocated && b.ptr == buf.ptr()))
    }

    /// Checks that every element of `buf` is `expected`, after `stream`'s work.
    fn expect(
        &self,
        stream: &Stream,
        buf: &DeviceBuffer<f32>,
        expected: f32,
        what: &str,
    ) -> TestResult {
        stream.synchronize()?;
        let values = buf.to_host()?;
        match values.iter().position(|&v| v != expected) {
            None => Ok(()),
            Some(i) => {
                Err(format!("{what}: element {i} is {}, expected {expected}", values[i]).into())
            }
        }
    }
}

mod async_backend;
mod async_scenarios;
mod callables;
mod capture;
mod lazy;
mod mlp;
mod nodes;
mod plan;
mod pools;
mod rng;
mod sleep;
mod update_inputs;

use async_backend::{
    async_capture_defers_uncaptured_frees_one_capture_at_a_time,
    async_capture_left_without_end_ends_the_allocators, async_capture_replays_into_graph_memory,
    async_graphed_callables_chain, async_stats_during_a_capture_invalidate_it,
};
use callables::{graphed_callable_refused_call_changes_nothing, graphed_callables_chain};
use capture::{
    a_capture_left_without_end_is_discarded, capture_memory_outlives_reset,
    capture_rules_are_typed_errors, concurrent_replay_with_separate_pools,
    forked_streams_join_the_capture, graph_memory_stats_after_destroy,
    graph_replays_on_static_buffers, graphs_share_a_pool, record_stream_during_capture_defers_free,
    thread_local_capture_ignores_other_threads, three_graphs_share_one_segment,
};
use lazy::{a_size_over_the_whole_budget_is_refused, lazy_capture_keeps_to_its_budget};
use mlp::mlp_step_whole_and_partial_capture;
use nodes::graph_nodes_are_read_and_set;
use plan::{
    the_plan_equals_a_decode_loops_captures, the_plan_equals_captures_that_free_their_outputs,
};
use pools::{
    capture_empties_the_cache_first, captures_sharing_a_pool_share_a_stream,
    recapture_loop_keeps_memory_flat,
};
use rng::rng_replays_match_eager;
use sleep::a_graph_over_a_sleeping_pool_replays_after_wake;
use update_inputs::{
    kept_instances_serve_the_addresses_they_hold, update_input_ptrs_repoints_by_address,
    update_inputs_patches_pointers, update_inputs_refuses_a_node_it_cannot_repoint,
    update_inputs_repoints_interior_pointers, update_inputs_repoints_memset_and_memcpy,
};

ferrocuda_testkit::both_backends!(
    graph_replays_on_static_buffers,
    capture_memory_outlives_reset,
    capture_rules_are_typed_errors,
    a_capture_left_without_end_is_discarded,
    graphs_share_a_pool,
    forked_streams_join_the_capture,
    thread_local_capture_ignores_other_threads,
    graphed_callables_chain,
    graphed_callable_refused_call_changes_nothing,
    graph_memory_stats_after_destroy,
    record_stream_during_capture_defers_free,
    concurrent_replay_with_separate_pools,
    rng_replays_match_eager,
    graph_nodes_are_read_and_set,
    update_inputs_patches_pointers,
    update_inputs_repoints_memset_and_memcpy,
    update_inputs_repoints_interior_pointers,
    update_inputs_refuses_a_node_it_cannot_repoint,
    update_input_ptrs_repoints_by_address,
    kept_instances_serve_the_addresses_they_hold,
    mlp_step_whole_and_partial_capture,
    three_graphs_share_one_segment,
    capture_empties_the_cache_first,
    captures_sharing_a_pool_share_a_stream,
    recapture_loop_keeps_memory_flat,
    a_graph_over_a_sleeping_pool_replays_after_wake,
    the_plan_equals_a_decode_loops_captures,
    the_plan_equals_captures_that_free_their_outputs,
    lazy_capture_keeps_to_its_budget,
    a_size_over_the_whole_budget_is_refused,
    async_capture_replays_into_graph_memory,
    async_capture_defers_uncaptured_frees_one_capture_at_a_time,
    async_capture_left_without_end_ends_the_allocators,
    async_graphed_callables_chain,
    async_stats_during_a_capture_invalidate_it,
);
