//! The out-of-memory report: the figures of a failed allocation and PyTorch's message.
//!
//! It lives here, below the stream layer, so that a buffer's allocation error carries it
//! intact (`ferrocuda_stream::MemoryError::OutOfMemory`); the caching allocator fills it in.
use crate::{Frame, StreamHandle, format_size};
use std::fmt;

/// The figures of an out-of-memory error. Its `Display` is PyTorch's message
/// (`c10/cuda/CUDACachingAllocator.cpp`, `DeviceCachingAllocator::malloc`); the
/// fragmentation figures PyTorch does not print (largest free block, cached memory per
/// stream, non-releasable memory) are fields only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfMemory {
    /// Device index.
    pub device: u16,
    /// Bytes the failed request needed from the device (a segment size), or the request
    /// itself when it was refused for being 1 EB or more.
    pub requested: u64,
    /// True when the request was 1 EB or more.
    pub beyond_one_exabyte: bool,
    /// Device memory in bytes.
    pub device_total: u64,
    /// Free device memory in bytes, as the driver reports it.
    pub device_free: u64,
    /// The compute processes on the device and their memory, as NVML lists them (empty
    /// without NVML).
    pub processes: Vec<ProcessMemory>,
    /// The memory-fraction limit, if set.
    pub allowed: Option<u64>,
    /// Bytes allocated by this allocator.
    pub allocated: u64,
    /// Bytes reserved by this allocator.
    pub reserved: u64,
    /// Bytes of cached free blocks in private pools (PyTorch's `allocated_in_private_pools`,
    /// counted as allocated in the message).
    pub allocated_in_private_pools: u64,
    /// Largest cached free block, in bytes.
    pub largest_free_block: u64,
    /// Cached free bytes per stream.
    pub cached_per_stream: Vec<(StreamHandle, u64)>,
    /// Free pieces of partly used segments: cached but not releasable.
    pub non_releasable: u64,
    /// Whether expandable segments are on.
    pub expandable_segments: bool,
    /// Refused up front for passing the memory fraction (`throw_on_cudamalloc_oom`).
    pub rejected_by_fraction: bool,
    /// With `oom_forensics:<path>` (ferrocuda's own key): what the cache looked like, printed
    /// after PyTorch's message. `None` by default: the message is PyTorch's alone.
    pub forensics: Option<Box<OomForensics>>,
}

/// The figures `oom_forensics` adds to an out-of-memory error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomForensics {
    /// Cached free memory per (pool, small or large, stream), largest first.
    pub free: Vec<FreeCache>,
    /// Bytes `empty_cache()` would give back to the device now.
    pub releasable: u64,
    /// The largest request on the failed request's stream that would succeed after
    /// `empty_cache()`: the larger of the device's free memory plus what it gives back
    /// (within the memory fraction) and the largest cached block it would keep.
    pub largest_after_release: u64,
    /// The largest live blocks, largest first (at most five), with their allocation sites
    /// when history records stacks.
    pub largest_live: Vec<LiveBlock>,
    /// Where the snapshot was written, or why it was not.
    pub snapshot: Result<String, String>,
}

/// Cached free memory of one (pool, small or large, stream).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreeCache {
    /// The memory pool: `(0, 0)` is the default pool, others private pools.
    pub pool: (u64, u64),
    /// Whether it is the small-block pool.
    pub small: bool,
    /// The stream.
    pub stream: StreamHandle,
    /// Free bytes cached.
    pub bytes: u64,
    /// Free blocks cached.
    pub blocks: usize,
    /// The largest of them, in bytes.
    pub largest: u64,
}

/// A live block, for the forensics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    /// Address.
    pub ptr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Its stream.
    pub stream: StreamHandle,
    /// Where it was allocated, innermost first (empty without stacks in the history).
    pub frames: Vec<Frame>,
}

impl fmt::Display for OomForensics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\n\nferrocuda OOM forensics (oom_forensics):")?;
        f.write_str("\n  cached free memory by pool and stream (free, largest block, blocks):")?;
        if self.free.is_empty() {
            f.write_str(" none")?;
        }
        for c in &self.free {
            let pool = if c.pool == (0, 0) {
                "default".to_string()
            } else {
                format!("private ({}, {})", c.pool.0, c.pool.1)
            };
            write!(
                f,
                "\n    {pool} {} pool, stream {:#x}: {}, {}, {}",
                if c.small { "small" } else { "large" },
                c.stream.raw,
                format_size(c.bytes),
                format_size(c.largest),
                c.blocks
            )?;
        }
        write!(
            f,
            "\n  empty_cache() would give back {}; the largest request on this stream that would then succeed is about {}.",
            format_size(self.releasable),
            format_size(self.largest_after_release)
        )?;
        f.write_str("\n  largest live blocks:")?;
        if self.largest_live.is_empty() {
            f.write_str(" none")?;
        }
        for b in &self.largest_live {
            write!(
                f,
                "\n    {} at {:#x}, stream {:#x}",
                format_size(b.size),
                b.ptr,
                b.stream.raw
            )?;
            match b.frames.first() {
                Some(fr) => write!(
                    f,
                    ", allocated at {}:{} ({})",
                    fr.filename, fr.line, fr.name
                )?,
                None => f.write_str(" (no stack: record_memory_history records them)")?,
            }
        }
        match &self.snapshot {
            Ok(path) => write!(
                f,
                "\n  snapshot written to {path} (PyTorch's memory viewer and `ferrocuda summary` read it)."
            ),
            Err(why) => write!(f, "\n  no snapshot: {why}"),
        }
    }
}

/// A process using the device, for the out-of-memory message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Its process id.
    pub pid: u32,
    /// Device memory it uses, in bytes (all of it, PyTorch's or not).
    pub used: u64,
    /// Whether it is the process reporting.
    pub this_process: bool,
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_pytorch(f)?;
        match &self.forensics {
            Some(x) => write!(f, "{x}"),
            None => Ok(()),
        }
    }
}

impl OutOfMemory {
    /// PyTorch's message alone.
    fn fmt_pytorch(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.beyond_one_exabyte {
            return f.write_str("CUDA out of memory. Tried to allocate more than 1EB memory.");
        }
        if self.rejected_by_fraction {
            // PyTorch's `alloc_block` with `throw_on_cudamalloc_oom`.
            return write!(
                f,
                "CUDA out of memory. Allocation was preemptively rejected because it would exceed per_process_memory_fraction limit. Requested size: {}. Total allocated memory: {}. Memory limit: {}. Set throw_on_cudamalloc_oom:false to disable.",
                format_size(self.requested),
                format_size(self.reserved),
                format_size(self.allowed.unwrap_or(self.device_total)),
            );
        }
        write!(
            f,
            "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
            format_size(self.requested),
            self.device,
            format_size(self.device_total),
            format_size(self.device_free)
        )?;
        for p in &self.processes {
            if p.this_process {
                f.write_str("Including non-PyTorch memory, this process")?;
            } else {
                write!(f, "Process {}", p.pid)?;
            }
            write!(f, " has {} memory in use. ", format_size(p.used))?;
        }
        if let Some(a) = self.allowed {
            write!(f, "{} allowed; ", format_size(a))?;
        }
        let private = self.allocated_in_private_pools;
        write!(
            f,
            "Of the allocated memory {} is allocated by PyTorch, ",
            format_size(self.allocated + private)
        )?;
        if private > 0 {
            write!(
                f,
                "with {} allocated in private pools (e.g., CUDA Graphs), ",
                format_size(private)
            )?;
        }
        write!(
            f,
            "and {} is reserved by PyTorch but unallocated.",
            format_size(self.reserved.saturating_sub(self.allocated + private))
        )?;
        if !self.expandable_segments {
            f.write_str(
                " If reserved but unallocated memory is large try setting \
                 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See \
                 documentation for Memory Management  \
                 (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)",
            )?;
        }
        Ok(())
    }
}

/// The figures of an out-of-memory error of the `backend:cudaMallocAsync` allocator. Its
/// `Display` is PyTorch's message (`c10/cuda/CUDAMallocAsyncAllocator.cpp`, `mallocAsync`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolOutOfMemory {
    /// Device index.
    pub device: u16,
    /// Bytes of live allocations of this allocator on the device (`pytorch_used_bytes`).
    pub allocated: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Device memory in bytes.
    pub device_total: u64,
    /// Free device memory in bytes, as the driver reports it.
    pub device_free: u64,
    /// The limit set by the memory fraction (`u64::MAX` when none is set).
    pub limit: u64,
}

impl fmt::Display for PoolOutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Allocation on device {} would exceed allowed memory. (out of memory)\
             \nCurrently allocated     : {}\
             \nRequested               : {}\
             \nDevice limit            : {}\
             \nFree (according to CUDA): {}\
             \nPyTorch limit (set by user-supplied memory fraction)\
             \n                        : {}",
            self.device,
            format_size(self.allocated),
            format_size(self.requested),
            format_size(self.device_total),
            format_size(self.device_free),
            format_size(self.limit),
        )
    }
}
