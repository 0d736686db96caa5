//! The scopes that change a thread's autocast state ([`AutocastGuard`], [`StateGuard`],
//! [`RedispatchGuard`], [`InferenceModeGuard`]) and the queries that read it.
//!
//! # Guards dropped out of order
//!
//! Every guard ([`AutocastGuard`], [`StateGuard`], [`RedispatchGuard`],
//! [`InferenceModeGuard`]) records what it changes on a per-thread stack. A guard dropped
//! on top of the stack (Rust's scoping does this) restores the state it found. A guard
//! dropped below others (guards kept in a `Vec`, two `let`s dropped by hand, a redispatch
//! guard outliving its region) takes its own change out: the state becomes the state before
//! the oldest live guard with each live guard's change applied in the order they were made.
//! So once every guard is gone the state is the one before the first, whatever the drop
//! order, and the nesting depth counts the live scopes (the weight-cast cache is cleared
//! when the last one goes). PyTorch's `with` blocks always exit in reverse order; its
//! `autocast.__exit__` called by hand out of order restores what that region found, which
//! can leave autocast on after the last exit (`torch/amp/autocast_mode.py`): here, by
//! design, it cannot.
use std::marker::PhantomData;

use ferrocuda_types::DType;

use super::device::DeviceKind;
use super::error::AutocastError;
use super::state::{AmpState, Autocast, Change, Frame, check_dtype};
use super::thread_state;

impl AmpState {
    /// This thread's current state.
    pub fn current() -> AmpState {
        thread_state::current().frame.amp
    }

    /// Installs this state on the current thread until the guard drops; the guard is a
    /// scope like [`Autocast::enter`]'s (it counts in the nesting depth, and the outermost
    /// scope's exit clears this thread's weight-cast cache).
    pub fn enter(self) -> StateGuard {
        StateGuard {
            id: thread_state::push(Change::Install(self)),
            _thread_bound: PhantomData,
        }
    }

    /// Runs `f` with this state installed (for worker threads and recompute closures).
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        let _guard = self.enter();
        f()
    }
}

impl Autocast {
    /// A region enabling autocast on `device` with the thread's current dtype and cache
    /// setting for it (read now, as PyTorch's constructor does).
    pub fn new(device: DeviceKind) -> Autocast {
        let now = AmpState::current();
        Autocast {
            device,
            dtype: now.dtype(device),
            enabled: true,
            cache_enabled: now.cache_enabled,
        }
    }

    /// Enters the region on this thread. An enabled region whose dtype is neither fp16 nor
    /// bf16 is refused with [`AutocastError::UnsupportedDtype`] (PyTorch warns and runs the
    /// region disabled instead, or for CUDA accepts it). A disabled region accepts any dtype
    /// and, like PyTorch, still sets the device's dtype inside it.
    pub fn enter(&self) -> Result<AutocastGuard, AutocastError> {
        if self.enabled {
            check_dtype(self.device, self.dtype)?;
        }
        Ok(AutocastGuard {
            id: thread_state::push(Change::Region(*self)),
            _thread_bound: PhantomData,
        })
    }

    /// Runs `f` inside the region.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> Result<R, AutocastError> {
        let _guard = self.enter()?;
        Ok(f())
    }
}

/// The scope of an entered [`Autocast`] region: dropped on top of this thread's guards, it
/// restores the state it found (and clears this thread's weight-cast cache when it is the
/// last scope); dropped below others, it takes its change out from under them (see
/// [out of order](self#guards-dropped-out-of-order)). Guards are bound to their thread.
#[derive(Debug)]
#[must_use = "the region ends when the guard drops"]
pub struct AutocastGuard {
    id: u64,
    _thread_bound: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        thread_state::pop(self.id);
    }
}

/// The scope of an installed [`AmpState`]: takes the installed state away again, as
/// [`AutocastGuard`] does its region.
#[derive(Debug)]
#[must_use = "the state is uninstalled when the guard drops"]
pub struct StateGuard {
    id: u64,
    _thread_bound: PhantomData<*const ()>,
}

impl Drop for StateGuard {
    fn drop(&mut self) {
        thread_state::pop(self.id);
    }
}

/// Turns autocast off for one device while a listed op's body runs, without counting as a
/// scope: the guard PyTorch's op wrappers hold (`ExcludeDispatchKeyGuard` of the device's
/// autocast key in `autocast_mode.h`) so that ops called inside are not autocast again.
#[derive(Debug)]
#[must_use = "autocast comes back when the guard drops"]
pub struct RedispatchGuard {
    id: u64,
    _thread_bound: PhantomData<*const ()>,
}

impl RedispatchGuard {
    /// Suspends autocast for `device` on this thread.
    pub fn new(device: DeviceKind) -> RedispatchGuard {
        RedispatchGuard {
            id: thread_state::push(Change::Redispatch(device)),
            _thread_bound: PhantomData,
        }
    }
}

impl Drop for RedispatchGuard {
    fn drop(&mut self) {
        thread_state::pop(self.id);
    }
}

/// Marks this thread as being in (or out of) the tensor library's inference mode: the
/// weight-cast cache is not used there (PyTorch 2.15, `cached_cast` in `autocast_mode.cpp`).
#[derive(Debug)]
#[must_use = "the flag is restored when the guard drops"]
pub struct InferenceModeGuard {
    id: u64,
    _thread_bound: PhantomData<*const ()>,
}

impl InferenceModeGuard {
    /// Sets the flag to `on` until the guard drops.
    pub fn new(on: bool) -> InferenceModeGuard {
        InferenceModeGuard {
            id: thread_state::push(Change::InferenceMode(on)),
            _thread_bound: PhantomData,
        }
    }
}

impl Drop for InferenceModeGuard {
    fn drop(&mut self) {
        thread_state::pop(self.id);
    }
}

/// Whether autocast is on for `device` on this thread (`torch.is_autocast_enabled`).
pub fn is_enabled(device: DeviceKind) -> bool {
    AmpState::current().is_enabled(device)
}

/// This thread's lower-precision dtype for `device` (`torch.get_autocast_dtype`).
pub fn dtype(device: DeviceKind) -> DType {
    AmpState::current().dtype(device)
}

/// Whether this thread's weight-cast cache is on (`torch.is_autocast_cache_enabled`).
pub fn is_cache_enabled() -> bool {
    AmpState::current().cache_enabled
}

/// How many scopes are open on this thread.
pub fn nesting() -> u32 {
    thread_state::current().nesting
}

/// Whether this thread is in the tensor library's inference mode ([`InferenceModeGuard`]).
pub fn is_inference_mode() -> bool {
    thread_state::current().frame.inference_mode
}

/// What the hot path reads: everything for one device in one thread-local access.
#[derive(Copy, Clone, Debug)]
pub(crate) struct DeviceView {
    pub(crate) enabled: bool,
    pub(crate) dtype: DType,
    /// Cache flag on and not in inference mode.
    pub(crate) cache_usable: bool,
}

#[inline]
pub(crate) fn device_view(device: DeviceKind) -> DeviceView {
    let Frame {
        amp,
        inference_mode,
    } = thread_state::current().frame;
    let d = device.index();
    DeviceView {
        enabled: amp.enabled[d],
        dtype: amp.dtype[d],
        cache_usable: amp.cache_enabled && !inference_mode,
    }
}
