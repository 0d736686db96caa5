//! What can go wrong with the gradient scaler. The messages of errors PyTorch also raises are
//! PyTorch's (`torch/amp/grad_scaler.py`, `aten/src/ATen/native/cuda/AmpKernels.cu`), so a
//! user searching for one finds the same advice.
use ferrocuda_driver::DriverError;
use ferrocuda_stream::StreamError;
use ferrocuda_types::{DType, DeviceIndex};

/// A gradient-scaler error.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ScalerError {
    /// `GradScaler.__init__` with `growth_factor <= 1.0`.
    #[error("The growth factor must be > 1.0.")]
    GrowthFactor,
    /// `GradScaler.__init__` with `backoff_factor >= 1.0`.
    #[error("The backoff factor must be < 1.0.")]
    BackoffFactor,
    /// A `min_scale` above the `max_scale` (our clamps; PyTorch has none).
    #[error("min_scale {min} is above max_scale {max}")]
    ScaleClamps {
        /// The floor asked for.
        min: f32,
        /// The ceiling asked for.
        max: f32,
    },
    /// `_check_scale_growth_tracker`: the device state does not exist yet because nothing
    /// was scaled (and [`GradScaler::device_state`](crate::GradScaler::device_state) was
    /// not called).
    #[error(
        "Attempted {op} but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
    )]
    NotInitialized {
        /// The call that needed the state (`unscale_`, `step`, `update`).
        op: &'static str,
    },
    /// `unscale_` twice for one optimizer between two `update`s.
    #[error("unscale_() has already been called on this optimizer since the last update().")]
    UnscaleAlreadyCalled,
    /// `unscale_` after `step` for one optimizer, before `update`.
    #[error("unscale_() is being called after step().")]
    UnscaleAfterStep,
    /// `step` twice for one optimizer between two `update`s.
    #[error("step() has already been called since the last update().")]
    StepAlreadyCalled,
    /// `step` for an optimizer whose gradient list was empty (frozen model, parameters
    /// moved after the optimizer was made, ...).
    #[error("No inf checks were recorded for this optimizer.")]
    NoInfChecksForOptimizer,
    /// `step` for an optimizer after `unscale_` with another gradient list than the one
    /// `unscale_` unscaled (PyTorch cannot meet this: it reads the optimizer's own
    /// gradients); the step would run on gradients never unscaled or checked.
    #[error(
        "step() was given other gradients than unscale_() unscaled for this optimizer; they were never unscaled or checked for infs."
    )]
    GradsChanged,
    /// `update` with no optimizer unscaled or stepped since the last one.
    #[error("No inf checks were recorded prior to update.")]
    NoInfChecksBeforeUpdate,
    /// `unscale_` (`allow_fp16=False`) met an fp16 gradient.
    #[error("Attempting to unscale FP16 gradients.")]
    Fp16Gradients,
    /// A gradient of a dtype the kernels do not take (integers, bool).
    #[error("\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for '{dtype:?}'")]
    UnsupportedDtype {
        /// The offending dtype.
        dtype: DType,
    },
    /// A gradient on another device than the scaler's (one scaler state per device).
    #[error("one of scaled_grads is on cuda:{found} but the scaler's state is on cuda:{expected}")]
    WrongDevice {
        /// The scaler's device.
        expected: DeviceIndex,
        /// The gradient's device.
        found: DeviceIndex,
    },
    /// A gradient view whose bytes run past the end of the address space.
    #[error(transparent)]
    ViewOutOfRange(#[from] crate::ViewOutOfRange),
    /// A gradient list larger than its device's memory (views that cannot be real), or
    /// than one chunk table addresses (2^32 chunks of 64 KiB): refused before any table is
    /// built.
    #[error(
        "a gradient list of {bytes} bytes is too large: at most {limit} bytes (the device's memory)"
    )]
    TooLarge {
        /// The list's total size (saturating).
        bytes: u64,
        /// The most a list may hold.
        limit: u64,
    },
    /// `load_state_dict({})`: the dict came from a disabled scaler.
    #[error(
        "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
    )]
    EmptyStateDict,
    /// `load_state_dict` with a key missing (PyTorch's `KeyError`).
    #[error("KeyError: '{key}'")]
    MissingKey {
        /// The missing key.
        key: &'static str,
    },
    /// A state-dict value out of the range the device state holds (an `int32` tracker or
    /// interval).
    #[error("state dict value {key} = {value} does not fit in an int32")]
    OutOfRange {
        /// The key.
        key: &'static str,
        /// The value.
        value: i64,
    },
    /// A stream-layer error (device, buffer, kernel launch).
    #[error(transparent)]
    Stream(#[from] StreamError),
}

impl From<DriverError> for ScalerError {
    fn from(e: DriverError) -> ScalerError {
        ScalerError::Stream(StreamError::from(e))
    }
}
