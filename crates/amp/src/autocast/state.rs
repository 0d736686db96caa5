//! Per-thread autocast state and the scopes that change it.
//!
//! PyTorch keeps this state thread-local (`autocast_mode.cpp`: the TLS excluded-key set,
//! `autocast_dtype[]`, `cache_enabled`, `nesting`), and its Python `autocast` object stores
//! what `__exit__` restores on itself, so one instance re-entered recursively restores the
//! wrong state (`torch/amp/autocast_mode.py`, `autocast.__enter__`). Here every scope is a
//! guard value that owns what it restores, a region description ([`Autocast`]) can be
//! entered any number of times, and [`AmpState`] is a plain snapshot value to carry autocast
//! into another thread or a recompute closure (new threads start with autocast off, as in
//! PyTorch).
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
use super::thread_state::{self, Frame};

const N: usize = DeviceKind::COUNT;

/// An autocast configuration for every device kind: enabled, lower-precision dtype, and
/// whether the weight-cast cache is on. `AmpState::default()` is what a new thread has.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AmpState {
    enabled: [bool; N],
    dtype: [DType; N],
    cache_enabled: bool,
}

impl Default for AmpState {
    fn default() -> AmpState {
        AmpState::NEW_THREAD
    }
}

impl AmpState {
    /// Everything off, default dtypes, cache on: a new thread's state.
    pub(super) const NEW_THREAD: AmpState = {
        let mut dtype = [DType::F16; N];
        let mut i = 0;
        while i < N {
            dtype[i] = DeviceKind::ALL[i].default_dtype();
            i += 1;
        }
        AmpState {
            enabled: [false; N],
            dtype,
            cache_enabled: true,
        }
    };

    /// This thread's current state.
    pub fn current() -> AmpState {
        thread_state::current().frame.amp
    }

    /// Whether autocast is on for `device`.
    pub fn is_enabled(&self, device: DeviceKind) -> bool {
        self.enabled[device.index()]
    }

    /// Whether autocast is on for any device.
    pub fn is_any_enabled(&self) -> bool {
        self.enabled.contains(&true)
    }

    /// The lower-precision dtype of `device`.
    pub fn dtype(&self, device: DeviceKind) -> DType {
        self.dtype[device.index()]
    }

    /// Whether the weight-cast cache is on.
    pub fn cache_enabled(&self) -> bool {
        self.cache_enabled
    }

    /// This state with autocast on for `device` in `dtype` (fp16 or bf16).
    pub fn enable(mut self, device: DeviceKind, dtype: DType) -> Result<AmpState, AutocastError> {
        check_dtype(device, dtype)?;
        self.enabled[device.index()] = true;
        self.dtype[device.index()] = dtype;
        Ok(self)
    }

    /// This state with autocast off for `device` (its dtype kept).
    pub fn disable(mut self, device: DeviceKind) -> AmpState {
        self.enabled[device.index()] = false;
        self
    }

    /// This state with the weight-cast cache on or off.
    pub fn with_cache_enabled(mut self, on: bool) -> AmpState {
        self.cache_enabled = on;
        self
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

/// An autocast region: which device, which dtype, enabled or not, cache on or off
/// (`torch.autocast(device_type, dtype, enabled, cache_enabled)`). A description, not a
/// scope: [`Autocast::enter`] returns the scope guard, so one value may be entered any
/// number of times, nested or recursively.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Autocast {
    device: DeviceKind,
    dtype: DType,
    enabled: bool,
    cache_enabled: bool,
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

    /// The lower-precision dtype of the region.
    pub fn dtype(mut self, dtype: DType) -> Autocast {
        self.dtype = dtype;
        self
    }

    /// Whether the region enables (true) or disables (false) autocast on its device.
    pub fn enabled(mut self, enabled: bool) -> Autocast {
        self.enabled = enabled;
        self
    }

    /// Whether the weight-cast cache is on inside the region.
    pub fn cache_enabled(mut self, on: bool) -> Autocast {
        self.cache_enabled = on;
        self
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

/// What one guard changes, re-applied when a guard made before it goes first.
#[derive(Copy, Clone, Debug)]
pub(super) enum Change {
    /// An entered region: its device's flag and dtype, and the cache flag.
    Region(Autocast),
    /// An installed snapshot.
    Install(AmpState),
    /// Autocast off for one device ([`RedispatchGuard`]).
    Redispatch(DeviceKind),
    /// The inference-mode flag.
    InferenceMode(bool),
}

impl Change {
    pub(super) fn apply(self, frame: &mut Frame) {
        match self {
            Change::Region(r) => {
                let d = r.device.index();
                frame.amp.enabled[d] = r.enabled;
                frame.amp.dtype[d] = r.dtype;
                frame.amp.cache_enabled = r.cache_enabled;
            }
            Change::Install(state) => frame.amp = state,
            Change::Redispatch(device) => frame.amp.enabled[device.index()] = false,
            Change::InferenceMode(on) => frame.inference_mode = on,
        }
    }

    /// Whether it is a scope (a region or a snapshot), counted in [`nesting`].
    pub(super) fn is_scope(self) -> bool {
        matches!(self, Change::Region(_) | Change::Install(_))
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

fn check_dtype(device: DeviceKind, dtype: DType) -> Result<(), AutocastError> {
    if device.supports_dtype(dtype) {
        Ok(())
    } else {
        Err(AutocastError::UnsupportedDtype {
            device,
            upper: device.name().to_uppercase(),
            dtype,
        })
    }
}
