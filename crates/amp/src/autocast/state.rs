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
use std::cell::Cell;
use std::marker::PhantomData;

use ferrocuda_types::DType;

use super::cache;
use super::device::DeviceKind;
use super::error::AutocastError;

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
    const NEW_THREAD: AmpState = {
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
        THREAD.with(|t| t.get().amp)
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
        let previous = enter_scope(|amp| *amp = self);
        StateGuard {
            previous,
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
        let d = self.device.index();
        let previous = enter_scope(|amp| {
            amp.enabled[d] = self.enabled;
            amp.dtype[d] = self.dtype;
            amp.cache_enabled = self.cache_enabled;
        });
        Ok(AutocastGuard {
            device: self.device,
            enabled: previous.enabled[d],
            dtype: previous.dtype[d],
            cache_enabled: previous.cache_enabled,
            _thread_bound: PhantomData,
        })
    }

    /// Runs `f` inside the region.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> Result<R, AutocastError> {
        let _guard = self.enter()?;
        Ok(f())
    }
}

/// The scope of an entered [`Autocast`] region: restores the device's enabled flag and
/// dtype and the cache flag it found, and clears this thread's weight-cast cache when it
/// is the outermost scope. Guards are bound to their thread; drop them in reverse order.
#[derive(Debug)]
#[must_use = "the region ends when the guard drops"]
pub struct AutocastGuard {
    device: DeviceKind,
    enabled: bool,
    dtype: DType,
    cache_enabled: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        let d = self.device.index();
        exit_scope(|amp| {
            amp.enabled[d] = self.enabled;
            amp.dtype[d] = self.dtype;
            amp.cache_enabled = self.cache_enabled;
        });
    }
}

/// The scope of an installed [`AmpState`]: restores the whole state it found.
#[derive(Debug)]
#[must_use = "the state is uninstalled when the guard drops"]
pub struct StateGuard {
    previous: AmpState,
    _thread_bound: PhantomData<*const ()>,
}

impl Drop for StateGuard {
    fn drop(&mut self) {
        let previous = self.previous;
        exit_scope(|amp| *amp = previous);
    }
}

/// Turns autocast off for one device while a listed op's body runs, without counting as a
/// scope: the guard PyTorch's op wrappers hold (`ExcludeDispatchKeyGuard` of the device's
/// autocast key in `autocast_mode.h`) so that ops called inside are not autocast again.
#[derive(Debug)]
#[must_use = "autocast comes back when the guard drops"]
pub struct RedispatchGuard {
    device: DeviceKind,
    was_enabled: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl RedispatchGuard {
    /// Suspends autocast for `device` on this thread.
    pub fn new(device: DeviceKind) -> RedispatchGuard {
        let was_enabled = update(|t| {
            let was = t.amp.enabled[device.index()];
            t.amp.enabled[device.index()] = false;
            was
        });
        RedispatchGuard {
            device,
            was_enabled,
            _thread_bound: PhantomData,
        }
    }
}

impl Drop for RedispatchGuard {
    fn drop(&mut self) {
        let (d, was) = (self.device.index(), self.was_enabled);
        update(|t| t.amp.enabled[d] = was);
    }
}

/// Marks this thread as being in (or out of) the tensor library's inference mode: the
/// weight-cast cache is not used there (PyTorch 2.15, `cached_cast` in `autocast_mode.cpp`).
#[derive(Debug)]
#[must_use = "the flag is restored when the guard drops"]
pub struct InferenceModeGuard {
    was: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl InferenceModeGuard {
    /// Sets the flag to `on` until the guard drops.
    pub fn new(on: bool) -> InferenceModeGuard {
        let was = update(|t| std::mem::replace(&mut t.inference_mode, on));
        InferenceModeGuard {
            was,
            _thread_bound: PhantomData,
        }
    }
}

impl Drop for InferenceModeGuard {
    fn drop(&mut self) {
        let was = self.was;
        update(|t| t.inference_mode = was);
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
    THREAD.with(|t| t.get().nesting)
}

/// Whether this thread is in the tensor library's inference mode ([`InferenceModeGuard`]).
pub fn is_inference_mode() -> bool {
    THREAD.with(|t| t.get().inference_mode)
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
    THREAD.with(|t| {
        let t = t.get();
        let d = device.index();
        DeviceView {
            enabled: t.amp.enabled[d],
            dtype: t.amp.dtype[d],
            cache_usable: t.amp.cache_enabled && !t.inference_mode,
        }
    })
}

#[derive(Copy, Clone, Debug)]
struct ThreadState {
    amp: AmpState,
    nesting: u32,
    inference_mode: bool,
}

thread_local! {
    /// Bumped by every change of this thread's state ([`thread_state_version`]).
    static VERSION: Cell<u64> = const { Cell::new(0) };
    static THREAD: Cell<ThreadState> = const {
        Cell::new(ThreadState { amp: AmpState::NEW_THREAD, nesting: 0, inference_mode: false })
    };
}

fn update<R>(f: impl FnOnce(&mut ThreadState) -> R) -> R {
    VERSION.with(|v| v.set(v.get().wrapping_add(1)));
    THREAD.with(|cell| {
        let mut t = cell.get();
        let r = f(&mut t);
        cell.set(t);
        r
    })
}

/// A number that changes whenever this thread's autocast state may have changed: a reader
/// that keeps what it derived from [`AmpState::current`] with the number it read first may
/// reuse it while the number is unchanged (the guards of a graph cache do, every call).
pub fn thread_state_version() -> u64 {
    VERSION.with(Cell::get)
}

/// Opens a scope: returns the state before `change`, increments the nesting depth.
fn enter_scope(change: impl FnOnce(&mut AmpState)) -> AmpState {
    update(|t| {
        let previous = t.amp;
        change(&mut t.amp);
        t.nesting = t.nesting.saturating_add(1);
        previous
    })
}

/// Closes a scope: decrements the depth, clears this thread's cache at depth 0 (as
/// `autocast.__exit__` does before restoring), then restores.
fn exit_scope(restore: impl FnOnce(&mut AmpState)) {
    let outermost = update(|t| {
        t.nesting = t.nesting.saturating_sub(1);
        t.nesting == 0
    });
    if outermost {
        cache::clear_thread_caches();
    }
    update(|t| restore(&mut t.amp));
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
