//! A pluggable allocator library for ferrocuda's tests (the interface of PyTorch's
//! `CUDAPluggableAllocator`, `ferrocuda_driver::pluggable`), built as a cdylib, and a
//! [`Probe`] that reads what the loaded library was asked.
//!
//! Functions of the library (C ABI):
//! - `fixture_host_alloc` / `fixture_host_free`: host memory (512-byte aligned), for the
//!   fake device, where the caching allocator only does arithmetic on segment addresses;
//! - `fixture_cuda_alloc` / `fixture_cuda_free`: `cuMemAlloc` / `cuMemFree` in the device's
//!   primary context (the one ferrocuda uses), for the GPU;
//! - `fixture_null_alloc`: always null (out of memory);
//! - one function per hook: `fixture_init`, `fixture_reset`, `fixture_memory_fraction`,
//!   `fixture_base_alloc`, `fixture_record_stream`, `fixture_begin_allocate_to_pool`,
//!   `fixture_end_allocate_to_pool`, `fixture_release_pool`.
//!
//! Every call is logged in the library; [`Probe`] reads the log of the copy a test loaded
//! (the same file, [`path`], so the same copy) and serialises the tests of one process that
//! use it. Lives under `crates/driver` because it is `unsafe` by nature (C ABI, libcuda).
use libloading::Library;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Allocation alignment of the host functions (the caching allocator's 512-byte rounding).
const ALIGN: usize = 512;

/// One logged call, as the library stores it.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct RawEvent {
    kind: u32,
    device: i32,
    ptr: u64,
    size: u64,
    stream: u64,
    first: u64,
    second: u64,
    fraction: f64,
}

const ALLOC: u32 = 1;
const FREE: u32 = 2;
const INIT: u32 = 3;
const RESET: u32 = 4;
const FRACTION: u32 = 5;
const BASE_ALLOC: u32 = 6;
const RECORD_STREAM: u32 = 7;
const BEGIN: u32 = 8;
const END: u32 = 9;
const RELEASE: u32 = 10;

/// The log, and the live allocations (address → size) of either kind.
struct State {
    events: Vec<RawEvent>,
    live: BTreeMap<u64, u64>,
}

static STATE: Mutex<State> = Mutex::new(State {
    events: Vec::new(),
    live: BTreeMap::new(),
});

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn log(event: RawEvent) {
    state().events.push(event);
}

fn alloc_event(size: usize, device: c_int, stream: *mut c_void, ptr: u64) {
    let mut st = state();
    if ptr != 0 {
        st.live.insert(ptr, size as u64);
    }
    st.events.push(RawEvent {
        kind: ALLOC,
        device,
        ptr,
        size: size as u64,
        stream: stream as u64,
        ..RawEvent::default()
    });
}

/// Logs a free and forgets the allocation: the size it was made with, if it was live.
fn free_event(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) -> Option<u64> {
    let mut st = state();
    st.events.push(RawEvent {
        kind: FREE,
        device,
        ptr: ptr as u64,
        size: size as u64,
        stream: stream as u64,
        ..RawEvent::default()
    });
    st.live.remove(&(ptr as u64))
}

fn host_layout(size: u64) -> Option<std::alloc::Layout> {
    std::alloc::Layout::from_size_align(usize::try_from(size.max(1)).ok()?, ALIGN).ok()
}

/// `void* fixture_host_alloc(size_t size, int device, cudaStream_t stream)`: host memory.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_host_alloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let ptr = match host_layout(size as u64) {
        // SAFETY: the layout's size is at least 1.
        Some(layout) => unsafe { std::alloc::alloc(layout) },
        None => std::ptr::null_mut(),
    };
    alloc_event(size, device, stream, ptr as u64);
    ptr.cast()
}

/// `void fixture_host_free(void* ptr, size_t size, int device, cudaStream_t stream)`. A
/// pointer it did not hand out is logged and left alone.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_host_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) {
    let made = free_event(ptr, size, device, stream);
    if let Some(layout) = made.and_then(host_layout) {
        // SAFETY: `ptr` came from `fixture_host_alloc` with this layout (its recorded size)
        // and was live until now.
        unsafe { std::alloc::dealloc(ptr.cast(), layout) };
    }
}

/// `void* fixture_null_alloc(size_t, int, cudaStream_t)`: always out of memory.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_null_alloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    alloc_event(size, device, stream, 0);
    std::ptr::null_mut()
}

/// Makes `device`'s primary context current on this thread (retained once per device).
fn bind_primary_context(device: c_int) -> bool {
    use cudarc::driver::sys;
    static CONTEXTS: Mutex<BTreeMap<c_int, usize>> = Mutex::new(BTreeMap::new());
    // SAFETY: only tries to open libcuda by name.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    let mut contexts = CONTEXTS.lock().unwrap_or_else(PoisonError::into_inner);
    let ctx = match contexts.get(&device) {
        Some(&ctx) => ctx,
        None => {
            let (mut dev, mut ctx) = (0, std::ptr::null_mut());
            // SAFETY: cuInit first, as documented; each call writes through a valid pointer.
            let ok = unsafe {
                sys::cuInit(0) == sys::CUresult::CUDA_SUCCESS
                    && sys::cuDeviceGet(&mut dev, device) == sys::CUresult::CUDA_SUCCESS
                    && sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) == sys::CUresult::CUDA_SUCCESS
            };
            if !ok {
                return false;
            }
            contexts.insert(device, ctx as usize);
            ctx as usize
        }
    };
    // SAFETY: a primary context retained above and never released.
    unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) == sys::CUresult::CUDA_SUCCESS }
}

/// `void* fixture_cuda_alloc(size_t size, int device, cudaStream_t stream)`: `cuMemAlloc`.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_cuda_alloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    let mut ptr = 0;
    if bind_primary_context(device) {
        // SAFETY: a context is current; writes one address through a valid pointer.
        let r = unsafe { cudarc::driver::sys::cuMemAlloc_v2(&mut ptr, size) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            ptr = 0;
        }
    }
    alloc_event(size, device, stream, ptr);
    ptr as *mut c_void
}

/// `void fixture_cuda_free(void* ptr, size_t size, int device, cudaStream_t stream)`:
/// `cuMemFree` of what `fixture_cuda_alloc` handed out (anything else is logged only).
#[unsafe(no_mangle)]
pub extern "C" fn fixture_cuda_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) {
    if free_event(ptr, size, device, stream).is_some() && bind_primary_context(device) {
        // SAFETY: the address came from cuMemAlloc and is freed once (it left `live`).
        let _ = unsafe { cudarc::driver::sys::cuMemFree_v2(ptr as u64) };
    }
}

/// The library's hook functions, in the order of `ferrocuda_driver::Hook::ALL`.
pub const HOOK_FUNCTIONS: [&str; 8] = [
    "fixture_init",
    "fixture_reset",
    "fixture_memory_fraction",
    "fixture_base_alloc",
    "fixture_record_stream",
    "fixture_begin_allocate_to_pool",
    "fixture_end_allocate_to_pool",
    "fixture_release_pool",
];

/// `void fixture_init(int device_count)`.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_init(device_count: c_int) {
    log(RawEvent {
        kind: INIT,
        device: device_count,
        ..RawEvent::default()
    });
}

/// `void fixture_reset(void)`.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_reset() {
    log(RawEvent {
        kind: RESET,
        ..RawEvent::default()
    });
}

/// `void fixture_memory_fraction(double fraction, int device)`.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_memory_fraction(fraction: f64, device: c_int) {
    log(RawEvent {
        kind: FRACTION,
        device,
        fraction,
        ..RawEvent::default()
    });
}

/// `void* fixture_base_alloc(void* ptr, size_t* size)`: the start of the live allocation
/// holding `ptr`, its size written to `*size` (`ptr` and `*size` unchanged if none holds it).
///
/// # Safety
/// `size` must point to a writable `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fixture_base_alloc(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    let mut st = state();
    let at = ptr as u64;
    let found = st.live.range(..=at).next_back().map(|(&b, &s)| (b, s));
    st.events.push(RawEvent {
        kind: BASE_ALLOC,
        ptr: at,
        ..RawEvent::default()
    });
    match found {
        Some((base, bytes)) if at < base + bytes.max(1) => {
            // SAFETY: the caller passes a writable size_t.
            unsafe { *size = bytes as usize };
            base as *mut c_void
        }
        _ => ptr,
    }
}

/// `void fixture_record_stream(void* ptr, cudaStream_t stream)`.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    log(RawEvent {
        kind: RECORD_STREAM,
        ptr: ptr as u64,
        stream: stream as u64,
        ..RawEvent::default()
    });
}

fn pool_event(kind: u32, device: c_int, first: u64, second: u64) {
    log(RawEvent {
        kind,
        device,
        first,
        second,
        ..RawEvent::default()
    });
}

/// `void fixture_begin_allocate_to_pool(int device, uint64_t first, uint64_t second)`.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_begin_allocate_to_pool(device: c_int, first: u64, second: u64) {
    pool_event(BEGIN, device, first, second);
}

/// `void fixture_end_allocate_to_pool(int device, uint64_t first, uint64_t second)`.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_end_allocate_to_pool(device: c_int, first: u64, second: u64) {
    pool_event(END, device, first, second);
}

/// `void fixture_release_pool(int device, uint64_t first, uint64_t second)`.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_release_pool(device: c_int, first: u64, second: u64) {
    pool_event(RELEASE, device, first, second);
}

/// `size_t fixture_event_count(void)`: logged calls.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_event_count() -> usize {
    state().events.len()
}

/// `bool fixture_event(size_t i, RawEvent* out)`: the `i`-th logged call.
///
/// # Safety
/// `out` must point to a writable `RawEvent`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fixture_event(i: usize, out: *mut RawEvent) -> bool {
    match state().events.get(i) {
        Some(e) => {
            // SAFETY: the caller passes a writable RawEvent.
            unsafe { *out = *e };
            true
        }
        None => false,
    }
}

/// `void fixture_clear(void)`: empties the log (live allocations stay).
#[unsafe(no_mangle)]
pub extern "C" fn fixture_clear() {
    state().events.clear();
}

/// `size_t fixture_live(void)`: allocations handed out and not freed.
#[unsafe(no_mangle)]
pub extern "C" fn fixture_live() -> usize {
    state().live.len()
}

/// Where cargo puts the fixture library: beside the running test executable (its `deps`
/// folder, or the GPU bundle's folder, where `cargo xtask gpu-bundle` copies it).
pub fn path() -> PathBuf {
    let name = format!(
        "{}ferrocuda_pluggable_fixture{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let exe = std::env::current_exe().unwrap_or_default();
    exe.parent()
        .map_or_else(|| PathBuf::from(&name), |d| d.join(&name))
}

/// A call the loaded library received.
#[derive(Copy, Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// An allocation function (`ptr` 0: it returned null).
    Alloc {
        size: u64,
        device: i32,
        stream: u64,
        ptr: u64,
    },
    /// A free function.
    Free {
        ptr: u64,
        size: u64,
        device: i32,
        stream: u64,
    },
    /// `init(device_count)`.
    Init(i32),
    /// `reset()`.
    Reset,
    /// `memory_fraction(fraction, device)`.
    MemoryFraction { fraction: f64, device: i32 },
    /// `base_alloc(ptr, …)`.
    BaseAlloc { ptr: u64 },
    /// `record_stream(ptr, stream)`.
    RecordStream { ptr: u64, stream: u64 },
    /// `begin_allocate_to_pool(device, first, second)`.
    BeginAllocateToPool { device: i32, pool: (u64, u64) },
    /// `end_allocate_to_pool(device, first, second)`.
    EndAllocateToPool { device: i32, pool: (u64, u64) },
    /// `release_pool(device, first, second)`.
    ReleasePool { device: i32, pool: (u64, u64) },
}

impl Event {
    fn from_raw(e: &RawEvent) -> Option<Event> {
        let pool = (e.first, e.second);
        let device = e.device;
        Some(match e.kind {
            ALLOC => Event::Alloc {
                size: e.size,
                device,
                stream: e.stream,
                ptr: e.ptr,
            },
            FREE => Event::Free {
                ptr: e.ptr,
                size: e.size,
                device,
                stream: e.stream,
            },
            INIT => Event::Init(device),
            RESET => Event::Reset,
            FRACTION => Event::MemoryFraction {
                fraction: e.fraction,
                device,
            },
            BASE_ALLOC => Event::BaseAlloc { ptr: e.ptr },
            RECORD_STREAM => Event::RecordStream {
                ptr: e.ptr,
                stream: e.stream,
            },
            BEGIN => Event::BeginAllocateToPool { device, pool },
            END => Event::EndAllocateToPool { device, pool },
            RELEASE => Event::ReleasePool { device, pool },
            _ => return None,
        })
    }
}

/// Reads the log of the loaded fixture library. Holding one serialises the tests of this
/// process that use the library (its log and live set are process-wide); opening one clears
/// the log.
pub struct Probe {
    count: unsafe extern "C" fn() -> usize,
    event: unsafe extern "C" fn(usize, *mut RawEvent) -> bool,
    clear: unsafe extern "C" fn(),
    live: unsafe extern "C" fn() -> usize,
    _library: Library,
    _turn: MutexGuard<'static, ()>,
}

impl std::fmt::Debug for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probe").finish_non_exhaustive()
    }
}

impl Probe {
    /// Loads the fixture library at [`path`] (the copy the tests load: one per process) and
    /// waits for this process's other probes to drop.
    pub fn open() -> Result<Probe, String> {
        static TURN: Mutex<()> = Mutex::new(());
        let turn = TURN.lock().unwrap_or_else(PoisonError::into_inner);
        let path = path();
        // SAFETY: the fixture library built from this crate: its initialisers are Rust's.
        let library =
            unsafe { Library::new(&path) }.map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: each type is the signature of the function of that name above, and the
        // pointers are kept beside the library that holds them.
        let probe = unsafe {
            Probe {
                count: *library
                    .get(b"fixture_event_count")
                    .map_err(|e| e.to_string())?,
                event: *library.get(b"fixture_event").map_err(|e| e.to_string())?,
                clear: *library.get(b"fixture_clear").map_err(|e| e.to_string())?,
                live: *library.get(b"fixture_live").map_err(|e| e.to_string())?,
                _library: library,
                _turn: turn,
            }
        };
        // SAFETY: no argument.
        unsafe { (probe.clear)() };
        Ok(probe)
    }

    /// The calls logged since the probe opened (or since [`Probe::clear`]).
    pub fn events(&self) -> Vec<Event> {
        let mut out = Vec::new();
        // SAFETY: no argument.
        let n = unsafe { (self.count)() };
        for i in 0..n {
            let mut raw = RawEvent::default();
            // SAFETY: `raw` is a writable RawEvent.
            if unsafe { (self.event)(i, &mut raw) } {
                out.extend(Event::from_raw(&raw));
            }
        }
        out
    }

    /// Empties the log.
    pub fn clear(&self) {
        // SAFETY: no argument.
        unsafe { (self.clear)() }
    }

    /// Allocations the library handed out and was not given back.
    pub fn live(&self) -> usize {
        // SAFETY: no argument.
        unsafe { (self.live)() }
    }
}
