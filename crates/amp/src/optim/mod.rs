//! Optimizers with a sync-free, graph-capturable step.
//!
//! PyTorch decides on the host whether to skip a step after an inf/NaN gradient: its generic
//! `GradScaler.step` reads `found_inf` with `.item()` (`torch/amp/grad_scaler.py`
//! `_maybe_opt_step`), a full stream sync that also forbids CUDA-graph capture. Only its
//! fused optimizers (`_fused_sgd_`, `_fused_adamw_`) read `found_inf` on the device. Here
//! every optimizer does: [`DeviceOptimizer::step`] takes the scaler's `found_inf` (one f32 on
//! the device, `0.0` when every gradient was finite) and the kernels return at once when it
//! is non-zero, leaving parameters, optimizer state and the step count as they were.
//!
//! Why it is capturable (PyTorch's `capturable=True`): every buffer is allocated at
//! construction (momentum, moments, the multi-tensor tables, the step scalars), the step
//! count, learning rate and Adam's bias corrections live on the device, and a step is a
//! fixed sequence of launches with fixed arguments: a one-thread prologue that advances the
//! step count (or counts a skip), then one multi-tensor launch over every parameter. So a
//! captured step replays exactly as an eager one, including steps that skip.
//!
//! Optimizers without a fused kernel get the same contract from [`Masked`], which snapshots
//! what the step writes when `found_inf` is set and restores it afterwards.
//!
//! Parameters are f32; gradients are f32, f16 or bf16 (upcast exactly in the kernel), and
//! arrive already unscaled. Parameter and gradient addresses are fixed at construction, as a
//! graph needs: zero gradients in place rather than reallocating them.
mod adamw;
mod kernels;
mod masked;
mod python_repr;
mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use kernels::{OPTIM_KERNELS, register_fake_optim_kernels};
pub use masked::Masked;
pub use sgd::{Sgd, SgdConfig};

use crate::TensorView;
use ferrocuda_stream::{DeviceBuffer, Function, Module, Runtime, Stream, StreamError};
use ferrocuda_types::{DType, DeviceIndex, DevicePtr, KernelArg, LaunchConfig};
use kernels::{CHUNK, GRAD_BF16, GRAD_F16, GRAD_F32, LR, SCALARS, SKIPPED, STEP, THREADS};
use std::sync::Arc;

/// What can go wrong building or stepping an optimizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    /// A launch, an allocation or a copy failed.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// A parameter or gradient view whose bytes run past the end of the address space.
    #[error(transparent)]
    ViewOutOfRange(#[from] crate::ViewOutOfRange),
    /// A hyperparameter out of range; the message is PyTorch's (`torch/optim/sgd.py`,
    /// `torch/optim/adamw.py` constructors), the value printed as Python's `repr` prints a
    /// float (`-1.0`, `1e-08`, `nan`, `inf`).
    #[error("{0}")]
    InvalidHyperparameter(String),
    /// A parameter or gradient on another device than the first parameter.
    #[error("parameter {index}: its {what} is on {found}, the optimizer's device is {expected}")]
    DeviceMismatch {
        /// The parameter's position.
        index: usize,
        /// "parameter" or "gradient".
        what: &'static str,
        /// The device of the first parameter.
        expected: DeviceIndex,
        /// Where this one lives.
        found: DeviceIndex,
    },
    /// A dtype the kernels do not take.
    #[error("parameter {index}: its {what} has dtype {dtype:?}; supported: {supported}")]
    UnsupportedDtype {
        /// The parameter's position.
        index: usize,
        /// "parameter" or "gradient".
        what: &'static str,
        /// The dtype found.
        dtype: DType,
        /// The dtypes accepted.
        supported: &'static str,
    },
    /// A gradient whose length differs from its parameter's.
    #[error("parameter {index} has {param} elements but its gradient has {grad}")]
    LengthMismatch {
        /// The parameter's position.
        index: usize,
        /// Elements of the parameter.
        param: u64,
        /// Elements of the gradient.
        grad: u64,
    },
    /// Parameters (or, for [`Masked`], parameters and state arrays) whose bytes add up to
    /// more than the device's memory: views that cannot be real (a wrong length), refused
    /// at the first view past the limit, before any table is built.
    #[error("parameters of {bytes} bytes or more: more than the device's {limit} bytes")]
    TooLargeForDevice {
        /// The bytes of the views in all (saturating).
        bytes: u64,
        /// The device's memory.
        limit: u64,
    },
    /// More work than one multi-tensor launch can address.
    #[error("{chunks} chunks of {CHUNK} elements in one launch: at most 2^31 - 1")]
    TooLarge {
        /// Chunks needed.
        chunks: u64,
    },
    /// No parameters (PyTorch: "optimizer got an empty parameter list").
    #[error("optimizer got an empty parameter list")]
    NoParameters,
}

/// One parameter and its gradient, both on the device. The gradient's address must stay
/// the same for the optimizer's life.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// The parameter (f32; the master weights under mixed precision).
    pub param: TensorView,
    /// Its gradient (f32, f16 or bf16), already unscaled.
    pub grad: TensorView,
}

/// How many steps an optimizer took and skipped, read from its device counters.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct StepCounts {
    /// Steps applied (PyTorch's `state['step']`).
    pub taken: u64,
    /// Steps skipped because `found_inf` was set.
    pub skipped: u64,
}

/// An optimizer whose step decides on the device whether to apply itself.
pub trait DeviceOptimizer: std::fmt::Debug {
    /// The device it works on.
    fn device(&self) -> DeviceIndex;

    /// The parameters it updates, in order.
    fn params(&self) -> Vec<TensorView>;

    /// The gradients its step reads, in the order of [`params`](DeviceOptimizer::params):
    /// what the gradient scaler must unscale (and check) before the step.
    fn grads(&self) -> Vec<TensorView>;

    /// Every other device array a step writes (momentum, moments, counters): with
    /// [`params`](DeviceOptimizer::params), all a step changes. [`Masked`] restores these.
    fn state_tensors(&self) -> Vec<TensorView>;

    /// Enqueues one step on `stream`, with no host sync and no allocation. When `found_inf`
    /// points at a non-zero f32, the step leaves every parameter, every state array and the
    /// step count unchanged. `None` always steps.
    fn step(&mut self, stream: &Stream, found_inf: Option<DevicePtr>) -> Result<(), OptimError>;
}

/// PyTorch's `ValueError(f"Invalid {what}: {value}")` of an optimizer constructor, the value
/// printed as Python prints a float.
fn invalid(what: impl std::fmt::Display, value: f32) -> OptimError {
    OptimError::InvalidHyperparameter(format!(
        "Invalid {what}: {}",
        python_repr::python_repr(value)
    ))
}

/// Null pointer bytes, for an absent device-pointer argument.
const NULL: [u8; 8] = [0; 8];

/// A device-pointer kernel argument that may be null.
fn optional_ptr(device: DeviceIndex, ptr: Option<DevicePtr>) -> KernelArg<'static> {
    match ptr {
        Some(ptr) => KernelArg::Ptr { device, ptr },
        None => KernelArg::Value(&NULL),
    }
}

/// A buffer's address as a kernel argument, null when absent.
fn optional_buffer(device: DeviceIndex, buf: Option<&DeviceBuffer<f32>>) -> KernelArg<'static> {
    optional_ptr(device, buf.map(DeviceBuffer::ptr))
}

/// Loads one of [`OPTIM_KERNELS`] (through the runtime's kernel cache).
fn load_kernel(rt: &Runtime, device: DeviceIndex, name: &str) -> Result<Function, StreamError> {
    if let Some(fake) = rt.fake() {
        kernels::provide_fake_optim_kernels(fake);
    }
    Module::from_cuda_source(rt, device, "ferrocuda_amp_optim", OPTIM_KERNELS)?.function(name)
}

/// The two device tables of a multi-tensor launch (see [`kernels`]).
#[derive(Debug)]
struct LaunchTable {
    /// The rows, as `i64` (the same bits: the kernels read `u64`).
    table: DeviceBuffer<i64>,
    /// The `(tensor, chunk)` pairs, as `i32` (the kernels read `u32`).
    chunks: DeviceBuffer<i32>,
    blocks: usize,
}

impl LaunchTable {
    /// Uploads `rows` (the flattened tensor rows) and the chunk pairs covering `lens` units
    /// of each tensor, on the device's current stream.
    fn new(
        rt: &Arc<Runtime>,
        device: DeviceIndex,
        rows: &[u64],
        lens: &[u64],
    ) -> Result<LaunchTable, OptimError> {
        let total: u64 = (lens.iter())
            .map(|l| l.div_ceil(CHUNK))
            .fold(0, u64::saturating_add);
        if total > i32::MAX as u64 {
            return Err(OptimError::TooLarge { chunks: total });
        }
        let mut pairs: Vec<u32> = Vec::with_capacity(2 * total as usize);
        for (t, len) in lens.iter().enumerate() {
            for c in 0..len.div_ceil(CHUNK) {
                // Both fit: there are fewer than 2^31 chunks in all.
                pairs.extend([t as u32, c as u32]);
            }
        }
        Ok(LaunchTable {
            table: DeviceBuffer::from_slice(rt, device, bytemuck::cast_slice(rows))?,
            chunks: DeviceBuffer::from_slice(rt, device, bytemuck::cast_slice(&pairs))?,
            blocks: total as usize,
        })
    }

    /// Launches `function` with the tables as its first two arguments, then `args`.
    fn launch(
        &self,
        stream: &Stream,
        function: &Function,
        args: &[KernelArg<'_>],
    ) -> Result<(), OptimError> {
        if self.blocks == 0 {
            return Ok(());
        }
        let all: Vec<KernelArg<'_>> = [self.table.arg(), self.chunks.arg()]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let config = LaunchConfig::for_elements(self.blocks * THREADS as usize, THREADS);
        Ok(stream.launch(function, &config, &all)?)
    }

    /// The device bytes the tables take.
    fn bytes(&self) -> u64 {
        self.table.bytes() + self.chunks.bytes()
    }
}

/// An optimizer's device scalars: step count, skip count, bias corrections, learning rate.
#[derive(Debug)]
struct StepScalars {
    rt: Arc<Runtime>,
    buf: DeviceBuffer<f32>,
    prologue: Function,
}

impl StepScalars {
    fn new(rt: &Arc<Runtime>, device: DeviceIndex, lr: f32) -> Result<StepScalars, OptimError> {
        let mut init = [0.0f32; SCALARS];
        init[LR] = lr;
        Ok(StepScalars {
            rt: rt.clone(),
            buf: DeviceBuffer::from_slice(rt, device, &init)?,
            prologue: load_kernel(rt, device, "optim_prologue")?,
        })
    }

    /// Enqueues the prologue: count the step (or the skip), refresh the bias corrections.
    fn advance(
        &self,
        stream: &Stream,
        found_inf: Option<DevicePtr>,
        betas: (f32, f32),
    ) -> Result<(), OptimError> {
        self.rt.check_stream(stream)?;
        let args = [
            optional_ptr(self.buf.device(), found_inf),
            self.buf.arg(),
            KernelArg::value(&betas.0),
            KernelArg::value(&betas.1),
        ];
        Ok(stream.launch(&self.prologue, &LaunchConfig::for_elements(1, 1), &args)?)
    }

    /// Writes the learning rate in `stream` order.
    fn set_lr(&self, stream: &Stream, lr: f32) -> Result<(), OptimError> {
        self.rt.check_stream(stream)?;
        let at = self.buf.ptr().offset((LR * size_of::<f32>()) as u64);
        // Pageable source: the driver stages it before returning.
        self.rt
            .driver()
            .memcpy_htod_async(at, bytemuck::bytes_of(&lr), stream.handle())
            .map_err(StreamError::from)?;
        Ok(())
    }

    /// Reads the counters after `stream`'s work (a host sync: not for the hot path).
    fn counts(&self, stream: &Stream) -> Result<StepCounts, OptimError> {
        self.rt.check_stream(stream)?;
        stream.synchronize()?;
        let s = self.buf.to_host()?;
        Ok(StepCounts {
            taken: s[STEP] as u64,
            skipped: s[SKIPPED] as u64,
        })
    }
}

/// What SGD and AdamW share: the parameters, their launch table and the step scalars.
#[derive(Debug)]
struct StepCore {
    device: DeviceIndex,
    params: Vec<TensorView>,
    grads: Vec<TensorView>,
    /// Elements in all parameters: the length of each flat state array.
    elements: usize,
    table: LaunchTable,
    scalars: StepScalars,
}

impl StepCore {
    /// Checks `params` and builds the table whose rows are `[param, grad, len, offset of the
    /// tensor in the flat state arrays, grad dtype code]`.
    fn new(rt: &Arc<Runtime>, params: &[Param], lr: f32) -> Result<StepCore, OptimError> {
        let device = params.first().ok_or(OptimError::NoParameters)?.param.device;
        let mut within = DeviceBytes::of(rt, device)?;
        let (mut rows, mut lens, mut offset) = (Vec::new(), Vec::new(), 0u64);
        for (index, p) in params.iter().enumerate() {
            let code = check_param(index, device, p)?;
            within.add(&p.param)?;
            rows.extend([p.param.ptr.0, p.grad.ptr.0, p.param.len, offset, code]);
            lens.push(p.param.len);
            // No overflow: the parameters' bytes are within the device's memory.
            offset += p.param.len;
        }
        Ok(StepCore {
            device,
            params: params.iter().map(|p| p.param).collect(),
            grads: params.iter().map(|p| p.grad).collect(),
            elements: offset as usize,
            table: LaunchTable::new(rt, device, &rows, &lens)?,
            scalars: StepScalars::new(rt, device, lr)?,
        })
    }

    /// A zeroed flat state array.
    fn zeros(&self, rt: &Arc<Runtime>) -> Result<DeviceBuffer<f32>, OptimError> {
        Ok(DeviceBuffer::filled(rt, self.device, self.elements, 0.0)?)
    }

    /// Waits for the construction's uploads, so that a step on any stream sees them.
    fn ready(self, rt: &Runtime) -> Result<StepCore, OptimError> {
        rt.current_stream(self.device)?.synchronize()?;
        Ok(self)
    }

    /// The scalars as a state tensor.
    fn scalars_view(&self) -> TensorView {
        TensorView::of(&self.scalars.buf)
    }
}

/// The bytes of a list of views, which may not exceed their device's memory: a larger list
/// cannot be real (a wrong length), and is refused before any table is built for it.
#[derive(Debug)]
struct DeviceBytes {
    bytes: u64,
    limit: u64,
}

impl DeviceBytes {
    fn of(rt: &Runtime, device: DeviceIndex) -> Result<DeviceBytes, OptimError> {
        Ok(DeviceBytes {
            bytes: 0,
            limit: rt.device_properties(device)?.total_memory,
        })
    }

    /// Counts `view` (checked by [`TensorView::check_range`] first).
    fn add(&mut self, view: &TensorView) -> Result<(), OptimError> {
        self.bytes = self.bytes.saturating_add(view.bytes());
        if self.bytes > self.limit {
            return Err(OptimError::TooLargeForDevice {
                bytes: self.bytes,
                limit: self.limit,
            });
        }
        Ok(())
    }
}

/// Checks one parameter against the device and the dtypes; returns its grad dtype code.
fn check_param(index: usize, device: DeviceIndex, p: &Param) -> Result<u64, OptimError> {
    for (what, t) in [("parameter", &p.param), ("gradient", &p.grad)] {
        if t.device != device {
            return Err(OptimError::DeviceMismatch {
                index,
                what,
                expected: device,
                found: t.device,
            });
        }
    }
    if p.param.dtype != DType::F32 {
        return Err(OptimError::UnsupportedDtype {
            index,
            what: "parameter",
            dtype: p.param.dtype,
            supported: "f32",
        });
    }
    p.param.check_range()?;
    p.grad.check_range()?;
    if p.param.len != p.grad.len {
        return Err(OptimError::LengthMismatch {
            index,
            param: p.param.len,
            grad: p.grad.len,
        });
    }
    match p.grad.dtype {
        DType::F32 => Ok(GRAD_F32),
        DType::F16 => Ok(GRAD_F16),
        DType::BF16 => Ok(GRAD_BF16),
        dtype => Err(OptimError::UnsupportedDtype {
            index,
            what: "gradient",
            dtype,
            supported: "f32, f16, bf16",
        }),
    }
}
