//! What the scaler's device kernels and their host twins agree on: the word layout of the
//! scaler's device state and the codes of gradient dtypes.
use super::ScalerError;
use ferrocuda_types::DType;

/// Word indices of the scaler's device state (32-bit words, one allocation).
pub(crate) mod word {
    /// The scale (f32).
    pub(crate) const SCALE: u64 = 0;
    /// `float(1 / double(scale))` (f32), refreshed by every update.
    pub(crate) const INV_SCALE: u64 = 1;
    /// The combined found_inf of the iteration (f32, 0.0 or 1.0).
    pub(crate) const FOUND_INF: u64 = 2;
    /// A constant 1.0f: the inverse scale of a check-only pass.
    pub(crate) const ONE: u64 = 3;
    /// The growth tracker (i32).
    pub(crate) const GROWTH_TRACKER: u64 = 4;
    /// Updates run by the update kernel (i32).
    pub(crate) const UPDATES: u64 = 5;
    /// Updates that saw a non-finite gradient (i32).
    pub(crate) const SKIPPED: u64 = 6;
    /// Such updates in a row, up to the last one (i32).
    pub(crate) const CONSECUTIVE_SKIPPED: u64 = 7;
    /// Whether the last update saw one (i32, 0 or 1).
    pub(crate) const LAST_SKIPPED: u64 = 8;
    /// A found_inf nobody reads (for scaling a loss through the unscale kernel).
    pub(crate) const SCRATCH: u64 = 9;
    /// Words in all.
    pub(crate) const COUNT: usize = 10;
}

/// The kernel's code for a gradient dtype.
pub(crate) fn dtype_code(dtype: DType) -> Result<u32, ScalerError> {
    match dtype {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        DType::F64 => Ok(3),
        other => Err(ScalerError::UnsupportedDtype { dtype: other }),
    }
}

/// The dtype of a kernel code (the inverse of [`dtype_code`]).
pub(crate) fn code_dtype(code: u32) -> DType {
    match code {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::BF16,
        _ => DType::F64,
    }
}
