//! PyTorch's scaler formulas on the host: the reference the device kernels are tested
//! against, and the arithmetic the fake device's host twins run.
//!
//! - Non-finite check and unscale: `_amp_foreach_non_finite_check_and_unscale_`
//!   (`aten/src/ATen/native/cuda/AmpKernels.cu`): an element is checked in its opmath type
//!   (fp32 for fp16/bf16), and written back as `inv == 1.0f ? v : v * inv` computed in opmath
//!   and rounded to nearest even into the element type. `found_inf` is only ever set to 1.0.
//! - Update: `_amp_update_scale_` (same file), with the factors in double, the growth refused
//!   when it would reach inf, and this crate's optional clamps (off by default).
use ferrocuda_types::DType;
use half::{bf16, f16};

/// A gradient element type the scaler's kernels take.
pub trait GradElement: bytemuck::Pod + Send + Sync + 'static {
    /// Its dtype.
    const DTYPE: DType;
    /// Whether the value is ±inf or NaN.
    fn is_nonfinite(self) -> bool;
    /// `self * inv` in opmath (fp32, or fp64 for fp64), rounded back to the element type.
    fn times(self, inv: f32) -> Self;
}

impl GradElement for f32 {
    const DTYPE: DType = DType::F32;
    fn is_nonfinite(self) -> bool {
        !self.is_finite()
    }
    fn times(self, inv: f32) -> f32 {
        self * inv
    }
}

impl GradElement for f16 {
    const DTYPE: DType = DType::F16;
    fn is_nonfinite(self) -> bool {
        !self.is_finite()
    }
    fn times(self, inv: f32) -> f16 {
        f16::from_f32(self.to_f32() * inv)
    }
}

impl GradElement for bf16 {
    const DTYPE: DType = DType::BF16;
    fn is_nonfinite(self) -> bool {
        !self.is_finite()
    }
    fn times(self, inv: f32) -> bf16 {
        bf16::from_f32(self.to_f32() * inv)
    }
}

impl GradElement for f64 {
    const DTYPE: DType = DType::F64;
    fn is_nonfinite(self) -> bool {
        !self.is_finite()
    }
    fn times(self, inv: f32) -> f64 {
        self * f64::from(inv)
    }
}

/// One gradient, unscaled in place: returns whether it held a non-finite value (checked
/// before unscaling). `inv == 1.0` leaves the values untouched (the check-only pass).
pub fn check_and_unscale<T: GradElement>(values: &mut [T], inv: f32) -> bool {
    let mut found = false;
    for v in values.iter_mut() {
        found |= v.is_nonfinite();
        if inv != 1.0 {
            *v = v.times(inv);
        }
    }
    found
}

/// `inv_scale` as `GradScaler.unscale_` computes it: the reciprocal in fp64, rounded to fp32.
pub fn inv_scale(scale: f32) -> f32 {
    (1.0 / f64::from(scale)) as f32
}

/// The parameters of one scale update.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct UpdateParams {
    /// Multiplies the scale after `growth_interval` clean steps in a row.
    pub growth_factor: f64,
    /// Multiplies the scale after a step with a non-finite gradient.
    pub backoff_factor: f64,
    /// Clean steps in a row before a growth (compared with `==`, as PyTorch does).
    pub growth_interval: i32,
    /// A floor for backoff (not PyTorch's: `None` there).
    pub min_scale: Option<f32>,
    /// A ceiling for growth (not PyTorch's: `None` there; growth to inf is refused anyway).
    pub max_scale: Option<f32>,
}

/// `_amp_update_scale_`: the new `(scale, growth_tracker)` after a step whose combined
/// found_inf was `found_inf` (any non-zero value, NaN included, counts as found).
pub fn update_scale(
    scale: f32,
    growth_tracker: i32,
    found_inf: f32,
    p: &UpdateParams,
) -> (f32, i32) {
    if found_inf != 0.0 {
        let mut s = (f64::from(scale) * p.backoff_factor) as f32;
        if let Some(min) = p.min_scale {
            s = s.max(min);
        }
        return (s, 0);
    }
    let successful = growth_tracker.wrapping_add(1);
    if successful != p.growth_interval {
        return (scale, successful);
    }
    let mut grown = (f64::from(scale) * p.growth_factor) as f32;
    if let Some(max) = p.max_scale {
        grown = grown.min(max);
    }
    (if grown.is_finite() { grown } else { scale }, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PYTORCH: UpdateParams = UpdateParams {
        growth_factor: 2.0,
        backoff_factor: 0.25,
        growth_interval: 2,
        min_scale: None,
        max_scale: None,
    };

    #[test]
    fn update_follows_test_grad_scaling_update_scale() {
        // test_cuda.py: scale 4, growth 2, backoff .25, interval 2.
        let (s, t) = update_scale(4.0, 0, 0.0, &PYTORCH);
        assert_eq!((s, t), (4.0, 1));
        let (s, t) = update_scale(s, t, 0.0, &PYTORCH);
        assert_eq!((s, t), (8.0, 0));
        assert_eq!(update_scale(s, t, 1.0, &PYTORCH), (2.0, 0));
    }

    #[test]
    fn update_edge_cases_of_the_quirk_catalogue() {
        assert_eq!(
            update_scale(4.0, 1, f32::NAN, &PYTORCH),
            (1.0, 0),
            "NaN backs off"
        );
        assert_eq!(
            update_scale(4.0, 1, -1.0, &PYTORCH),
            (1.0, 0),
            "negative backs off"
        );
        let never = UpdateParams {
            growth_interval: 0,
            ..PYTORCH
        };
        assert_eq!(
            update_scale(4.0, 7, 0.0, &never),
            (4.0, 8),
            "interval 0 never grows"
        );
        let every = UpdateParams {
            growth_interval: 1,
            growth_factor: 16.0,
            ..PYTORCH
        };
        assert_eq!(
            update_scale(3e38, 0, 0.0, &every),
            (3e38, 0),
            "growth to inf refused"
        );
        let tiny = update_scale(f32::from_bits(1), 0, 1.0, &PYTORCH);
        assert_eq!(tiny, (0.0, 0), "backoff underflows to exactly 0");
        let clamped = UpdateParams {
            min_scale: Some(1.0),
            max_scale: Some(1e6),
            ..every
        };
        assert_eq!(update_scale(1.5, 0, 1.0, &clamped), (1.0, 0));
        assert_eq!(update_scale(3e38, 0, 0.0, &clamped), (1e6, 0));
    }

    #[test]
    fn check_only_pass_leaves_values_and_detects() {
        let mut v = [f16::from_f32(1.5), f16::INFINITY, f16::from_f32(-3.0)];
        let before = v;
        assert!(check_and_unscale(&mut v, 1.0));
        assert_eq!(v.map(f16::to_bits), before.map(f16::to_bits));
        let mut w = [bf16::from_f32(3.0), bf16::from_f32(1e-3)];
        assert!(!check_and_unscale(&mut w, 0.5));
        assert_eq!(w[0], bf16::from_f32(1.5));
        assert_eq!(inv_scale(65536.0), 1.0 / 65536.0);
        assert_eq!(inv_scale(3.0), (1.0f64 / 3.0) as f32);
    }
}
