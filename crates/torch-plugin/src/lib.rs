//! ferrocuda's caching allocator as a library PyTorch loads:
//! `torch.cuda.memory.CUDAPluggableAllocator("libferrocuda_torch.so", "ferrocuda_malloc",
//! "ferrocuda_free")`, configured from `FERROCUDA_ALLOC_CONF` (else
//! `PYTORCH_CUDA_ALLOC_CONF`), with the optional hooks PyTorch can call (`init`, `reset`,
//! `memory_fraction`, `base_alloc`, `record_stream`, begin/end allocate to pool, release
//! pool) and C functions returning ferrocuda's statistics and a snapshot file. How to load
//! it and which hook PyTorch 2.11 really calls: `docs/backends.md`.
//!
//! # Design choices
//! - **No `unsafe` here.** The exported C functions live in `ferrocuda_driver::c_export`
//!   (the only crate allowed `unsafe`): they turn PyTorch's raw pointers into typed values
//!   and call the [`TorchAllocator`] this
//!   library registers, [`TorchBackend`]. Registering happens when the library is loaded:
//!   `ferrocuda_driver::torch_allocator_library!` writes an ELF `.init_array` entry (the
//!   `unsafe` attribute is written in the driver crate, the macro expands it here; a lint
//!   on code from another crate's macro is not reported, which is how `forbid(unsafe_code)`
//!   still holds). The entry only stores the factory; the backend is made at the first call.
//! - **Symbols from a dependency.** The shims are `#[no_mangle]` functions of the
//!   `ferrocuda-driver` rlib. rustc exports the `#[no_mangle]` functions of every linked
//!   crate from a `cdylib` (its exported-symbol list includes upstream crates', and it keeps
//!   their object files in the link for them), so nothing is re-exported by hand: the test
//!   `tests/torch_plugin_scenarios/library.rs` loads the built library and looks every name up, so
//!   a missing export fails CI.
//! - **The process's allocators.** The backend is the facade's global runtime and its
//!   allocators (`ferrocuda::memory`), so the driver is the real one unless
//!   `FERROCUDA_BACKEND=fake`, and a malformed configuration makes every call fail with the
//!   parse error (kept for `ferrocuda_last_error`) instead of being ignored.
//! - **PyTorch's streams are adopted, not owned.** A `cudaStream_t` PyTorch passes is a
//!   `ForeignStream` (made by the shim with the `unsafe` `ForeignStream::from_raw`) and
//!   becomes a driver handle through `Driver::stream_adopt` (checked against the device's
//!   primary context; never destroyed), once per stream and thread (a thread-local set keeps
//!   the hot path off the driver's registry lock), never forgotten: PyTorch's streams live as
//!   long as the process.
//! - **CUDA graphs without PyTorch's filter.** `beginAllocateToPool` comes with a C++
//!   closure a C function cannot call; the pool is routed with `Route::NextCapture` (bound to
//!   the first capture that allocates, preferring the thread that began it), which is exact
//!   for one capture at a time and for concurrent captures begun and filled by their own
//!   threads.
//!
//! # What the caller (PyTorch, or a C program) must do
//! Pass live streams of the device given (PyTorch does), free only what `ferrocuda_malloc`
//! returned (anything else is an error reported, not a crash), and load the library before
//! CUDA is initialised (PyTorch's `change_current_allocator` rule).
#![forbid(unsafe_code)]

mod backend;
mod error;

pub use backend::TorchBackend;
pub use error::PluginError;

use ferrocuda_driver::c_export::{BackendError, TorchAllocator};

/// The backend the exported functions serve: the global runtime's allocators.
fn from_env() -> Result<Box<dyn TorchAllocator>, BackendError> {
    Ok(Box::new(TorchBackend::from_env()?))
}

ferrocuda_driver::torch_allocator_library!(from_env);
