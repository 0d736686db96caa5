//! Autocast state as values: an [`AmpState`] snapshot, an [`Autocast`] region description,
//! and the change each guard makes (the guards and the thread's state are in
//! [`guards`](super::guards) and `thread_state`).
//!
//! PyTorch keeps this state thread-local (`autocast_mode.cpp`: the TLS excluded-key set,
//! `autocast_dtype[]`, `cache_enabled`, `nesting`), and its Python `autocast` object stores
//! what `__exit__` restores on itself, so one instance re-entered recursively restores the
//! wrong state (`torch/amp/autocast_mode.py`, `autocast.__enter__`). Here every scope is a
//! guard value that owns what it restores, a region description ([`Autocast`]) can be
//! entered any number of times, and [`AmpState`] is a plain snapshot value to carry autocast
//! into another thread or a recompute closure (new threads start with autocast off, as in
//! PyTorch).
use ferrocuda_types::DType;

use super::device::DeviceKind;
use super::error::AutocastError;

const N: usize = DeviceKind::COUNT;

/// An autocast configuration for every device kind: enabled, lower-precision dtype, and
/// whether the weight-cast cache is on. `AmpState::default()` is what a new thread has.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AmpState {
    pub(super) enabled: [bool; N],
    pub(super) dtype: [DType; N],
    pub(super) cache_enabled: bool,
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
}

/// An autocast region: which device, which dtype, enabled or not, cache on or off
/// (`torch.autocast(device_type, dtype, enabled, cache_enabled)`). A description, not a
/// scope: [`Autocast::enter`] returns the scope guard, so one value may be entered any
/// number of times, nested or recursively.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Autocast {
    pub(super) device: DeviceKind,
    pub(super) dtype: DType,
    pub(super) enabled: bool,
    pub(super) cache_enabled: bool,
}

impl Autocast {
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
}

/// What a guard saves and a [`Change`] applies to: the autocast state and the inference-mode
/// flag.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Frame {
    pub(super) amp: AmpState,
    pub(super) inference_mode: bool,
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

pub(super) fn check_dtype(device: DeviceKind, dtype: DType) -> Result<(), AutocastError> {
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
