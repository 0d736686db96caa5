//! One mixed-precision optimizer iteration with no host sync, capturable whole.
//!
//! PyTorch's `GradScaler.step` reads `found_inf` on the host (`_maybe_opt_step`,
//! `torch/amp/grad_scaler.py`) to decide whether to step: one stream sync per iteration,
//! and no CUDA-graph capture of the step. [`ScaledStep`] enqueues the same iteration with
//! the decision left on the device: zero `found_inf`, check and unscale the gradients by
//! the device's `inv_scale`, step the optimizer (which skips itself where `found_inf` is
//! set), update the scale and growth tracker. Every buffer exists before the first
//! iteration, so an iteration captured into a CUDA graph (`ferrocuda_graph::CudaGraph`)
//! replays as the eager one, skipped steps included. Whether a step was skipped is read
//! lazily ([`GradScaler::request_step_stats`] / [`GradScaler::poll_step_stats`]).
use crate::TensorView;
use crate::optim::{DeviceOptimizer, OptimError};
use crate::scaler::{GradScaler, ScalerError};
use ferrocuda_stream::Stream;

/// What can go wrong enqueueing a [`ScaledStep`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError {
    /// The scaler refused or failed (fp16 gradients, a launch, an allocation).
    #[error(transparent)]
    Scaler(#[from] ScalerError),
    /// The gradient list is not the optimizer's ([`DeviceOptimizer::grads`]: the same
    /// views, in parameter order): the optimizer would step on gradients never unscaled.
    #[error(
        "ScaledStep got {given} gradients that are not the optimizer's {expected} (the same views, in parameter order): the optimizer would step on gradients never unscaled"
    )]
    GradsMismatch {
        /// Gradients given.
        given: usize,
        /// Gradients the optimizer reads.
        expected: usize,
    },
    /// The optimizer failed to enqueue its step.
    #[error(transparent)]
    Optim(#[from] OptimError),
}

/// A gradient scaler and an optimizer stepping together without a host sync.
#[derive(Debug)]
pub struct ScaledStep<O: DeviceOptimizer> {
    scaler: GradScaler,
    optimizer: O,
    grads: Vec<TensorView>,
}

impl<O: DeviceOptimizer> ScaledStep<O> {
    /// Ties `scaler` to `optimizer`, whose gradients are `grads` (the arrays the backward
    /// pass writes, scaled by the scaler's scale). Makes the scaler's device state and the
    /// table of `grads` now, on `stream`, so that capturing [`ScaledStep::run`] allocates
    /// and copies nothing. A disabled scaler makes this a plain optimizer step.
    ///
    /// `grads` must be the optimizer's gradients ([`DeviceOptimizer::grads`]: the same
    /// views, in parameter order), else [`StepError::GradsMismatch`]: the optimizer would
    /// step on gradients that were never unscaled or checked. An enabled scaler also refuses
    /// an empty list with PyTorch's "No inf checks were recorded for this optimizer."
    pub fn new(
        mut scaler: GradScaler,
        optimizer: O,
        grads: Vec<TensorView>,
        stream: &Stream,
    ) -> Result<ScaledStep<O>, StepError> {
        if scaler.is_enabled() && grads.is_empty() {
            return Err(ScalerError::NoInfChecksForOptimizer.into());
        }
        let expected = optimizer.grads();
        if grads != expected {
            return Err(StepError::GradsMismatch {
                given: grads.len(),
                expected: expected.len(),
            });
        }
        scaler.prepare_device(stream, &grads)?;
        Ok(ScaledStep {
            scaler,
            optimizer,
            grads,
        })
    }

    /// Enqueues one iteration's step on `stream`: zero `found_inf`, check and unscale the
    /// gradients, the optimizer's step (skipped on the device when a gradient was not
    /// finite), the scale update. Reads nothing back.
    pub fn run(&mut self, stream: &Stream) -> Result<(), StepError> {
        self.scaler.unscale_device(stream, &self.grads)?;
        let found_inf = self
            .scaler
            .device_state()?
            .map(|state| state.found_inf().ptr());
        self.optimizer.step(stream, found_inf)?;
        self.scaler.update_device(stream)?;
        Ok(())
    }

    /// The scaler (its scale, checkpoints, step statistics).
    pub fn scaler(&self) -> &GradScaler {
        &self.scaler
    }

    /// The scaler, to change its factors or request its step statistics.
    pub fn scaler_mut(&mut self) -> &mut GradScaler {
        &mut self.scaler
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &O {
        &self.optimizer
    }

    /// The optimizer, to change its learning rate.
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.optimizer
    }

    /// The scaler and the optimizer, apart again.
    pub fn into_parts(self) -> (GradScaler, O) {
        (self.scaler, self.optimizer)
    }
}
