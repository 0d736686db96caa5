//! PyTorch's per-optimizer state machine (`torch/amp/grad_scaler.py`, `OptState`):
//! `unscale_`, `step` (generic and fused), `update`, with PyTorch's errors.
//!
//! | stage | `unscale_` | `step` | `update` |
//! | --- | --- | --- | --- |
//! | Ready | unscale → Unscaled | unscale (fused: check only) then step → Stepped | → Ready |
//! | Unscaled | error | step with the recorded found_inf → Stepped | → Ready |
//! | Stepped | error | error | → Ready |
//!
//! Each optimizer has its own found_inf on the device (made at its first use, then reused),
//! so one optimizer's overflow skips only its own step, as in PyTorch; the check kernel also
//! sets the scaler's combined found_inf, which the update reads (PyTorch sums the
//! optimizers' flags into it).
use super::device_state::DeviceScalar;
use super::error::ScalerError;
use super::kernels::{ChunkTable, cached_table};
use super::{GradScaler, live_for};
use crate::TensorView;
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_types::DType;
use std::sync::atomic::{AtomicU64, Ordering};

/// Names an optimizer for the scaler (PyTorch keys its states by `id(optimizer)`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OptimizerId(pub u64);

impl OptimizerId {
    /// An id no other call of `fresh` in this process returns.
    pub fn fresh() -> OptimizerId {
        static NEXT: AtomicU64 = AtomicU64::new(1 << 32);
        OptimizerId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// Where an optimizer is in the iteration (PyTorch's `OptState`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Nothing done since the last `update` (or ever).
    Ready,
    /// `unscale_` ran.
    Unscaled,
    /// `step` ran.
    Stepped,
}

/// What a scaling-aware (fused) optimizer gets from [`GradScaler::step_fused`]: PyTorch's
/// `optimizer.grad_scale` and `optimizer.found_inf`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AmpStepArgs {
    /// The scale to divide the gradients by inside the optimizer kernel; `None` when they
    /// were already unscaled by an explicit `unscale_`.
    pub grad_scale: Option<DeviceScalar<f32>>,
    /// Non-zero when a gradient was non-finite: the kernel must leave everything untouched.
    pub found_inf: DeviceScalar<f32>,
}

#[derive(Debug)]
pub(crate) struct OptimizerState {
    stage: Stage,
    /// This optimizer's found_inf (stable address).
    found_inf: DeviceBuffer<f32>,
    /// Whether an inf check ran this iteration (PyTorch: `found_inf_per_device` not empty).
    recorded: bool,
    table: Option<ChunkTable>,
}

impl OptimizerState {
    fn found_inf(&self) -> DeviceScalar<f32> {
        DeviceScalar::of(&self.found_inf)
    }

    /// Whether `grads` is the list this iteration's check ran on (its table describes it;
    /// an empty list leaves no table).
    fn checked(&self, grads: &[TensorView]) -> bool {
        match &self.table {
            Some(table) => table.describes(grads),
            None => grads.is_empty(),
        }
    }
}

/// `_unscale_grads_(allow_fp16=False)`'s refusal.
pub(crate) fn refuse_fp16(grads: &[TensorView]) -> Result<(), ScalerError> {
    if grads.iter().any(|g| g.dtype == DType::F16) {
        return Err(ScalerError::Fp16Gradients);
    }
    Ok(())
}

/// Which inverse scale a check uses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Pass {
    /// Check and unscale by `inv_scale`.
    Unscale,
    /// Check only (inverse scale 1.0): the fused path's `_check_inf_per_device`.
    CheckOnly,
}

impl GradScaler {
    /// The stage of `opt` (`Ready` for an optimizer never seen).
    pub fn stage(&self, opt: OptimizerId) -> Stage {
        self.optimizers.get(&opt).map_or(Stage::Ready, |s| s.stage)
    }

    /// Frees what the scaler keeps for `opt` (its found_inf and chunk table).
    pub fn forget_optimizer(&mut self, opt: OptimizerId) {
        self.optimizers.remove(&opt);
    }

    /// `unscale_(optimizer)`: divides `grads` (the optimizer's gradients, in parameter order)
    /// by the scale in place and records whether any was inf/NaN; no host sync. Refuses fp16
    /// gradients, as PyTorch does. Disabled: a no-op.
    #[doc(alias = "unscale_")]
    pub fn unscale(&mut self, opt: OptimizerId, grads: &[TensorView]) -> Result<(), ScalerError> {
        if !self.config.enabled {
            return Ok(());
        }
        live_for(&mut self.live, "unscale_")?;
        match self.stage(opt) {
            Stage::Unscaled => return Err(ScalerError::UnscaleAlreadyCalled),
            Stage::Stepped => return Err(ScalerError::UnscaleAfterStep),
            Stage::Ready => {}
        }
        refuse_fp16(grads)?;
        self.record(opt, grads, Pass::Unscale)?.stage = Stage::Unscaled;
        Ok(())
    }

    /// Runs the inf check of `pass` for `opt` into its found_inf (zeroed first) and the
    /// combined one (zeroed at the iteration's first check).
    fn record(
        &mut self,
        opt: OptimizerId,
        grads: &[TensorView],
        pass: Pass,
    ) -> Result<&mut OptimizerState, ScalerError> {
        let stream = self.runtime.current_stream(self.device)?;
        let live = live_for(&mut self.live, "unscale_")?;
        let combined = live.state.found_inf();
        if !self.iteration_open {
            live.state.zero(combined, &stream)?;
            self.iteration_open = true;
        }
        let st = match self.optimizers.entry(opt) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(OptimizerState {
                stage: Stage::Ready,
                found_inf: DeviceBuffer::uninit(&self.runtime, self.device, 1)?,
                recorded: false,
                table: None,
            }),
        };
        live.state.zero(st.found_inf(), &stream)?;
        if grads.is_empty() {
            st.table = None;
            return Ok(st);
        }
        let inv = match pass {
            Pass::Unscale => live.state.inv_scale(),
            Pass::CheckOnly => live.state.one(),
        };
        let found = st.found_inf();
        let table = cached_table(&mut st.table, &self.runtime, self.device, grads, &stream)?;
        live.kernels
            .check_unscale(&stream, table, found.arg(), combined.arg(), inv.arg())?;
        st.recorded = true;
        Ok(st)
    }

    /// `step(optimizer)` on PyTorch's generic path: unscales `grads` if `unscale_` was not
    /// called, reads the optimizer's found_inf to the host (a sync, as PyTorch's
    /// `_maybe_opt_step`), and runs `optimizer_step` only if every gradient was finite.
    /// Returns `None` when the step was skipped (PyTorch returns `None` both ways).
    /// No gradients is PyTorch's "No inf checks were recorded for this optimizer."; after
    /// `unscale_`, `grads` must be the list it unscaled ([`ScalerError::GradsChanged`]).
    /// Disabled: runs the step.
    pub fn step<R>(
        &mut self,
        opt: OptimizerId,
        grads: &[TensorView],
        optimizer_step: impl FnOnce() -> R,
    ) -> Result<Option<R>, ScalerError> {
        if !self.config.enabled {
            return Ok(Some(optimizer_step()));
        }
        live_for(&mut self.live, "step")?;
        match self.stage(opt) {
            Stage::Stepped => return Err(ScalerError::StepAlreadyCalled),
            Stage::Ready => self.unscale(opt, grads)?,
            Stage::Unscaled => self.check_unscaled(opt, grads)?,
        }
        let st = self
            .optimizers
            .get_mut(&opt)
            .filter(|s| s.recorded)
            .ok_or(ScalerError::NoInfChecksForOptimizer)?;
        let found = st.found_inf.to_host()?;
        let result = (found.iter().sum::<f32>() == 0.0).then(optimizer_step);
        st.stage = Stage::Stepped;
        Ok(result)
    }

    /// `step(optimizer)` on PyTorch's `_step_supports_amp_scaling` path, for an optimizer
    /// whose kernels read found_inf (and divide by the scale) on the device: if `unscale_`
    /// was not called, checks `grads` for inf/NaN without unscaling (fp16 allowed) and passes
    /// the scale as `grad_scale`; then runs `optimizer_step` with no host sync. After
    /// `unscale_`, `grads` must be the list it unscaled ([`ScalerError::GradsChanged`]).
    /// No gradients is not an error, as in PyTorch (whose found_inf is then `sum([]) == 0`):
    /// `found_inf` points at 0.0 and the optimizer (with nothing to update) steps; nothing is
    /// recorded, so an `update` with no other optimizer checked is still refused. Disabled:
    /// runs it with `None`.
    pub fn step_fused<R>(
        &mut self,
        opt: OptimizerId,
        grads: &[TensorView],
        optimizer_step: impl FnOnce(Option<&AmpStepArgs>) -> R,
    ) -> Result<R, ScalerError> {
        if !self.config.enabled {
            return Ok(optimizer_step(None));
        }
        let scale = live_for(&mut self.live, "step")?.state.scale();
        let grad_scale = match self.stage(opt) {
            Stage::Stepped => return Err(ScalerError::StepAlreadyCalled),
            Stage::Ready => {
                self.record(opt, grads, Pass::CheckOnly)?;
                Some(scale)
            }
            Stage::Unscaled => {
                self.check_unscaled(opt, grads)?;
                None
            }
        };
        // Made by the check (or by `unscale_`), recorded or not.
        let st = self
            .optimizers
            .get_mut(&opt)
            .ok_or(ScalerError::NoInfChecksForOptimizer)?;
        let args = AmpStepArgs {
            grad_scale,
            found_inf: st.found_inf(),
        };
        let result = optimizer_step(Some(&args));
        st.stage = Stage::Stepped;
        Ok(result)
    }

    /// Refuses a step after `unscale_` on other gradients than the ones it unscaled.
    fn check_unscaled(&self, opt: OptimizerId, grads: &[TensorView]) -> Result<(), ScalerError> {
        match self.optimizers.get(&opt) {
            Some(st) if st.checked(grads) => Ok(()),
            _ => Err(ScalerError::GradsChanged),
        }
    }

    /// `update()`: moves the scale by PyTorch's rule from the combined found_inf of every
    /// optimizer checked since the last update (a kernel on the current stream, no host
    /// sync), and makes every optimizer Ready. Disabled: a no-op.
    pub fn update(&mut self) -> Result<(), ScalerError> {
        if !self.config.enabled {
            return Ok(());
        }
        let params = self.update_params();
        let stream = self.runtime.current_stream(self.device)?;
        let live = live_for(&mut self.live, "update")?;
        if !self.optimizers.values().any(|s| s.recorded) {
            return Err(ScalerError::NoInfChecksBeforeUpdate);
        }
        live.kernels.update_scale(
            &stream,
            live.state.arg(),
            live.state.found_inf().arg(),
            &params,
        )?;
        self.reset_optimizers();
        Ok(())
    }

    /// `update(new_scale)`: sets the scale (and its inverse) from the host; the growth
    /// tracker is untouched and the iteration's inf checks are dropped. Every optimizer
    /// becomes Ready. Under a bf16 compute dtype the scale stays 1.0. Disabled: a no-op.
    pub fn update_to(&mut self, new_scale: f32) -> Result<(), ScalerError> {
        if !self.config.enabled {
            return Ok(());
        }
        let stream = self.runtime.current_stream(self.device)?;
        let bf16 = self.is_bf16_noop();
        let live = live_for(&mut self.live, "update")?;
        if !bf16 {
            live.state.write_scale(new_scale, &stream)?;
        }
        self.reset_optimizers();
        Ok(())
    }

    fn reset_optimizers(&mut self) {
        for s in self.optimizers.values_mut() {
            s.stage = Stage::Ready;
            s.recorded = false;
        }
        self.iteration_open = false;
    }
}
