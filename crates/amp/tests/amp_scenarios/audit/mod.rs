//! Regression tests for the defects an audit of the crate found, one module per defect,
//! each written to fail before its fix (fake device):
//! - [`scaled_step`]: a step on gradients that were not unscaled (an empty list, or not the
//!   optimizer's) is refused, as PyTorch's "No inf checks were recorded for this optimizer.";
//! - [`guards`]: autocast guards dropped in any order leave the thread's state as it was;
//! - [`huge_views`]: absurd view lengths are refused promptly on every public path;
//! - [`fused_empty`]: `step_fused` with no gradients is PyTorch's no-op, not an error;
//! - [`state_dict_json`]: a non-finite scale survives a JSON round trip;
//! - [`optim_checks`]: optimizer hyperparameter checks are PyTorch's comparisons, in its
//!   order, with its messages (floats printed as Python's `repr`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

mod fused_empty;
mod guards;
mod huge_views;
mod optim_checks;
mod scaled_step;
mod state_dict_json;

use ferrocuda_amp::optim::{Param, register_fake_optim_kernels};
use ferrocuda_amp::scaler::register_fake_amp_kernels;
use ferrocuda_amp::{GradScaler, GradScalerConfig, TensorView};
use ferrocuda_stream::DeviceBuffer;
use ferrocuda_testkit::{Harness, fake_harness};
use ferrocuda_types::{DType, DeviceIndex, DevicePtr};

pub(crate) type TestResult = Result<(), Box<dyn std::error::Error>>;
pub(crate) const D0: DeviceIndex = DeviceIndex(0);

/// A fake device with the scaler's and the optimizers' host kernels.
pub(crate) fn harness() -> Harness {
    let h = fake_harness();
    if let Some(fake) = &h.fake {
        register_fake_amp_kernels(fake);
        register_fake_optim_kernels(fake);
    }
    h
}

/// An enabled scaler (PyTorch's defaults, `init_scale` as given) with its device state made.
pub(crate) fn live_scaler(
    h: &Harness,
    init_scale: f64,
) -> Result<GradScaler, Box<dyn std::error::Error>> {
    let mut s = GradScaler::new(
        &h.rt,
        D0,
        GradScalerConfig {
            init_scale,
            ..GradScalerConfig::default()
        },
    )?;
    s.device_state()?;
    Ok(s)
}

/// A view of `len` elements of `dtype` at `ptr` on device 0 (nothing need be there).
pub(crate) fn view(ptr: u64, len: u64, dtype: DType) -> TensorView {
    TensorView {
        device: D0,
        ptr: DevicePtr(ptr),
        len,
        dtype,
    }
}

/// A parameter and its gradient, f32, filled with `param` and `grad`.
#[derive(Debug)]
pub(crate) struct Owned {
    pub(crate) param: DeviceBuffer<f32>,
    pub(crate) grad: DeviceBuffer<f32>,
}

impl Owned {
    pub(crate) fn new(
        h: &Harness,
        len: usize,
        param: f32,
        grad: f32,
    ) -> Result<Owned, Box<dyn std::error::Error>> {
        Ok(Owned {
            param: DeviceBuffer::filled(&h.rt, D0, len, param)?,
            grad: DeviceBuffer::filled(&h.rt, D0, len, grad)?,
        })
    }

    pub(crate) fn param(&self) -> Param {
        Param {
            param: TensorView::of(&self.param),
            grad: TensorView::of(&self.grad),
        }
    }
}
