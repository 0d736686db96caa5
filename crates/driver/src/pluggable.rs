//! Allocator functions in a shared library: the C side of PyTorch's
//! `torch.cuda.memory.CUDAPluggableAllocator(path_to_so_file, alloc_fn_name, free_fn_name)`
//! (torch/cuda/memory.py) and of the hooks its C++ class takes
//! (torch/csrc/cuda/CUDAPluggableAllocator.cpp, `set_init_fn` … `set_release_pool`).
//!
//! This module only loads the library, looks the functions up and calls them. What an
//! allocator does with them (the table of live allocations, "Trying to free a pointer not
//! allocated here", which hook runs when) is the caching-allocator layer's
//! (`ferrocuda_alloc::PluggableAllocator`).
//!
//! # The C functions
//! The two PyTorch requires, by the names given to [`PluggableLibrary::load`]:
//! ```c
//! void* alloc(size_t size, int device, cudaStream_t stream);
//! void  free(void* ptr, size_t size, int device, cudaStream_t stream);
//! ```
//! (PyTorch's docstring says `ssize_t size` for `alloc`, the same register on every platform
//! it runs on, and omits `device` from `free`; its C++ type, which is what it calls, has it.)
//! The optional hooks, by the names given to [`PluggableLibrary::with_hook`]; their C forms are
//! the C++ `std::function`s of PyTorch's class with a pool id `(first, second)` passed as two
//! integers. The stream filter of `beginAllocateToPool` is a C++ closure with no C form and
//! is not passed:
//! ```c
//! void  init(int device_count);                        // Hook::Init
//! void  reset(void);                                   // Hook::Reset (empty_cache)
//! void  memory_fraction(double fraction, int device);  // Hook::MemoryFraction
//! void* base_alloc(void* ptr, size_t* size);           // Hook::BaseAlloc
//! void  record_stream(void* ptr, cudaStream_t stream); // Hook::RecordStream
//! void  begin_allocate_to_pool(int device, uint64_t first, uint64_t second);
//! void  end_allocate_to_pool(int device, uint64_t first, uint64_t second);
//! void  release_pool(int device, uint64_t first, uint64_t second);
//! ```
//! A stream is passed as its `CUstream` (null for the legacy default stream); on the fake
//! device, as the fake's stream number.
//!
//! # Trust
//! Loading a library runs its initialisers, and ferrocuda calls the named functions with the
//! C types above: neither can be checked (as with PyTorch's `ctypes.CDLL`, or NVML here). Load
//! only libraries written for this interface. A missing file or name is a typed error
//! ([`PluggableError`]), never a panic.
use ferrocuda_types::{DeviceIndex, PoolId, StreamHandle};
use libloading::Library;
use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};

/// Why a pluggable allocator library could not be used. The texts are the ones Python gives
/// for `CUDAPluggableAllocator(...)`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PluggableError {
    /// The library did not load: the system loader's message, as `ctypes.CDLL` raises it
    /// (an `OSError` in Python), e.g. `…/liba.so: cannot open shared object file: No such
    /// file or directory`.
    #[error("{0}")]
    Load(String),
    /// The library has no function of that name: the loader's message, as `getattr` on the
    /// library raises it (an `AttributeError`), e.g. `…/liba.so: undefined symbol: my_alloc`.
    #[error("{message}")]
    MissingFunction {
        /// The name looked up.
        name: String,
        /// The loader's message.
        message: String,
    },
    /// The name exists but its address is null: PyTorch's `AssertionError` text.
    #[error("{role} '{name}' is None")]
    NullFunction {
        /// `alloc_fn`, `free_fn`, or the hook's (`init_fn`, ...).
        role: &'static str,
        /// The name looked up.
        name: String,
    },
}

/// An optional function of a pluggable allocator (PyTorch's `set_*_fn` of
/// `CUDAPluggableAllocator`). See the [module docs](self) for their C types.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Hook {
    /// `void init(int device_count)`: `set_init_fn`.
    Init,
    /// `void reset(void)`: `set_reset_fn`, called by `empty_cache`.
    Reset,
    /// `void memory_fraction(double fraction, int device)`: `set_memory_fraction_fn`.
    MemoryFraction,
    /// `void* base_alloc(void* ptr, size_t* size)`: `set_base_alloc_fn`.
    BaseAlloc,
    /// `void record_stream(void* ptr, cudaStream_t stream)`: `set_record_stream_fn`.
    RecordStream,
    /// `void begin_allocate_to_pool(int device, uint64_t first, uint64_t second)`:
    /// `set_begin_allocate_to_pool`.
    BeginAllocateToPool,
    /// `void end_allocate_to_pool(int device, uint64_t first, uint64_t second)`:
    /// `set_end_allocate_to_pool_fn`.
    EndAllocateToPool,
    /// `void release_pool(int device, uint64_t first, uint64_t second)`: `set_release_pool`.
    ReleasePool,
}

impl Hook {
    /// Every hook, in the order of PyTorch's setters.
    pub const ALL: [Hook; 8] = [
        Hook::Init,
        Hook::Reset,
        Hook::MemoryFraction,
        Hook::BaseAlloc,
        Hook::RecordStream,
        Hook::BeginAllocateToPool,
        Hook::EndAllocateToPool,
        Hook::ReleasePool,
    ];

    /// The name PyTorch's members give the function (`init_fn_` …), for messages.
    fn role(self) -> &'static str {
        match self {
            Hook::Init => "init_fn",
            Hook::Reset => "reset_fn",
            Hook::MemoryFraction => "memory_fraction_fn",
            Hook::BaseAlloc => "base_alloc_fn",
            Hook::RecordStream => "record_stream_fn",
            Hook::BeginAllocateToPool => "begin_allocate_to_pool_fn",
            Hook::EndAllocateToPool => "end_allocate_to_pool_fn",
            Hook::ReleasePool => "release_pool_fn",
        }
    }
}

type AllocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type FreeFn = unsafe extern "C" fn(*mut c_void, usize, c_int, *mut c_void);
type InitFn = unsafe extern "C" fn(c_int);
type ResetFn = unsafe extern "C" fn();
type FractionFn = unsafe extern "C" fn(f64, c_int);
type BaseAllocFn = unsafe extern "C" fn(*mut c_void, *mut usize) -> *mut c_void;
type RecordStreamFn = unsafe extern "C" fn(*mut c_void, *mut c_void);
type PoolFn = unsafe extern "C" fn(c_int, u64, u64);

/// The hooks found, each `None` until given.
#[derive(Copy, Clone, Default)]
struct Hooks {
    init: Option<InitFn>,
    reset: Option<ResetFn>,
    memory_fraction: Option<FractionFn>,
    base_alloc: Option<BaseAllocFn>,
    record_stream: Option<RecordStreamFn>,
    begin_allocate_to_pool: Option<PoolFn>,
    end_allocate_to_pool: Option<PoolFn>,
    release_pool: Option<PoolFn>,
}

/// A loaded allocator library and its functions. Calls pass straight through: no state is
/// kept here (see the [module docs](self)).
pub struct PluggableLibrary {
    path: PathBuf,
    alloc: AllocFn,
    free: FreeFn,
    hooks: Hooks,
    /// Keeps the functions above loaded: dropped only with them.
    library: Library,
}

impl std::fmt::Debug for PluggableLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluggableLibrary")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The loader's own message (`dlerror`, which names the file); libloading's wraps it.
fn loader_message(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(detail) => detail.to_string(),
        None => e.to_string(),
    }
}

/// The address of `name` in `library`, which must not be null (`ctypes.cast(getattr(lib,
/// name), c_void_p).value` and PyTorch's `is None` check).
fn address(library: &Library, name: &str, role: &'static str) -> Result<usize, PluggableError> {
    // SAFETY: the symbol is read as an address (`*mut c_void`, what every symbol is), not
    // called; the value is not used after `library` is dropped (its callers keep both).
    let symbol = unsafe { library.get::<*mut c_void>(name.as_bytes()) };
    match symbol {
        Ok(s) if s.is_null() => Err(PluggableError::NullFunction {
            role,
            name: name.to_owned(),
        }),
        Ok(s) => Ok(*s as usize),
        Err(e) => Err(PluggableError::MissingFunction {
            name: name.to_owned(),
            message: loader_message(&e),
        }),
    }
}

/// A C function pointer of type `F` at `address`.
///
/// # Safety
/// `F` must be an `unsafe extern "C" fn` type, `address` a non-null function address whose
/// C type is `F`, and the library holding it must outlive the result.
unsafe fn function<F: Copy>(address: usize) -> F {
    const { assert!(size_of::<F>() == size_of::<usize>()) };
    // SAFETY: the caller's contract; `F` is a function pointer, the size of an address.
    unsafe { std::mem::transmute_copy(&address) }
}

impl PluggableLibrary {
    /// Loads `path` and looks up its allocation and free functions (PyTorch's
    /// `CUDAPluggableAllocator(path_to_so_file, alloc_fn_name, free_fn_name)`). A path
    /// without a `/` is searched for as the system loader searches (`LD_LIBRARY_PATH` …).
    /// See [Trust](self#trust).
    pub fn load(
        path: impl AsRef<Path>,
        alloc_fn_name: &str,
        free_fn_name: &str,
    ) -> Result<PluggableLibrary, PluggableError> {
        let path = path.as_ref().to_path_buf();
        // SAFETY: loading runs the library's initialisers: the caller's choice of code to
        // run, as with any plug-in (see the module's "Trust").
        let library =
            unsafe { Library::new(&path) }.map_err(|e| PluggableError::Load(loader_message(&e)))?;
        let alloc = address(&library, alloc_fn_name, "alloc_fn")?;
        let free = address(&library, free_fn_name, "free_fn")?;
        // SAFETY: non-null addresses in `library`, which the result keeps; their C types are
        // the interface's (the module's "Trust").
        let (alloc, free) = unsafe { (function(alloc), function(free)) };
        Ok(PluggableLibrary {
            path,
            alloc,
            free,
            hooks: Hooks::default(),
            library,
        })
    }

    /// Adds the optional function `hook`, found by `name` in the same library (the C++
    /// class's `set_*_fn`); given twice, the second replaces the first.
    pub fn with_hook(mut self, hook: Hook, name: &str) -> Result<PluggableLibrary, PluggableError> {
        let at = address(&self.library, name, hook.role())?;
        let h = &mut self.hooks;
        // SAFETY: a non-null address in `self.library`, which `self` keeps; its C type is
        // the hook's (the module's "Trust").
        unsafe {
            match hook {
                Hook::Init => h.init = Some(function(at)),
                Hook::Reset => h.reset = Some(function(at)),
                Hook::MemoryFraction => h.memory_fraction = Some(function(at)),
                Hook::BaseAlloc => h.base_alloc = Some(function(at)),
                Hook::RecordStream => h.record_stream = Some(function(at)),
                Hook::BeginAllocateToPool => h.begin_allocate_to_pool = Some(function(at)),
                Hook::EndAllocateToPool => h.end_allocate_to_pool = Some(function(at)),
                Hook::ReleasePool => h.release_pool = Some(function(at)),
            }
        }
        Ok(self)
    }

    /// The path it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `hook` was given.
    pub fn has_hook(&self, hook: Hook) -> bool {
        let h = &self.hooks;
        match hook {
            Hook::Init => h.init.is_some(),
            Hook::Reset => h.reset.is_some(),
            Hook::MemoryFraction => h.memory_fraction.is_some(),
            Hook::BaseAlloc => h.base_alloc.is_some(),
            Hook::RecordStream => h.record_stream.is_some(),
            Hook::BeginAllocateToPool => h.begin_allocate_to_pool.is_some(),
            Hook::EndAllocateToPool => h.end_allocate_to_pool.is_some(),
            Hook::ReleasePool => h.release_pool.is_some(),
        }
    }

    /// Calls `alloc(size, device, stream)`: the address it returns (0 for null, also when
    /// `size` does not fit the platform's `size_t`).
    pub fn alloc(&self, size: u64, device: DeviceIndex, stream: StreamHandle) -> u64 {
        let Ok(size) = usize::try_from(size) else {
            return 0;
        };
        // SAFETY: the library's function of this C type (the module's "Trust"); plain values.
        unsafe { (self.alloc)(size, c_int::from(device.0), stream_arg(stream)) as u64 }
    }

    /// Calls `free(ptr, size, device, stream)`.
    pub fn free(&self, ptr: u64, size: u64, device: DeviceIndex, stream: StreamHandle) {
        // SAFETY: the library's function of this C type (the module's "Trust"); plain values
        // (the pointer is passed back, never dereferenced here).
        unsafe {
            (self.free)(
                ptr as *mut c_void,
                size as usize,
                c_int::from(device.0),
                stream_arg(stream),
            )
        }
    }

    /// Calls `init(device_count)`; false without that hook.
    pub fn init(&self, device_count: usize) -> bool {
        let n = c_int::try_from(device_count).unwrap_or(c_int::MAX);
        // SAFETY: the hook's C type (the module's "Trust"); a plain value.
        self.hooks.init.map(|f| unsafe { f(n) }).is_some()
    }

    /// Calls `reset()`; false without that hook.
    pub fn reset(&self) -> bool {
        // SAFETY: the hook's C type (the module's "Trust"); no argument.
        self.hooks.reset.map(|f| unsafe { f() }).is_some()
    }

    /// Calls `memory_fraction(fraction, device)`; false without that hook.
    pub fn memory_fraction(&self, fraction: f64, device: DeviceIndex) -> bool {
        let dev = c_int::from(device.0);
        // SAFETY: the hook's C type (the module's "Trust"); plain values.
        let call = |f: FractionFn| unsafe { f(fraction, dev) };
        self.hooks.memory_fraction.map(call).is_some()
    }

    /// Calls `base_alloc(ptr, &size)`: the base address and the size it wrote; `None`
    /// without that hook.
    pub fn base_alloc(&self, ptr: u64, size: u64) -> Option<(u64, u64)> {
        let f = self.hooks.base_alloc?;
        let mut size = size as usize;
        // SAFETY: the hook's C type (the module's "Trust"); `size` is a live, writable
        // size_t for the duration of the call.
        let base = unsafe { f(ptr as *mut c_void, &mut size) };
        Some((base as u64, size as u64))
    }

    /// Calls `record_stream(ptr, stream)`; false without that hook.
    pub fn record_stream(&self, ptr: u64, stream: StreamHandle) -> bool {
        // SAFETY: the hook's C type (the module's "Trust"); plain values.
        let call = |f: RecordStreamFn| unsafe { f(ptr as *mut c_void, stream_arg(stream)) };
        self.hooks.record_stream.map(call).is_some()
    }

    /// Calls the pool hook `hook` (one of [`Hook::BeginAllocateToPool`],
    /// [`Hook::EndAllocateToPool`], [`Hook::ReleasePool`]) with `(device, pool.0, pool.1)`;
    /// false without it (or for another hook).
    pub fn pool_hook(&self, hook: Hook, device: DeviceIndex, pool: PoolId) -> bool {
        let f = match hook {
            Hook::BeginAllocateToPool => self.hooks.begin_allocate_to_pool,
            Hook::EndAllocateToPool => self.hooks.end_allocate_to_pool,
            Hook::ReleasePool => self.hooks.release_pool,
            _ => None,
        };
        let dev = c_int::from(device.0);
        // SAFETY: the hook's C type (the module's "Trust"); plain values.
        f.map(|f| unsafe { f(dev, pool.0, pool.1) }).is_some()
    }
}

/// A stream as C's `cudaStream_t`.
fn stream_arg(stream: StreamHandle) -> *mut c_void {
    stream.raw as *mut c_void
}
