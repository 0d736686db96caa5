//! SGD with momentum (`torch/optim/sgd.py`), as one fused multi-tensor launch per step.
use super::kernels::{FLAG_MAXIMIZE, FLAG_VARIANT};
use super::{
    DeviceOptimizer, OptimError, Param, StepCore, StepCounts, invalid, load_kernel,
    optional_buffer, optional_ptr,
};
use crate::TensorView;
use ferrocuda_stream::{DeviceBuffer, Function, Runtime, Stream};
use ferrocuda_types::{DeviceIndex, DevicePtr, KernelArg};
use std::sync::Arc;

/// SGD's hyperparameters, with PyTorch's defaults.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (`lr=1e-3`).
    pub lr: f32,
    /// Momentum factor (0: no momentum buffer).
    pub momentum: f32,
    /// Dampening of the gradient's contribution to the momentum.
    pub dampening: f32,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Maximize the objective instead of minimizing it.
    pub maximize: bool,
}

impl Default for SgdConfig {
    fn default() -> SgdConfig {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
}

impl SgdConfig {
    /// PyTorch's constructor checks (`torch/optim/sgd.py`, `SGD.__init__`), in its order,
    /// with its messages. They are Python's `<` comparisons, so NaN passes every one (and
    /// `dampening` is checked only against Nesterov).
    fn validate(&self) -> Result<(), OptimError> {
        if self.lr < 0.0 {
            return Err(invalid("learning rate", self.lr));
        }
        if self.momentum < 0.0 {
            return Err(invalid("momentum value", self.momentum));
        }
        if self.weight_decay < 0.0 {
            return Err(invalid("weight_decay value", self.weight_decay));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(OptimError::InvalidHyperparameter(
                "Nesterov momentum requires a momentum and zero dampening".into(),
            ));
        }
        Ok(())
    }
}

/// SGD over a fixed set of f32 parameters, every tensor in one launch.
///
/// Per element, each operation rounded once (PyTorch's `_single_tensor_sgd`):
/// `g = ±grad (+ weight_decay * p)`; with momentum, `buf = g` on the first applied step, else
/// `buf = buf * momentum + (1 - dampening) * g`, then `g = g + momentum * buf` (Nesterov) or
/// `g = buf`; finally `p = p + (-lr) * g`. "First" is read from the device step count, so a
/// capture taken before the first step still initialises the buffer on its first replay.
#[derive(Debug)]
pub struct Sgd {
    core: StepCore,
    momentum_buffer: Option<DeviceBuffer<f32>>,
    kernel: Function,
    config: SgdConfig,
}

impl Sgd {
    /// An optimizer over `params` (all on one device), its state allocated now.
    pub fn new(rt: &Arc<Runtime>, params: &[Param], config: SgdConfig) -> Result<Sgd, OptimError> {
        config.validate()?;
        let core = StepCore::new(rt, params, config.lr)?;
        let momentum_buffer = if config.momentum != 0.0 {
            Some(core.zeros(rt)?)
        } else {
            None
        };
        Ok(Sgd {
            kernel: load_kernel(rt, core.device, "sgd_multi_tensor")?,
            core: core.ready(rt)?,
            momentum_buffer,
            config,
        })
    }

    /// The hyperparameters (`lr` as last set).
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// Sets the learning rate in `stream` order; captured steps replayed later use it too.
    pub fn set_lr(&mut self, stream: &Stream, lr: f32) -> Result<(), OptimError> {
        SgdConfig { lr, ..self.config }.validate()?;
        self.core.scalars.set_lr(stream, lr)?;
        self.config.lr = lr;
        Ok(())
    }

    /// The momentum buffers of every parameter, one after another in parameter order
    /// (`None` without momentum).
    pub fn momentum_buffer(&self) -> Option<&DeviceBuffer<f32>> {
        self.momentum_buffer.as_ref()
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

impl DeviceOptimizer for Sgd {
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
        let buffer = self.momentum_buffer.as_ref().map(TensorView::of);
        buffer
            .into_iter()
            .chain([self.core.scalars_view()])
            .collect()
    }

    fn step(&mut self, stream: &Stream, found_inf: Option<DevicePtr>) -> Result<(), OptimError> {
        let c = &self.config;
        let flags = u32::from(c.maximize) * FLAG_MAXIMIZE + u32::from(c.nesterov) * FLAG_VARIANT;
        self.core.scalars.advance(stream, found_inf, (0.0, 0.0))?;
        let device = self.core.device;
        let args = [
            optional_ptr(device, found_inf),
            self.core.scalars.buf.arg(),
            optional_buffer(device, self.momentum_buffer.as_ref()),
            KernelArg::value(&c.momentum),
            KernelArg::value(&c.dampening),
            KernelArg::value(&c.weight_decay),
            KernelArg::value(&flags),
        ];
        self.core.table.launch(stream, &self.kernel, &args)
    }
}
