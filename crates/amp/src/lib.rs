//! Mixed precision (`torch.amp`): autocast policy tables and per-thread state, the gradient
//! scaler with its device kernels, and the TF32 / reduced-precision flags.
//!
//! # Design choices
//! - **Autocast is a library a tensor crate calls**, not a dispatcher: a tensor type tells
//!   autocast what it needs to know about an argument, and autocast answers which dtype each
//!   argument must be cast to (or that the op is banned). No tensor type of ours is needed.
//! - **One declarative table** (shared lists plus per-device overlays) is the single source
//!   of every op's policy; the op-policy docs page is generated from it.
//! - **State is explicit where PyTorch's is ambient**: scope guards own what they restore,
//!   and an `AmpState` snapshot carries autocast into worker threads and recompute closures.
//! - **The gradient scaler can step without a host sync**: scale, its inverse, the growth
//!   tracker and found_inf live on the device at stable addresses, optimizers read found_inf
//!   there and skip themselves, so a whole iteration captures into one CUDA graph.
//!
//!
//! # Modules
//! - [`scaler`]: the gradient scaler ([`GradScaler`]) with its device kernels, PyTorch's
//!   per-optimizer state machine, checkpoints, and the sync-free pieces of a captured step.
//!
//! PyTorch's behaviour is cited by its source (`aten/src/ATen/autocast_mode.{h,cpp}`,
//! `torch/amp/grad_scaler.py`, `aten/src/ATen/native/cuda/AmpKernels.cu`).
#![forbid(unsafe_code)]

pub mod scaler;
mod tensor;

pub use scaler::{GradScaler, GradScalerConfig, ScalerError};
pub use tensor::TensorView;
