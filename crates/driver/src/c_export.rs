//! The C functions PyTorch's `CUDAPluggableAllocator` loads, and ferrocuda's own statistics
//! and snapshot functions beside them (feature `c-export`, built into the cdylib of
//! `crates/torch-plugin`).
//!
//! Every exported function is a thin shim: it turns raw pointers into typed values here
//! (a `cudaStream_t` into a [`ForeignStream`], a `void*` into a [`DevicePtr`], a
//! `MempoolId_t` into a [`PoolId`]), then calls the safe function of the same name in this
//! module, which calls the [`TorchAllocator`] the library registered when it was loaded
//! ([`register`], through [`torch_allocator_library!`](crate::torch_allocator_library)).
//! Tests call those safe functions with a backend of their own, exactly as the shims do.
//!
//! # What a shim never does
//! - **Unwind into C.** Every call into the backend runs under `catch_unwind`; a panic
//!   becomes [`ExportError::Panicked`].
//! - **Fail silently.** PyTorch's hooks return nothing (and `alloc` a pointer PyTorch does
//!   not check), so a failure is kept for [`ferrocuda_last_error`] and counted by
//!   [`ferrocuda_error_count`]; `ferrocuda_malloc` then returns null.
//! - **Leave PyTorch's device changed.** A driver act for another device binds that
//!   device's context; the shim puts the thread's context back before it returns.
//!
//! # PyTorch's C signatures (torch/csrc/cuda/CUDAPluggableAllocator.h, the setters bound in
//! torch/csrc/cuda/Module.cpp `registerCudaPluggableAllocator`)
//! | PyTorch | exported here |
//! |---|---|
//! | `void* alloc(size_t size, int device, cudaStream_t stream)` | [`ferrocuda_malloc`] |
//! | `void free(void* ptr, size_t size, int device, cudaStream_t stream)` | [`ferrocuda_free`] |
//! | `set_init_fn`: `void(int device_count)` | [`ferrocuda_init`] |
//! | `set_reset_fn`: `void()` (`torch.cuda.empty_cache`) | [`ferrocuda_reset`] |
//! | `set_memory_fraction_fn`: `void(double fraction, int device)` | [`ferrocuda_memory_fraction`] |
//! | `set_base_alloc_fn`: `void*(void* ptr, size_t* size)` | [`ferrocuda_base_alloc`] |
//! | `set_record_stream_fn`: `void(void* ptr, cudaStream_t stream)` | [`ferrocuda_record_stream`] |
//! | `set_begin_allocate_to_pool`: `void(int, MempoolId_t, std::function<bool(cudaStream_t)>)` | [`ferrocuda_begin_allocate_to_pool`] |
//! | `set_end_allocate_to_pool_fn`: `void(int, MempoolId_t)` | [`ferrocuda_end_allocate_to_pool`] |
//! | `set_release_pool`: `void(int, MempoolId_t)` | [`ferrocuda_release_pool`] |
//!
//! `MempoolId_t` is `std::pair<unsigned long long, unsigned long long>`, trivially copyable,
//! so it is passed by value as the C struct [`MempoolId`]. The `std::function` filter is not
//! trivially copyable, so the Itanium C++ ABI passes it as a pointer to the caller's
//! temporary: the begin shim takes that pointer and never reads it (a C function cannot
//! call a C++ closure), and routes by capture instead (see
//! `ferrocuda_alloc::Route::NextCapture`).
use crate::ForeignStream;
use crate::cuda::context_scope::ContextScope;
use ferrocuda_types::{DeviceIndex, DevicePtr, PoolId};
use parking_lot::Mutex;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// A backend's own error, carried as is.
pub type BackendError = Box<dyn std::error::Error + Send + Sync>;

/// What the exported functions call: the allocator behind the library. Devices are valid
/// indices, pointers and streams typed (the shims checked and converted them).
pub trait TorchAllocator: Send + Sync + 'static {
    /// PyTorch's `init(device_count)` (at CUDA's lazy initialisation, when set).
    fn init(&self, device_count: usize) -> Result<(), BackendError>;
    /// Allocates `bytes` on `device` for use on `stream`; zero bytes give a null pointer.
    fn allocate(
        &self,
        bytes: u64,
        device: DeviceIndex,
        stream: &ForeignStream,
    ) -> Result<DevicePtr, BackendError>;
    /// Frees what [`TorchAllocator::allocate`] returned (PyTorch passes back the size,
    /// device and stream it asked with).
    fn free(
        &self,
        ptr: DevicePtr,
        bytes: u64,
        device: DeviceIndex,
        stream: &ForeignStream,
    ) -> Result<(), BackendError>;
    /// `Tensor.record_stream`: `ptr` is also used on `stream` (PyTorch does not say the
    /// device: `stream` is named for device 0, [`ForeignStream::for_device`] names it for
    /// the device that owns `ptr`).
    fn record_stream(&self, ptr: DevicePtr, stream: &ForeignStream) -> Result<(), BackendError>;
    /// `torch.cuda.empty_cache()`.
    fn empty_cache(&self) -> Result<(), BackendError>;
    /// `torch.cuda.set_per_process_memory_fraction(fraction, device)`.
    fn set_memory_fraction(&self, fraction: f64, device: DeviceIndex) -> Result<(), BackendError>;
    /// PyTorch's `getBaseAllocation`: the segment holding the allocation at `ptr`, and its
    /// size.
    fn base_allocation(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64), BackendError>;
    /// `beginAllocateToPool` (a CUDA graph capture about to begin, or a memory pool in use).
    fn begin_allocate_to_pool(&self, device: DeviceIndex, pool: PoolId)
    -> Result<(), BackendError>;
    /// `endAllocateToPool`.
    fn end_allocate_to_pool(&self, device: DeviceIndex, pool: PoolId) -> Result<(), BackendError>;
    /// `releasePool`.
    fn release_pool(&self, device: DeviceIndex, pool: PoolId) -> Result<(), BackendError>;
    /// `torch.cuda.memory_stats(device)` as a JSON object (PyTorch's keys).
    fn memory_stats_json(&self, device: DeviceIndex) -> Result<String, BackendError>;
    /// `torch.cuda.reset_peak_memory_stats(device)`.
    fn reset_peak_memory_stats(&self, device: DeviceIndex) -> Result<(), BackendError>;
    /// The configuration in force, for people and logs.
    fn allocator_settings(&self) -> Result<String, BackendError>;
    /// Starts (`enabled`) or stops recording allocation history, keeping at most
    /// `max_entries` events per device.
    fn record_memory_history(&self, enabled: bool, max_entries: usize) -> Result<(), BackendError>;
    /// Writes a snapshot pickle PyTorch's memory viewer reads.
    fn dump_snapshot(&self, path: &Path) -> Result<(), BackendError>;
    /// Makes `pool` sleepable (its segments from the driver's virtual memory API), before
    /// anything is allocated in it.
    fn create_sleepable_pool(&self, device: DeviceIndex, pool: PoolId) -> Result<(), BackendError>;
    /// Puts sleepable `pool` to sleep: its physical memory back to the device, the
    /// addresses kept.
    fn sleep(
        &self,
        device: DeviceIndex,
        pool: PoolId,
        mode: SleepRequest,
    ) -> Result<(), BackendError>;
    /// Wakes sleeping `pool`: new physical memory at the same addresses, offloaded contents
    /// restored.
    fn wake(&self, device: DeviceIndex, pool: PoolId) -> Result<(), BackendError>;
}

/// Makes the backend, at the first exported call (not at load time: loading a library
/// must stay cheap and must not touch CUDA).
pub type Factory = fn() -> Result<Box<dyn TorchAllocator>, BackendError>;

/// Why an exported call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// Nothing registered a backend: the library was not made with
    /// [`torch_allocator_library!`](crate::torch_allocator_library), or its platform has
    /// no load-time constructors (only Linux's `.init_array` is used).
    #[error("no ferrocuda allocator is registered in this library")]
    NotRegistered,
    /// The factory failed (a malformed `FERROCUDA_ALLOC_CONF`, say); every call reports it.
    #[error("the ferrocuda allocator could not be made: {0}")]
    Unavailable(String),
    /// The backend refused the call.
    #[error("{call}: {source}")]
    Backend {
        /// The exported function.
        call: &'static str,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
    /// A negative device index (or device count).
    #[error("{call}: {value} is not a device index")]
    InvalidDevice {
        /// The exported function.
        call: &'static str,
        /// The value given.
        value: c_int,
    },
    /// A sleep mode other than 0 (discard), 1 (offload) or 2 (offload, checked).
    #[error("{call}: mode {value} is not 0 (discard), 1 (offload) or 2 (offload with a checksum)")]
    InvalidMode {
        /// The exported function.
        call: &'static str,
        /// The value given.
        value: c_int,
    },
    /// A null pointer where one is needed.
    #[error("{call}: {what} is a null pointer")]
    Null {
        /// The exported function.
        call: &'static str,
        /// Which argument.
        what: &'static str,
    },
    /// A path that is not UTF-8.
    #[error("{call}: the path is not UTF-8")]
    PathNotUtf8 {
        /// The exported function.
        call: &'static str,
    },
    /// The backend panicked; the panic was caught before it could reach C.
    #[error("{call} panicked: {message}")]
    Panicked {
        /// The exported function (or `"factory"`).
        call: &'static str,
        /// The panic's message, when it had one.
        message: String,
    },
}

/// What a sleep does with a pool's contents (`ferrocuda_sleep`'s `mode`: 0, 1 or 2).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SleepRequest {
    /// 0: the contents are dropped (a KV cache, a graph's temporaries).
    Discard,
    /// 1: copied to pinned host memory and restored on wake; 2: the same, with the
    /// restored bytes checked against a checksum of the offloaded ones.
    Offload {
        /// Whether the restore is checked.
        checksum: bool,
    },
}

impl SleepRequest {
    fn from_c(mode: c_int) -> Option<SleepRequest> {
        match mode {
            0 => Some(SleepRequest::Discard),
            1 => Some(SleepRequest::Offload { checksum: false }),
            2 => Some(SleepRequest::Offload { checksum: true }),
            _ => None,
        }
    }
}

/// PyTorch's `MempoolId_t` (`std::pair<unsigned long long, unsigned long long>`), passed by
/// value.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MempoolId {
    /// Non-zero for a graph's own pool.
    pub first: u64,
    /// Non-zero for `graph_pool_handle()` / `MemPool`.
    pub second: u64,
}

impl From<MempoolId> for PoolId {
    fn from(id: MempoolId) -> PoolId {
        PoolId(id.first, id.second)
    }
}

// ---- registration ------------------------------------------------------------------------

static FACTORY: OnceLock<Factory> = OnceLock::new();
static BACKEND: OnceLock<Result<Box<dyn TorchAllocator>, String>> = OnceLock::new();

/// Registers the factory of this library's backend; the first registration wins (returns
/// whether this one did).
pub fn register(factory: Factory) -> bool {
    FACTORY.set(factory).is_ok()
}

/// The registered backend, made at the first call.
pub fn registered() -> Result<&'static dyn TorchAllocator, ExportError> {
    let factory = *FACTORY.get().ok_or(ExportError::NotRegistered)?;
    let made = BACKEND.get_or_init(|| match catch_unwind(factory) {
        Ok(Ok(backend)) => Ok(backend),
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => Err(format!("the factory panicked: {}", panic_message(&*panic))),
    });
    match made {
        Ok(backend) => Ok(&**backend),
        Err(e) => Err(ExportError::Unavailable(e.clone())),
    }
}

/// Makes a `cdylib` whose exported functions (this module's) serve the backend `$factory`
/// makes: registers `$factory` when the library is loaded (an ELF `.init_array` entry, so
/// Linux only). The `unsafe` attribute this needs is written here, in the driver crate, and
/// expands into the library's crate; registering only stores the function pointer.
#[macro_export]
macro_rules! torch_allocator_library {
    ($factory:path) => {
        #[cfg(target_os = "linux")]
        #[used]
        // SAFETY: an `.init_array` entry is a function the loader calls once with no
        // arguments this function reads; it only stores a function pointer in a `OnceLock`.
        #[unsafe(link_section = ".init_array")]
        static FERROCUDA_REGISTER_TORCH_ALLOCATOR: extern "C" fn() = {
            extern "C" fn register() {
                $crate::c_export::register($factory);
            }
            register
        };
    };
}

// ---- the safe calls the shims make --------------------------------------------------------

/// Runs `f` on the backend, catching a panic and naming the call in the error.
fn guarded<T>(
    call: &'static str,
    f: impl FnOnce() -> Result<T, BackendError>,
) -> Result<T, ExportError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(ExportError::Backend { call, source }),
        Err(panic) => Err(ExportError::Panicked {
            call,
            message: panic_message(&*panic),
        }),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

fn device(call: &'static str, value: c_int) -> Result<DeviceIndex, ExportError> {
    u16::try_from(value)
        .map(DeviceIndex)
        .map_err(|_| ExportError::InvalidDevice { call, value })
}

/// `alloc(size, device, stream)`.
pub fn malloc(
    b: &dyn TorchAllocator,
    size: usize,
    dev: c_int,
    stream: &ForeignStream,
) -> Result<DevicePtr, ExportError> {
    let dev = device("alloc", dev)?;
    guarded("alloc", || b.allocate(size as u64, dev, stream))
}

/// `free(ptr, size, device, stream)`.
pub fn free(
    b: &dyn TorchAllocator,
    ptr: DevicePtr,
    size: usize,
    dev: c_int,
    stream: &ForeignStream,
) -> Result<(), ExportError> {
    let dev = device("free", dev)?;
    guarded("free", || b.free(ptr, size as u64, dev, stream))
}

/// `init(device_count)`.
pub fn init(b: &dyn TorchAllocator, device_count: c_int) -> Result<(), ExportError> {
    let count = usize::try_from(device_count).map_err(|_| ExportError::InvalidDevice {
        call: "init",
        value: device_count,
    })?;
    guarded("init", || b.init(count))
}

/// `reset()`.
pub fn reset(b: &dyn TorchAllocator) -> Result<(), ExportError> {
    guarded("reset", || b.empty_cache())
}

/// `memory_fraction(fraction, device)`.
pub fn memory_fraction(
    b: &dyn TorchAllocator,
    fraction: f64,
    dev: c_int,
) -> Result<(), ExportError> {
    let dev = device("memory_fraction", dev)?;
    guarded("memory_fraction", || b.set_memory_fraction(fraction, dev))
}

/// `base_alloc(ptr, size*)`.
pub fn base_alloc(b: &dyn TorchAllocator, ptr: DevicePtr) -> Result<(DevicePtr, u64), ExportError> {
    guarded("base_alloc", || b.base_allocation(ptr))
}

/// `record_stream(ptr, stream)`.
pub fn record_stream(
    b: &dyn TorchAllocator,
    ptr: DevicePtr,
    stream: &ForeignStream,
) -> Result<(), ExportError> {
    guarded("record_stream", || b.record_stream(ptr, stream))
}

/// `begin_allocate_to_pool(device, pool, filter)` (the filter is not PyTorch's to give us).
pub fn begin_allocate_to_pool(
    b: &dyn TorchAllocator,
    dev: c_int,
    pool: MempoolId,
) -> Result<(), ExportError> {
    let dev = device("begin_allocate_to_pool", dev)?;
    guarded("begin_allocate_to_pool", || {
        b.begin_allocate_to_pool(dev, pool.into())
    })
}

/// `end_allocate_to_pool(device, pool)`.
pub fn end_allocate_to_pool(
    b: &dyn TorchAllocator,
    dev: c_int,
    pool: MempoolId,
) -> Result<(), ExportError> {
    let dev = device("end_allocate_to_pool", dev)?;
    guarded("end_allocate_to_pool", || {
        b.end_allocate_to_pool(dev, pool.into())
    })
}

/// `create_sleepable_pool(device, pool)`.
pub fn create_sleepable_pool(
    b: &dyn TorchAllocator,
    dev: c_int,
    pool: MempoolId,
) -> Result<(), ExportError> {
    let dev = device("create_sleepable_pool", dev)?;
    guarded("create_sleepable_pool", || {
        b.create_sleepable_pool(dev, pool.into())
    })
}

/// `sleep(device, pool, mode)`.
pub fn sleep(
    b: &dyn TorchAllocator,
    dev: c_int,
    pool: MempoolId,
    mode: c_int,
) -> Result<(), ExportError> {
    const CALL: &str = "sleep";
    let dev = device(CALL, dev)?;
    let mode = SleepRequest::from_c(mode).ok_or(ExportError::InvalidMode {
        call: CALL,
        value: mode,
    })?;
    guarded(CALL, || b.sleep(dev, pool.into(), mode))
}

/// `wake(device, pool)`.
pub fn wake(b: &dyn TorchAllocator, dev: c_int, pool: MempoolId) -> Result<(), ExportError> {
    let dev = device("wake", dev)?;
    guarded("wake", || b.wake(dev, pool.into()))
}

/// `release_pool(device, pool)`.
pub fn release_pool(
    b: &dyn TorchAllocator,
    dev: c_int,
    pool: MempoolId,
) -> Result<(), ExportError> {
    let dev = device("release_pool", dev)?;
    guarded("release_pool", || b.release_pool(dev, pool.into()))
}

/// The statistics of `device` as JSON.
pub fn memory_stats_json(b: &dyn TorchAllocator, dev: c_int) -> Result<String, ExportError> {
    let dev = device("memory_stats_json", dev)?;
    guarded("memory_stats_json", || b.memory_stats_json(dev))
}

/// Resets the peaks of `device`.
pub fn reset_peak_memory_stats(b: &dyn TorchAllocator, dev: c_int) -> Result<(), ExportError> {
    let dev = device("reset_peak_memory_stats", dev)?;
    guarded("reset_peak_memory_stats", || b.reset_peak_memory_stats(dev))
}

/// The configuration in force.
pub fn allocator_settings(b: &dyn TorchAllocator) -> Result<String, ExportError> {
    guarded("allocator_settings", || b.allocator_settings())
}

/// Starts or stops recording history.
pub fn record_memory_history(
    b: &dyn TorchAllocator,
    enabled: bool,
    max_entries: usize,
) -> Result<(), ExportError> {
    guarded("record_memory_history", || {
        b.record_memory_history(enabled, max_entries)
    })
}

/// Writes a snapshot pickle to `path`.
pub fn dump_snapshot(b: &dyn TorchAllocator, path: &Path) -> Result<(), ExportError> {
    guarded("dump_snapshot", || b.dump_snapshot(path))
}

// ---- errors kept for C callers ----------------------------------------------------------

static ERRORS: AtomicU64 = AtomicU64::new(0);
static LAST_ERROR: Mutex<String> = Mutex::new(String::new());

/// Keeps a failure for [`ferrocuda_last_error`] and counts it; passes a success through.
fn report<T>(r: Result<T, ExportError>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            ERRORS.fetch_add(1, Ordering::Relaxed);
            *LAST_ERROR.lock() = e.to_string();
            None
        }
    }
}

/// `0` on success, `-1` (error kept) on failure.
fn status(r: Result<(), ExportError>) -> c_int {
    report(r).map_or(-1, |()| 0)
}

/// Copies `text` and a NUL into `buf` when it fits in `len` bytes; returns the length of
/// `text` (a caller whose buffer was too small calls again with `len` above it).
///
/// # Safety
/// `buf` is null, or valid for writes of `len` bytes.
unsafe fn write_c_string(text: &str, buf: *mut c_char, len: usize) -> isize {
    if !buf.is_null() && text.len() < len {
        // SAFETY: the caller vouches for `len` writable bytes at `buf`; text.len() + 1 <= len.
        let out = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), text.len() + 1) };
        out[..text.len()].copy_from_slice(text.as_bytes());
        out[text.len()] = 0;
    }
    isize::try_from(text.len()).unwrap_or(isize::MAX)
}

/// PyTorch's stream, named for `device` (an index that is not one is named 0 here: the
/// call refuses it next).
///
/// # Safety
/// `raw` is null or a live `cudaStream_t` (see [`ForeignStream::from_raw`]).
unsafe fn raw_stream(device: c_int, raw: *mut c_void) -> ForeignStream {
    let device = DeviceIndex(u16::try_from(device).unwrap_or(0));
    // SAFETY: the caller's contract is `from_raw`'s.
    unsafe { ForeignStream::from_raw(device, raw) }
}

fn into_void(ptr: DevicePtr) -> *mut c_void {
    std::ptr::without_provenance_mut(ptr.0 as usize)
}

fn from_void(ptr: *mut c_void) -> DevicePtr {
    DevicePtr(ptr.addr() as u64)
}

// ---- the exported functions -------------------------------------------------------------

/// PyTorch's `alloc`: device memory for `size` bytes on `device`, ordered on `stream`; null
/// on failure (kept for [`ferrocuda_last_error`]).
///
/// # Safety
/// `stream` is null or a live `cudaStream_t` of `device` (see [`ForeignStream::from_raw`]):
/// what PyTorch passes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocuda_malloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let _scope = ContextScope::enter();
    // SAFETY: the caller's contract above is `raw_stream`'s.
    let stream = unsafe { raw_stream(device, stream) };
    let r = registered().and_then(|b| malloc(b, size, device, &stream));
    report(r).map_or(std::ptr::null_mut(), into_void)
}

/// PyTorch's `free`. A pointer this library did not allocate is an error (kept), nothing
/// more.
///
/// # Safety
/// `stream` is null or a live `cudaStream_t` of `device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocuda_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) {
    let _scope = ContextScope::enter();
    // SAFETY: the caller's contract above is `raw_stream`'s.
    let stream = unsafe { raw_stream(device, stream) };
    report(registered().and_then(|b| free(b, from_void(ptr), size, device, &stream)));
}

/// PyTorch's `init(device_count)`.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_init(device_count: c_int) {
    let _scope = ContextScope::enter();
    report(registered().and_then(|b| init(b, device_count)));
}

/// PyTorch's `reset()`, called by `torch.cuda.empty_cache()`.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_reset() {
    let _scope = ContextScope::enter();
    report(registered().and_then(reset));
}

/// PyTorch's `memory_fraction(fraction, device)`.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_memory_fraction(fraction: f64, device: c_int) {
    let _scope = ContextScope::enter();
    report(registered().and_then(|b| memory_fraction(b, fraction, device)));
}

/// PyTorch's `base_alloc(ptr, size)`: the segment holding `ptr` (its size written to
/// `*size` when `size` is not null); null on failure.
///
/// # Safety
/// `size` is null or valid for one write of a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocuda_base_alloc(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    let _scope = ContextScope::enter();
    let Some((base, bytes)) = report(registered().and_then(|b| base_alloc(b, from_void(ptr))))
    else {
        return std::ptr::null_mut();
    };
    if !size.is_null() {
        // SAFETY: the caller vouches that a non-null `size` is valid for one write.
        unsafe { size.write(usize::try_from(bytes).unwrap_or(usize::MAX)) };
    }
    into_void(base)
}

/// PyTorch's `record_stream(ptr, stream)`.
///
/// # Safety
/// `stream` is null or a live `cudaStream_t` of the device `ptr` was allocated on.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocuda_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    let _scope = ContextScope::enter();
    // SAFETY: the caller's contract above is `raw_stream`'s.
    let stream = unsafe { raw_stream(0, stream) };
    report(registered().and_then(|b| record_stream(b, from_void(ptr), &stream)));
}

/// PyTorch's `begin_allocate_to_pool(device, pool, filter)`. `filter` (a pointer to the
/// caller's `std::function<bool(cudaStream_t)>`) is never read.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_begin_allocate_to_pool(
    device: c_int,
    pool: MempoolId,
    _filter: *const c_void,
) {
    let _scope = ContextScope::enter();
    report(registered().and_then(|b| begin_allocate_to_pool(b, device, pool)));
}

/// PyTorch's `end_allocate_to_pool(device, pool)`.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_end_allocate_to_pool(device: c_int, pool: MempoolId) {
    let _scope = ContextScope::enter();
    report(registered().and_then(|b| end_allocate_to_pool(b, device, pool)));
}

/// PyTorch's `release_pool(device, pool)`.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_release_pool(device: c_int, pool: MempoolId) {
    let _scope = ContextScope::enter();
    report(registered().and_then(|b| release_pool(b, device, pool)));
}

/// Makes pool `pool` (a `torch.cuda.graph_pool_handle()` or `MemPool` id) sleepable, before
/// anything is allocated in it: 0, or -1 on failure (`ferrocuda_last_error` says why).
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_create_sleepable_pool(device: c_int, pool: MempoolId) -> c_int {
    let _scope = ContextScope::enter();
    status(registered().and_then(|b| create_sleepable_pool(b, device, pool)))
}

/// Puts sleepable pool `pool` to sleep, `mode` 0 discarding its contents, 1 offloading them
/// to pinned host memory, 2 offloading them with a checksum checked on wake: 0, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_sleep(device: c_int, pool: MempoolId, mode: c_int) -> c_int {
    let _scope = ContextScope::enter();
    status(registered().and_then(|b| sleep(b, device, pool, mode)))
}

/// Wakes pool `pool` at the same addresses, restoring what was offloaded: 0, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_wake(device: c_int, pool: MempoolId) -> c_int {
    let _scope = ContextScope::enter();
    status(registered().and_then(|b| wake(b, device, pool)))
}

/// `torch.cuda.memory_stats(device)` as a JSON object with PyTorch's keys, written to `buf`
/// (NUL-terminated) when it fits in `len` bytes. Returns the JSON's length (call again with
/// a larger buffer when it is `len` or more), or -1 on failure.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocuda_memory_stats_json(
    device: c_int,
    buf: *mut c_char,
    len: usize,
) -> isize {
    let _scope = ContextScope::enter();
    match report(registered().and_then(|b| memory_stats_json(b, device))) {
        // SAFETY: the caller's contract above is `write_c_string`'s.
        Some(json) => unsafe { write_c_string(&json, buf, len) },
        None => -1,
    }
}

/// `torch.cuda.reset_peak_memory_stats(device)`: 0, or -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_reset_peak_memory_stats(device: c_int) -> c_int {
    let _scope = ContextScope::enter();
    status(registered().and_then(|b| reset_peak_memory_stats(b, device)))
}

/// The allocator configuration in force, written as [`ferrocuda_memory_stats_json`] writes.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocuda_allocator_settings(buf: *mut c_char, len: usize) -> isize {
    let _scope = ContextScope::enter();
    match report(registered().and_then(allocator_settings)) {
        // SAFETY: the caller's contract above is `write_c_string`'s.
        Some(settings) => unsafe { write_c_string(&settings, buf, len) },
        None => -1,
    }
}

/// Starts (`enabled` non-zero) or stops recording allocation history for the snapshot:
/// 0, or -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_record_memory_history(enabled: c_int, max_entries: usize) -> c_int {
    let _scope = ContextScope::enter();
    status(registered().and_then(|b| record_memory_history(b, enabled != 0, max_entries)))
}

/// Writes a snapshot pickle (what `torch.cuda.memory._dump_snapshot` writes) to `path`:
/// 0, or -1 on failure.
///
/// # Safety
/// `path` is null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocuda_dump_snapshot(path: *const c_char) -> c_int {
    let _scope = ContextScope::enter();
    const CALL: &str = "dump_snapshot";
    if path.is_null() {
        return status(Err(ExportError::Null {
            call: CALL,
            what: "path",
        }));
    }
    // SAFETY: the caller vouches that a non-null `path` is NUL-terminated.
    let path = unsafe { CStr::from_ptr(path) };
    let Ok(path) = path.to_str() else {
        return status(Err(ExportError::PathNotUtf8 { call: CALL }));
    };
    status(registered().and_then(|b| dump_snapshot(b, Path::new(path))))
}

/// The message of the last failure of any exported function (empty if none), written as
/// [`ferrocuda_memory_stats_json`] writes.
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocuda_last_error(buf: *mut c_char, len: usize) -> isize {
    let last = LAST_ERROR.lock().clone();
    // SAFETY: the caller's contract above is `write_c_string`'s.
    unsafe { write_c_string(&last, buf, len) }
}

/// How many exported calls have failed since the library was loaded.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocuda_error_count() -> u64 {
    ERRORS.load(Ordering::Relaxed)
}
