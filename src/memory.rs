//! `torch.cuda.memory` for the global runtime: statistics, cache control, memory fraction,
//! raw allocations, allocator settings, the current allocator (a pluggable one in the
//! caching allocators' place: [`change_current_allocator`]), memory pools ([`MemPool`]), and
//! the pinned host allocator's statistics and cache. Every device function takes the device
//! explicitly; use `ferrocuda::runtime().current_device()` for PyTorch's `device=None`.
//!
//! With a pluggable allocator current, each function does what PyTorch's
//! `CUDAPluggableAllocator` does for it: `empty_cache` and `set_per_process_memory_fraction`
//! call its hooks, the raw allocation functions its `alloc` and `free`, and what it has no
//! form of (statistics, history, snapshots) is PyTorch's "does not yet support" error.
use crate::alloc::history::{HistoryOptions, SkipFrames};
use crate::alloc::{
    AllocError, AsyncAllocator, DeviceAllocators, HostAllocator, PluggableAllocator,
};
use crate::graph::CaptureMemory;
use crate::stream::{HostMemoryResource, MemoryResource, Runtime, Stream, StreamError};
use crate::types::{
    AllocatorBackend, AllocatorConfig, DeviceIndex, DevicePtr, HostRange, StreamHandle,
};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

mod current;
mod pool;

pub(crate) use current::init_current;
pub use current::{change_current_allocator, get_allocator_backend};
use current::{pluggable, pluggable_initialized};
pub use pool::{MemPool, MemPoolGuard, use_mem_pool};

/// The allocator the configuration selects (`backend:native` or `backend:cudaMallocAsync`).
#[derive(Debug)]
enum Configured {
    /// One caching allocator per device.
    Native(Arc<DeviceAllocators>),
    /// PyTorch's `CudaMallocAsyncAllocator`, and the pinned host allocator (which does not
    /// depend on the device backend in PyTorch either).
    Async(Arc<AsyncAllocator>, Arc<HostAllocator>),
}

impl Configured {
    /// The allocators of the configuration in the environment, for `rt`'s driver.
    fn from_env(rt: &Runtime) -> Result<Configured, AllocError> {
        let config = AllocatorConfig::from_env()?;
        Ok(match config.backend {
            AllocatorBackend::CudaMallocAsync => {
                let host = HostAllocator::new(rt.driver().clone(), config.pinned.clone());
                Configured::Async(
                    AsyncAllocator::from_config(rt.driver().clone(), &config)?,
                    host,
                )
            }
            _ => Configured::Native(DeviceAllocators::from_env(rt.driver().clone())?),
        })
    }

    /// `initialized()`.
    fn is_initialized(&self) -> bool {
        match self {
            Configured::Native(a) => a.is_initialized(),
            Configured::Async(a, _) => a.is_initialized(),
        }
    }

    /// `init(device_count)`.
    fn init(&self) -> Result<(), AllocError> {
        match self {
            Configured::Native(a) => a.init(),
            Configured::Async(a, _) => a.init().map(drop),
        }
    }
}

static ALLOCATORS: OnceLock<Result<Configured, AllocError>> = OnceLock::new();

/// Serves every request with the configuration error, so a typo in the allocator
/// configuration is never silently ignored.
#[derive(Debug)]
struct Misconfigured(AllocError);

impl MemoryResource for Misconfigured {
    fn allocate(&self, _: DeviceIndex, _: u64, _: StreamHandle) -> Result<DevicePtr, StreamError> {
        Err(self.0.clone().into())
    }
    fn free(&self, _: DeviceIndex, _: DevicePtr) -> Result<(), StreamError> {
        Ok(())
    }
    fn record_stream(
        &self,
        _: DeviceIndex,
        _: DevicePtr,
        _: StreamHandle,
    ) -> Result<(), StreamError> {
        Ok(())
    }
}

impl HostMemoryResource for Misconfigured {
    fn allocate_host(&self, _: u64, _: StreamHandle) -> Result<HostRange, StreamError> {
        Err(self.0.clone().into())
    }
    fn free_host(&self, _: HostRange) -> Result<(), StreamError> {
        Ok(())
    }
    fn record_host_use(&self, _: HostRange, _: StreamHandle) -> Result<(), StreamError> {
        Ok(())
    }
}

/// The allocators of this module, made from the environment for `rt`'s driver on first use.
fn allocators_for(rt: &Runtime) -> &'static Result<Configured, AllocError> {
    ALLOCATORS.get_or_init(|| Configured::from_env(rt))
}

/// Makes `error` the answer of every allocation on `rt` and of every function of this
/// module (the global runtime's, when the environment cannot be read).
pub(crate) fn install_refusal(rt: &Arc<Runtime>, error: AllocError) {
    let _ = ALLOCATORS.set(Err(error));
    install(rt);
}

/// Installs the environment-configured allocators on `rt` (the global runtime does this
/// itself); only the first call's runtime is served by the functions of this module.
pub fn install(rt: &Arc<Runtime>) {
    match allocators_for(rt) {
        Ok(Configured::Native(a)) => a.install(rt),
        Ok(Configured::Async(a, host)) => {
            rt.set_memory(a.clone());
            rt.set_host_memory(host.clone());
        }
        Err(e) => {
            let refuse = Arc::new(Misconfigured(e.clone()));
            rt.set_memory(refuse.clone());
            rt.set_host_memory(refuse);
        }
    }
}

/// The configured allocators of the global runtime (or the configuration error).
fn configured() -> Result<&'static Configured, AllocError> {
    allocators_for(crate::runtime())
        .as_ref()
        .map_err(Clone::clone)
}

/// The global runtime's caching allocators (or the configuration error; under
/// `backend:cudaMallocAsync`, PyTorch's backend assertion error).
pub fn allocators() -> Result<&'static Arc<DeviceAllocators>, AllocError> {
    match configured()? {
        Configured::Native(a) => Ok(a),
        Configured::Async(..) => Err(AllocError::WrongBackend),
    }
}

/// The `backend:cudaMallocAsync` allocator of the global runtime, when configured.
pub fn async_allocator() -> Option<&'static Arc<AsyncAllocator>> {
    match configured() {
        Ok(Configured::Async(a, _)) => Some(a),
        _ => None,
    }
}

/// What a [`CudaGraph`](crate::graph::CudaGraph) of the global runtime captures through,
/// under either backend:
/// `CudaGraph::new(ferrocuda::runtime().clone(), ferrocuda::memory::capture_memory()?, dev)`.
/// With a pluggable allocator current, PyTorch's "does not yet support" error for
/// `beginAllocateToPool` (its hooks are not called by ferrocuda's graphs).
pub fn capture_memory() -> Result<CaptureMemory, AllocError> {
    Ok(match serving("beginAllocateToPool")? {
        Configured::Native(a) => CaptureMemory::Native(a.clone()),
        Configured::Async(a, host) => CaptureMemory::Async {
            device: a.clone(),
            host: host.clone(),
        },
    })
}

/// The caching allocators, for the function PyTorch's allocator interface calls `what`: a
/// pluggable allocator current ([`PluggableAllocator::unsupported`]) or the cudaMallocAsync
/// backend ([`AsyncAllocator::unsupported`]) has no form of it.
fn native(what: &'static str) -> Result<&'static Arc<DeviceAllocators>, AllocError> {
    match (pluggable(), configured()?) {
        (Some(_), _) => Err(PluggableAllocator::unsupported(what)),
        (None, Configured::Async(..)) => Err(AsyncAllocator::unsupported(what)),
        (None, Configured::Native(a)) => Ok(a),
    }
}

/// The allocator serving `what`: a pluggable one current has no form of it; otherwise the
/// configured backend.
fn serving(what: &'static str) -> Result<&'static Configured, AllocError> {
    match pluggable() {
        Some(_) => Err(PluggableAllocator::unsupported(what)),
        None => configured(),
    }
}

fn stats_of(dev: DeviceIndex) -> Result<crate::types::DeviceStats, AllocError> {
    match serving("getDeviceStats")? {
        Configured::Native(a) => Ok(a.device(dev)?.stats()),
        Configured::Async(a, _) => a.stats(dev),
    }
}

/// One figure of the statistics, or 0 before CUDA is initialised: PyTorch reads these from
/// `memory_stats`, which is empty then for any device index, without initialising anything
/// (`torch/cuda/memory.py`, `memory_stats_as_nested_dict`). Once initialised, a device that
/// does not exist is an error ("Invalid device argument").
fn figure(
    dev: DeviceIndex,
    of: impl FnOnce(&crate::types::DeviceStats) -> i64,
) -> Result<u64, AllocError> {
    if !crate::is_initialized() {
        return Ok(0);
    }
    Ok(of(&stats_of(dev)?) as u64)
}

/// `torch.cuda.memory_allocated`: bytes of live allocations.
pub fn memory_allocated(dev: DeviceIndex) -> Result<u64, AllocError> {
    figure(dev, |s| s.allocated_bytes.all.current)
}

/// `torch.cuda.max_memory_allocated`.
pub fn max_memory_allocated(dev: DeviceIndex) -> Result<u64, AllocError> {
    figure(dev, |s| s.allocated_bytes.all.peak)
}

/// `torch.cuda.memory_reserved`: bytes held from the driver.
pub fn memory_reserved(dev: DeviceIndex) -> Result<u64, AllocError> {
    figure(dev, |s| s.reserved_bytes.all.current)
}

/// `torch.cuda.max_memory_reserved`.
pub fn max_memory_reserved(dev: DeviceIndex) -> Result<u64, AllocError> {
    figure(dev, |s| s.reserved_bytes.all.peak)
}

/// `torch.cuda.memory_stats`: the flat dictionary with PyTorch's keys; empty before CUDA is
/// initialised for any device index (`memory_stats_as_nested_dict`), which it does not
/// initialise; once initialised, a device that does not exist is an error
/// ([`AllocError::NoSuchDevice`], PyTorch's "Invalid device argument").
pub fn memory_stats(dev: DeviceIndex) -> Result<BTreeMap<String, i64>, AllocError> {
    if !crate::is_initialized() {
        return Ok(BTreeMap::new());
    }
    Ok(stats_of(dev)?.to_map())
}

/// `torch.cuda.memory_summary`.
pub fn memory_summary(dev: DeviceIndex, abbreviated: bool) -> Result<String, AllocError> {
    Ok(stats_of(dev)?.summary(dev.0, abbreviated))
}

/// `torch.cuda.reset_peak_memory_stats`.
pub fn reset_peak_memory_stats(dev: DeviceIndex) -> Result<(), AllocError> {
    match serving("resetPeakStats")? {
        Configured::Native(a) => a.device(dev)?.reset_peak_stats(),
        Configured::Async(a, _) => a.reset_peak_stats(dev)?,
    }
    Ok(())
}

/// `torch.cuda.reset_accumulated_memory_stats` (no effect under `backend:cudaMallocAsync`,
/// with PyTorch's warning).
pub fn reset_accumulated_memory_stats(dev: DeviceIndex) -> Result<(), AllocError> {
    match serving("resetAccumulatedStats")? {
        Configured::Native(a) => a.device(dev)?.reset_accumulated_stats(),
        Configured::Async(a, _) => a.reset_accumulated_stats(dev)?,
    }
    Ok(())
}

/// `torch.cuda.empty_cache`, on every device in use (a pluggable allocator's reset hook;
/// under `backend:cudaMallocAsync`, a synchronization and a trim of each pool).
pub fn empty_cache() -> Result<(), AllocError> {
    if let Some(p) = pluggable() {
        p.empty_cache();
        return Ok(());
    }
    match configured()? {
        Configured::Native(a) => a.created().for_each(|a| a.empty_cache()),
        Configured::Async(a, _) => a.empty_cache()?,
    }
    Ok(())
}

/// The global runtime's pinned host allocator (what
/// [`PinnedBuffer`](crate::stream::PinnedBuffer)s of the global runtime allocate from).
pub fn host_allocator() -> Result<&'static Arc<HostAllocator>, AllocError> {
    match configured()? {
        Configured::Native(a) => Ok(a.host()),
        Configured::Async(_, host) => Ok(host),
    }
}

/// `torch.cuda.host_memory_stats`: the pinned host allocator's flat dictionary with
/// PyTorch's keys; empty before CUDA is initialised, as PyTorch's.
pub fn host_memory_stats() -> Result<BTreeMap<String, i64>, AllocError> {
    if !crate::is_initialized() {
        return Ok(BTreeMap::new());
    }
    Ok(host_allocator()?.stats().to_map())
}

/// `torch.cuda.reset_peak_host_memory_stats`.
pub fn reset_peak_host_memory_stats() -> Result<(), AllocError> {
    host_allocator()?.reset_peak_stats();
    Ok(())
}

/// `torch.cuda.reset_accumulated_host_memory_stats`.
pub fn reset_accumulated_host_memory_stats() -> Result<(), AllocError> {
    host_allocator()?.reset_accumulated_stats();
    Ok(())
}

/// `torch._C._host_emptyCache`: gives the pinned host allocator's cached blocks back.
pub fn host_empty_cache() -> Result<(), AllocError> {
    host_allocator()?.empty_cache()
}

/// `torch.cuda.set_per_process_memory_fraction` (a pluggable allocator's memory-fraction
/// hook, after Python's range check; under `backend:cudaMallocAsync`, a limit on its own
/// count of bytes in use).
pub fn set_per_process_memory_fraction(fraction: f64, dev: DeviceIndex) -> Result<(), AllocError> {
    // torch/cuda/memory.py: CUDA's lazy initialisation, then the range check (which NaN
    // passes, to meet the allocator's own check).
    let pluggable = pluggable_initialized();
    if !fraction.is_nan() && !(0.0..=1.0).contains(&fraction) {
        return Err(AllocError::FractionOutOfRange(fraction));
    }
    if let Some(p) = pluggable {
        crate::runtime().check_device(dev)?;
        p.set_memory_fraction(fraction, dev);
        return Ok(());
    }
    match configured()? {
        Configured::Native(a) => a.device(dev)?.set_memory_fraction(fraction),
        Configured::Async(a, _) => a.set_memory_fraction(fraction, dev),
    }
}

/// `torch.cuda.get_per_process_memory_fraction`.
pub fn get_per_process_memory_fraction(dev: DeviceIndex) -> Result<f64, AllocError> {
    Ok(native("getMemoryFraction")?.device(dev)?.memory_fraction())
}

/// `torch.cuda.caching_allocator_alloc(size, device, stream)`: raw memory on `stream`
/// (default: the current stream of `dev`).
pub fn caching_allocator_alloc(
    bytes: u64,
    dev: DeviceIndex,
    stream: Option<&Stream>,
) -> Result<DevicePtr, AllocError> {
    // PyTorch allocates `with torch.cuda.device(device)`: a device that does not exist is
    // refused before any allocator is asked, whatever stream is given.
    crate::runtime().check_device(dev)?;
    let stream = match stream {
        Some(s) => {
            // A stream of another runtime would name one of the global runtime's by number.
            crate::runtime().check_stream(s)?;
            s.handle()
        }
        None => crate::runtime().current_stream(dev)?.handle(),
    };
    if let Some(p) = pluggable_initialized() {
        // `raw_alloc_with_stream`; a null answer to a request is an error here.
        return match p.malloc(bytes, dev, stream) {
            DevicePtr(0) if bytes > 0 => Err(AllocError::PluggableOutOfMemory {
                bytes,
                device: dev.0,
            }),
            ptr => Ok(ptr),
        };
    }
    match configured()? {
        Configured::Native(a) => Ok(a.device(dev)?.allocate(bytes, stream)?.ptr),
        Configured::Async(a, _) => a.allocate(dev, bytes, stream),
    }
}

/// `torch.cuda.caching_allocator_delete(ptr)` (a pluggable allocator's `raw_delete`:
/// "Trying to free a pointer not allocated here" for one it did not hand out).
pub fn caching_allocator_delete(ptr: DevicePtr) -> Result<(), AllocError> {
    if ptr.0 == 0 {
        // PyTorch's `free` returns at once for a null pointer.
        return Ok(());
    }
    match (pluggable(), configured()?) {
        (Some(p), _) => p.raw_delete(ptr),
        (None, Configured::Native(a)) => a.free_anywhere(ptr),
        (None, Configured::Async(a, _)) => a.free(ptr),
    }
}

/// `torch.cuda.memory._set_allocator_settings`: re-parses the configuration for every
/// device (see `docs/configuration.md`).
pub fn set_allocator_settings(settings: &str) -> Result<(), AllocError> {
    match configured()? {
        Configured::Native(a) => a.set_settings(settings),
        Configured::Async(a, host) => {
            a.update_config(settings)?;
            host.update_config(settings)
        }
    }
}

/// `torch.cuda.mem_get_info`: `(free, total)` device bytes.
pub fn mem_get_info(dev: DeviceIndex) -> Result<(u64, u64), AllocError> {
    Ok(crate::runtime().mem_get_info(dev)?)
}

/// The frames of ferrocuda's own allocation plumbing above the allocator (the stream
/// layer's buffers and memory resource, and this module), which recorded stacks skip so
/// that they start at the caller. [`record_memory_history`] passes them; pass them in
/// [`HistoryOptions::skip_frames`] when recording on allocators of your own.
pub fn plumbing_frames() -> SkipFrames {
    SkipFrames::new(
        &[
            "ferrocuda_stream::buffer::",
            "ferrocuda_stream::memory::",
            "ferrocuda::memory::",
        ],
        &[
            "/crates/stream/src/buffer.rs",
            "/crates/stream/src/memory.rs",
        ],
    )
}

/// `torch.cuda.memory._record_memory_history(enabled, context, stacks, max_entries)` on
/// every device: `enabled` `None`/`"state"`/`"all"`, `context` `None`/`"state"`/`"alloc"`/
/// `"all"`, `stacks` `"python"` or `"all"` (both record Rust frames here).
pub fn record_memory_history(
    enabled: Option<&str>,
    context: Option<&str>,
    stacks: &str,
    max_entries: usize,
) -> Result<(), AllocError> {
    if !matches!(stacks, "python" | "all") {
        return Err(AllocError::History(
            "expected stacks to be 'python', or 'all'".into(),
        ));
    }
    let options = HistoryOptions {
        skip_frames: plumbing_frames(),
        ..HistoryOptions::parse(enabled, context, max_entries).map_err(AllocError::History)?
    };
    let allocators = native("recordHistory")?;
    for dev in 0..crate::runtime().device_count() {
        allocators
            .device(DeviceIndex(dev as u16))?
            .record_memory_history(options.clone());
    }
    Ok(())
}

/// `torch.cuda.memory._snapshot()`: segments of every device, per-device history, settings.
pub fn memory_snapshot() -> Result<crate::types::Snapshot, AllocError> {
    match serving("snapshot")? {
        Configured::Native(a) => a.snapshot(),
        Configured::Async(a, _) => a.snapshot(),
    }
}

/// `torch.cuda.memory._dump_snapshot(path)`: the snapshot as a pickle PyTorch's viewer reads.
pub fn dump_snapshot(path: &std::path::Path) -> Result<(), AllocError> {
    let bytes = memory_snapshot()?
        .to_pickle()
        .map_err(AllocError::History)?;
    std::fs::write(path, bytes)
        .map_err(|e| AllocError::History(format!("cannot write {}: {e}", path.display())))
}
