//! Mixed precision (`torch.amp`): autocast policy tables and per-thread state, the gradient
//! scaler with its device kernels, and the TF32 / reduced-precision flags.
//!
//! # Example
//! One training step with the scaler and SGD, no host synchronization (capturable whole):
//! ```
//! use ferrocuda_amp::autocast::{self, Autocast, DeviceKind};
//! use ferrocuda_amp::optim::{Param, Sgd, SgdConfig};
//! use ferrocuda_amp::{GradScaler, GradScalerConfig, ScaledStep, TensorView};
//! use ferrocuda_driver::FakeDriver;
//! use ferrocuda_stream::{DeviceBuffer, Runtime};
//! use ferrocuda_types::{DType, DeviceIndex};
//! use std::sync::Arc;
//!
//! let rt = Runtime::new(Arc::new(FakeDriver::default()));
//! let dev = DeviceIndex(0);
//! let w = DeviceBuffer::from_slice(&rt, dev, &[1.0f32; 4])?;
//! let g = DeviceBuffer::from_slice(&rt, dev, &[0.0f32; 4])?;
//! let param = Param { param: TensorView::of(&w), grad: TensorView::of(&g) };
//! let sgd = Sgd::new(&rt, &[param], SgdConfig { lr: 0.5, ..SgdConfig::default() })?;
//! let scaler = GradScaler::new(&rt, dev, GradScalerConfig::default())?;
//! let stream = rt.current_stream(dev)?;
//! let mut step = ScaledStep::new(scaler, sgd, vec![TensorView::of(&g)], &stream)?;
//! {
//!     let _fp16 = Autocast::new(DeviceKind::Cuda).enter()?; // the forward pass's region
//!     assert_eq!(autocast::dtype(DeviceKind::Cuda), DType::F16);
//! }
//! g.copy_from_host(&[65536.0; 4])?; // backward's gradients, scaled by 2^16
//! step.run(&stream)?; // unscale and check, SGD, update the scale
//! assert_eq!(w.to_host()?, [0.5; 4]);
//! g.copy_from_host(&[f32::INFINITY; 4])?; // an overflow:
//! step.run(&stream)?; // SGD skips itself on the device, the scale backs off
//! assert_eq!(w.to_host()?, [0.5; 4]);
//! assert_eq!(step.scaler().scale()?, 32768.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Design choices
//! - **Autocast is a library a tensor crate calls**, not a dispatcher: a tensor type tells
//!   autocast what it needs to know about an argument, and autocast answers which dtype each
//!   argument must be cast to (or that the op is banned). No tensor type of ours is needed.
//! - **One declarative table** (shared lists plus per-device overlays) is the single source
//!   of every op's policy; the op-policy docs page is generated from it.
//! - **State is explicit where PyTorch's is ambient**: scope guards record what they change
//!   and may drop in any order (the state is then the one before the first live guard with
//!   the live guards' changes applied; after the last, the one before the first), and an
//!   `AmpState` snapshot carries autocast into worker threads and recompute closures.
//! - **The gradient scaler can step without a host sync**: scale, its inverse, the growth
//!   tracker and found_inf live on the device at stable addresses, optimizers read found_inf
//!   there and skip themselves, so a whole iteration captures into one CUDA graph.
//! - **Optimizers** ([`optim`]): fused multi-tensor SGD and AdamW whose step reads
//!   `found_inf` on the device (step count and learning rate on the device too, as
//!   PyTorch's `capturable=True`), and a masked fallback for any other optimizer.
//! - **Views are checked before any work**: a [`TensorView`] is an address and a length the
//!   caller vouches for, so every path that takes one refuses, before building a table or
//!   launching, a view past the end of the address space ([`ViewOutOfRange`]) and a list
//!   larger than the device's memory. The caller remains responsible for the views pointing
//!   at live memory of their dtype.
//!
//! PyTorch's behaviour is cited by its source (`aten/src/ATen/autocast_mode.{h,cpp}`,
//! `torch/amp/grad_scaler.py`, `aten/src/ATen/native/cuda/AmpKernels.cu`, `torch/optim/sgd.py`,
//! `torch/optim/adamw.py`).
//!
//! # Modules
//! - [`scaler`]: the gradient scaler ([`GradScaler`]) with its device kernels, PyTorch's
//!   per-optimizer state machine, checkpoints, and the sync-free pieces of a captured step.
//! - [`autocast`]: op policy tables per device, eligibility and cast rules, per-thread
//!   state with scope guards and `AmpState` snapshots, the version-checked weight-cast cache.
//! - [`precision`]: the fp32 precision settings (TF32 / bf16 / ieee per backend and op), the
//!   legacy flags written into them, and the cuBLAS / cuBLASLt mode a GEMM gets.
//! - [`optim`]: optimizers whose step reads `found_inf` on the device ([`optim::Sgd`],
//!   [`optim::AdamW`], [`optim::Masked`]).
//! - [`ScaledStep`]: a scaler and an optimizer stepping together with no host sync, one
//!   iteration capturable into one CUDA graph.
#![forbid(unsafe_code)]

pub mod autocast;
pub mod optim;
pub mod precision;
pub mod scaler;
mod sync_free;
mod tensor;

pub use scaler::{GradScaler, GradScalerConfig, ScalerError};
pub use sync_free::{ScaledStep, StepError};
pub use tensor::{TensorView, ViewOutOfRange};
