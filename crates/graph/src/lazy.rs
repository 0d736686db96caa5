//! Lazy capture under a byte budget: a graph per key (a batch size, a shape), captured the
//! first time the key is run, replayed after; when a new key's graph would not fit in the
//! budget, the least recently used graphs are dropped first.
//!
//! A new key is warmed up once, eagerly on a side stream, with its allocation requests
//! recorded ([`CachingAllocator::record_requests`]); [`plan_pool`] turns them into the bytes
//! its capture's pool will reserve, before anything is captured. So the budget holds
//! before the capture, not after an out-of-memory error (vLLM captures every size up
//! front and can only estimate: vllm#53013, vllm#57475). Each key has a pool of its own, so
//! dropping a graph gives its memory back to the driver at once.
//!
//! [`CachingAllocator::record_requests`]: ferrocuda_alloc::CachingAllocator::record_requests
use crate::{CaptureMode, CudaGraph, GraphError};
use ferrocuda_alloc::{AfterCapture, CachingAllocator, DeviceAllocators, plan_pool};
use ferrocuda_stream::{Runtime, Stream};
use ferrocuda_types::DeviceIndex;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;

/// What a [`LazyGraphs`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LazyStats {
    /// Keys warmed up and captured.
    pub captures: u64,
    /// Runs served by a replay of a held graph.
    pub replays: u64,
    /// Graphs dropped to make room.
    pub evictions: u64,
}

/// One key's graph, the outputs its capture allocated, and its pool's bytes.
#[derive(Debug)]
struct Held<T> {
    /// Declared before the graph: the outputs go back to the pool before the pool goes.
    outputs: T,
    graph: CudaGraph,
    reserved: u64,
    last_used: u64,
}

/// Graphs captured on first use per key and replayed after, within a byte budget for their
/// pools (see the module's text).
#[derive(Debug)]
pub struct LazyGraphs<K, T> {
    runtime: Arc<Runtime>,
    allocators: Arc<DeviceAllocators>,
    device: DeviceIndex,
    budget: u64,
    warmup_stream: Stream,
    held: HashMap<K, Held<T>>,
    clock: u64,
    stats: LazyStats,
}

impl<K: Hash + Eq + Clone, T> LazyGraphs<K, T> {
    /// Graphs of `device` whose pools together reserve at most `budget` bytes, captured
    /// through `allocators` (installed as `runtime`'s memory resource).
    pub fn new(
        runtime: Arc<Runtime>,
        allocators: Arc<DeviceAllocators>,
        device: DeviceIndex,
        budget: u64,
    ) -> Result<LazyGraphs<K, T>, GraphError> {
        runtime.check_device(device)?;
        allocators.device(device)?;
        let warmup_stream = runtime.new_stream(device, 0)?;
        Ok(LazyGraphs {
            runtime,
            allocators,
            device,
            budget,
            warmup_stream,
            held: HashMap::new(),
            clock: 0,
            stats: LazyStats::default(),
        })
    }

    /// Runs `work` for `key` on `stream` and returns the outputs it allocated: by a replay
    /// if `key`'s graph is held; else `work` is warmed up (run once eagerly on a side
    /// stream, its outputs dropped), its pool planned, the least recently used graphs
    /// dropped until the plan fits the budget, `work` captured (it must enqueue its work
    /// on the stream it is given and allocate its outputs there) and replayed on `stream`.
    ///
    /// A key whose plan alone exceeds the budget is [`GraphError::OverBudget`], with no
    /// graph dropped; a failed warm-up leaves the held graphs as they were, a failed
    /// capture leaves no graph for `key` (graphs dropped to make room for it stay dropped).
    pub fn run<E: From<GraphError>>(
        &mut self,
        key: K,
        stream: &Stream,
        mut work: impl FnMut(&Stream) -> Result<T, E>,
    ) -> Result<&T, E> {
        self.clock += 1;
        if self.held.contains_key(&key) {
            let held = self.held.get_mut(&key).ok_or(GraphError::NothingCaptured)?;
            held.graph.replay(stream)?;
            held.last_used = self.clock;
            self.stats.replays += 1;
            return Ok(&held.outputs);
        }
        let planned = self.warm_up(&mut work)?;
        if planned > self.budget {
            return Err(GraphError::OverBudget {
                planned,
                budget: self.budget,
            }
            .into());
        }
        while self.held_bytes() + planned > self.budget {
            self.evict_least_recent()?;
        }
        let graph = CudaGraph::new(self.runtime.clone(), self.allocators.clone(), self.device)?;
        let capture = graph.capture(None, None, CaptureMode::ThreadLocal)?;
        let outputs = work(capture.stream())?;
        capture.end()?;
        let pool = graph.pool().ok_or(GraphError::NothingCaptured)?;
        let reserved = self.allocator()?.pool_reserved_bytes(pool);
        graph.replay(stream)?;
        self.stats.captures += 1;
        let held = Held {
            outputs,
            graph,
            reserved,
            last_used: self.clock,
        };
        Ok(&self.held.entry(key).insert_entry(held).into_mut().outputs)
    }

    /// Runs `work` once eagerly on the side stream with its requests recorded; returns the
    /// bytes its capture's pool will reserve.
    fn warm_up<E: From<GraphError>>(
        &self,
        work: &mut impl FnMut(&Stream) -> Result<T, E>,
    ) -> Result<u64, E> {
        let allocator = self.allocator()?;
        let (outputs, requests) = {
            let _current = self
                .runtime
                .stream_guard(&self.warmup_stream)
                .map_err(GraphError::from)?;
            allocator.record_requests(&[], || work(&self.warmup_stream))
        };
        drop(outputs?);
        let plan = plan_pool(&allocator.config(), &[requests], AfterCapture::KeepOutputs)
            .map_err(GraphError::from)?;
        Ok(plan.reserved_bytes)
    }

    fn allocator(&self) -> Result<&CachingAllocator, GraphError> {
        Ok(self.allocators.device(self.device)?)
    }

    /// Drops the least recently used graph and gives its pool's memory back.
    fn evict_least_recent(&mut self) -> Result<(), GraphError> {
        let Some(key) = self
            .held
            .iter()
            .min_by_key(|(_, h)| h.last_used)
            .map(|(k, _)| k.clone())
        else {
            return Ok(());
        };
        self.evict(&key).map(|_| ())
    }

    /// Drops `key`'s graph and its outputs, and gives its pool's memory back to the driver;
    /// whether it was held.
    pub fn evict(&mut self, key: &K) -> Result<bool, GraphError> {
        let Some(held) = self.held.remove(key) else {
            return Ok(false);
        };
        let pool = held.graph.pool();
        drop(held);
        if let Some(pool) = pool {
            self.allocator()?.empty_cache_pool(pool);
        }
        self.stats.evictions += 1;
        Ok(true)
    }

    /// Whether `key`'s graph is held.
    pub fn contains(&self, key: &K) -> bool {
        self.held.contains_key(key)
    }

    /// The held keys, least recently used first.
    pub fn keys_by_use(&self) -> Vec<K> {
        let mut keys: Vec<(&K, u64)> = self.held.iter().map(|(k, h)| (k, h.last_used)).collect();
        keys.sort_by_key(|(_, t)| *t);
        keys.into_iter().map(|(k, _)| k.clone()).collect()
    }

    /// Bytes the held graphs' pools reserve (as measured after each capture).
    pub fn held_bytes(&self) -> u64 {
        self.held.values().map(|h| h.reserved).sum()
    }

    /// The budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Captures, replays and evictions so far.
    pub fn stats(&self) -> LazyStats {
        self.stats
    }
}
