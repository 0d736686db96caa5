//! AdamW (`torch/optim/adamw.py`, fused form), as one prologue and one fused multi-tensor
//! launch per step.
use super::kernels::{FLAG_MAXIMIZE, FLAG_VARIANT};
use super::{
    DeviceOptimizer, OptimError, Param, StepCore, StepCounts, invalid, load_kernel,
    optional_buffer, optional_ptr,
};
use crate::TensorView;
use ferrocuda_stream::{DeviceBuffer, Function, Runtime, Stream};
use ferrocuda_types::{DeviceIndex, DevicePtr, KernelArg};
use std::sync::Arc;

/// AdamW's hyperparameters, with PyTorch's defaults.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (`lr=1e-3`).
    pub lr: f32,
    /// Decay rates of the first and second moments (`betas=(0.9, 0.999)`).
    pub betas: (f32, f32),
    /// Added to the denominator (`eps=1e-8`).
    pub eps: f32,
    /// Decoupled weight decay (`weight_decay=1e-2`).
    pub weight_decay: f32,
    /// Use the running maximum of the second moment (AMSGrad).
    pub amsgrad: bool,
    /// Maximize the objective instead of minimizing it.
    pub maximize: bool,
}

impl Default for AdamWConfig {
    fn default() -> AdamWConfig {
        AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
            amsgrad: false,
            maximize: false,
        }
    }
}

impl AdamWConfig {
    /// PyTorch's constructor checks (`torch/optim/adamw.py`, as `torch/optim/adam.py`), in
    /// its order, with its messages: `not 0.0 <= lr`, `not 0.0 <= eps`,
    /// `not 0.0 <= betas[i] < 1.0`, `not 0.0 <= weight_decay` (written as range tests, the
    /// same comparisons), so NaN fails every one and inf passes all but the betas.
    fn validate(&self) -> Result<(), OptimError> {
        if !(0.0..).contains(&self.lr) {
            return Err(invalid("learning rate", self.lr));
        }
        if !(0.0..).contains(&self.eps) {
            return Err(invalid("epsilon value", self.eps));
        }
        for (i, beta) in [self.betas.0, self.betas.1].into_iter().enumerate() {
            if !(0.0..1.0).contains(&beta) {
                return Err(invalid(format_args!("beta parameter at index {i}"), beta));
            }
        }
        if !(0.0..).contains(&self.weight_decay) {
            return Err(invalid("weight_decay value", self.weight_decay));
        }
        Ok(())
    }
}

/// AdamW over a fixed set of f32 parameters, every tensor in one launch (PyTorch's
/// `fused=True, capturable=True`).
///
/// The prologue computes, on the device and only for applied steps, `step += 1`,
/// `bc1 = f32(1 - beta1^step)` and `bc2_sqrt = f32(sqrt(1 - beta2^step))` in f64 (as PyTorch's
/// fused kernel does, the powers by repeated squaring). Then per element, in f32, each
/// operation rounded once (`aten/src/ATen/native/cuda/fused_adam_utils.cuh` `adam_math`,
/// ADAMW mode): `g = ±grad`; `p = p - (lr * weight_decay) * p`;
/// `m = beta1 * m + (1 - beta1) * g`; `v = beta2 * v + (1 - beta2) * g * g`;
/// with AMSGrad `vmax = max(vmax, v)` and `v̂ = vmax`, else `v̂ = v`;
/// `p = p - (lr / bc1) * m / (sqrt(v̂) / bc2_sqrt + eps)`.
/// PyTorch's fused kernel keeps the hyperparameters in f64; here they are f32.
#[derive(Debug)]
pub struct AdamW {
    core: StepCore,
    exp_avg: DeviceBuffer<f32>,
    exp_avg_sq: DeviceBuffer<f32>,
    max_exp_avg_sq: Option<DeviceBuffer<f32>>,
    kernel: Function,
    config: AdamWConfig,
}

impl AdamW {
    /// An optimizer over `params` (all on one device), its state allocated now.
    pub fn new(
        rt: &Arc<Runtime>,
        params: &[Param],
        config: AdamWConfig,
    ) -> Result<AdamW, OptimError> {
        config.validate()?;
        let core = StepCore::new(rt, params, config.lr)?;
        let (exp_avg, exp_avg_sq) = (core.zeros(rt)?, core.zeros(rt)?);
        let max_exp_avg_sq = if config.amsgrad {
            Some(core.zeros(rt)?)
        } else {
            None
        };
        Ok(AdamW {
            kernel: load_kernel(rt, core.device, "adamw_multi_tensor")?,
            core: core.ready(rt)?,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
            config,
        })
    }

    /// The hyperparameters (`lr` as last set).
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Sets the learning rate in `stream` order; captured steps replayed later use it too.
    pub fn set_lr(&mut self, stream: &Stream, lr: f32) -> Result<(), OptimError> {
        AdamWConfig { lr, ..self.config }.validate()?;
        self.core.scalars.set_lr(stream, lr)?;
        self.config.lr = lr;
        Ok(())
    }

    /// The first moments of every parameter, one after another in parameter order.
    pub fn exp_avg(&self) -> &DeviceBuffer<f32> {
        &self.exp_avg
    }

    /// The second moments, laid out as [`exp_avg`](AdamW::exp_avg).
    pub fn exp_avg_sq(&self) -> &DeviceBuffer<f32> {
        &self.exp_avg_sq
    }

    /// The running maxima of the second moments (AMSGrad only).
    pub fn max_exp_avg_sq(&self) -> Option<&DeviceBuffer<f32>> {
        self.max_exp_avg_sq.as_ref()
    }

    /// Steps taken and skipped, after `stream`'s work. Syncs with the host.
    pub fn counts(&self, stream: &Stream) -> Result<StepCounts, OptimError> {
        self.core.scalars.counts(stream)
    }

    /// The device counters `[steps taken, steps skipped, ..]` (f32), for reading lazily.
    pub fn counters(&self) -> TensorView {
        self.core.scalars_view()
    }
}

impl DeviceOptimizer for AdamW {
    fn device(&self) -> DeviceIndex {
        self.core.device
    }

    fn params(&self) -> Vec<TensorView> {
        self.core.params.clone()
    }

    fn grads(&self) -> Vec<TensorView> {
        self.core.grads.clone()
    }

    fn state_tensors(&self) -> Vec<TensorView> {
        let max = self.max_exp_avg_sq.as_ref().map(TensorView::of);
        [
            TensorView::of(&self.exp_avg),
            TensorView::of(&self.exp_avg_sq),
        ]
        .into_iter()
        .chain(max)
        .chain([self.core.scalars_view()])
        .collect()
    }

    fn step(&mut self, stream: &Stream, found_inf: Option<DevicePtr>) -> Result<(), OptimError> {
        let c = &self.config;
        let flags = u32::from(c.maximize) * FLAG_MAXIMIZE + u32::from(c.amsgrad) * FLAG_VARIANT;
        self.core.scalars.advance(stream, found_inf, c.betas)?;
        let device = self.core.device;
        let args = [
            optional_ptr(device, found_inf),
            self.core.scalars.buf.arg(),
            self.exp_avg.arg(),
            self.exp_avg_sq.arg(),
            optional_buffer(device, self.max_exp_avg_sq.as_ref()),
            KernelArg::value(&c.betas.0),
            KernelArg::value(&c.betas.1),
            KernelArg::value(&c.eps),
            KernelArg::value(&c.weight_decay),
            KernelArg::value(&flags),
        ];
        self.core.table.launch(stream, &self.kernel, &args)
    }
}
