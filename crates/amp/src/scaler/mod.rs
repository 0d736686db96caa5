//! The gradient scaler (`torch.amp.GradScaler`, `torch/amp/grad_scaler.py`): scales the loss
//! so that fp16 gradients do not underflow, unscales the gradients before the optimizer
//! step, skips the step when a gradient overflowed, and grows or backs off the scale.
//!
//! Two ways to drive it:
//! - **PyTorch's eager API**: [`GradScaler::scale_in_place`], [`GradScaler::unscale`],
//!   [`GradScaler::step`] (reads found_inf to the host, as PyTorch's `_maybe_opt_step`
//!   does), [`GradScaler::step_fused`] (PyTorch's `_step_supports_amp_scaling` path: no host
//!   read), [`GradScaler::update`], with PyTorch's per-optimizer state machine and errors.
//! - **Sync-free**: [`GradScaler::unscale_device`] and [`GradScaler::update_device`] enqueue
//!   kernels and read nothing back; optimizers read [`ScalerDeviceState::found_inf`] on the
//!   device and skip themselves, so the whole iteration can be captured into one CUDA graph.
//!
//! Beyond PyTorch: bf16 gradients are accepted (PyTorch's CUDA kernel refuses them), a bf16
//! compute dtype makes the scale a constant 1.0 that still checks for infs, optional
//! `min_scale` / `max_scale` clamps, no allocation per iteration, and skip counters that can
//! be read without a sync on the hot path ([`GradScaler::request_step_stats`]).
mod abi;
mod checkpoint;
mod device_state;
mod error;
mod host_twins;
mod kernels;
pub mod reference;
mod state_machine;

pub use checkpoint::ScalerStateDict;
pub use device_state::{DeviceScalar, ScalerDeviceState, StepStats};
pub use error::ScalerError;
pub use host_twins::register_fake_amp_kernels;
pub use kernels::{ChunkTable, SCALER_KERNELS};
pub use state_machine::{AmpStepArgs, OptimizerId, Stage};

use crate::TensorView;
use device_state::StatsMirror;
use ferrocuda_stream::{Runtime, Stream};
use ferrocuda_types::{DType, DeviceIndex};
use kernels::{ChunkTable as Table, ScalerKernels, cached_table};
use reference::UpdateParams;
use state_machine::OptimizerState;
use std::collections::HashMap;
use std::sync::Arc;

/// How a [`GradScaler`] is made. The default is PyTorch's `GradScaler("cuda")`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale (`init_scale`, 2^16).
    pub init_scale: f64,
    /// Multiplies the scale after `growth_interval` clean steps (2.0; must be > 1).
    pub growth_factor: f64,
    /// Multiplies the scale after a step with an inf/NaN gradient (0.5; must be < 1).
    pub backoff_factor: f64,
    /// Clean steps in a row before a growth (2000).
    pub growth_interval: i32,
    /// `false`: every call is a pass-through, as PyTorch's `enabled=False`.
    pub enabled: bool,
    /// The autocast dtype the gradients come from. `BF16` needs no scaling: the scale is a
    /// constant 1.0, and unscaling is an inf/NaN check that still skips bad steps.
    pub compute_dtype: DType,
    /// A floor for backoff (`None`, as PyTorch: the scale can fall to 0 and stay there).
    pub min_scale: Option<f32>,
    /// A ceiling for growth (`None`, as PyTorch: only growth to inf is refused).
    pub max_scale: Option<f32>,
}

impl Default for GradScalerConfig {
    fn default() -> GradScalerConfig {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
            compute_dtype: DType::F16,
            min_scale: None,
            max_scale: None,
        }
    }
}

/// What exists once the scaler is initialised (PyTorch's lazy `_scale` and
/// `_growth_tracker`, plus the kernels).
#[derive(Debug)]
struct Live {
    state: ScalerDeviceState,
    kernels: ScalerKernels,
    mirror: Option<StatsMirror>,
}

/// A gradient scaler on one device. See the [module docs](self).
#[derive(Debug)]
pub struct GradScaler {
    runtime: Arc<Runtime>,
    device: DeviceIndex,
    config: GradScalerConfig,
    init_growth_tracker: i32,
    live: Option<Live>,
    optimizers: HashMap<OptimizerId, OptimizerState>,
    /// Whether the combined found_inf was zeroed since the last update.
    iteration_open: bool,
    /// The chunk table of the sync-free path's gradient list.
    device_table: Option<Table>,
    /// The chunk table of the last loss scaled.
    loss_table: Option<Table>,
    /// The chunk table of the last [`GradScaler::foreach_non_finite_check_and_unscale_`].
    raw_table: Option<Table>,
    /// The kernels, when the bare op is used without the scaler's state.
    bare_kernels: Option<ScalerKernels>,
}

impl GradScaler {
    /// A scaler for gradients on `device`. Enabled, it checks the factors as PyTorch does;
    /// disabled, it checks nothing. Nothing is allocated before the first use.
    pub fn new(
        runtime: &Arc<Runtime>,
        device: DeviceIndex,
        config: GradScalerConfig,
    ) -> Result<GradScaler, ScalerError> {
        runtime.check_device(device)?;
        if config.enabled {
            if config.growth_factor <= 1.0 {
                return Err(ScalerError::GrowthFactor);
            }
            if config.backoff_factor >= 1.0 {
                return Err(ScalerError::BackoffFactor);
            }
            if let (Some(min), Some(max)) = (config.min_scale, config.max_scale)
                && min > max
            {
                return Err(ScalerError::ScaleClamps { min, max });
            }
        }
        Ok(GradScaler {
            runtime: runtime.clone(),
            device,
            config,
            init_growth_tracker: 0,
            live: None,
            optimizers: HashMap::new(),
            iteration_open: false,
            device_table: None,
            loss_table: None,
            raw_table: None,
            bare_kernels: None,
        })
    }

    /// `is_enabled()`.
    pub fn is_enabled(&self) -> bool {
        self.config.enabled
    }

    /// Whether scaling is a no-op because the compute dtype is bf16.
    pub fn is_bf16_noop(&self) -> bool {
        self.config.compute_dtype == DType::BF16
    }

    /// The device of the scaler's state.
    pub fn device(&self) -> DeviceIndex {
        self.device
    }

    /// The configuration, with the factors as last set.
    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// The scale a fresh state starts from (1.0 under bf16).
    fn initial_scale(&self) -> f32 {
        if self.is_bf16_noop() {
            1.0
        } else {
            self.config.init_scale as f32
        }
    }

    /// The update's parameters (factors of 1.0 under bf16: the scale never moves).
    fn update_params(&self) -> UpdateParams {
        if self.is_bf16_noop() {
            return UpdateParams {
                growth_factor: 1.0,
                backoff_factor: 1.0,
                growth_interval: self.config.growth_interval,
                min_scale: None,
                max_scale: None,
            };
        }
        UpdateParams {
            growth_factor: self.config.growth_factor,
            backoff_factor: self.config.backoff_factor,
            growth_interval: self.config.growth_interval,
            min_scale: self.config.min_scale,
            max_scale: self.config.max_scale,
        }
    }

    fn current_stream(&self) -> Result<Stream, ScalerError> {
        Ok(self.runtime.current_stream(self.device)?)
    }

    /// The device state, made at the first call (PyTorch's lazy init in `scale`): scale,
    /// inverse scale, growth tracker and found_inf at addresses that never change. `None`
    /// when disabled. Call it before capturing an iteration that uses the pointers.
    pub fn device_state(&mut self) -> Result<Option<&ScalerDeviceState>, ScalerError> {
        Ok(self.live()?.map(|l| &l.state))
    }

    fn live(&mut self) -> Result<Option<&mut Live>, ScalerError> {
        if !self.config.enabled {
            return Ok(None);
        }
        if self.live.is_none() {
            let kernels = match self.bare_kernels.take() {
                Some(k) => k,
                None => ScalerKernels::load(&self.runtime, self.device)?,
            };
            let state = ScalerDeviceState::new(
                &self.runtime,
                self.device,
                self.initial_scale(),
                self.init_growth_tracker,
            )?;
            self.live = Some(Live {
                state,
                kernels,
                mirror: None,
            });
        }
        Ok(self.live.as_mut())
    }

    /// `scale(outputs)` for a loss (or any outputs) on the device: multiplies `loss` in place
    /// by the scale, on the current stream, in the loss's dtype (fp16 and bf16 computed in
    /// fp32 and rounded, as PyTorch's `outputs * scale`). Disabled, or bf16: a no-op.
    /// Unlike PyTorch this is in place: a 0-dim fp16 loss stays fp16 (PyTorch promotes it).
    /// Enabled, a view that cannot be real (see [`ChunkTable::new`])
    /// is refused, bf16 included.
    pub fn scale_in_place(&mut self, loss: &TensorView) -> Result<(), ScalerError> {
        if !self.config.enabled {
            return Ok(());
        }
        let stream = self.current_stream()?;
        self.live()?;
        if self.is_bf16_noop() {
            let limit = kernels::list_limit(&self.runtime, self.device)?;
            kernels::check_views(self.device, &[*loss], limit)?;
            return Ok(());
        }
        let live = live_for(&mut self.live, "scale")?;
        let table = cached_table(
            &mut self.loss_table,
            &self.runtime,
            self.device,
            &[*loss],
            &stream,
        )?;
        // The unscale kernel with the scale as its factor: `x * scale` in opmath, rounded.
        let scratch = live.state.scratch().arg();
        live.kernels
            .check_unscale(&stream, table, scratch, scratch, live.state.scale().arg())
    }

    /// `get_scale()`: 1.0 when disabled, the initial scale before the state exists, else the
    /// device value (a host sync).
    #[doc(alias = "get_scale")]
    pub fn scale(&self) -> Result<f64, ScalerError> {
        if !self.config.enabled {
            return Ok(1.0);
        }
        match &self.live {
            None if self.is_bf16_noop() => Ok(1.0),
            None => Ok(self.config.init_scale),
            Some(l) => {
                let w = l.state.read(&self.current_stream()?)?;
                Ok(f64::from(f32::from_bits(w[abi::word::SCALE as usize])))
            }
        }
    }

    /// `_get_growth_tracker()`: 0 when disabled, the initial value before the state exists,
    /// else the device value (a host sync).
    #[doc(alias = "get_growth_tracker")]
    pub fn growth_tracker(&self) -> Result<i32, ScalerError> {
        if !self.config.enabled {
            return Ok(0);
        }
        match &self.live {
            None => Ok(self.init_growth_tracker),
            Some(l) => {
                let w = l.state.read(&self.current_stream()?)?;
                Ok(w[abi::word::GROWTH_TRACKER as usize] as i32)
            }
        }
    }

    /// `get_growth_factor()`.
    #[doc(alias = "get_growth_factor")]
    pub fn growth_factor(&self) -> f64 {
        self.config.growth_factor
    }
    /// `set_growth_factor()`: not checked, as in PyTorch; used from the next update.
    pub fn set_growth_factor(&mut self, v: f64) {
        self.config.growth_factor = v;
    }
    /// `get_backoff_factor()`.
    #[doc(alias = "get_backoff_factor")]
    pub fn backoff_factor(&self) -> f64 {
        self.config.backoff_factor
    }
    /// `set_backoff_factor()`: not checked, as in PyTorch; used from the next update.
    pub fn set_backoff_factor(&mut self, v: f64) {
        self.config.backoff_factor = v;
    }
    /// `get_growth_interval()`.
    #[doc(alias = "get_growth_interval")]
    pub fn growth_interval(&self) -> i32 {
        self.config.growth_interval
    }
    /// `set_growth_interval()`: used from the next update.
    pub fn set_growth_interval(&mut self, v: i32) {
        self.config.growth_interval = v;
    }

    /// Makes the device state and the chunk table of `grads` now (on `stream`), so that
    /// capturing [`GradScaler::unscale_device`] over the same list allocates and copies
    /// nothing. An empty list is refused as `unscale_device` refuses it. Disabled: a no-op.
    pub fn prepare_device(
        &mut self,
        stream: &Stream,
        grads: &[TensorView],
    ) -> Result<(), ScalerError> {
        self.runtime.check_stream(stream)?;
        if self.live()?.is_none() {
            return Ok(());
        }
        refuse_empty(grads)?;
        cached_table(
            &mut self.device_table,
            &self.runtime,
            self.device,
            grads,
            stream,
        )?;
        Ok(())
    }

    /// Sync-free unscale for a captured (or eager) iteration: zeroes the combined found_inf,
    /// then checks and unscales `grads` by the device's `inv_scale` on `stream`, one launch
    /// for the whole list (its chunk table is built at the first call and kept while the
    /// list is unchanged: call once before capturing). Reads nothing back. Refuses fp16
    /// gradients as `unscale_` does, and an empty list: it would record no inf check, so
    /// the step would run unchecked and the update would grow the scale (PyTorch's step and
    /// update both refuse, "No inf checks were recorded ..."). Disabled: a no-op.
    pub fn unscale_device(
        &mut self,
        stream: &Stream,
        grads: &[TensorView],
    ) -> Result<(), ScalerError> {
        self.runtime.check_stream(stream)?;
        if !self.config.enabled {
            return Ok(());
        }
        refuse_empty(grads)?;
        state_machine::refuse_fp16(grads)?;
        self.live()?;
        let live = live_for(&mut self.live, "unscale_device")?;
        let table = cached_table(
            &mut self.device_table,
            &self.runtime,
            self.device,
            grads,
            stream,
        )?;
        let found = live.state.found_inf();
        live.state.zero(found, stream)?;
        live.kernels.check_unscale(
            stream,
            table,
            found.arg(),
            found.arg(),
            live.state.inv_scale().arg(),
        )
    }

    /// PyTorch's `_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`
    /// on `stream` with this scaler's kernels: every element of `grads` (fp32, fp16, bf16 or
    /// fp64, mixed) that is inf/NaN sets `*found_inf` to 1.0 (never clears it); every element
    /// becomes `inv == 1.0 ? v : v * inv` in opmath. fp16 is accepted (the op's contract;
    /// `unscale_` refuses it). Works when disabled too: it is the bare kernel.
    #[doc(alias = "foreach_non_finite_check_and_unscale_")]
    pub fn foreach_non_finite_check_and_unscale(
        &mut self,
        stream: &Stream,
        grads: &[TensorView],
        found_inf: DeviceScalar<f32>,
        inv_scale: DeviceScalar<f32>,
    ) -> Result<(), ScalerError> {
        self.runtime.check_stream(stream)?;
        let kernels = match (&self.live, &self.bare_kernels) {
            (Some(l), _) => l.kernels.clone(),
            (None, Some(k)) => k.clone(),
            (None, None) => self
                .bare_kernels
                .insert(ScalerKernels::load(&self.runtime, self.device)?)
                .clone(),
        };
        let table = cached_table(
            &mut self.raw_table,
            &self.runtime,
            self.device,
            grads,
            stream,
        )?;
        let found = found_inf.arg();
        kernels.check_unscale(stream, table, found, found, inv_scale.arg())
    }

    /// Sync-free update on `stream`: the update kernel reads the combined found_inf, moves
    /// the scale and growth tracker by PyTorch's rule, refreshes `inv_scale` and counts a
    /// skipped step. Reads nothing back. Disabled: a no-op.
    pub fn update_device(&mut self, stream: &Stream) -> Result<(), ScalerError> {
        self.runtime.check_stream(stream)?;
        let params = self.update_params();
        let Some(live) = self.live()? else {
            return Ok(());
        };
        live.kernels.update_scale(
            stream,
            live.state.arg(),
            live.state.found_inf().arg(),
            &params,
        )
    }

    /// Enqueues, on `stream`, a copy of the skip counters to page-locked host memory, for
    /// [`GradScaler::poll_step_stats`] to read once it has landed. No host wait.
    pub fn request_step_stats(&mut self, stream: &Stream) -> Result<(), ScalerError> {
        self.runtime.check_stream(stream)?;
        let runtime = self.runtime.clone();
        let Some(live) = self.live()? else {
            return Ok(());
        };
        if live.mirror.is_none() {
            live.mirror = Some(StatsMirror::new(&runtime)?);
        }
        match &live.mirror {
            Some(m) => m.request(&live.state, stream),
            None => Ok(()),
        }
    }

    /// The counters of the last [`GradScaler::request_step_stats`] if its copy has completed,
    /// else `None` (never waits).
    pub fn poll_step_stats(&self) -> Result<Option<StepStats>, ScalerError> {
        match self.live.as_ref().and_then(|l| l.mirror.as_ref()) {
            Some(m) => m.poll(),
            None => Ok(None),
        }
    }

    /// The skip counters now, after the work enqueued on the current stream (a host sync).
    /// Zeros when disabled or before the state exists.
    pub fn step_stats(&self) -> Result<StepStats, ScalerError> {
        match &self.live {
            Some(l) => l.state.stats(&self.current_stream()?),
            None => Ok(StepStats::default()),
        }
    }
}

/// PyTorch's "No inf checks were recorded for this optimizer." for a list with nothing to
/// check, on the sync-free path.
fn refuse_empty(grads: &[TensorView]) -> Result<(), ScalerError> {
    if grads.is_empty() {
        return Err(ScalerError::NoInfChecksForOptimizer);
    }
    Ok(())
}

/// The state for `op`, which PyTorch refuses before the first `scale`.
fn live_for<'a>(live: &'a mut Option<Live>, op: &'static str) -> Result<&'a mut Live, ScalerError> {
    live.as_mut().ok_or(ScalerError::NotInitialized { op })
}
