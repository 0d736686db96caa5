//! How many bytes a CUDA graph capture's private pool will reserve, told before capturing.
//!
//! A capture's pool takes segments by the allocator's rules (PyTorch's `get_allocation_size`
//! and best fit inside the pool), so its size is decided by the sequence of requests the
//! capture makes and nothing else: the pool starts empty and no other allocation is served
//! from it. The plan replays that sequence through this crate's own allocator, with the
//! caller's configuration, over a fake device that keeps no bytes: the same rules that
//! serve the real capture, so the same segments. The sequence comes from a warm-up run
//! (what `torch.cuda.graph` users and CUDA-graph trees run before capturing), recorded as
//! `record_memory_history(enabled="all")` records it, or is written by hand.
//!
//! Several captures sharing one pool (vLLM's batch sizes, a tree's paths) are planned as they
//! run: one after the other in one pool, the blocks each leaves allocated (its outputs) kept
//! or freed before the next begins ([`AfterCapture`]). A pool that holds segments already
//! (CUDA-graph trees warm up in theirs, and record into it step after step) is planned from
//! its layout ([`CachingAllocator::pool_layout`], [`plan_pool_from`]): its segments, in
//! address order, and the blocks live in them.
//!
//! What the plan cannot see: a real capture that runs out of device memory, and the pool's
//! segments that another allocation's out-of-memory retry releases (neither happens to a
//! capture that fits). Blocks a capture frees that were used on other streams go back to the
//! pool when the capture ends (PyTorch's `insert_events_deferred_until_no_capture`), which a
//! trace shows as a `free_completed` that does not follow its `free_requested` at once.
use crate::history::HistoryOptions;
use crate::state::Request;
use crate::{AllocError, Caching, CachingAllocator, Route};
use ferrocuda_driver::{Driver, FakeDriver};
use ferrocuda_types::{
    AllocatorConfig, BlockCheckpoint, DeviceIndex, DevicePtr, PoolCheckpoint, PoolId,
    SegmentCheckpoint, StreamFlags, StreamHandle, TraceEntry,
};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// One request of a capture, as the plan replays it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlannedRequest {
    /// Allocates `bytes` (as requested, before rounding) on stream `stream` (any key:
    /// requests with equal keys, in this capture or another of the plan, are on one
    /// stream); the block is known as `block` afterwards.
    Alloc {
        /// The block's number in this capture.
        block: usize,
        /// Requested bytes.
        bytes: u64,
        /// The stream's key.
        stream: u64,
    },
    /// Frees block `block` now.
    Free {
        /// The block's number in this capture.
        block: usize,
    },
    /// Frees block `block` when the capture ends (it was used on another stream).
    FreeAtEnd {
        /// The block's number in this capture.
        block: usize,
    },
}

/// The requests one capture makes, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaptureRequests {
    requests: Vec<PlannedRequest>,
    blocks: usize,
}

/// A request naming a block the capture did not allocate, or freed twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("block {block} is not allocated by this capture at request {at}")]
pub struct UnknownBlock {
    /// The block named.
    pub block: usize,
    /// Its request's position.
    pub at: usize,
}

impl CaptureRequests {
    /// No requests yet.
    pub fn new() -> CaptureRequests {
        CaptureRequests::default()
    }

    /// Adds a request of `bytes` on stream `stream` (a key, see
    /// [`PlannedRequest::Alloc`]); returns the block's number.
    pub fn alloc(&mut self, bytes: u64, stream: u64) -> usize {
        let block = self.blocks;
        self.blocks += 1;
        self.requests.push(PlannedRequest::Alloc {
            block,
            bytes,
            stream,
        });
        block
    }

    /// Adds the free of `block`, now ([`PlannedRequest::Free`]).
    pub fn free(&mut self, block: usize) {
        self.requests.push(PlannedRequest::Free { block });
    }

    /// Adds the free of `block` at the capture's end ([`PlannedRequest::FreeAtEnd`]).
    pub fn free_at_end(&mut self, block: usize) {
        self.requests.push(PlannedRequest::FreeAtEnd { block });
    }

    /// Adds `other`'s requests after these, in the same capture (its blocks numbered
    /// after these'); returns the number `other`'s block 0 got.
    pub fn append(&mut self, other: &CaptureRequests) -> usize {
        let shift = self.blocks;
        self.requests.extend(other.requests.iter().map(|&r| {
            let mut r = r;
            match &mut r {
                PlannedRequest::Alloc { block, .. }
                | PlannedRequest::Free { block }
                | PlannedRequest::FreeAtEnd { block } => *block += shift,
            }
            r
        }));
        self.blocks += other.blocks;
        shift
    }

    /// The requests, in order.
    pub fn requests(&self) -> &[PlannedRequest] {
        &self.requests
    }

    /// The requests a recorded trace shows (`torch.cuda.memory._snapshot()["device_traces"]`
    /// of the warm-up, or this crate's [`CachingAllocator::snapshot`]): each `alloc`, and
    /// each `free_requested` of a block allocated within the trace (a free of memory
    /// allocated before it is not the capture's). A `free_requested` whose
    /// `free_completed` is not the next request-related entry waited for another stream's
    /// work: in a capture it is freed at the end. A stream's key is its raw handle.
    ///
    /// A trace cannot always tell such frees apart: when the allocation right after one
    /// completes it (the block's events done by then), its `free_completed` comes next, as
    /// a plain free's does, and the plan frees it at once where a capture waits for its
    /// end. [`CachingAllocator::record_requests`] knows, and is exact.
    pub fn from_trace(entries: &[TraceEntry]) -> CaptureRequests {
        let relevant: Vec<&TraceEntry> = entries
            .iter()
            .filter(|e| {
                matches!(
                    e.action.as_str(),
                    "alloc" | "free_requested" | "free_completed"
                )
            })
            .collect();
        let steps = relevant.iter().enumerate().map(|(i, e)| {
            let waited = e.action == "free_requested"
                && !relevant
                    .get(i + 1)
                    .is_some_and(|n| n.action == "free_completed" && n.addr == e.addr);
            (*e, waited)
        });
        CaptureRequests::from_steps(steps)
    }

    /// The requests of trace entries, each with whether (for a `free_requested`) the
    /// block is freed at the capture's end.
    fn from_steps<'e>(steps: impl Iterator<Item = (&'e TraceEntry, bool)>) -> CaptureRequests {
        let mut requests = CaptureRequests::new();
        let mut live: FxHashMap<u64, usize> = FxHashMap::default();
        for (e, at_end) in steps {
            match e.action.as_str() {
                "alloc" => {
                    live.insert(e.addr, requests.alloc(e.size, e.stream));
                }
                "free_requested" => {
                    let Some(block) = live.remove(&e.addr) else {
                        continue;
                    };
                    if at_end {
                        requests.free_at_end(block);
                    } else {
                        requests.free(block);
                    }
                }
                _ => {}
            }
        }
        requests
    }

    /// Checks that every free names a block allocated before it and not yet freed.
    fn check(&self) -> Result<(), UnknownBlock> {
        let mut live = vec![false; self.blocks];
        for (at, r) in self.requests.iter().enumerate() {
            match *r {
                PlannedRequest::Alloc { block, .. } => live[block] = true,
                PlannedRequest::Free { block } | PlannedRequest::FreeAtEnd { block } => {
                    if !live.get(block).copied().unwrap_or(false) {
                        return Err(UnknownBlock { block, at });
                    }
                    live[block] = false;
                }
            }
        }
        Ok(())
    }
}

impl CachingAllocator {
    /// Runs `warmup` while every request is recorded, and returns its result with the
    /// requests made on `streams` (every stream if empty): the input of [`plan_pool`] for
    /// a capture that will make the same requests. The history (`record_memory_history`)
    /// keeps every event meanwhile and goes back to its options afterwards (a panicking
    /// warm-up too), which keep of the recorded events what they would have kept. A free
    /// of a block other streams used (`record_stream`) is planned at the capture's end, as
    /// a capture frees it. Requests other threads make on `streams` meanwhile are recorded
    /// too.
    pub fn record_requests<T>(
        &self,
        streams: &[StreamHandle],
        warmup: impl FnOnce() -> T,
    ) -> (T, CaptureRequests) {
        let mut recording = Recording::begin(self);
        let out = warmup();
        let (trace, with_uses) = recording.end();
        let kept = |e: &TraceEntry| streams.is_empty() || streams.iter().any(|s| s.raw == e.stream);
        let steps = (trace.iter().enumerate())
            .filter(|(_, e)| kept(e))
            // (Positions are recorded in order: sorted.)
            .map(|(i, e)| (e, with_uses.binary_search(&i).is_ok()));
        (out, CaptureRequests::from_steps(steps))
    }
}

/// A recording of requests underway: ended by [`Recording::end`], or when dropped (a
/// warm-up that panicked), so the history's options always come back.
struct Recording<'a> {
    allocator: &'a CachingAllocator,
    started: Option<(HistoryOptions, usize)>,
}

impl<'a> Recording<'a> {
    fn begin(allocator: &'a CachingAllocator) -> Recording<'a> {
        let started = allocator.engine.lock().history.begin_recording();
        Recording {
            allocator,
            started: Some(started),
        }
    }

    /// The events recorded, and the positions of the frees of blocks other streams used.
    fn end(&mut self) -> (Vec<TraceEntry>, Vec<usize>) {
        match self.started.take() {
            Some((saved, from)) => {
                (self.allocator.engine.lock().history).end_recording(saved, from)
            }
            None => (Vec::new(), Vec::new()),
        }
    }
}

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        self.end();
    }
}

/// What becomes of the blocks a capture leaves allocated (its outputs) before the next
/// capture sharing the pool begins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterCapture {
    /// They stay allocated to the end of the plan (a graph that keeps its static outputs,
    /// as `torch.cuda.make_graphed_callables` and CUDA-graph trees do).
    KeepOutputs,
    /// They are freed (vLLM keeps only weak references to a capture's outputs, so the next
    /// capture may reuse their memory).
    FreeOutputs,
}

/// What a pool shared by a set of captures will reserve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolPlan {
    /// Bytes the pool reserves after the last capture (its starting segments if there is
    /// none): what the real pool reserves then.
    pub reserved_bytes: u64,
    /// Bytes reserved after each capture, in order.
    pub reserved_after: Vec<u64>,
    /// The most bytes allocated from the pool at once.
    pub peak_allocated_bytes: u64,
    /// Each segment's bytes, in the order they were taken (the starting segments first).
    pub segments: Vec<u64>,
}

/// Why a plan could not be made.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A capture's requests name a block they did not allocate.
    #[error("capture {capture}: {source}")]
    UnknownBlock {
        /// The capture's position.
        capture: usize,
        /// What was wrong.
        source: UnknownBlock,
    },
    /// The configuration or a request the allocator refuses (a request of an exabyte, say).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A starting segment with no blocks, blocks that do not tile it, or segments that
    /// overlap.
    #[error("starting layout: {0}")]
    Layout(String),
}

/// The device the plan runs on: large enough that no plan runs out of memory.
const PLAN_DEVICE_BYTES: u64 = 1 << 50;

/// Plans the pool `captures` share, in order, under `config` (the allocator's
/// configuration of the program that will capture: it decides the rounding and the
/// segment sizes). One capture is a set of one. The pool starts empty, as a capture's
/// own pool does; [`plan_pool_from`] plans a pool that holds segments already.
pub fn plan_pool(
    config: &AllocatorConfig,
    captures: &[CaptureRequests],
    after: AfterCapture,
) -> Result<PoolPlan, PlanError> {
    plan_pool_from(config, &[], captures, after)
}

/// [`plan_pool`] for a pool that holds `start` already: its segments, in address order,
/// each split into blocks as the pool has it, some live (what
/// [`CachingAllocator::pool_layout`] reads of a real pool; mark blocks free that will be
/// freed before the captures begin). The plan's pool gets segments of the same sizes,
/// kinds and streams in the same address order, and the same blocks live; its new
/// segments lie above them (a real device may place them anywhere, which matters only to
/// ties between equal free blocks). Stream keys are the blocks' raw stream handles, as
/// [`CachingAllocator::record_requests`] records them. [`PoolPlan::segments`] and
/// `reserved_*` count the starting segments too.
pub fn plan_pool_from(
    config: &AllocatorConfig,
    start: &[SegmentCheckpoint],
    captures: &[CaptureRequests],
    after: AfterCapture,
) -> Result<PoolPlan, PlanError> {
    for (capture, c) in captures.iter().enumerate() {
        c.check()
            .map_err(|source| PlanError::UnknownBlock { capture, source })?;
    }
    check_layout(start)?;
    let fake: Arc<dyn Driver> = Arc::new(
        FakeDriver::builder()
            .capacity(PLAN_DEVICE_BYTES)
            .backing(false)
            .build(),
    );
    let device = DeviceIndex(0);
    let allocator = CachingAllocator::new(fake.clone(), device, config.clone(), Caching::On)?;
    let pool = PoolId::for_capture();
    let mut replay = Replay {
        allocator: &allocator,
        fake: &fake,
        streams: FxHashMap::default(),
    };
    allocator.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
    let seeded = replay.seed(pool, start);
    allocator.end_allocate_to_pool(pool)?;
    seeded?;
    let mut reserved_after = Vec::with_capacity(captures.len());
    for capture in captures {
        allocator.begin_allocate_to_pool(pool, Route::Thread(std::thread::current().id()))?;
        let left = replay.capture(capture);
        allocator.end_allocate_to_pool(pool)?;
        // Kept outputs simply stay allocated.
        let left = left?;
        if after == AfterCapture::FreeOutputs {
            left.into_iter().try_for_each(|ptr| replay.free(ptr))?;
        }
        reserved_after.push(allocator.pool_reserved_bytes(pool));
    }
    Ok(PoolPlan {
        reserved_bytes: allocator.pool_reserved_bytes(pool),
        reserved_after,
        // The plan's allocator serves this pool only: its statistics are the pool's.
        peak_allocated_bytes: allocator.stats().allocated_bytes.all.peak as u64,
        segments: allocator.pool_segments(pool),
    })
}

/// A capture's requests going through the plan's allocator.
struct Replay<'a> {
    allocator: &'a CachingAllocator,
    fake: &'a Arc<dyn Driver>,
    /// Stream key → the fake's stream, created on first use.
    streams: FxHashMap<u64, StreamHandle>,
}

/// Checks that each starting segment's blocks tile it and that segments do not overlap.
fn check_layout(start: &[SegmentCheckpoint]) -> Result<(), PlanError> {
    let mut previous_end = 0;
    for (i, segment) in start.iter().enumerate() {
        let Some(first) = segment.blocks.first() else {
            return Err(PlanError::Layout(format!("segment {i} has no blocks")));
        };
        if first.ptr.0 < previous_end {
            return Err(PlanError::Layout(format!(
                "segment {i} at {:#x} overlaps the one before it, or is out of address order",
                first.ptr.0
            )));
        }
        let mut end = first.ptr.0;
        for b in &segment.blocks {
            if b.ptr.0 != end || b.size == 0 {
                return Err(PlanError::Layout(format!(
                    "segment {i}: a block at {:#x} of {} bytes where one at {end:#x} was due",
                    b.ptr.0, b.size
                )));
            }
            end += b.size;
        }
        previous_end = end;
    }
    Ok(())
}

impl CachingAllocator {
    /// `pool`'s segments now, in address order, each with its blocks (live or free; a
    /// block freed but waiting for other streams' events shows free, as it will be): the
    /// start of [`plan_pool_from`] for a private pool. Empty for a pool that does not exist
    /// or holds nothing. (The default pool under expandable segments lists only mapped
    /// pages: its segments have gaps, and a plan refuses them as a layout.)
    pub fn pool_layout(&self, pool: PoolId) -> Vec<SegmentCheckpoint> {
        let mut blocks = self.pool_blocks(pool);
        blocks.retain(|b| b.mapped);
        blocks.sort_by_key(|b| (b.segment.0, b.ptr.0));
        let mut segments: Vec<(DevicePtr, SegmentCheckpoint)> = Vec::new();
        for b in blocks {
            let block = BlockCheckpoint {
                ptr: b.ptr,
                size: b.size,
                requested: b.requested,
                stream: b.stream,
                allocated: b.allocated,
            };
            match segments.last_mut() {
                Some((at, s)) if *at == b.segment => s.blocks.push(block),
                _ => segments.push((
                    b.segment,
                    SegmentCheckpoint {
                        kind: b.pool,
                        blocks: vec![block],
                    },
                )),
            }
        }
        segments.into_iter().map(|(_, s)| s).collect()
    }

    /// A new segment of exactly `bytes` in `pool` on `stream`, one free block: a starting
    /// segment of a plan. Its address, or `None` if the device had no room.
    fn seed_segment(
        &self,
        pool: PoolId,
        kind: ferrocuda_types::PoolKind,
        stream: StreamHandle,
        bytes: u64,
    ) -> Result<Option<u64>, AllocError> {
        let request = Request {
            size: bytes,
            requested: bytes,
            kind,
            stream,
            pool,
            frames: None,
            capture: None,
        };
        let st = self.engine.lock();
        let (mut st, id) = self.engine.alloc_segment(st, bytes, &request)?;
        Ok(id.map(|id| {
            st.pool_insert(id);
            st.blocks[id].ptr
        }))
    }
}

impl Replay<'_> {
    /// Makes `start`'s segments in `pool` (routed to this thread), then its live blocks
    /// (a checkpoint of the layout at the new addresses, restored).
    fn seed(&mut self, pool: PoolId, start: &[SegmentCheckpoint]) -> Result<(), AllocError> {
        let mut moved = Vec::with_capacity(start.len());
        for segment in start {
            let (Some(first), Some(last)) = (segment.blocks.first(), segment.blocks.last()) else {
                continue;
            };
            let bytes = last.ptr.0 + last.size - first.ptr.0;
            let stream = self.stream(first.stream.raw)?;
            let base = (self.allocator)
                .seed_segment(pool, segment.kind, stream, bytes)?
                .ok_or(AllocError::Driver(
                    ferrocuda_driver::DriverError::OUT_OF_MEMORY,
                ))?;
            let blocks = (segment.blocks.iter())
                .map(|b| BlockCheckpoint {
                    ptr: DevicePtr(base + (b.ptr.0 - first.ptr.0)),
                    stream,
                    ..*b
                })
                .collect();
            moved.push(SegmentCheckpoint {
                kind: segment.kind,
                blocks,
            });
        }
        if moved.iter().flat_map(|s| &s.blocks).any(|b| b.allocated) {
            let checkpoint = PoolCheckpoint {
                pool,
                segments: moved,
            };
            self.allocator.restore_pool(&checkpoint)?;
        }
        Ok(())
    }

    /// Runs one capture's requests; returns the addresses of the blocks it leaves allocated.
    fn capture(&mut self, capture: &CaptureRequests) -> Result<Vec<u64>, AllocError> {
        let mut blocks: Vec<Option<u64>> = vec![None; capture.blocks];
        let mut at_end = Vec::new();
        for r in &capture.requests {
            match *r {
                PlannedRequest::Alloc {
                    block,
                    bytes,
                    stream,
                } => {
                    let stream = self.stream(stream)?;
                    blocks[block] = Some(self.allocator.allocate(bytes, stream)?.ptr.0);
                }
                PlannedRequest::Free { block } => {
                    if let Some(b) = blocks[block].take() {
                        self.free(b)?;
                    }
                }
                PlannedRequest::FreeAtEnd { block } => at_end.extend(blocks[block].take()),
            }
        }
        at_end.into_iter().try_for_each(|b| self.free(b))?;
        Ok(blocks.into_iter().flatten().collect())
    }

    fn free(&self, ptr: u64) -> Result<(), AllocError> {
        self.allocator.free(ferrocuda_types::DevicePtr(ptr))
    }

    fn stream(&mut self, key: u64) -> Result<StreamHandle, AllocError> {
        if let Some(s) = self.streams.get(&key) {
            return Ok(*s);
        }
        let s = self
            .fake
            .stream_create(self.allocator.device(), StreamFlags::default())?;
        self.streams.insert(key, s);
        Ok(s)
    }
}
